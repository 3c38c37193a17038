"""`pomona data tokenize/preprocess`: layouts, rendering, BOS/EOS, bad rows, cache, atomicity."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from mlx_lm.utils import load_tokenizer

from engine.data.pairs import load_pairs
from tasks.data import dataset_dir
from tasks.data.dataset_dir import read_manifest, read_table
from tasks.data.preprocess import preprocess_dataset
from tasks.data.tokenize import TokenizeOptions, TooManyBadRows, tokenize_dataset

pytestmark = pytest.mark.integration
SAMPLES = Path(__file__).resolve().parents[1] / "datasets" / "sample"


# A row or two, all in train: a split that left train empty would be refused (issue 28).
ALL_TRAIN = {"valid_fraction": 0.0, "test_fraction": 0.0}

def jsonl(path: Path, rows: list) -> Path:
    lines = [r if isinstance(r, (str, bytes)) else json.dumps(r) for r in rows]
    path.write_bytes(b"\n".join(x if isinstance(x, bytes) else x.encode() for x in lines) + b"\n")
    return path


def table(out: Path) -> dict[str, list]:
    return read_table(out).to_pydict()


@pytest.fixture(scope="module")
def tok(tiny_model):
    return load_tokenizer(tiny_model)


@pytest.mark.parametrize("layout", ["explicit", "conversational", "implicit"])
def test_each_layout_tokenizes_and_the_engine_reads_it(tiny_model, tmp_path, layout) -> None:
    out = tmp_path / layout
    report = tokenize_dataset(SAMPLES / f"{layout}.jsonl", str(tiny_model), out)
    assert report.rows == 200 and not report.rejects and not report.cache_hit
    m = read_manifest(out)
    assert m["schema_version"] == 1 and m["rows"]["total"] == 200
    assert m["tokenizer_hash"] and m["sources"][0]["sha256"]
    t = read_table(out)
    assert t.schema.field("prompt_ids").type == pa.list_(pa.int32())
    pairs = load_pairs(out)  # the engine reads it with pyarrow alone
    assert len(pairs.train) + len(pairs.valid) + len(pairs.test) == 200
    assert pairs.valid and pairs.test


def test_chat_template_rendering_bos_once_eos_once(tiny_model, tmp_path, tok) -> None:
    rows = [{"id": "a", "system": "Be brief.", "prompt": "Sort: 3 1", "chosen": "1 3",
             "rejected": "3 1"}]
    out = tmp_path / "t"
    tokenize_dataset(jsonl(tmp_path / "a.jsonl", rows), str(tiny_model), out)
    t = table(out)
    prompt = tok.decode(t["prompt_ids"][0], skip_special_tokens=False)
    assert prompt == ("<|bos|><|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n"
                      "Sort: 3 1<|im_end|>\n<|im_start|>assistant\n")
    assert t["prompt_ids"][0].count(tok.bos_token_id) == 1  # template's BOS, none added
    chosen = tok.decode(t["chosen_ids"][0], skip_special_tokens=False)
    assert chosen == "1 3<|im_end|>\n" and t["chosen_ids"][0].count(tok.eos_token_id) == 1


def test_raw_rendering_adds_bos_and_eos(tiny_model, tmp_path, tok) -> None:
    rows = [{"prompt": "Sort: 3 1\nAnswer:", "chosen": " 1 3", "rejected": " 3 1"}]
    out = tmp_path / "raw"
    tokenize_dataset(jsonl(tmp_path / "r.jsonl", rows), str(tiny_model), out,
                     TokenizeOptions(chat_template="off", **ALL_TRAIN))
    t = table(out)
    assert t["prompt_ids"][0][0] == tok.bos_token_id
    assert tok.decode(t["prompt_ids"][0][1:]) == "Sort: 3 1\nAnswer:"
    assert t["chosen_ids"][0][-1] == tok.eos_token_id
    assert tok.decode(t["chosen_ids"][0][:-1]) == " 1 3"
    assert t["id"][0].startswith("h-")  # content hash when the row has no id


def test_no_bos_tokenizer(tiny_qwen2, tmp_path) -> None:
    qtok = load_tokenizer(tiny_qwen2)
    rows = [{"prompt": "hi", "chosen": "a", "rejected": "b"}]
    out = tmp_path / "q"
    tokenize_dataset(jsonl(tmp_path / "q.jsonl", rows), str(tiny_qwen2), out)
    assert table(out)["prompt_ids"][0][0] != qtok.convert_tokens_to_ids("<|bos|>")


def test_implicit_prompt_split_is_checked_at_token_level(tiny_model, tmp_path, tok) -> None:
    text = "\n\nHuman: Sort these numbers: 17 12\n\nAssistant:"
    rows = [{"chosen": text + " 12 17", "rejected": text + " 17 12"}]
    out = tmp_path / "imp"
    tokenize_dataset(jsonl(tmp_path / "i.jsonl", rows), str(tiny_model), out)
    t = table(out)
    # The text prefix ends in " 1", inside the tokens " 12" / " 17": the split backs off
    # to the last token boundary both branches share, keeping the canonical tokenization.
    assert tok.encode(" 12 17", add_special_tokens=False)[0] == tok.convert_tokens_to_ids("Ġ12")
    assert tok.decode(t["prompt_ids"][0][1:]) == text
    assert tok.decode(t["chosen_ids"][0][:-1]) == " 12 17"
    full = tok.encode(text + " 12 17", add_special_tokens=True)
    assert t["prompt_ids"][0] + t["chosen_ids"][0][:-1] == full  # canonical tokenization
    assert read_manifest(out)["truncation"].get("boundary_merged") == 1


def test_implicit_messages_layout(tiny_model, tmp_path, tok) -> None:
    turns = [{"role": "user", "content": "Reverse: ab"}]
    rows = [{"chosen": turns + [{"role": "assistant", "content": "ba"}],
             "rejected": turns + [{"role": "assistant", "content": "ab"}]}]
    out = tmp_path / "im"
    tokenize_dataset(jsonl(tmp_path / "m.jsonl", rows), str(tiny_model), out)
    t = table(out)
    assert tok.decode(t["chosen_ids"][0], skip_special_tokens=False) == "ba<|im_end|>\n"


def test_truncation_keeps_prompt_end_and_counts(tiny_model, tmp_path, tok) -> None:
    long_prompt = "Sort: " + " ".join(str(i) for i in range(60))
    rows = [{"id": "long", "prompt": long_prompt, "chosen": " 1 2 3 4 5 6 7 8 9",
             "rejected": " 9 8"},
            {"id": "ok", "prompt": "Sort: 2 1", "chosen": " 1 2", "rejected": " 2 1"}]
    out = tmp_path / "tr"
    opts = TokenizeOptions(chat_template="off", max_length=24, max_prompt_length=16,
                           **ALL_TRAIN)
    report = tokenize_dataset(jsonl(tmp_path / "t.jsonl", rows), str(tiny_model), out, opts)
    t = table(out)
    i = t["id"].index("long")
    assert len(t["prompt_ids"][i]) == 16 and t["prompt_ids"][i][0] == tok.bos_token_id
    assert tok.decode(t["prompt_ids"][i][1:]).endswith("58 59")  # the end survives
    assert len(t["prompt_ids"][i]) + len(t["chosen_ids"][i]) == 24
    assert report.truncation == {"truncated_prompt": 1, "truncated_chosen": 1}
    # A budget that leaves no response token rejects the row, with its reason.
    out2 = tmp_path / "tr2"
    opts2 = TokenizeOptions(chat_template="off", max_length=3, max_bad_fraction=1.0,
                            **ALL_TRAIN)
    r2 = tokenize_dataset(jsonl(tmp_path / "t2.jsonl", rows[:1]), str(tiny_model), out2, opts2)
    assert r2.rows == 1  # max_length 3: prompt 2 (BOS + end), 1 response token each


BAD_ROWS = [
    (b'{"prompt": "p", "chosen": "a", "rejected": ', "malformed_json"),
    (b'{"prompt": "p", "chosen": "\xff\xfe", "rejected": "b"}', "invalid_utf8"),
    ({"prompt": "p", "chosen": "a"}, "missing_field:rejected"),
    ({"prompt": "p", "chosen": "  ", "rejected": "b"}, "empty_field:chosen"),
    ({"prompt": "p", "chosen": 5, "rejected": "b"}, "wrong_type:chosen"),
    ({"prompt": "p", "chosen": "same", "rejected": "same"}, "chosen_equals_rejected"),
    ({"id": ["x"], "prompt": "p", "chosen": "a", "rejected": "b"}, "wrong_type:id"),
    ([1, 2, 3], "not_an_object"),
]


def test_bad_rows_go_to_rejects_and_good_rows_all_stay(tiny_model, tmp_path) -> None:
    good = [{"id": f"g{i}", "prompt": f"Sort: {i} 1", "chosen": f" 1 {i}", "rejected": f" {i} 1"}
            for i in range(2, 40)]
    rows = [good[0]] + [r for r, _ in BAD_ROWS] + good[1:]
    (tmp_path / "in").mkdir()
    src = jsonl(tmp_path / "in" / "a_explicit.jsonl", rows)
    msg = lambda role, text: [{"role": role, "content": text}]  # noqa: E731
    conv = [{"id": "c1", "prompt": msg("user", "hi"), "chosen": msg("assistant", "a"),
             "rejected": msg("assistant", "b")},
            {"id": "c2", "prompt": msg("robot", "x"), "chosen": msg("assistant", "a"),
             "rejected": msg("assistant", "b")}]
    jsonl(tmp_path / "in" / "b_chat.jsonl", conv)
    out = tmp_path / "bad"
    report = tokenize_dataset(tmp_path / "in", str(tiny_model), out,
                              TokenizeOptions(max_bad_fraction=0.5))
    assert report.rows == len(good) + 1
    assert sorted(table(out)["id"]) == sorted([g["id"] for g in good] + ["c1"])
    expected = {"unknown_role": 1}
    for _, reason in BAD_ROWS:
        expected[reason] = expected.get(reason, 0) + 1
    assert report.rejects == expected
    rejects = [json.loads(x) for x in (tmp_path / "bad.rejects.jsonl").read_text().splitlines()]
    by_reason = {r["reason"]: r for r in rejects}
    assert by_reason["malformed_json"]["line"] == 2 and by_reason["malformed_json"]["raw"]
    assert by_reason["unknown_role"]["source"] == str(tmp_path / "in" / "b_chat.jsonl")
    assert by_reason["unknown_role"]["line"] == 2
    assert by_reason["wrong_type:id"]["source"] == str(src)
    assert all({"source", "line", "reason", "raw"} <= set(r) for r in rejects)


def test_too_many_bad_rows_fails_naming_reasons_and_files(tiny_model, tmp_path) -> None:
    rows = [{"prompt": "p", "chosen": "x", "rejected": "x"}] * 3
    rows += [{"prompt": "p", "chosen": "a", "rejected": "b"}] * 7
    src = jsonl(tmp_path / "worse.jsonl", rows)
    with pytest.raises(TooManyBadRows, match=r"chosen_equals_rejected \(3\).*worse\.jsonl"):
        tokenize_dataset(src, str(tiny_model), tmp_path / "o")
    assert read_manifest(tmp_path / "o") is None


def test_other_formats_and_directories(tiny_model, tmp_path) -> None:
    d = tmp_path / "in"
    d.mkdir()
    rows = [{"id": f"r{i}", "prompt": f"Sort: {i} 0", "chosen": f" 0 {i}",
             "rejected": f" {i} 0"} for i in range(1, 7)]
    pq.write_table(pa.Table.from_pylist(rows[:2]), d / "a.parquet")
    (d / "b.json").write_text(json.dumps(rows[2:4]))
    (d / "sub").mkdir()
    csv = "id,prompt,chosen,rejected\n" + "".join(
        f'{r["id"]},"{r["prompt"]}",{r["chosen"]},{r["rejected"]}\n' for r in rows[4:])
    (d / "sub" / "c.csv").write_text(csv)
    report = tokenize_dataset(d, str(tiny_model), tmp_path / "out")
    assert report.rows == 6 and not report.rejects
    assert len(read_manifest(tmp_path / "out")["sources"]) == 3


def test_stable_split_survives_added_rows(tiny_model, tmp_path) -> None:
    rows = [{"id": f"s{i}", "prompt": f"Sort: {i} 0", "chosen": f" 0 {i}", "rejected": f" {i} 0"}
            for i in range(1, 120)]
    tokenize_dataset(jsonl(tmp_path / "a.jsonl", rows[:80]), str(tiny_model), tmp_path / "a")
    tokenize_dataset(jsonl(tmp_path / "b.jsonl", rows), str(tiny_model), tmp_path / "b")
    a, b = table(tmp_path / "a"), table(tmp_path / "b")
    split_b = dict(zip(b["id"], b["split"], strict=True))
    assert all(split_b[i] == s for i, s in zip(a["id"], a["split"], strict=True))
    assert 0 < a["split"].count("valid") < 30 and 0 < a["split"].count("test") < 30


def test_fingerprint_cache(tiny_model, tiny_qwen2, tmp_path) -> None:
    # one row: its prompt must hash to train (a dataset with no train rows is refused)
    src = jsonl(tmp_path / "c.jsonl", [{"prompt": "q", "chosen": "a", "rejected": "b"}])
    out = tmp_path / "cache"
    first = tokenize_dataset(src, str(tiny_model), out)
    assert not first.cache_hit
    assert tokenize_dataset(src, str(tiny_model), out).cache_hit
    assert not tokenize_dataset(src, str(tiny_model), out,
                                TokenizeOptions(max_length=64)).cache_hit  # options changed
    jsonl(src, [{"prompt": "q", "chosen": "a", "rejected": "c"}])
    assert not tokenize_dataset(src, str(tiny_model), out).cache_hit  # content changed
    assert not tokenize_dataset(src, str(tiny_qwen2), out).cache_hit  # tokenizer changed


def test_crash_mid_write_leaves_no_valid_looking_dataset(tiny_model, tmp_path, monkeypatch):
    src = SAMPLES / "explicit.jsonl"
    out = tmp_path / "atomic"
    good = tokenize_dataset(src, str(tiny_model), out, TokenizeOptions(max_length=512))
    real_write = pq.write_table

    def crash_after_first_shard(table, where, *a, **k):
        real_write(table, where, *a, **k)
        raise KeyboardInterrupt("killed mid-write")

    monkeypatch.setattr(dataset_dir.pq, "write_table", crash_after_first_shard)
    with pytest.raises(KeyboardInterrupt):
        tokenize_dataset(src, str(tiny_model), out, TokenizeOptions(max_length=256))
    assert read_manifest(out)["fingerprint"] == good.fingerprint  # old dataset intact
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".atomic")
                and p.name != ".atomic.pomona-lock"]  # the lock stays: engine/host/outputs.py
    with pytest.raises(KeyboardInterrupt):
        tokenize_dataset(src, str(tiny_model), tmp_path / "fresh")
    assert read_manifest(tmp_path / "fresh") is None and not (tmp_path / "fresh").exists()


def test_preprocess_dedupes_and_shares(tiny_model, tmp_path) -> None:
    row = {"prompt": "Sort: 2 1", "chosen": " 1 2", "rejected": " 2 1"}
    rows = [{**row, "id": "a"}, {**row, "id": "b"}, {"id": "c", "prompt": "Sort: 3 1",
                                                     "chosen": " 1 3", "rejected": " 3 1"}]
    out = tmp_path / "pp"
    tokenize_dataset(jsonl(tmp_path / "p.jsonl", rows), str(tiny_model), out)
    assert table(out)["prefix_shared"] == [None, None, None]
    report = preprocess_dataset(out)
    assert report.duplicates_removed == 1 and report.rows == 2
    t = table(out)
    assert t["prefix_shared"] == [True, True]
    assert report.tokens_saved == sum(len(p) for p in t["prompt_ids"])
    m = read_manifest(out)
    assert m["preprocessed"] and m["duplicates_removed"] == 1 and m["prefix_share_rate"] == 1.0


def test_compiled_template_matches_apply_chat_template(tiny_model, tiny_qwen2) -> None:
    from tasks.data.preference_rows import read_conversations
    from tasks.data.render import ChatTemplate, prompt_messages

    for model in (tiny_model, tiny_qwen2):
        hf = load_tokenizer(model)._tokenizer
        fast = ChatTemplate(hf)
        assert fast.compiled is not None
        for conv in list(read_conversations(SAMPLES / "conversational.jsonl"))[:40]:
            msgs = prompt_messages(conv)
            for extra, gen in (([], True), (conv.chosen, False)):
                want = hf.apply_chat_template(msgs + extra, add_generation_prompt=gen,
                                              tokenize=False)
                assert fast(msgs + extra, add_generation_prompt=gen) == want


def test_data_cli_tokenize_and_stats(tiny_model, tmp_path) -> None:
    from typer.testing import CliRunner

    from cli.main import app

    out = tmp_path / "cli"
    args = ["data", "tokenize", "--input", str(SAMPLES / "explicit.jsonl"), "--model",
            str(tiny_model), "--out", str(out)]
    first = CliRunner().invoke(app, args)
    assert first.exit_code == 0, first.output
    assert "tokenized 200 pairs" in first.output and "prefix share rate" in first.output
    again = CliRunner().invoke(app, args)
    assert "cache hit" in again.output
    stats = CliRunner().invoke(app, ["data", "stats", str(out)])
    m = read_manifest(out)["rows"]
    assert stats.exit_code == 0 and "rows (train / valid / test)" in stats.output
    assert f"{m['train']} / {m['valid']} / {m['test']}" in stats.output and m["test"] > 0
    bad = CliRunner().invoke(app, ["data", "stats", str(tmp_path)])
    assert bad.exit_code == 2 and "not a complete Pomona dataset" in bad.output


def test_over_long_row_identical_after_truncation_is_rejected(tiny_model, tmp_path) -> None:
    rows = [{"id": "a", "prompt": "Sort: 1 2 3 9", "chosen": " 1 2 3 9", "rejected": " 1 2 9 3"},
            {"id": "b", "prompt": "Sort: 3 1", "chosen": " 1 3", "rejected": " 3 1"}]
    # (the kept row's prompt hashes to train: a dataset with no train rows is refused)
    opts = TokenizeOptions(chat_template="off", max_length=8, max_bad_fraction=0.5)
    report = tokenize_dataset(jsonl(tmp_path / "l.jsonl", rows), str(tiny_model),
                              tmp_path / "l", opts)
    assert report.rejects == {"identical_after_truncation": 1} and report.rows == 1
    line = json.loads((tmp_path / "l.rejects.jsonl").read_text())
    assert line["reason"] == "identical_after_truncation" and line["line"] == 1


@pytest.mark.unit
def test_length_bucketed_batches_cut_padding_and_are_seeded() -> None:
    import numpy as np

    from engine.data.batch import Pair
    from engine.data.pairs import epoch_batches

    rng = np.random.default_rng(0)
    pairs = [Pair(str(i), [1] * int(n), [2], [3]) for i, n in enumerate(rng.integers(1, 400, 512))]

    def padding(batches) -> int:
        return sum(max(len(pairs[i].prompt) for i in b) * len(b) -
                   sum(len(pairs[i].prompt) for i in b) for b in batches)

    bucketed = epoch_batches(pairs, 8, seed=3, epoch=0)
    shuffled = [list(range(i, i + 8)) for i in range(0, 512, 8)]
    assert padding(bucketed) < padding(shuffled) / 4
    assert bucketed == epoch_batches(pairs, 8, seed=3, epoch=0)
    assert bucketed != epoch_batches(pairs, 8, seed=3, epoch=1)
    assert sorted(i for b in bucketed for i in b) == list(range(512))  # every row once


@pytest.mark.slow
def test_tokenize_benchmark_runs_both_sides() -> None:
    import io
    from contextlib import redirect_stdout

    from benchmarks.tokenize_bench import main

    out = io.StringIO()
    with redirect_stdout(out):
        assert main(["--rows", "300", "--json"]) == 0
    result = json.loads(out.getvalue().strip().splitlines()[-1])
    names = [r["name"] for r in result["rows"]]
    assert names == ["pomona", "hf_datasets"]
    assert all(r["rows"] == 300 and r["rows_per_s"] > 0 and r["tokens_per_s"] > 0
               for r in result["rows"])
    assert result["rows"][0]["tokens"] == result["rows"][1]["tokens"]  # same work counted
