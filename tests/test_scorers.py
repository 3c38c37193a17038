"""Scorers, intervals and the paired test against hand-computed values (tasks/eval/scorers.py,
tasks/eval/intervals.py, tasks/eval/paired.py), and the bad scorers a spec can name."""

from __future__ import annotations

import math
import sys
import types
from pathlib import Path

import numpy as np
import pytest

from tasks.eval.intervals import estimate, paired, sign_test, wilson
from tasks.eval.scorers import (
    ScorerError,
    parse_scorer,
    parse_scorers,
    score,
    score_rows,
    scorer_code,
)

ROW = {"id": "r1", "prompt": "What is 2 + 2?", "chosen": " 4 ", "rejected": "5"}


def run(name: str, completion: str, row: dict | None = None) -> float:
    return score(parse_scorer(name), ROW["prompt"], completion, row or ROW)


@pytest.mark.unit
def test_exact_contains_and_regex_by_hand() -> None:
    assert run("exact", "4") == 1.0 and run("exact", "  4\n") == 1.0
    assert run("exact", "The answer is 4") == 0.0
    assert run("contains", "The answer is 4") == 1.0 and run("contains", "5") == 0.0
    caps = {**ROW, "chosen": "Hello  World"}
    assert run("exact", "hello world", caps) == 1.0  # case and whitespace normalised
    assert run(r"regex:^\d+$", "4") == 1.0 and run(r"regex:^\d+$", "four") == 0.0
    assert run(r"regex:answer is (\d+)", "the answer is 4.") == 1.0  # the group must be 4
    assert run(r"regex:answer is (\d+)", "the answer is 5.") == 0.0
    assert parse_scorer(r"regex:\d").label == "regex"


@pytest.mark.unit
def test_task_verifiers_accept_every_right_answer_and_nothing_else() -> None:
    add = {"id": "synth-add-small-s0-000001", "prompt": "", "chosen": "1148", "rejected": ""}
    for right in ("1148", " 1148.", "1,148"):
        assert run("task", right, add) == 1.0, right
    for wrong in ("1147", "The answer is 1148", "11 48"):
        assert run("task:add", wrong, add) == 0.0, wrong
    srt = {"id": "synth-sort-s0-000002", "prompt": "", "chosen": "3 5 9", "rejected": ""}
    for right in ("3 5 9", "3, 5, 9", "[3, 5, 9]", "3,5,9."):
        assert run("task", right, srt) == 1.0, right
    assert run("task", "3 9 5", srt) == 0.0 and run("task", "3 5", srt) == 0.0
    rev = {"id": "synth-reverse-s0-000003", "prompt": "", "chosen": "oirbc", "rejected": ""}
    assert run("task", "OIRBC", rev) == 1.0 and run("task", '"o i r b c"', rev) == 1.0
    assert run("task", "oirb", rev) == 0.0
    with pytest.raises(ScorerError, match="scorer task: row r1: not a synthetic"):
        run("task", "4")


def lab_module(**functions) -> str:
    """A lab's scorer module, importable by name."""
    module = types.ModuleType("lab_scorers_under_test")
    module.__dict__.update(functions)
    sys.modules[module.__name__] = module
    return module.__name__


@pytest.mark.unit
def test_a_python_scorer_and_every_way_it_can_be_wrong() -> None:
    name = lab_module(half=lambda p, c, row: 0.5 if row["chosen"].strip() in c else 0.0,
                      boom=lambda p, c, row: 1 / 0, nan=lambda p, c, row: math.nan,
                      word=lambda p, c, row: "yes", big=lambda p, c, row: 2.0,
                      flag=lambda p, c, row: True, const=3,
                      np32=lambda p, c, row: np.float32(1.0),
                      leave=lambda p, c, row: sys.exit(0))
    assert run(f"python:{name}:half", "it is 4") == 0.5
    assert parse_scorer(f"python:{name}:half").label == "half"
    assert run(f"python:{name}:flag", "4") == 1.0  # a bool is 0/1
    assert run(f"python:{name}:np32", "4") == 1.0  # numpy's numbers are numbers (issue 52)
    for fn, said in (("boom", "raised ZeroDivisionError"), ("nan", "returned nan"),
                     ("word", "returned 'yes'"), ("big", "returned 2.0"),
                     ("leave", r"called sys.exit\(0\)")):
        with pytest.raises(ScorerError, match=f"^scorer python:{name}:{fn}: row r1: {said}"):
            run(f"python:{name}:{fn}", "4")
    for bad, said in ((f"python:{name}:missing", "cannot import it"),
                      ("python:no_such_module_here:f", "cannot import it"),
                      (f"python:{name}:const", "is not a function"),
                      ("python:justamodule", "expected python:package.module:function"),
                      ("fuzzy", "expected exact, contains"), ("regex:(", "not a regular"),
                      ("task:poetry", "has no verifier")):
        with pytest.raises(ScorerError, match=said):
            parse_scorer(bad)
    with pytest.raises(ScorerError, match="two are labelled 'exact'"):
        parse_scorers(["exact", "exact"])


@pytest.mark.unit
def test_labels_are_the_users_and_never_the_bookkeepings() -> None:
    """Issue 52, case 1: a scorer labelled tokens was overwritten by the token count, and
    the board ranked on it. Reserved labels are refused; LABEL= names a scorer (two
    regexes side by side)."""
    name = lab_module(tokens=lambda p, c, row: 1.0, tokens_per_sec=lambda p, c, row: 1.0)
    for reserved in (f"python:{name}:tokens", f"python:{name}:tokens_per_sec",
                     "tokens=exact", "tokens_per_sec=regex:x"):
        with pytest.raises(ScorerError, match=r"is reserved .*label it otherwise"):
            parse_scorer(reserved)
    assert parse_scorer(f"count=python:{name}:tokens").label == "count"
    two = parse_scorers([r"digits=regex:^\d+$", r"eq=regex:a=(\d)"])
    assert [(s.label, s.arg) for s in two] == [("digits", r"^\d+$"), ("eq", r"a=(\d)")]
    assert run(r"digits=regex:^\d+$", "4") == 1.0
    assert parse_scorer(r"regex:x=(\d)").label == "regex"  # a pattern holding "="


def module_file(tmp_path: Path, monkeypatch, name: str, source: str) -> str:
    """A lab's scorer module as a file on sys.path (its source read, its bytes digested)."""
    (tmp_path / f"{name}.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop(name, None)
    return name


@pytest.mark.unit
def test_a_module_that_cannot_import_is_one_line(tmp_path, monkeypatch) -> None:
    """Issue 52, cases 6 and 7: a SyntaxError, any exception or sys.exit at import was a
    60-line traceback, or an exit 0 with nothing written."""
    for name, source, said in (
            ("lab_syntax", "def f(p, c, row)\n    return 1\n",
             r"SyntaxError: expected ':' at lab_syntax.py:1\)$"),
            ("lab_raises", "raise RuntimeError('no judge key')\n",
             r"raised RuntimeError: no judge key\)$"),
            ("lab_exits", "import sys\nsys.exit(0)\n", r"called sys.exit\(0\)\)$")):
        module_file(tmp_path, monkeypatch, name, source)
        with pytest.raises(ScorerError, match=f"^scorer python:{name}:f: cannot import it "
                                              f"\\({said}") as err:
            parse_scorer(f"python:{name}:f")
        assert "\n" not in str(err.value)


@pytest.mark.unit
def test_a_scorer_that_never_returns_ends_in_its_time_limit() -> None:
    """Issue 52, case 8: a scorer that never returned hung the run."""
    import time

    name = lab_module(stuck=lambda p, c, row: time.sleep(3600),
                      ok=lambda p, c, row: 1.0)
    rows = [(ROW["prompt"], "4", {**ROW, "id": f"r{i}"}) for i in range(3)]
    assert score_rows(parse_scorers([f"python:{name}:ok"]), rows, 5.0) == [{"ok": 1.0}] * 3
    start = time.monotonic()
    with pytest.raises(ScorerError, match=f"^scorer python:{name}:stuck: row r0: no score "
                                          "within 0.5 s \\(evaluation.score_timeout_s"):
        score_rows(parse_scorers([f"python:{name}:ok", f"python:{name}:stuck"]), rows, 0.5)
    assert time.monotonic() - start < 2.0


@pytest.mark.unit
def test_the_cache_reads_a_scorers_code(tmp_path, monkeypatch) -> None:
    """Issue 52, case 2: the evaluation cache keyed on the spec string, so an edited
    scorer's old scores were reused. The key holds the module's bytes."""
    from tasks.eval.generation_eval import GenerationSettings
    from tasks.prefect.pipeline_tasks import generation_key

    name = module_file(tmp_path, monkeypatch, "lab_edited", "def f(p, c, row):\n    return 1.0\n")
    settings = GenerationSettings(scorers=parse_scorers(["exact", f"python:{name}:f"]))
    before = generation_key(settings)
    assert len(scorer_code(settings.scorers)) == 1
    (tmp_path / f"{name}.py").write_text("def f(p, c, row):\n    return 0.0\n")
    assert generation_key(settings) != before
    assert generation_key(GenerationSettings()) == generation_key(GenerationSettings())


@pytest.mark.unit
def test_wilson_interval_by_hand() -> None:
    # 7 of 10: centre (0.7 + 1.96²/20)/(1 + 1.96²/10), half-width by Wilson's formula.
    low, high = wilson(7, 10)
    assert (round(low, 4), round(high, 4)) == (0.3968, 0.8922)
    assert wilson(0, 20)[0] == 0.0 and round(wilson(0, 20)[1], 4) == 0.1611
    assert wilson(0, 0) == (0.0, 1.0)
    # All right (or all wrong): the bound is the estimate itself. Rounding left it at
    # 0.9999999999999999 for 207 of 207, below the mean the demo test compared it with.
    for n in range(1, 400):
        assert wilson(n, n)[1] == 1.0 and wilson(0, n)[0] == 0.0, n
    est = estimate([1.0] * 7 + [0.0] * 3)
    assert (est.mean, est.n, round(est.low, 4)) == (0.7, 10, 0.3968)
    # Scores in between: the normal interval on the sample sd (0.25, 0.75: sd 0.2887).
    half = estimate([0.25, 0.75, 0.25, 0.75])
    assert half.mean == 0.5 and half.low == pytest.approx(0.5 - 1.96 * 0.2887 / 2, abs=1e-3)
    assert estimate([]) is None


@pytest.mark.unit
def test_sign_test_and_paired_counts_by_hand() -> None:
    assert sign_test(5, 0) == pytest.approx(2 / 32)  # 2 · (1/2)^5
    assert sign_test(8, 2) == pytest.approx(2 * (1 + 10 + 45) / 1024)  # 0.109375
    assert sign_test(3, 3) == 1.0 and sign_test(0, 0) == 1.0
    model = {"a": 1.0, "b": 1.0, "c": 0.0, "d": 1.0, "e": 0.5}
    base = {"a": 0.0, "b": 1.0, "c": 1.0, "d": 0.0, "f": 1.0}
    result = paired(model, base)  # a, d better; b same; c worse; e and f unpaired
    assert (result.wins, result.ties, result.losses) == (2, 1, 1)
    assert result.p == pytest.approx(sign_test(2, 1)) == pytest.approx(1.0)
    assert paired({"x": 1.0}, {"y": 0.0}) is None
