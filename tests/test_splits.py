"""The test split (issue 17, item 1): trials are ranked on valid, the board reports test.

Valid keeps every row it had before the test split existed (test comes out of train), a
``split`` column's "test" is honored, valid and test metrics come from disjoint rows, and
a dataset with no test rows says so instead of passing validation numbers off as test.
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

import pytest

from engine.data.batch import Pair
from engine.data.pairs import load_pairs, stable_split, write_pairs_jsonl
from engine.data.splits import check_fractions
from tasks.board.leaderboard import markdown, rank_trials

IDS = [f"row-{i}" for i in range(4000)]


def split_before_test(row_id: str, valid_fraction: float = 0.1) -> str:
    """stable_split as it was before the test split (the reference old rows must keep)."""
    h = int.from_bytes(hashlib.blake2b(row_id.encode(), digest_size=8).digest(), "big")
    return "valid" if h / 2**64 < valid_fraction else "train"


@pytest.mark.unit
def test_valid_keeps_its_rows_and_test_comes_out_of_train() -> None:
    """Catches a test split carved from valid (or drawn first, shifting valid's range):
    a row would then move between train and valid, and old runs' validation would change."""
    old = {i: split_before_test(i) for i in IDS}
    new = {i: stable_split(i, 0.1, 0.15) for i in IDS}
    assert all(new[i] == "valid" for i in IDS if old[i] == "valid")
    assert all(old[i] == "valid" for i in IDS if new[i] == "valid")
    assert all(old[i] == "train" for i in IDS if new[i] == "test")
    shares = {s: list(new.values()).count(s) / len(IDS) for s in ("train", "valid", "test")}
    assert shares["valid"] == pytest.approx(0.1, abs=0.02)
    assert shares["test"] == pytest.approx(0.15, abs=0.02)  # the fraction is the dial
    assert all(stable_split(i, 0.1, 0.0) == old[i] for i in IDS)  # no test: as before


@pytest.mark.unit
def test_fractions_are_checked() -> None:
    """Catches shares that leave train nothing (0.5 + 0.5 and 1 + 0 were accepted, issue
    28 item 9) and shares outside [0, 1]."""
    check_fractions(0.5, 0.49)
    for valid, test, named in ((0.6, 0.5, "1 or more"), (0.5, 0.5, "1 or more"),
                               (1.0, 0.0, "1 or more"), (-0.1, 0.1, "--valid-fraction"),
                               (0.1, 1.5, "--test-fraction")):
        with pytest.raises(ValueError, match=named):
            check_fractions(valid, test)


def _pairs(n: int, prefix: str) -> list[Pair]:
    return [Pair(f"{prefix}{i}", [1, 2, 3], [4, i + 5], [6, i + 5]) for i in range(n)]


@pytest.mark.unit
def test_a_split_column_is_honored_and_checked(tmp_path: Path) -> None:
    """Catches "test" rows read as train (trained on, then reported) and an unknown split
    value silently trained on; a row without a value takes the id's hash."""
    path = tmp_path / "d.jsonl"
    rows = [write_pairs_jsonl(_pairs(3, s), tmp_path / f"{s}.jsonl", split=s).read_text()
            for s in ("train", "valid", "test")]
    hashed = write_pairs_jsonl([Pair(i, [1], [2], [3]) for i in IDS[:50]], tmp_path / "h.jsonl")
    path.write_text("".join(rows) + hashed.read_text())
    data = load_pairs(path)
    for s in ("train", "valid", "test"):
        named = [p.id for p in data.split(s) if not p.id.startswith("row-")]
        assert named == [f"{s}0", f"{s}1", f"{s}2"]
    for i in IDS[:50]:  # rows with no split: the hash decides
        where = next(s for s in ("train", "valid", "test") if i in {p.id for p in data.split(s)})
        assert where == stable_split(i)
    path.write_text(path.read_text() + json.dumps({**json.loads(rows[0].splitlines()[0]),
                                                   "id": "x", "split": "validation"}) + "\n")
    with pytest.raises(ValueError, match=r"d.jsonl: row 59 \(id 'x'\) has split 'validation'"):
        load_pairs(path)


@pytest.mark.unit
def test_the_board_ranks_on_valid_and_reports_test_in_its_own_column() -> None:
    """Catches ranking on test (b would win), and one accuracy shown under both names."""
    results = [{"trial_id": t, "status": "completed", "best/val/rewards/accuracies": v}
               for t, v in (("a", 0.9), ("b", 0.7))]
    evals = {"a": {"eval/valid/logps/accuracies": 0.875, "eval/valid/rows": 40,
                   "eval/test/logps/accuracies": 0.625, "eval/test/rows": 40},
             "b": {"eval/valid/logps/accuracies": 0.75, "eval/valid/rows": 40,
                   "eval/test/logps/accuracies": 0.8125, "eval/test/rows": 40}}
    board = rank_trials(results, evals, "val/rewards/accuracies", "max")
    assert [(r["trial_id"], r["rank"]) for r in board] == [("a", 1), ("b", 2)]
    text = markdown(board, "val/rewards/accuracies", "t")
    head, _, a, b = [[c.strip() for c in line.strip("|").split("|")]
                     for line in text.splitlines() if line.startswith("|")]
    accs = ("eval/valid/logps/accuracies", "eval/test/logps/accuracies")
    assert [a[head.index(c)] for c in accs] == ["0.8750", "0.6250"]
    assert [b[head.index(c)] for c in accs] == ["0.7500", "0.8125"]
    assert "test split:" not in text


@pytest.mark.unit
def test_no_test_rows_show_as_missing_on_the_board_and_in_the_demo() -> None:
    """Catches validation numbers printed as test when a dataset has no test rows."""
    from cli.demo import before_after

    reason = "d.jsonl: no test rows (...)"
    missing = {"eval/test/logps/accuracies": None, "eval/test/rows": 0,
               "eval/test/missing": reason}
    base = {"trial_id": "base", "status": "baseline", "eval/valid/logps/accuracies": 0.5,
            **missing}
    best = {"trial_id": "a", "status": "completed", "best/val/loss": 0.3,
            "eval/valid/logps/accuracies": 0.8, **missing}
    board = rank_trials([best], {}, "val/loss", "min", base=base)
    text = markdown(board, "val/loss", "t")
    head, _, a, _ = [[c.strip() for c in line.strip("|").split("|")]
                     for line in text.splitlines() if line.startswith("|")]
    assert a[head.index("eval/test/logps/accuracies")] == "-"
    assert a[head.index("eval/valid/logps/accuracies")] == "0.8000"
    assert f"- test split: {reason}" in text
    line = before_after(base, board[0])
    assert "no test accuracy" in line and reason in line and "test preference" not in line
    assert "validation (ranked on): 0.50 → 0.80" in line
    ok = {"eval/test/logps/accuracies": 0.55, "eval/test/rows": 30}
    line = before_after({**base, **ok}, {**board[0], **ok, "eval/test/logps/accuracies": 0.9})
    assert "test preference accuracy: base model 0.55 → best adapter 0.90 (30 test" in line


@pytest.mark.integration
def test_an_old_dataset_loads_without_test_rows_and_preprocess_carves_them(
        tiny_model, tmp_path) -> None:
    """A dataset whose manifest names no test_fraction (as one written before the test
    split did; split by prompt, so still read) loads with an empty test; preprocess carves
    test out of train, leaves valid's rows where they were, and changes the data
    fingerprint trials are cached on."""
    from tasks.data.preprocess import preprocess_dataset
    from tasks.data.tokenize import TokenizeOptions, tokenize_dataset
    from tasks.sweep.sweep_plan import data_fingerprint

    rows = [{"id": f"s{i}", "prompt": f"Sort: {i} 0", "chosen": f" 0 {i}",
             "rejected": f" {i} 0"} for i in range(1, 161)]
    src = tmp_path / "a.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "old"
    tokenize_dataset(src, str(tiny_model), out, TokenizeOptions(test_fraction=0.0))
    manifest = json.loads((out / "manifest.json").read_text())  # as the old code wrote it
    del manifest["options"]["test_fraction"], manifest["rows"]["test"]
    (out / "manifest.json").write_text(json.dumps(manifest))
    old = load_pairs(out)
    assert not old.test and old.valid and old.train
    before = data_fingerprint(str(out))

    preprocess_dataset(out)
    new = load_pairs(out)
    ids = {s: {p.id for p in new.split(s)} for s in ("train", "valid", "test")}
    assert ids["valid"] == {p.id for p in old.valid}
    assert new.test and ids["test"] <= {p.id for p in old.train}
    assert not ids["test"] & ids["valid"] and not ids["test"] & ids["train"]
    m = json.loads((out / "manifest.json").read_text())
    assert m["options"]["test_fraction"] == 0.1 and m["rows"]["test"] == len(new.test)
    assert data_fingerprint(str(out)) != before  # cached trials trained on today's test rows


@pytest.mark.integration
def test_the_test_fraction_is_a_dial_of_tokenize_and_preprocess(tiny_model, tmp_path) -> None:
    """Catches --test-fraction not reaching the split (CLI → options → manifest → rows)."""
    from typer.testing import CliRunner

    from cli.main import app

    out = tmp_path / "tok"
    samples = Path(__file__).resolve().parents[1] / "datasets" / "sample" / "explicit.jsonl"
    result = CliRunner().invoke(app, ["data", "tokenize", "--input", str(samples), "--model",
                                      str(tiny_model), "--out", str(out), "--test-fraction",
                                      "0.3"])
    assert result.exit_code == 0, result.output
    m = json.loads((out / "manifest.json").read_text())
    assert m["options"]["test_fraction"] == 0.3 and 40 < m["rows"]["test"] < 80  # of 200
    assert m["rows"]["test"] == len(load_pairs(out).test)
    result = CliRunner().invoke(app, ["data", "preprocess", str(out), "--test-fraction", "0"])
    assert result.exit_code == 0, result.output
    assert not load_pairs(out).test
    assert json.loads((out / "manifest.json").read_text())["rows"]["test"] == 0


@pytest.fixture(scope="module")
def mirrored(tiny_model, tmp_path_factory) -> Path:
    """15 valid pairs, and as test the same pairs with chosen and rejected swapped."""
    from tests.pairs import tokenized_pairs

    pairs = tokenized_pairs(tiny_model, 15, seed=3, task="sort")
    tmp = tmp_path_factory.mktemp("mirrored")
    valid = [Pair(f"v{i}", p.prompt, p.chosen, p.rejected) for i, p in enumerate(pairs)]
    test = [Pair(f"t{i}", p.prompt, p.rejected, p.chosen) for i, p in enumerate(pairs)]
    train = tokenized_pairs(tiny_model, 4, seed=4, task="sort")
    parts = [write_pairs_jsonl(x, tmp / f"{s}.jsonl", split=s).read_text()
             for x, s in ((train, "train"), (valid, "valid"), (test, "test"))]
    (tmp / "data.jsonl").write_text("".join(parts))
    return tmp / "data.jsonl"


@pytest.mark.integration
def test_valid_and_test_metrics_come_from_disjoint_rows(tiny_model, mirrored, tmp_path):
    """Test is valid mirrored (chosen ↔ rejected), so its margin must be valid's negated
    and, on 15 pairs (no tie at 0.5), its accuracy 1 − valid's. Scoring one split for both,
    or both splits' rows for each, gives equal numbers and fails."""
    from tasks.eval.evaluate import evaluate_adapter
    from tasks.eval.generation_eval import GenerationSettings

    result = evaluate_adapter(str(tiny_model), None, str(mirrored),
                              generation=GenerationSettings(valid_prompts=0, test_prompts=2,
                                                            max_tokens=2))
    m = result.metrics
    assert m["eval/valid/rows"] == m["eval/test/rows"] == 15
    assert abs(m["eval/valid/logps/margin"]) > 1e-4
    assert m["eval/test/logps/margin"] == pytest.approx(-m["eval/valid/logps/margin"], abs=1e-4)
    accs = m["eval/test/logps/accuracies"], m["eval/valid/logps/accuracies"]
    assert accs[0] == pytest.approx(1 - accs[1])
    assert "eval/test/missing" not in m
    samples = result.generations
    assert [(s["id"], s["split"]) for s in samples] == [("t0", "test"), ("t1", "test")]


@pytest.mark.integration
def test_evaluation_without_test_rows_says_so(tiny_model, tiny_data, caplog) -> None:
    """tiny_data's split column names only train and valid, as datasets written before the
    test split: test metrics are None with the reason, valid ones are still computed."""
    from tasks.eval.evaluate import evaluate_adapter

    with caplog.at_level(logging.WARNING, logger="tasks.eval.evaluate"):
        m = evaluate_adapter(str(tiny_model), None, str(tiny_data)).metrics
    assert m["eval/test/rows"] == 0
    assert m["eval/test/logps/accuracies"] is None and m["eval/test/logps/margin"] is None
    assert m["eval/valid/rows"] == 16 and 0 <= m["eval/valid/logps/accuracies"] <= 1
    assert "no test rows" in m["eval/test/missing"] and str(tiny_data) in m["eval/test/missing"]
    assert m["eval/test/missing"] in caplog.text


@pytest.mark.integration
def test_score_cli_scores_the_test_split(tiny_model, mirrored, tiny_data, tmp_path) -> None:
    from engine.cli import main as engine_main

    out = tmp_path / "s.jsonl"
    base = ["--model", str(tiny_model), "--out", str(out)]
    assert engine_main(["score", *base, "--data", str(mirrored), "--split", "test"]) == 0
    assert [json.loads(x)["id"] for x in out.read_text().splitlines()] == \
        [f"t{i}" for i in range(15)]
    assert engine_main(["score", *base, "--data", str(tiny_data), "--split", "test"]) == 2


# Issue 28, item 9: splits that leave nothing ------------------------------------------------

def _tokenize(*args: str) -> tuple[int, list[str]]:
    from typer.testing import CliRunner

    from cli.main import app

    result = CliRunner().invoke(app, ["data", "tokenize", *args])
    assert "Traceback" not in result.output, result.output
    return result.exit_code, [x for x in result.output.splitlines() if x.strip()]


@pytest.mark.integration
def test_a_split_that_leaves_no_train_rows_is_refused(tiny_model, tmp_path) -> None:
    """--valid-fraction 0.6 + --test-fraction 0.39 on 19 rows put none in train and exited
    0; so did 1 + 0. Would catch: a dataset written that trains nothing."""
    from tasks.data.synthetic import synth_rows, write_rows

    rows = list(synth_rows("sort", 20, seed=0))[1:]  # row 0 is the one train row of 20
    raw = write_rows(rows, tmp_path / "raw.jsonl")
    base = ["--input", str(raw), "--model", str(tiny_model), "--out", str(tmp_path / "ds")]
    for shares, message in ((["0.6", "0.39"], "--valid-fraction 0.6 and --test-fraction 0.39 "
                                              "leave no train rows (of 19: "),
                            (["1", "0"], "is 1 or more: nothing would be left to train on")):
        code, lines = _tokenize(*base, "--valid-fraction", shares[0], "--test-fraction",
                                shares[1])
        assert code == 2 and len(lines) == 1 and message in lines[0], lines
    assert not (tmp_path / "ds").exists()
    only_valid = write_pairs_jsonl(_pairs(4, "v"), tmp_path / "v.jsonl", split="valid")
    from engine.data.pairs import check_train_split

    with pytest.raises(ValueError, match=f"{only_valid}: no train rows"):
        check_train_split(load_pairs(only_valid), only_valid)


@pytest.mark.integration
def test_an_empty_valid_split_is_a_note_that_reaches_the_board(tiny_model, tmp_path) -> None:
    """--valid-fraction 0: every metric "-", trials ranked in no order and the sweep exit 0.
    Would catch: no note at tokenize, trials ranked on nothing, the board silent on why."""
    from tasks.board.leaderboard import why_unranked
    from tasks.eval.evaluate import missing_valid_reason

    samples = Path(__file__).resolve().parents[1] / "datasets" / "sample" / "explicit.jsonl"
    code, lines = _tokenize("--input", str(samples), "--model", str(tiny_model), "--out",
                            str(tmp_path / "ds"), "--valid-fraction", "0")
    assert code == 0, lines
    notes = [x for x in lines if x.startswith("note:")]
    assert notes == ["note: the valid split is empty (--valid-fraction 0.0 of 200 rows): "
                     "training reports no validation metrics and a sweep cannot rank its "
                     "trials"], lines
    reason = missing_valid_reason(str(tmp_path / "ds"))
    results = [{"trial_id": t, "status": "completed", "reason": ""} for t in ("a", "b")]
    evals = {t: {"eval/valid/rows": 0, "eval/valid/missing": reason,
                 "eval/test/logps/accuracies": 0.6, "eval/test/rows": 20} for t in "ab"}
    board = rank_trials(results, evals, "val/loss", "min")
    assert [(r["trial_id"], r["rank"]) for r in board] == [("a", None), ("b", None)]
    text = markdown(board, "val/loss", "t")
    assert f"- valid split: {reason}" in text
    assert "- a: not ranked: no val/loss in training" in text
    assert "no trial can be ranked" in why_unranked(results, "val/loss")


@pytest.mark.integration
def test_leaderboard_with_nothing_held_out_is_one_line(tmp_path) -> None:
    """With neither valid nor test rows every evaluation failed inside the flow (a
    traceback per evaluation). Would catch: the flow started on such data."""
    from typer.testing import CliRunner

    from cli.main import app
    from tasks.board.results_table import write_results

    sweep = tmp_path / "sweep"
    write_results([{"trial_id": "t-1", "status": "completed"}], sweep / "results.parquet")
    data = write_pairs_jsonl(_pairs(6, "p"), tmp_path / "train.jsonl", split="train")
    result = CliRunner().invoke(app, ["leaderboard", str(sweep), "--model", str(tmp_path),
                                      "--data", str(data)], env={"RAY_ADDRESS": ""})
    lines = [x for x in result.output.splitlines() if x.strip()]
    assert result.exit_code == 2 and len(lines) == 1, result.output
    assert f"{data}: no valid and no test rows, nothing to evaluate on" in lines[0]


@pytest.mark.integration
def test_a_prompts_pairs_share_one_split_and_an_old_split_is_refused(
        tiny_model, tmp_path) -> None:
    """Issue 67, case 5: splits hashed each row's id, so with 60 prompts of 5 pairs each (the
    shape of UltraFeedback or HH-RLHF) 31 prompts had pairs in more than one split: test,
    "which no choice read", was partly trained on. Would catch: a split drawn from the id
    (or the row), whitespace in a prompt giving it another split, a ``group`` field
    ignored, and a dataset split the old way read, preprocessed or cached without a word."""
    from engine.data.shards import SPLIT_BY
    from engine.host.digests import sha256_file
    from tasks.data.dataset_dir import read_table
    from tasks.data.preprocess import preprocess_dataset
    from tasks.data.tokenize import TokenizeOptions, tokenize_dataset
    from tasks.sweep.sweep_plan import data_fingerprint

    rows = [{"id": f"q{q}-{k}", "prompt": f"Sort: {q} 0" + " " * (k % 2),  # spacing varies
             "chosen": f" 0 {q}", "rejected": f" {q} {k} 0"}
            for q in range(1, 61) for k in range(5)]
    rows += [{"id": f"g{i}", "group": "same", "prompt": f"Tell {i}", "chosen": " yes",
              "rejected": " no"} for i in range(8)]
    src = tmp_path / "rows.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "ds"
    opts = TokenizeOptions(valid_fraction=0.2, test_fraction=0.2)
    tokenize_dataset(src, str(tiny_model), out, opts)
    t = read_table(out).to_pydict()
    by_prompt: dict[str, set[str]] = {}
    for row_id, split in zip(t["id"], t["split"], strict=True):
        by_prompt.setdefault(row_id.split("-")[0] if "-" in row_id else "same", set()).add(split)
    assert all(len(s) == 1 for s in by_prompt.values()), by_prompt
    assert set().union(*by_prompt.values()) == {"train", "valid", "test"}  # all drawn
    pairs = load_pairs(out)
    assert sum(map(len, (pairs.train, pairs.valid, pairs.test))) == len(rows)

    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["split_by"] == SPLIT_BY
    del manifest["split_by"]  # as a Pomona before this change wrote it
    (out / "manifest.json").write_text(json.dumps(manifest))
    for read in (lambda: load_pairs(out), lambda: preprocess_dataset(out),
                 lambda: data_fingerprint(str(out))):
        with pytest.raises(ValueError, match=r"before splits kept each prompt's pairs "
                                             r"together.*Tokenize it again"):
            read()
    # An old dataset's row-hash splits, as the old code drew them: re-tokenizing says how
    # many rows moved.
    import pyarrow as pa
    import pyarrow.parquet as pq

    for shard in manifest["shards"]:
        table = pq.read_table(out / shard)
        old = [stable_split(i, 0.2, 0.2) for i in table.column("id").to_pylist()]
        pq.write_table(table.set_column(table.schema.get_field_index("split"), "split",
                                        pa.array(old)), out / shard)
        manifest["shard_files"][shard] = {"bytes": (out / shard).stat().st_size,
                                          "sha256": sha256_file(out / shard)}
    manifest["code_version"], manifest["fingerprint"] = "2", "fingerprinted by code 2"
    (out / "manifest.json").write_text(json.dumps(manifest))
    moved = sum(a != b for a, b in zip(
        [stable_split(i, 0.2, 0.2) for i in t["id"]], t["split"], strict=True))
    report = tokenize_dataset(src, str(tiny_model), out, opts)
    note = next(n for n in report.notes if "re-split by prompt" in n)
    assert f"{moved} of {len(rows)} rows moved split" in note and moved > 0, note
    assert read_table(out).to_pydict()["split"] == t["split"]
