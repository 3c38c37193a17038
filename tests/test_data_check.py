"""Issue 70, step 2: ``pomona data check`` (tasks/data/data_check.py) on rows made to hold
each problem: a pair identical once truncated, chosen always longer, a response repeating
its prompt, duplicate prompts (exact and normalised), a prompt in two splits. Each finding
names its rows; over a limit it warns, and fails with ``--strict``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.test_grpo_train import pomona


def rows(folder: Path) -> Path:
    """30 pairs whose chosen is the longer by far, three problem rows, and short ones."""
    out = [{"id": f"long-{i}", "prompt": f"Question number {i}?", "chosen": "yes " * (8 + i % 3),
            "rejected": "no"} for i in range(30)]
    out += [
        {"id": "echo", "prompt": "Hi there", "chosen": "Hi there: hello", "rejected": "no"},
        {"id": "twin-a", "prompt": "What is two plus two?", "chosen": "four",
         "rejected": "five", "group": "twins"},
        {"id": "twin-b", "prompt": "what is two plus two", "chosen": "four",
         "rejected": "three", "group": "twins"},
        {"id": "cut", "prompt": "Count", "chosen": "one two three four five six seven x",
         "rejected": "one two three four five six seven y"},
        *({"id": f"s{i}", "prompt": f"Short {i}", "chosen": "a", "rejected": "bb"}
          for i in range(5))]
    path = folder / "pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in out))
    return path


@pytest.mark.unit
def test_data_check_names_each_problem_and_strict_fails_on_it(tiny_model, tmp_path) -> None:
    from tasks.data.data_check import check_dataset
    from tasks.data.tokenize import tokenize_dataset
    from tasks.data.tokenize_options import TokenizeOptions

    raw = rows(tmp_path)
    tokenize_dataset(raw, str(tiny_model), tmp_path / "data",
                     TokenizeOptions(max_length=30, max_bad_fraction=0.5))
    report = check_dataset(tmp_path / "data", raw)
    got = {(f.split, f.check): f for f in report.findings}
    assert got["all", "identical_after_truncation (dropped)"].ids == ("cut",)
    bias = got["train", "length bias d (chosen − rejected tokens)"]
    assert bias.over and bias.value > 0.5, bias
    assert got["train", "chosen longer"].over  # 0.85: the long rows, not the rest
    assert [f.ids for f in report.findings if f.check == "responses repeating the prompt"
            and f.ids] == [("echo",)]
    twins = next(s for s in ("train", "valid", "test") if "twin-a" in got[
        s, "duplicate prompts (normalised)"].ids)  # one group: one split
    assert set(got[twins, "duplicate prompts (normalised)"].ids) == {"twin-a", "twin-b"}
    assert got[twins, "duplicate prompts (exact)"].value == 0
    assert got["all", "prompts in more than one split"].value == 0
    args = ("data", "check", "--input", str(raw), "--model", str(tiny_model),
            "--max-length", "30", "--max-bad-fraction", "0.5")
    code, lines = pomona(*args)
    text = " ".join(lines)
    assert code == 0 and "warning:" in text and "echo" in text, lines
    code, lines = pomona(*args, "--strict")
    assert code == 1 and "over their limits (--strict)" in lines[-1], lines
    code, lines = pomona(*args, "--max-chosen-longer", "1.5")
    assert code == 2 and lines == ["error: --max-chosen-longer 1.5: expected in [0, 1]"], lines
    left = {p.name for p in tmp_path.iterdir()} - {"data", "data.rejects.jsonl",
                                                   ".data.pomona-lock"}  # the first's
    assert left == {"pairs.jsonl"}, left  # the CLI's check wrote nothing beside its input


@pytest.mark.unit
def test_a_prompt_in_two_splits_is_named() -> None:
    """Splits are drawn by prompt, so only a prompt written two ways (or a split column)
    lands in two: case, spacing and punctuation aside, it is one prompt."""
    from tasks.data.data_check import CheckLimits, cross_split

    found = cross_split({"train": [{"id": "a", "prompt": "What is 2 + 2?"},
                                   {"id": "c", "prompt": "Other"}],
                         "test": [{"id": "b", "prompt": "what is 2 + 2"}]}, CheckLimits())
    assert (found.value, found.ids, found.over) == (1, ("a",), True)
