"""Scorers: how a generated answer is judged, each a score in [0, 1] for one held-out row.

Named in a sweep spec's ``evaluation.scorers`` (or ``--scorer``), each giving the metric
``gen/<split>/<label>``:

- ``exact``: the completion equals the chosen response, whitespace and case normalised;
- ``contains``: the normalised chosen response appears in the normalised completion;
- ``regex:PATTERN``: PATTERN is found in the completion; with a group, its first group,
  normalised, must also equal the normalised chosen response (label ``regex``);
- ``task`` / ``task:NAME``: a synthetic task's own verifier (tasks/data/synthetic.py:
  ``verify``), which accepts every right way to write the answer; ``task`` reads the
  task from the row's id (label ``task``, or NAME);
- ``python:package.module:function``: a lab's own ``f(prompt, completion, row) -> float``
  in [0, 1], ``row`` the held-out row's id, prompt, chosen and rejected text (label
  ``function``).

A scorer that cannot be imported is refused when the spec is read; one that raises or
returns a non-number, NaN or a value outside [0, 1] is a one-line ScorerError naming the
scorer and the row (``check_scorers`` tries each on the data's rows before a sweep).
"""

from __future__ import annotations

import importlib
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tasks.data.synthetic import row_task, verify

KINDS = ("exact", "contains", "regex", "task", "python")


class ScorerError(ValueError):
    """A scorer that cannot be used, or that failed on a row: names both."""


@dataclass(frozen=True)
class Scorer:
    """One parsed scorer: its label (the metric's last part), kind and argument."""

    label: str
    kind: str
    arg: str = ""

    @property
    def spec(self) -> str:
        return self.kind + (f":{self.arg}" if self.arg else "")


def normalise(text: str) -> str:
    """Whitespace collapsed, case folded, ends stripped."""
    return " ".join(text.split()).casefold()


def parse_scorer(text: Any) -> Scorer:
    """A scorer from its name in a spec; ScorerError (one line) when it cannot be used."""
    if not isinstance(text, str) or not text.strip():
        raise ScorerError(f"scorer {text!r}: expected one of {', '.join(KINDS)} (a string)")
    kind, _, arg = text.strip().partition(":")
    if kind in ("exact", "contains") and not arg:
        return Scorer(kind, kind)
    if kind == "regex" and arg:
        try:
            re.compile(arg)
        except re.error as err:
            raise ScorerError(f"scorer {text!r}: not a regular expression ({err})") from None
        return Scorer("regex", kind, arg)
    if kind == "task":
        if arg:
            try:
                verify(arg, "", "0")
            except ValueError as err:
                raise ScorerError(f"scorer {text!r}: {err}") from None
        return Scorer(arg or "task", kind, arg)
    if kind == "python" and arg:
        python_function(Scorer("", kind, arg))  # importable, now
        return Scorer(arg.rpartition(":")[2], kind, arg)
    raise ScorerError(f"scorer {text!r}: expected exact, contains, regex:PATTERN, task, "
                      "task:NAME or python:package.module:function")


def python_function(scorer: Scorer) -> Callable[..., Any]:
    """The function a ``python:`` scorer names, imported."""
    module, _, name = scorer.arg.partition(":")
    if not module or not name:
        raise ScorerError(f"scorer python:{scorer.arg}: expected python:package.module:function")
    try:
        fn = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as err:
        raise ScorerError(f"scorer python:{scorer.arg}: cannot import it ({err})") from None
    if not callable(fn):
        raise ScorerError(f"scorer python:{scorer.arg}: {name} is not a function")
    return fn


def parse_scorers(names: Any) -> tuple[Scorer, ...]:
    """Several scorers; their labels must differ (each is a metric's name)."""
    if isinstance(names, str):
        names = [names]
    if not isinstance(names, list | tuple) or not names:
        raise ScorerError(f"scorers: expected a list of scorer names, got {names!r}")
    scorers = tuple(parse_scorer(n) for n in names)
    labels = [s.label for s in scorers]
    if dup := next((x for i, x in enumerate(labels) if x in labels[:i]), None):
        raise ScorerError(f"scorers: two are labelled {dup!r} (metric gen/<split>/{dup}); "
                          "keep one")
    return scorers


def score(scorer: Scorer, prompt: str, completion: str, row: dict[str, Any]) -> float:
    """``scorer``'s score of ``completion`` for ``row`` (id, prompt, chosen, rejected)."""
    chosen = row["chosen"]
    try:
        value = _raw_score(scorer, prompt, completion, row, chosen)
    except ScorerError:
        raise
    except Exception as err:  # a lab's function: whatever it raised, named in one line
        raise ScorerError(f"scorer {scorer.spec}: row {row.get('id')}: raised "
                          f"{type(err).__name__}: {err}") from None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ScorerError(f"scorer {scorer.spec}: row {row.get('id')}: returned "
                          f"{value!r}, expected a number in [0, 1]")
    if not math.isfinite(value) or not 0.0 <= value <= 1.0:
        raise ScorerError(f"scorer {scorer.spec}: row {row.get('id')}: returned {value!r}, "
                          "expected a number in [0, 1]")
    return float(value)


def _raw_score(scorer: Scorer, prompt: str, completion: str, row: dict[str, Any],
               chosen: str) -> Any:
    if scorer.kind == "exact":
        return float(normalise(completion) == normalise(chosen))
    if scorer.kind == "contains":
        return float(normalise(chosen) in normalise(completion))
    if scorer.kind == "regex":
        match = re.search(scorer.arg, completion)
        if match is None or not match.groups():
            return float(match is not None)
        return float(normalise(match.group(1) or "") == normalise(chosen))
    if scorer.kind == "task":
        task = scorer.arg or row_task(str(row.get("id", "")))
        if task is None:
            raise ScorerError(f"scorer task: row {row.get('id')}: not a synthetic task's row "
                              "(its id names no task); name it (task:add) or use exact")
        return verify(task, completion, chosen)
    return python_function(scorer)(prompt, completion, dict(row))
