"""Issue 14, data path: each defect reproduced as a user hits it, through the real CLI.

Every test here failed on the code before the fix (its docstring says how) and a user's
mistake always ends as exit status 2 with one line naming the file, row or option.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from cli.main import app
from tasks.data.dataset_dir import read_manifest, read_table

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[1]
SAMPLES = REPO / "datasets" / "sample"


def jsonl(path: Path, rows: list) -> Path:
    lines = [r if isinstance(r, (str, bytes)) else json.dumps(r) for r in rows]
    path.write_bytes(b"\n".join(x if isinstance(x, bytes) else x.encode() for x in lines) + b"\n")
    return path


def explicit(n: int, start: int = 0) -> list[dict]:
    return [{"id": f"e{i}", "prompt": f"Sort: {i} 1\nAnswer:", "chosen": f" 1 {i}",
             "rejected": f" {i} 1"} for i in range(start + 2, start + n + 2)]


def tokenize(model: Path, src: Path, out: Path, *extra: str):
    args = ["data", "tokenize", "--input", str(src), "--model", str(model), "--out", str(out)]
    return CliRunner().invoke(app, [*args, *extra])


def error_line(result, *needles: str) -> str:
    """The result is exit 2 with one line, 'error: …', holding every needle."""
    lines = result.output.strip().splitlines()
    assert result.exit_code == 2, result.output
    assert len(lines) == 1 and lines[0].startswith("error: "), result.output
    assert "Traceback" not in result.output
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


def rejects(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]


def test_out_that_is_not_a_dataset_is_refused_and_kept(tiny_model, tmp_path) -> None:
    """Item 1: `--out u`, u holding the input and a user's file, deleted both (exit 0)."""
    u = tmp_path / "u"
    (u / "notes").mkdir(parents=True)
    raw = Path(shutil.copy(SAMPLES / "explicit.jsonl", u / "raw.jsonl"))
    thesis = u / "notes" / "thesis.txt"
    thesis.write_text("x")
    error_line(tokenize(tiny_model, raw, u), "would replace the input", str(raw))
    error_line(tokenize(tiny_model, SAMPLES / "explicit.jsonl", u / "notes"),
               "not a Pomona dataset", str(u / "notes"))
    error_line(tokenize(tiny_model, u, u / "tok"), "inside the input folder")
    error_line(tokenize(tiny_model, raw, raw), "would replace the input")
    assert raw.read_bytes() == (SAMPLES / "explicit.jsonl").read_bytes()
    assert thesis.read_text() == "x" and not (u / "tok").exists()
    # A Pomona dataset is replaced; one that also holds a user's file is not.
    ok = tmp_path / "tok"
    assert tokenize(tiny_model, raw, ok).exit_code == 0
    assert tokenize(tiny_model, raw, ok, "--max-length", "512").exit_code == 0
    assert read_manifest(ok)["options"]["max_length"] == 512
    (ok / "mine.txt").write_text("y")
    error_line(tokenize(tiny_model, raw, ok, "--max-length", "256"), "mine.txt")
    assert (ok / "mine.txt").read_text() == "y"
    assert read_manifest(ok)["options"]["max_length"] == 512
    # preprocess writes through the same code
    pre = CliRunner().invoke(app, ["data", "preprocess", str(ok), "--out", str(u / "notes")])
    error_line(pre, "not a Pomona dataset")
    assert thesis.read_text() == "x"


def test_unreadable_file_fails_the_run_naming_it(tiny_model, tmp_path) -> None:
    """Item 2: 100 good rows + a truncated .json + a half-written .parquet gave exit 0,
    'rows read 102' and 2 rejects: ~98 % of the data dropped without a failure."""
    d = tmp_path / "in"
    d.mkdir()
    jsonl(d / "a.jsonl", explicit(100))
    text = json.dumps(explicit(2000, start=100))
    (d / "b.json").write_text(text[: len(text) // 2])
    sink = pa.BufferOutputStream()
    pq.write_table(pa.Table.from_pylist(explicit(3000, start=3000)), sink)
    whole = sink.getvalue().to_pybytes()
    (d / "c.parquet").write_bytes(whole[: len(whole) // 2])
    out = tmp_path / "out"
    error_line(tokenize(tiny_model, d, out), str(d / "b.json"), "cannot read this file")
    (d / "b.json").unlink()
    error_line(tokenize(tiny_model, d, out), str(d / "c.parquet"), "cannot read this file")
    assert not out.exists() and not list(tmp_path.glob("out*.jsonl"))


def test_one_odd_first_row_does_not_pick_the_layout(tiny_model, tmp_path) -> None:
    """Item 4: an implicit-looking first row made every explicit row implicit (exit 0,
    0 rejects, every prompt ignored)."""
    sample = (SAMPLES / "explicit.jsonl").read_text().splitlines()
    src = jsonl(tmp_path / "mixed.jsonl",
                [{"id": "first", "chosen": " 1 3", "rejected": " 3 1"}, *sample])
    assert tokenize(tiny_model, src, tmp_path / "m").exit_code == 0
    assert tokenize(tiny_model, SAMPLES / "explicit.jsonl", tmp_path / "plain").exit_code == 0
    got, plain = read_manifest(tmp_path / "m"), read_manifest(tmp_path / "plain")
    assert got["rejects"] == {"layout_mismatch:implicit": 1}
    assert got["token_lengths"]["prompt"] == plain["token_lengths"]["prompt"]
    assert rejects(tmp_path / "m.rejects.jsonl")[0]["line"] == 1
    # An implicit row has no prompt: under --layout implicit a `prompt` makes it a reject.
    forced = jsonl(tmp_path / "forced.jsonl", [
        {"id": "p", "prompt": "Sort: 3 1", "chosen": "Sort: 3 1 1 3", "rejected": "Sort: 3 1 3 1"},
        *[{"id": f"i{i}", "chosen": f"Sort: {i} 1 1 {i}", "rejected": f"Sort: {i} 1 {i} 1"}
          for i in range(2, 30)]])
    assert tokenize(tiny_model, forced, tmp_path / "f", "--layout", "implicit").exit_code == 0
    assert read_manifest(tmp_path / "f")["rejects"] == {"unexpected_field:prompt": 1}


def test_conversational_prompt_must_end_with_the_users_turn(tiny_model, tmp_path) -> None:
    """Item 8: prompts [user, assistant] and [assistant] were accepted and rendered as two
    assistant turns in a row; datasets/README.md says the last message is the user's."""
    def turn(role: str, text: str) -> dict:
        return {"role": role, "content": text}

    good = [{"id": f"c{i}", "prompt": [turn("user", f"Sort: {i} 1")],
             "chosen": [turn("assistant", f"1 {i}")], "rejected": [turn("assistant", f"{i} 1")]}
            for i in range(2, 40)]
    bad = [{"id": "ua", "prompt": [turn("user", "Sort: 3 1"), turn("assistant", "1 3")],
            "chosen": [turn("assistant", "ok")], "rejected": [turn("assistant", "no")]},
           {"id": "a", "prompt": [turn("assistant", "Hello")],
            "chosen": [turn("assistant", "ok")], "rejected": [turn("assistant", "no")]}]
    src = jsonl(tmp_path / "chat.jsonl", [*bad, *good])
    assert tokenize(tiny_model, src, tmp_path / "c", "--max-bad-fraction", "0.1").exit_code == 0
    assert read_manifest(tmp_path / "c")["rejects"] == {"last_turn_not_user": 2}
    assert [r["line"] for r in rejects(tmp_path / "c.rejects.jsonl")] == [1, 2]
    assert sorted(read_table(tmp_path / "c").column("id").to_pylist()) == sorted(
        g["id"] for g in good)


def test_huge_row_is_cut_to_the_model_context_and_reported(tiny_model, tmp_path) -> None:
    """Item 10: a 2 MB row passed tokenize untruncated and unreported (max_length 0 meant
    unlimited) and killed training; now the model's context length is the default limit
    (counted as truncation) and the row is named as an outlier."""
    huge = " ".join(str(i % 97) for i in range(700_000))
    assert len(huge) > 2_000_000
    rows = [*explicit(30), {"id": "huge", "prompt": "Sort: " + huge, "chosen": " 1 2",
                            "rejected": " 2 1"}]
    result = tokenize(tiny_model, jsonl(tmp_path / "h.jsonl", rows), tmp_path / "h")
    assert result.exit_code == 0, result.output
    warnings = [x for x in result.output.splitlines() if x.startswith("warning:")]
    assert len(warnings) == 1, result.output
    assert "'huge'" in warnings[0] and "h.jsonl line 31" in warnings[0]
    m = read_manifest(tmp_path / "h")
    context = json.loads((tiny_model / "config.json").read_text())["max_position_embeddings"]
    assert m["options"]["max_length"] == context
    assert m["truncation"]["truncated_prompt"] == 1
    assert m["outliers"]["count"] == 1 and m["outliers"]["rows"][0]["id"] == "huge"
    t = read_table(tmp_path / "h").to_pydict()
    i = t["id"].index("huge")
    assert len(t["prompt_ids"][i]) + len(t["chosen_ids"][i]) <= context


@pytest.mark.parametrize("content", [b"", b"\n\n  \n", b"[]"])
def test_empty_input_is_an_error(tiny_model, tmp_path, content) -> None:
    """Smaller: an empty input gave exit 0 and a 0-row dataset."""
    src = tmp_path / ("empty.json" if content == b"[]" else "empty.jsonl")
    src.write_bytes(content)
    error_line(tokenize(tiny_model, src, tmp_path / "o"), "no rows", str(src))
    assert not (tmp_path / "o").exists()


def test_all_rows_bad_is_an_error_even_when_allowed(tiny_model, tmp_path) -> None:
    """A 0-row dataset is never written, even under --max-bad-fraction 1."""
    src = jsonl(tmp_path / "bad.jsonl", [{"prompt": "p", "chosen": "x", "rejected": "x"}] * 3)
    error_line(tokenize(tiny_model, src, tmp_path / "o", "--max-bad-fraction", "1"),
               "all 3 rows", "chosen_equals_rejected (3)")
    assert not (tmp_path / "o").exists()


def test_stale_temporaries_of_a_killed_run_are_removed(tiny_model, tmp_path) -> None:
    """Smaller: a run killed mid-write left its hidden temporary folder behind forever."""
    src, out = jsonl(tmp_path / "s.jsonl", explicit(20)), tmp_path / "ds"
    code = ("import os, signal\nfrom tasks.data import dataset_dir\n"
            "real = dataset_dir.pq.write_table\n"
            "def die(*a, **k):\n    real(*a, **k)\n    os.kill(os.getpid(), signal.SIGKILL)\n"
            "dataset_dir.pq.write_table = die\nfrom tasks.data.tokenize import tokenize_dataset\n"
            f"tokenize_dataset({str(src)!r}, {str(tiny_model)!r}, {str(out)!r})\n")
    killed = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True)
    assert killed.returncode == -signal.SIGKILL, killed.stderr.decode()[-2000:]
    left = [p for p in tmp_path.iterdir() if p.name.startswith(".ds.tmp-")]
    assert len(left) == 1 and not out.exists()
    # An older Pomona's name (no writer recorded) is stale once old; a live writer's is kept.
    legacy = tmp_path / ".ds.tmp-0123abcd"
    legacy.mkdir()
    os.utime(legacy, (0, 0))
    live = tmp_path / f".ds.tmp-{left[0].name.split('-')[1]}-1-89abcdef"  # pid 1 is alive
    live.mkdir()
    assert tokenize(tiny_model, src, out).exit_code == 0
    temporaries = [p.name for p in tmp_path.iterdir() if p.name.startswith(".ds.")
                   and p.name != ".ds.pomona-lock"]  # the lock stays: engine/host/outputs.py
    assert temporaries == [live.name]


def test_failed_tokenize_keeps_the_rejects_of_the_dataset_beside_it(tiny_model, tmp_path):
    """Smaller: a failed run overwrote `<out>.rejects.jsonl`, which then no longer described
    the dataset beside it; the error said 'See rejects.jsonl' (no such file)."""
    good = explicit(40)
    src = jsonl(tmp_path / "in.jsonl", [{"id": "x", "prompt": "p"}, *good])
    out, kept = tmp_path / "ds", tmp_path / "ds.rejects.jsonl"
    assert tokenize(tiny_model, src, out).exit_code == 0
    before, manifest = kept.read_bytes(), read_manifest(out)
    jsonl(src, [{"prompt": "p", "chosen": "x", "rejected": "x"}] * 10 + good)
    failed = tmp_path / "ds.failed.rejects.jsonl"
    error_line(tokenize(tiny_model, src, out), f"See {failed}")
    assert kept.read_bytes() == before and read_manifest(out) == manifest
    assert [r["reason"] for r in rejects(failed)] == ["chosen_equals_rejected"] * 10
    jsonl(src, good)
    assert tokenize(tiny_model, src, out).exit_code == 0
    assert kept.read_text() == "" and not failed.exists()


def test_numeric_id_does_not_collide_with_the_string(tiny_model, tmp_path) -> None:
    """Smaller: ids 7 and "7" of two different pairs both became "7" (one split, one
    score key for two pairs); the later one is now a counted duplicate_id reject."""
    rows = [{"id": 7, "prompt": "Sort: 9 8", "chosen": " 8 9", "rejected": " 9 8"},
            {"id": "7", "prompt": "Sort: 6 5", "chosen": " 5 6", "rejected": " 6 5"},
            {"id": "same", "prompt": "Sort: 4 3", "chosen": " 3 4", "rejected": " 4 3"},
            {"id": "same", "prompt": "Sort: 4 3", "chosen": " 3 4", "rejected": " 4 3"},
            *explicit(40)]
    out = tmp_path / "ids"
    assert tokenize(tiny_model, jsonl(tmp_path / "ids.jsonl", rows), out).exit_code == 0
    assert read_manifest(out)["rejects"] == {"duplicate_id": 1}
    [reject] = rejects(tmp_path / "ids.rejects.jsonl")
    assert reject["line"] == 2 and reject["raw"]["id"] == "7"
    ids = read_table(out).column("id").to_pylist()
    assert ids.count("7") == 1 and ids.count("same") == 1  # the exact twin: preprocess
    assert read_manifest(out)["duplicates_removed"] == 1


def _corrupt_manifest(path: Path) -> None:
    m = read_manifest(path)
    del m["rows"]
    (path / "manifest.json").write_text(json.dumps(m))


@pytest.mark.parametrize("mistake", [
    "missing input", "input of another type", "missing model", "model without tokenizer",
    "bad layout", "bad chat template", "negative max length", "valid fraction 2",
    "valid and test fractions over 1",
    "out is a file", "preprocess of a folder", "stats of a hand-edited manifest",
    "synth into a file's path"])
def test_user_mistakes_exit_2_with_one_line(tiny_model, tmp_path, mistake) -> None:
    """No traceback for a user's mistake in `pomona data *`: one line naming the culprit."""
    src, out = jsonl(tmp_path / "in.jsonl", explicit(5)), tmp_path / "out"
    tok = ["data", "tokenize", "--input", str(src), "--model", str(tiny_model), "--out", str(out)]
    cases = {
        "missing input": (["--input", str(tmp_path / "nope.jsonl")], "nope.jsonl"),
        "input of another type": (["--input", str(tmp_path / "x.txt")], "x.txt"),
        "missing model": (["--model", str(tmp_path / "no-model")], "no-model"),
        "model without tokenizer": (["--model", str(tmp_path)], "tokenizer"),
        "bad layout": (["--layout", "chat"], "--layout"),
        "bad chat template": (["--chat-template", "yes"], "--chat-template"),
        "negative max length": (["--max-length", "-1"], "--max-length"),
        "valid fraction 2": (["--valid-fraction", "2"], "--valid-fraction"),
        "valid and test fractions over 1": (["--valid-fraction", "0.6", "--test-fraction",
                                             "0.5"], "--test-fraction 0.5 is 1 or more"),
        "out is a file": (["--out", str(src)], str(src)),
    }
    (tmp_path / "x.txt").write_text("hi")
    if mistake in cases:
        extra, needle = cases[mistake]
        error_line(CliRunner().invoke(app, [*tok, *extra]), needle)
        return
    if mistake == "synth into a file's path":
        bad = src / "rows.jsonl"  # a folder that is a file: cannot be written
        result = CliRunner().invoke(app, ["data", "synth", "--out", str(bad), "--n", "4"])
        error_line(result, str(src))
        return
    assert CliRunner().invoke(app, tok).exit_code == 0
    if mistake == "preprocess of a folder":
        result = CliRunner().invoke(app, ["data", "preprocess", str(tmp_path)])
        error_line(result, "not a complete Pomona dataset")
    else:
        _corrupt_manifest(out)
        error_line(CliRunner().invoke(app, ["data", "stats", str(out)]), "manifest.json")


def test_a_broken_dataset_is_never_a_cache_hit(tiny_model, tmp_path) -> None:
    """Issue 28, item 8: a deleted or truncated shard gave "cache hit … nothing to do" on a
    broken dataset (only the manifest's fingerprint was compared). Would catch: a hit
    without the shards' sizes and digests checked, or an old manifest (no digests) read
    as whole when a shard is cut short."""
    src, out = jsonl(tmp_path / "in.jsonl", explicit(30)), tmp_path / "ds"
    assert tokenize(tiny_model, src, out, "--no-preprocess").exit_code == 0
    shard = out / read_manifest(out)["shards"][0]
    assert read_manifest(out)["shard_files"][shard.name]["bytes"] == shard.stat().st_size
    whole = shard.read_bytes()
    assert "cache hit" in tokenize(tiny_model, src, out, "--no-preprocess").output
    for damage, named in ((lambda: shard.write_bytes(whole[:-10]), "holds"),
                          (lambda: shard.unlink(), "is missing"),
                          (lambda: shard.write_bytes(whole[:-1] + b"\0"), "changed")):
        damage()
        result = tokenize(tiny_model, src, out, "--no-preprocess")
        assert result.exit_code == 0 and "cache hit" not in result.output, result.output
        assert f"its shard {shard.name} {named}" in result.output
        assert shard.read_bytes() == whole and read_table(out).num_rows == 30  # rebuilt
    manifest = read_manifest(out)
    del manifest["shard_files"]  # as a Pomona before this change wrote it
    (out / "manifest.json").write_text(json.dumps(manifest))
    assert "cache hit" in tokenize(tiny_model, src, out, "--no-preprocess").output
    shard.write_bytes(whole[: len(whole) // 2])
    result = tokenize(tiny_model, src, out, "--no-preprocess")
    assert "cache hit" not in result.output and "a shard cannot be read" in result.output


def test_a_shard_edited_in_place_is_refused_by_every_reader(tiny_model, tmp_path) -> None:
    """Issue 67, case 4: with chosen and rejected swapped in a shard (the manifest kept) a
    sweep said "2 cached" and `pomona train` trained on it without a word; the manifest's
    SHA-256 of each shard was never checked outside tokenize. Would catch: any reader
    (train, score, preprocess, the sweep's data key) opening the shards unchecked."""
    from tasks.sweep.sweep_plan import data_fingerprint

    src, out = jsonl(tmp_path / "in.jsonl", explicit(30)), tmp_path / "ds"
    assert tokenize(tiny_model, src, out, "--no-preprocess").exit_code == 0
    fingerprint = data_fingerprint(str(out))
    shard = out / read_manifest(out)["shards"][0]
    whole, table = shard.read_bytes(), pq.read_table(shard)
    swapped = table.set_column(table.schema.get_field_index("chosen_ids"), "chosen_ids",
                               table.column("rejected_ids")).set_column(
        table.schema.get_field_index("rejected_ids"), "rejected_ids", table.column("chosen_ids"))
    pq.write_table(swapped, shard)
    needles = (shard.name, "edited since tokenize")
    train = ["train", "--model", str(tiny_model), "--data", str(out), "--out",
             str(tmp_path / "run"), "--steps", "1"]
    result = CliRunner().invoke(app, train)  # after the model's load check lines
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output
    assert [x for x in result.output.splitlines() if x.startswith("error: ")] == [
        result.output.strip().splitlines()[-1]] and all(n in result.output for n in needles)
    error_line(CliRunner().invoke(app, ["data", "preprocess", str(out)]), *needles)
    with pytest.raises(ValueError, match="edited since tokenize"):
        data_fingerprint(str(out))  # what a sweep keys its cache on: refused, never cached
    assert not (tmp_path / "run" / "adapters.safetensors").exists()
    shard.write_bytes(whole)  # the bytes tokenize wrote: read again as before
    assert data_fingerprint(str(out)) == fingerprint
