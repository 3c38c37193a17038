"""A corpus of hostile preference files through `pomona data tokenize`, outcome per row.

Each file below is a list of (row, expected): the row as JSON (or raw bytes for lines that
are not JSON), expected either ``KEPT`` (the row's id is in the dataset) or the reject
reason datasets/README.md documents. The test names every row whose outcome differs.
Files that cannot be read at all fail the whole run, naming the file.

Then pre-tokenized rows straight into the engine (issue 28, items 5 and 6): ids out of
range, negative, float, huge, null, empty, from another vocabulary, and a dataset of
another tokenizer. Each is a counted reject, or above the 5% bad-row limit one line naming
the file, row and id: never rc 139, a traceback or a NaN loss.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from cli.main import app
from tasks.data.dataset_dir import read_manifest, read_table
from tasks.data.row_fields import content_id

pytestmark = pytest.mark.integration
KEPT = "kept"
BLANK = b"  "  # a blank line: not a row at all


def msg(role: str, text: Any) -> dict:
    return {"role": role, "content": text}


def pair(i: Any, prompt: Any = None, chosen: Any = " 1 3", rejected: Any = " 3 1",
         **extra: Any) -> dict:
    """An explicit row; the default prompt differs per id (preprocess drops twin pairs)."""
    prompt = f"Sort: 3 1 (row {i})" if prompt is None else prompt
    return {"id": i, "prompt": prompt, "chosen": chosen, "rejected": rejected, **extra}


def chat(i: str, prompt: list, chosen: Any = None, rejected: Any = None, **extra: Any) -> dict:
    return {"id": i, "prompt": prompt, "chosen": chosen or [msg("assistant", "1 3")],
            "rejected": rejected or [msg("assistant", "3 1")], **extra}


def good(prefix: str, n: int) -> list[tuple[Any, str]]:
    return [(pair(f"{prefix}{k}", f"Sort: {k} 0", f" 0 {k}", f" {k} 0"), KEPT)
            for k in range(1, n + 1)]


HUGE = "Sort: " + " ".join(str(k % 97) for k in range(700_000))  # > 2 MB
EXPLICIT = [
    ({"id": "first", "chosen": " 1 3", "rejected": " 3 1"}, "layout_mismatch:implicit"),
    (b'{"id": "cut", "prompt": "p", "chosen": "a", "rejected": ', "malformed_json"),
    (b'{"id": "bytes", "prompt": "p", "chosen": "\xff\xfe", "rejected": "b"}', "invalid_utf8"),
    (BLANK, None),
    ([1, 2, 3], "not_an_object"),
    ("just a string", "not_an_object"),
    (None, "not_an_object"),
    (42, "not_an_object"),
    ({"id": "n1", "prompt": None, "chosen": "a", "rejected": "b"}, "wrong_type:prompt"),
    (pair("n2", prompt=""), "empty_field:prompt"),
    (pair("n3", prompt=" \n\t "), "empty_field:prompt"),
    (b'{"id": "nan", "prompt": NaN, "chosen": "a", "rejected": "b"}', "wrong_type:prompt"),
    (pair("t1", chosen=5), "wrong_type:chosen"),
    (pair("t2", chosen=["a"]), "wrong_type:chosen"),
    (pair("t3", chosen="same", rejected="same"), "chosen_equals_rejected"),
    ({"id": "t4", "prompt": "p", "chosen": "a"}, "missing_field:rejected"),
    (pair([]), "wrong_type:id"),
    (pair(""), "empty_field:id"),
    (pair("   "), "empty_field:id"),
    (pair(True), "wrong_type:id"),
    (pair(1.5), "wrong_type:id"),
    (pair(None), "wrong_type:id"),
    (b'{"id": "bad \\ud800 id", "prompt": "p", "chosen": "a", "rejected": "b"}',
     "invalid_unicode:id"),
    (b'{"id": "sur", "prompt": "bad \\udc00 here", "chosen": "a", "rejected": "b"}',
     "invalid_unicode:prompt"),
    (pair("s1", system=5), "wrong_type:system"),
    (pair("s2", system=None), KEPT),
    (chat("conv", [msg("user", "hi")]), "layout_mismatch:conversational"),
    (pair(7, "Sort: 9 8", " 8 9", " 9 8"), KEPT),
    (pair("7", "Sort: 6 5", " 5 6", " 6 5"), "duplicate_id"),
    (pair("dup", "Sort: 5 4", " 4 5", " 5 4"), KEPT),
    (pair("dup", "Sort: 8 7", " 7 8", " 8 7"), "duplicate_id"),
    (pair(10**30, "Sort: 2 9", " 2 9", " 9 2"), KEPT),
    (("[" * 50_000 + "]" * 50_000).encode(), "malformed_json"),
    (pair("uni", "Sortez : ٣ ١ 🙂\u200b\u0000", " ١ ٣ 🙂", " ٣ ١"), KEPT),
    (pair("extra", meta={"a": [1, None]}, score=0.3), KEPT),
    (pair("ws", "Say a", " a", " a "), KEPT),
    (pair("huge", HUGE, " 1 2", " 2 1"), KEPT),
    (pair("longc", "Say it", " ok " * 80_000, " no"), KEPT),
    *good("e", 200),  # enough rows that two long ones lie beyond the p99
]
CONVERSATIONAL = [
    (chat("ua", [msg("user", "Sort: 3 1"), msg("assistant", "1 3")]), "last_turn_not_user"),
    (chat("a", [msg("assistant", "Hello")]), "last_turn_not_user"),
    (chat("sys", [msg("system", "Be brief.")]), "last_turn_not_user"),
    (chat("sns", [msg("user", "a"), msg("system", "b"), msg("user", "c")]), "system_not_first"),
    (chat("robot", [msg("robot", "beep")]), "unknown_role"),
    (chat("cnull", [msg("user", None)]), "wrong_type:prompt"),
    (chat("cstr", ["hi"]), "wrong_type:prompt"),
    (chat("parts", [msg("user", [{"type": "text", "text": "hi"}])]), "wrong_type:prompt"),
    (chat("empty", []), "empty_field:prompt"),
    (chat("ruser", [msg("user", "hi")], [msg("user", "x")]), "response_not_assistant"),
    (chat("rempty", [msg("user", "hi")], [msg("assistant", "  ")]), "empty_response"),
    (chat("conflict", [msg("system", "s"), msg("user", "hi")], system="t"), "system_conflict"),
    (chat("same", [msg("user", "hi")], [msg("assistant", "x")], [msg("assistant", "x")]),
     "chosen_equals_rejected"),
    (pair("flat"), "layout_mismatch:explicit"),
    (chat("multi", [msg("system", "s"), msg("user", "a"), msg("assistant", "b"),
                    msg("user", "c")]), KEPT),
    *[(chat(f"c{k}", [msg("user", f"Sort: {k} 0")], [msg("assistant", f"0 {k}")],
            [msg("assistant", f"{k} 0")]), KEPT) for k in range(1, 16)],
]
H = "\n\nHuman: Sort: 3 1\n\nAssistant:"
IMPLICIT = [
    ({"id": "nocommon", "chosen": "abc", "rejected": "xyz"}, "no_common_prompt"),
    ({"id": "prefix", "chosen": H + " 1", "rejected": H + " 1 3"}, "empty_response"),
    ({"id": "asst", "chosen": [msg("user", "a"), msg("assistant", "b"), msg("assistant", "c")],
      "rejected": [msg("user", "a"), msg("assistant", "b"), msg("assistant", "d")]},
     "last_turn_not_user"),
    ({"id": "mixed", "chosen": [msg("user", "a"), msg("assistant", "b")], "rejected": H},
     "wrong_type:chosen"),
    ({"id": "ruser", "chosen": [msg("user", "a"), msg("user", "b")],
      "rejected": [msg("user", "a"), msg("user", "c")]}, "response_not_assistant"),
    ({"id": "short", "chosen": [msg("user", "a")], "rejected": [msg("user", "a"),
                                                                 msg("assistant", "c")]},
     "empty_field:chosen"),
    (pair("withprompt", chosen=H + " 1 3", rejected=H + " 3 1"), "layout_mismatch:explicit"),
    ({"id": "msgs", "chosen": [msg("user", "Reverse: ab"), msg("assistant", "ba")],
      "rejected": [msg("user", "Reverse: ab"), msg("assistant", "ab")]}, KEPT),
    *[({"id": f"i{k}", "chosen": f"{H} {k} 0 ok", "rejected": f"{H} 0 {k} no"}, KEPT)
      for k in range(1, 12)],
]
ARRAY = [(pair("j1"), KEPT), (pair("j2", chosen={"a": 1}), "wrong_type:chosen"),
         ([], "not_an_object"), (pair("j3", "Sort: 4 2", " 2 4", " 4 2"), KEPT)]
# CSV: every cell is text ("42" stays a string) and an empty cell is a missing field.
CSV = [("csv1,Add: 40 + 2,42,43", KEPT), ("csv2,,1,2", "missing_field:prompt"),
       ("csv3,Say NA,NA,nan", KEPT), (",Say x,x,y", KEPT)]  # no id: a content id
PARQUET = [(pair(100, "Sort: 5 1", " 1 5", " 5 1"), KEPT),
           ({"id": 101, "prompt": None, "chosen": "a", "rejected": "b"},
            "missing_field:prompt"),  # a null cell is an absent field
           (pair(102, "Sort: 6 1", " 1 6", " 6 1"), KEPT)]


def write_corpus(d: Path) -> dict[tuple[str, int], tuple[Any, str]]:
    """Write every file; return (file, line) → (row's id or None, expected)."""
    d.mkdir()
    expected: dict[tuple[str, int], tuple[Any, str]] = {}
    for name, rows in (("a_explicit.jsonl", EXPLICIT), ("b_chat.jsonl", CONVERSATIONAL),
                       ("c_implicit.jsonl", IMPLICIT)):
        lines = [r if isinstance(r, bytes) else json.dumps(r).encode() for r, _ in rows]
        (d / name).write_bytes(b"\n".join(lines) + b"\n")
        for line, (row, want) in enumerate(rows, 1):
            if want is not None:
                expected[name, line] = (row.get("id") if isinstance(row, dict) else None, want)
    (d / "d_array.json").write_text(json.dumps([r for r, _ in ARRAY]))
    (d / "e_table.csv").write_text("id,prompt,chosen,rejected\n" +
                                   "".join(r + "\n" for r, _ in CSV))
    pq.write_table(pa.Table.from_pylist([r for r, _ in PARQUET]), d / "f_table.parquet")
    for name, rows in (("d_array.json", ARRAY), ("e_table.csv", CSV),
                       ("f_table.parquet", PARQUET)):
        for line, (row, want) in enumerate(rows, 1):
            if isinstance(row, str):  # a CSV line
                cells = dict(zip(("id", "prompt", "chosen", "rejected"), row.split(","),
                                 strict=True))
                row = {k: v for k, v in cells.items() if v}
            rid = row.get("id", content_id(row)) if isinstance(row, dict) else None
            expected[name, line] = (rid, want)
    return expected


def test_hostile_corpus_outcome_per_row(tiny_model, tmp_path) -> None:
    expected = write_corpus(tmp_path / "in")
    out = tmp_path / "ds"
    args = ["data", "tokenize", "--input", str(tmp_path / "in"), "--model", str(tiny_model),
            "--out", str(out), "--max-bad-fraction", "0.9"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    got = {(Path(r["source"]).name, r["line"]): r["reason"] for r in
           map(json.loads, (tmp_path / "ds.rejects.jsonl").read_text().splitlines())}
    ids = Counter(read_table(out).column("id").to_pylist())
    wrong = []
    for (name, line), (rid, want) in sorted(expected.items()):
        outcome = got.pop((name, line), KEPT if str(rid) in ids else "missing")
        if outcome != want:
            wrong.append(f"{name} line {line} (id {rid!r}): expected {want}, got {outcome}")
    assert not wrong and not got, "\n".join(wrong + [f"unexpected reject {k}" for k in got])
    kept = [str(rid) for rid, want in expected.values() if want == KEPT]
    assert ids == Counter(kept)  # every kept row once, nothing else
    m = read_manifest(out)
    assert m["rows"]["read"] == len(expected)
    context = m["options"]["max_length"]
    assert 0 < context < 10_000  # the tiny model's own limit, not "unlimited"
    assert m["truncation"]["truncated_prompt"] == 1 and m["truncation"]["truncated_chosen"] >= 1
    assert "'huge'" in result.output and "'longc'" in result.output  # outliers, named
    t = read_table(out).to_pydict()
    assert max(len(p) + max(len(c), len(r)) for p, c, r in
               zip(t["prompt_ids"], t["chosen_ids"], t["rejected_ids"], strict=True)) <= context


def _half_parquet(path: Path) -> None:
    sink = pa.BufferOutputStream()
    pq.write_table(pa.Table.from_pylist([pair(f"p{k}") for k in range(50)]), sink)
    whole = sink.getvalue().to_pybytes()
    path.write_bytes(whole[: len(whole) // 2])


@pytest.mark.parametrize("name,write", [
    ("cut.json", lambda p: p.write_text(json.dumps([pair(f"j{k}") for k in range(50)])[:900])),
    ("latin1.json", lambda p: p.write_bytes('[{"prompt": "café"}]'.encode("latin-1"))),
    ("deep.json", lambda p: p.write_text("[" * 50_000 + "]" * 50_000)),
    ("half.parquet", _half_parquet),
    ("text.parquet", lambda p: p.write_text("not parquet at all")),
    ("ragged.csv", lambda p: p.write_text("id,prompt,chosen,rejected\na,b,c\n")),
])
def test_unreadable_file_fails_naming_it(tiny_model, tmp_path, name, write) -> None:
    """A file that cannot be read is never counted as one bad row: the run stops on it."""
    src = tmp_path / name
    write(src)
    args = ["data", "tokenize", "--input", str(src), "--model", str(tiny_model),
            "--out", str(tmp_path / "ds")]
    result = CliRunner().invoke(app, args)
    lines = result.output.strip().splitlines()
    assert result.exit_code == 2 and len(lines) == 1, result.output
    assert lines[0].startswith(f"error: {src}: cannot read this file")
    assert not (tmp_path / "ds").exists()


# Pre-tokenized rows (issue 28, items 5 and 6): ids straight into the engine ----------------

VOCAB = 512  # tests/conftest.py TINY
GOOD = [{"id": f"g{k}", "prompt_ids": [1, 20 + k % 50], "chosen_ids": [40, 2],
         "rejected_ids": [41, 2]} for k in range(150)]
# (row, the reject reason load_pairs counts, what its first-bad line must name)
HOSTILE_IDS = {
    "out of range": ({"id": "over", "prompt_ids": [1, VOCAB], "chosen_ids": [40],
                      "rejected_ids": [41]}, "token id out of range", f"prompt_ids holds {VOCAB}"),
    "negative": ({"id": "neg", "prompt_ids": [1, 2], "chosen_ids": [-3], "rejected_ids": [41]},
                 "token id out of range", "chosen_ids holds -3"),
    "float": ({"id": "flt", "prompt_ids": [1, 2], "chosen_ids": [40], "rejected_ids": [41.7]},
              "token id not an integer", "rejected_ids holds 41.7"),
    "huge": ({"id": "huge", "prompt_ids": [1, 2**40], "chosen_ids": [40],
              "rejected_ids": [41]}, "token id out of range", f"holds {2**40}"),
    "empty": ({"id": "emp", "prompt_ids": [1, 2], "chosen_ids": [], "rejected_ids": [41]},
              "empty chosen response", "empty chosen response"),
    "other vocabulary": ({"id": "wide", "prompt_ids": [1, 30_000], "chosen_ids": [40_000],
                          "rejected_ids": [41]}, "token id out of range", "prompt_ids holds 30000"),
    "null": ({"id": "nul", "prompt_ids": [1, None], "chosen_ids": [40], "rejected_ids": [41]},
             "token id missing (null)", "null id"),
}


def _jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_pretokenized_hostile_rows_are_counted_rejects(tmp_path) -> None:
    """One row of each hostile kind among 150 good ones (under the 5% limit): each is a
    counted reject with its reason, the good rows load as ints. Would catch: an id past
    the vocabulary or a negative one kept (NaN, SIGSEGV, silent wrap), a float truncated,
    2**40 an OverflowError traceback."""
    from engine.data.pairs import load_pairs

    rows = GOOD[:75] + [row for row, _, _ in HOSTILE_IDS.values()] + GOOD[75:]
    pairs = load_pairs(_jsonl(tmp_path / "ids.jsonl", rows), vocab=VOCAB)
    kept = pairs.train + pairs.valid + pairs.test
    assert sorted(p.id for p in kept) == sorted(r["id"] for r in GOOD)
    assert all(type(i) is int and 0 <= i < VOCAB
               for p in kept for i in (*p.prompt, *p.chosen, *p.rejected))
    want: dict[str, int] = {}
    for _, reason, _ in HOSTILE_IDS.values():
        want[reason] = want.get(reason, 0) + 1
    assert dict(pairs.rejected) == want
    assert pairs.first_bad == f"row 75 (id 'over'): prompt_ids holds {VOCAB}, outside the " \
                              f"model's vocabulary of {VOCAB} ids (0-{VOCAB - 1})"
    assert pairs.skipped_note().startswith(f"skipped {len(HOSTILE_IDS)} of {len(rows)} rows:")


@pytest.mark.parametrize("kind", sorted(HOSTILE_IDS))
def test_pretokenized_hostile_majority_is_one_line_naming_file_row_and_id(kind, tmp_path) -> None:
    """180 of 200 rows unusable trained on the other 20 with no word (item 6); here 10 of
    20. Would catch: no bad-row limit, or an error that names no file, row or id."""
    from engine.data.pairs import load_pairs

    row, reason, named = HOSTILE_IDS[kind]
    path = _jsonl(tmp_path / "ids.jsonl", GOOD[:10] + [{**row, "id": f"{row['id']}{k}"}
                                                       for k in range(10)])
    with pytest.raises(ValueError) as err:
        load_pairs(path, vocab=VOCAB)
    line = str(err.value)
    assert "\n" not in line and line.startswith(f"{path}: 10 of 20 rows (50.0%)")
    assert f"above the 5% limit: {reason} (10)" in line
    assert f"first: row 10 (id '{row['id']}0'): " in line and named in line


def test_id_columns_that_hold_no_numbers_fail_naming_the_file(tmp_path) -> None:
    """A string or a nested list where ids belong was an Arrow traceback naming no file."""
    from engine.data.pairs import load_pairs

    for text, named in (('{"prompt_ids": [1, "a"], "chosen_ids": [2], "rejected_ids": [3]}',
                         "cannot read it as tokenized pairs"),
                        ('{"prompt_ids": [[1]], "chosen_ids": [2], "rejected_ids": [3]}',
                         "column prompt_ids is list<item: list<item: int64>>")):
        path = tmp_path / "odd.jsonl"
        path.write_text(text + "\n")
        with pytest.raises(ValueError, match=f"^{path}: {named}"):
            load_pairs(path)


def _train(*args: str) -> tuple[int, list[str]]:
    """`pomona train ARGS` in this process: exit code, non-blank output lines."""
    result = CliRunner().invoke(app, ["train", *args])
    assert result.exception is None or isinstance(result.exception, SystemExit), result.output
    assert "Traceback" not in result.output, result.output
    return result.exit_code, [x for x in result.output.splitlines()
                              if x.strip() and not x.startswith("load check")]  # its report


def test_training_on_hostile_ids_counts_them_and_stays_finite(tiny_model, tmp_path) -> None:
    """Through `pomona train`: every hostile kind once among 150 good rows trains on the
    good ones with a finite loss and reports the skipped rows by reason; a file of mostly
    hostile rows is one line, exit 2. Would catch: rc 139 (an id past the vocabulary read
    outside the embedding), a NonFiniteLoss traceback, silently dropped rows."""
    rows = GOOD + [row for row, _, _ in HOSTILE_IDS.values()]
    data = _jsonl(tmp_path / "ids.jsonl", rows)
    code, lines = _train("--model", str(tiny_model), "--data", str(data), "--out",
                         str(tmp_path / "run"), "--steps", "2", "--batch-size", "4",
                         "--val-every", "0")
    assert code == 0, lines
    note = next(x for x in lines if "skipped" in x)
    assert note.startswith(f"warning: {data}: skipped {len(HOSTILE_IDS)} of {len(rows)} rows")
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert sum(summary["rejected_rows"].values()) == len(HOSTILE_IDS)
    assert math.isfinite(summary["final"]["loss"])
    bad = _jsonl(tmp_path / "bad.jsonl", GOOD[:4] + [HOSTILE_IDS["other vocabulary"][0]] * 4)
    code, lines = _train("--model", str(tiny_model), "--data", str(bad), "--out",
                         str(tmp_path / "run2"), "--steps", "1")
    assert code == 2 and len(lines) == 1, lines
    assert lines[0].startswith(f"error: {bad}: 4 of 8 rows") and "(id 'wide')" in lines[0]


def test_a_dataset_of_another_tokenizer_is_refused_unless_allowed(tiny_model, tmp_path) -> None:
    """A manifest's tokenizer fingerprint was never compared with the model's: data
    tokenized for another vocabulary trained to NaN. Would catch: the mismatch accepted,
    or the refusal with no way past it."""
    import shutil

    from tasks.data.synthetic import synth_rows, write_rows
    from tasks.data.tokenize import tokenize_dataset

    other = tmp_path / "other-model"
    shutil.copytree(tiny_model, other)
    config = json.loads((other / "tokenizer_config.json").read_text())
    (other / "tokenizer_config.json").write_text(json.dumps({**config, "eos_token": "<|pad|>"}))
    raw = write_rows(list(synth_rows("sort", 40, seed=0)), tmp_path / "raw.jsonl")
    data = tmp_path / "ds"
    tokenize_dataset(raw, str(other), data)  # another end-of-text token: another tokenizer
    args = ["--model", str(tiny_model), "--data", str(data), "--steps", "1", "--batch-size",
            "2", "--val-every", "0"]
    code, lines = _train(*args, "--out", str(tmp_path / "a"))
    assert code == 2 and len(lines) == 1, lines
    assert lines[0].startswith(f"error: {data}: tokenized with another tokenizer")
    assert "--allow-tokenizer-mismatch" in lines[0]
    code, lines = _train(*args, "--out", str(tmp_path / "b"), "--allow-tokenizer-mismatch")
    assert code == 0, lines
    spec = tmp_path / "s.yaml"  # a sweep refuses it before Ray starts, not trial by trial
    spec.write_text(f"name: s\nmodel: {tiny_model}\ndata: {data}\n")
    result = CliRunner().invoke(app, ["sweep", str(spec), "--out", str(tmp_path / "sw")])
    lines = [x for x in result.output.splitlines() if x.strip()]
    assert result.exit_code == 2 and len(lines) == 1, result.output
    assert "tokenized with another tokenizer" in lines[0]
