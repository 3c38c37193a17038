"""Issue 68, Data: prompt rows (a prompt and the answer a verifier reads) in the explicit and
conversational layouts, as JSON Schema describes them, tokenized into a prompts dataset
that GRPO trains on and every pair reader refuses in one line; bad rows counted and
named as for pairs."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from cli.main import app
from tasks.data.synthetic import synth_rows, write_rows
from tasks.data.tokenize import tokenize_dataset
from tasks.data.tokenize_options import TokenizeOptions

pytestmark = pytest.mark.unit
ROOT = Path(__file__).resolve().parents[1]
LAYOUTS = ("prompts", "conversational-prompts")


def pomona(*args: str) -> tuple[int, list[str]]:
    result = CliRunner().invoke(app, list(args), env={"RAY_ADDRESS": "", "PREFECT_API_URL": ""})
    assert "Traceback" not in result.output, result.output
    return result.exit_code, [x for x in result.output.splitlines() if x.strip()]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_synthetic_prompt_rows_follow_their_schema(layout: str) -> None:
    """``pomona data synth --layout prompts`` writes rows the schema accepts, each with
    the pair's chosen response as its answer; a pair row is not a prompt row."""
    schema = json.loads((ROOT / "datasets" / "schema" / f"{layout}.schema.json").read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    check = jsonschema.Draft202012Validator(schema)
    pairs = list(synth_rows("parity", 20, seed=3, layout="explicit"))
    for row, pair in zip(synth_rows("parity", 20, seed=3, layout=layout), pairs, strict=True):
        assert not list(check.iter_errors(row)) and row["answer"] == pair["chosen"].strip()
    assert list(check.iter_errors({**pairs[0], "prompt": row["prompt"]}))


def test_prompt_rows_tokenize_into_a_prompts_dataset(tiny_model, tmp_path) -> None:
    """Both layouts in one folder make one prompts dataset (prompt ids, answers, splits by
    prompt); a broken row is a counted reject with its reason, and a pair row beside
    prompt rows is one too (``kind_mismatch:pairs``), never a silent drop."""
    raw = tmp_path / "raw"
    write_rows(list(synth_rows("parity", 40, seed=0, layout="prompts")), raw / "a.jsonl")
    write_rows(list(synth_rows("parity", 20, seed=1, layout="conversational-prompts")),
               raw / "b.jsonl")
    bad = [{"prompt": "", "answer": "even"}, {"prompt": "Is 7 even?", "answer": ["odd"]},
           {"id": "eight", "prompt": "Is 8 even?", "answer": "even"},
           {"id": "nine", "prompt": "Is 9 even?"},  # no answer: a verifier that needs none
           *({"id": f"g{i}", "group": "G", "prompt": f"Is 1{i} even?", "answer": "odd"}
             for i in range(8))]  # one group: one split, whatever each prompt hashes to
    (raw / "c.jsonl").write_text("".join(json.dumps(r) + "\n" for r in bad))
    write_rows(list(synth_rows("parity", 1, seed=5, layout="explicit")), raw / "d.jsonl")
    report = tokenize_dataset(raw, str(tiny_model), tmp_path / "ds",
                              TokenizeOptions(max_bad_fraction=0.1))
    manifest = json.loads((tmp_path / "ds" / "manifest.json").read_text())
    assert manifest["kind"] == "prompts" and report.rows == 70 and manifest["split_by"]
    assert report.rejects == {"empty_field:prompt": 1, "wrong_type:answer": 1,
                              "kind_mismatch:pairs": 1}, report.rejects
    table = pq.read_table(next((tmp_path / "ds").glob("shard-*.parquet")))
    assert table.column_names == ["id", "group", "prompt_ids", "answer", "split"]
    answers = dict(zip(table.column("id").to_pylist(), table.column("answer").to_pylist(),
                       strict=True))
    first = next(synth_rows("parity", 1, seed=0, layout="prompts"))
    assert answers[first["id"]] == first["answer"]
    assert (answers["eight"], answers["nine"]) == ("even", "")
    splits: dict[str, set] = {}
    for group, split in zip(table.column("group").to_pylist(), table.column("split").to_pylist(),
                            strict=True):
        splits.setdefault(group, set()).add(split)
    assert all(len(s) == 1 for s in splits.values()) and len(splits["g:G"]) == 1
    assert sum(g == "g:G" for g in table.column("group").to_pylist()) == 8


def test_a_prompts_dataset_trains_grpo_and_nothing_of_a_pairs(tiny_model, tmp_path) -> None:
    """GRPO trains on it from its answers (task:parity); a pair loss, preprocess and
    score refuse it in one line naming it."""
    write_rows(list(synth_rows("parity", 40, seed=0, layout="prompts")),
               tmp_path / "raw.jsonl")
    code, lines = pomona("data", "tokenize", "--input", str(tmp_path / "raw.jsonl"),
                         "--model", str(tiny_model), "--out", str(tmp_path / "ds"))
    assert code == 0, lines
    common = ("--model", str(tiny_model), "--data", str(tmp_path / "ds"))
    code, lines = pomona("train", *common, "--out", str(tmp_path / "run"), "--loss", "grpo",
                         "--reward", "task:parity", "--num-generations", "2", "--steps", "1",
                         "--batch-size", "2", "--max-completion-length", "4")
    assert code == 0, lines
    valid = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
             if '"valid"' in x]
    assert valid and valid[-1]["val/rows"] > 0
    train = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
             if '"train"' in x]
    assert "rewards/parity/mean" in train[-1], train
    refusal = "a prompts dataset (prompts and answers, no chosen or rejected response)"
    code, lines = pomona("train", *common, "--out", str(tmp_path / "orpo"))
    assert code == 2 and refusal in lines[-1] and "--loss grpo" in lines[-1], lines
    code, lines = pomona("score", *common, "--out", str(tmp_path / "s.jsonl"))
    assert code == 2 and refusal in lines[-1], lines
    code, lines = pomona("data", "preprocess", str(tmp_path / "ds"))
    assert code == 2 and len(lines) == 1 and "a prompts dataset" in lines[0], lines


def test_a_reward_that_reads_answers_refuses_prompts_without_one(tiny_model, tmp_path) -> None:
    """Prompt rows with no answer: a reward that reads one would score every completion
    alike (no signal) and is refused before step 1, naming a row; a verifier that needs
    no answer trains on them."""
    rows = [{k: v for k, v in r.items() if k != "answer"}
            for r in synth_rows("parity", 40, seed=0, layout="prompts")]
    write_rows(rows, tmp_path / "raw.jsonl")
    assert pomona("data", "tokenize", "--input", str(tmp_path / "raw.jsonl"), "--model",
                  str(tiny_model), "--out", str(tmp_path / "ds"))[0] == 0
    common = ("train", "--model", str(tiny_model), "--data", str(tmp_path / "ds"), "--loss",
              "grpo", "--num-generations", "2", "--steps", "1", "--batch-size", "2",
              "--max-completion-length", "4")
    code, lines = pomona(*common, "--out", str(tmp_path / "a"), "--reward", "task:parity")
    assert code == 2 and "train prompts have no answer (first: id 'synth-parity-s0-" in (
        lines[-1]) and "reward task:parity reads it" in lines[-1], lines
    code, lines = pomona(*common, "--out", str(tmp_path / "b"), "--reward",
                         "python:tests.grpo_rewards:digits")
    assert code == 0, lines


def test_a_prompts_table_in_any_file_form_is_read_as_prompts(tiny_model, tmp_path) -> None:
    """A prompts dataset's shards as one .parquet or .arrow file are prompts to GRPO's
    reader (not pairs missing their responses)."""
    import mlx_lm
    import pyarrow as pa

    from engine.check.load_check import checked_stack
    from engine.data.prompts import prompts_for

    write_rows(list(synth_rows("parity", 30, seed=0, layout="prompts")), tmp_path / "raw.jsonl")
    tokenize_dataset(tmp_path / "raw.jsonl", str(tiny_model), tmp_path / "ds")
    table = pq.read_table(next((tmp_path / "ds").glob("shard-*.parquet")))
    pq.write_table(table, tmp_path / "p.parquet")
    with pa.OSFile(str(tmp_path / "p.arrow"), "wb") as sink, pa.ipc.new_file(
            sink, table.schema) as writer:
        writer.write_table(table)
    model, tok = mlx_lm.load(str(tiny_model))
    stack = checked_stack(model)[0]
    for name in ("p.parquet", "p.arrow"):
        got = prompts_for(tmp_path / name, str(tiny_model), stack, tok,
                          allow_tokenizer_mismatch=True)
        assert len(got.train) + len(got.valid) + len(got.test) == 30
        assert all(r.answer in ("even", "odd") for r in got.train)
