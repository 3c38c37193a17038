"""`pomona data synth` and the shipped sample files: valid, deterministic, near-misses."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import numpy as np
import pyarrow.parquet as pq
import pytest
from hypothesis import given
from hypothesis import strategies as st

from tasks.data.synthetic import LAYOUTS, NEAR_MISSES, TASKS, near_miss, synth_rows, write_rows

ROOT = Path(__file__).resolve().parents[1]
DATASETS = ROOT / "datasets"
# The commands in datasets/README.md that produced the shipped samples.
SAMPLES = {
    "explicit": dict(task="mixed", n=200, seed=11, layout="explicit"),
    "conversational": dict(task="mixed", n=200, seed=12, layout="conversational"),
    "implicit": dict(task="mixed", n=200, seed=13, layout="implicit", ids=False),
}
# The pair layouts (the prompt layouts' rows: tests/test_prompt_data.py).
PAIR_LAYOUTS = tuple(x for x in LAYOUTS if x in SAMPLES)


def validator(layout: str) -> jsonschema.Draft202012Validator:
    schema = json.loads((DATASETS / "schema" / f"{layout}.schema.json").read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema)


def detect_layout(row: dict) -> str:
    if "prompt" not in row:
        return "implicit"
    return "conversational" if isinstance(row["prompt"], list) else "explicit"


def semantic_problems(row: dict, layout: str) -> list[str]:
    """The documented rules JSON Schema cannot express (datasets/README.md)."""
    problems = []
    if row["chosen"] == row["rejected"]:
        problems.append("chosen equals rejected")
    if layout == "conversational":
        roles = [m["role"] for m in row["prompt"]]
        if roles[-1] != "user":
            problems.append("prompt does not end with a user turn")
        if "system" in roles[1:]:
            problems.append("system message not first")
    if layout == "implicit":
        a, b = row["chosen"], row["rejected"]
        k = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)
        if not k or k >= min(len(a), len(b)):
            problems.append("no shared prompt or an empty response")
    return problems


def has_system(row: dict) -> bool:
    prompt = row.get("prompt")
    return "system" in row or (isinstance(prompt, list) and prompt[0]["role"] == "system")


def load_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.unit
@pytest.mark.parametrize("layout", PAIR_LAYOUTS)
def test_shipped_samples_validate_and_match_generator(layout: str) -> None:
    path = DATASETS / "sample" / f"{layout}.jsonl"
    rows = load_jsonl(path)
    assert len(rows) == 200
    v = validator(layout)
    for i, row in enumerate(rows, 1):
        errors = [e.message for e in v.iter_errors(row)]
        assert not errors, f"{path}:{i}: {errors}"
        assert detect_layout(row) == layout
        assert not semantic_problems(row, layout), f"{path}:{i}"
    assert any(has_system(r) for r in rows) and not all(has_system(r) for r in rows)
    regenerated = list(synth_rows(**SAMPLES[layout]))
    assert rows == regenerated, (
        f"{path} drifted from the generator; regenerate with the commands in datasets/README.md"
    )


@pytest.mark.unit
@pytest.mark.parametrize("task", TASKS)
@pytest.mark.parametrize("layout", PAIR_LAYOUTS)
def test_synth_output_validates(task: str, layout: str) -> None:
    v = validator(layout)
    rows = list(synth_rows(task, 60, seed=3, layout=layout))
    for row in rows:
        assert not list(v.iter_errors(row))
        assert not semantic_problems(row, layout)
    assert len({r["id"] for r in rows}) == len(rows)


@pytest.mark.unit
def test_schema_rejects_bad_rows() -> None:
    assert list(validator("explicit").iter_errors({"prompt": "p", "chosen": 3, "rejected": "r"}))
    bad_role = {"prompt": [{"role": "tool", "content": "x"}],
                "chosen": [{"role": "assistant", "content": "a"}],
                "rejected": [{"role": "assistant", "content": "b"}]}
    assert list(validator("conversational").iter_errors(bad_role))
    assert list(validator("implicit").iter_errors({"prompt": "p", "chosen": "a", "rejected": "b"}))


@pytest.mark.unit
def test_same_seed_same_rows_other_seed_other_rows() -> None:
    a = list(synth_rows("mixed", 50, seed=0))
    assert a == list(synth_rows("mixed", 50, seed=0))
    assert a != list(synth_rows("mixed", 50, seed=1))


@pytest.mark.unit
@given(
    answer=st.lists(st.sampled_from("abc12"), min_size=1, max_size=12),
    kind=st.sampled_from(NEAR_MISSES),
    seed=st.integers(0, 2**32 - 1),
)
def test_near_miss_always_differs(answer: list[str], kind: str, seed: int) -> None:
    out = near_miss(answer, ["x", "y"], kind, np.random.default_rng(seed))
    assert out != answer
    assert abs(len(out) - len(answer)) <= 1


@pytest.mark.unit
def test_lengths_vary_and_some_prompts_are_long() -> None:
    rows = list(synth_rows("mixed", 400, seed=0))
    lengths = np.array([len(r["prompt"]) for r in rows])
    assert lengths.min() < 60 and lengths.max() > 400  # short queries and many-shot prompts
    assert len({len(r["chosen"]) for r in rows}) > 10


@pytest.mark.unit
@pytest.mark.parametrize("suffix", [".jsonl", ".json", ".parquet"])
def test_write_rows_formats_round_trip(tmp_path: Path, suffix: str) -> None:
    rows = list(synth_rows("sort", 20, seed=5, system_fraction=0.5))
    out = write_rows(rows, tmp_path / f"data{suffix}")
    if suffix == ".jsonl":
        back = load_jsonl(out)
    elif suffix == ".json":
        back = json.loads(out.read_text())
    else:
        table = pq.read_table(out).to_pylist()
        back = [{k: v for k, v in r.items() if v is not None} for r in table]
    assert back == rows
    assert not list(tmp_path.glob("*.tmp"))


@pytest.mark.unit
def test_bad_arguments_name_the_problem(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown task 'nope'"):
        list(synth_rows("nope"))
    with pytest.raises(ValueError, match="unknown layout"):
        list(synth_rows("sort", layout="hh"))
    with pytest.raises(ValueError, match=r"\.csv"):
        write_rows([{"a": 1}], tmp_path / "x.csv")
