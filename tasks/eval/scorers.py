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
  in [0, 1] (a bool counts as 0/1), ``row`` the held-out row's id, prompt, chosen and
  rejected text (label ``function``).

``LABEL=SCORER`` gives a scorer its own label (two regexes: ``digits=regex:\\d+``).
``tokens`` and ``tokens_per_sec`` are not labels: ``gen/<split>/tokens…`` count what was
generated.

A scorer that cannot be imported (whatever its import raised, ``sys.exit`` included) is
refused when the spec is read; one that raises, exits, or returns a non-number, NaN or a
value outside [0, 1] is a one-line ScorerError naming the scorer and the row
(``check_scorers`` tries each on the data's rows before a sweep); one that has not
finished an evaluation's rows within ``score_timeout_s`` is one too (``score_rows``).
A ``python:`` scorer's module bytes are part of an evaluation's cache key
(``scorer_code``): an edited scorer scores again.
"""

from __future__ import annotations

import hashlib
import importlib
import math
import numbers
import re
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tasks.data.synthetic import row_task, verify

KINDS = ("exact", "contains", "regex", "task", "python")
RESERVED = ("tokens", "tokens_per_sec")  # gen/<split>/tokens…: what was generated, not scores
LABEL = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]*")  # a metric name's last part


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

    @property
    def name(self) -> str:
        """As a spec writes it: ``parse_scorer(s.name) == s`` (``LABEL=`` only where the
        label is not the kind's own)."""
        own = _with_label(self.kind, self.arg).label
        return self.spec if self.label == own else f"{self.label}={self.spec}"


def normalise(text: str) -> str:
    """Whitespace collapsed, case folded, ends stripped."""
    return " ".join(text.split()).casefold()


def parse_scorer(text: Any) -> Scorer:
    """A scorer from its name in a spec (``LABEL=`` before it names its metric); ScorerError
    (one line) when it cannot be used."""
    if not isinstance(text, str) or not text.strip():
        raise ScorerError(f"scorer {text!r}: expected one of {', '.join(KINDS)} (a string)")
    label, eq, rest = text.strip().partition("=")
    if eq and LABEL.fullmatch(label) and rest.partition(":")[0] in KINDS:
        scorer = Scorer(label, *_kind(rest, text))
    else:
        scorer = _with_label(*_kind(text.strip(), text))
    if scorer.label in RESERVED:
        raise ScorerError(f"scorer {text!r}: its label {scorer.label!r} is reserved "
                          f"(gen/<split>/{scorer.label} counts generated tokens); label it "
                          f"otherwise, e.g. score={scorer.spec}")
    return scorer


def _with_label(kind: str, arg: str) -> Scorer:
    """A scorer under its default label: its kind, a task's name or a function's name."""
    label = {"task": arg or "task", "python": arg.rpartition(":")[2]}.get(kind, kind)
    return Scorer(label, kind, arg)


def _kind(text: str, named: str) -> tuple[str, str]:
    """``text``'s kind and argument, checked (``named``: the scorer as the user wrote it)."""
    kind, _, arg = text.partition(":")
    if kind in ("exact", "contains") and not arg:
        return kind, ""
    if kind == "regex" and arg:
        try:
            re.compile(arg)
        except re.error as err:
            raise ScorerError(f"scorer {named!r}: not a regular expression ({err})") from None
        return kind, arg
    if kind == "task":
        if arg:
            try:
                verify(arg, "", "0")
            except ValueError as err:
                raise ScorerError(f"scorer {named!r}: {err}") from None
        return kind, arg
    if kind == "python" and arg:
        python_function(Scorer("", kind, arg))  # importable, now
        return kind, arg
    raise ScorerError(f"scorer {named!r}: expected exact, contains, regex:PATTERN, task, "
                      "task:NAME or python:package.module:function (LABEL= before it: "
                      "its metric's label)")


def python_function(scorer: Scorer) -> Callable[..., Any]:
    """The function a ``python:`` scorer names, imported."""
    module, _, name = scorer.arg.partition(":")
    if not module or not name:
        raise ScorerError(f"scorer python:{scorer.arg}: expected python:package.module:function")
    try:
        fn = getattr(importlib.import_module(module), name)
    except KeyboardInterrupt:
        raise
    except BaseException as err:  # a lab's module: SyntaxError, sys.exit, anything at import
        raise ScorerError(f"scorer python:{scorer.arg}: cannot import it "
                          f"({raised(err)})") from None
    if not callable(fn):
        raise ScorerError(f"scorer python:{scorer.arg}: {name} is not a function")
    return fn


def raised(err: BaseException) -> str:
    """What a lab's code raised, in one line: where for a SyntaxError, the code of an exit."""
    if isinstance(err, SyntaxError):
        return (f"SyntaxError: {err.msg} at {Path(err.filename or '?').name}:"
                f"{err.lineno}")
    if isinstance(err, SystemExit):
        return f"called sys.exit({err.code!r})"
    return " ".join(f"raised {type(err).__name__}: {err}".split())


def scorer_code(scorers: tuple[Scorer, ...]) -> list[str]:
    """The digest of each ``python:`` scorer's module file, for a cache key: an edited
    scorer is not the one that scored before. (The others' code is Pomona's own: its code
    version keys it.)"""
    digests = []
    for s in scorers:
        if s.kind == "python":
            module = sys.modules.get(s.arg.partition(":")[0])
            path = getattr(module, "__file__", None)
            digests.append(hashlib.sha256(Path(path).read_bytes()).hexdigest()
                           if path else s.arg)
    return digests


def parse_scorers(names: Any) -> tuple[Scorer, ...]:
    """Several scorers; their labels must differ (each is a metric's name)."""
    if isinstance(names, str):
        names = [names]
    if not isinstance(names, list | tuple) or not names:
        raise ScorerError(f"scorers: expected a list of scorer names, got {names!r}")
    return distinct(tuple(parse_scorer(n) for n in names))


def distinct(scorers: tuple[Scorer, ...]) -> tuple[Scorer, ...]:
    """``scorers``, parsed already, whose labels differ (each is a metric's name)."""
    if not scorers or not all(isinstance(s, Scorer) for s in scorers):
        raise ScorerError(f"scorers: expected parsed scorers (parse_scorers), got {scorers!r}")
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
    except (ScorerError, KeyboardInterrupt):
        raise
    except BaseException as err:  # a lab's function: whatever it raised, sys.exit included
        raise ScorerError(f"scorer {scorer.spec}: row {row.get('id')}: "
                          f"{raised(err)}") from None
    if not isinstance(value, numbers.Real) or not math.isfinite(value) or not (
            0.0 <= value <= 1.0):
        raise ScorerError(f"scorer {scorer.spec}: row {row.get('id')}: returned {value!r}, "
                          "expected a number in [0, 1]")
    return float(value)


def score_rows(scorers: tuple[Scorer, ...], rows: list[tuple[str, str, dict[str, Any]]],
               limit_s: float) -> list[dict[str, float]]:
    """Every scorer's score of every (prompt, completion, row), by label, within
    ``limit_s`` seconds in all: a scorer that never returns is a ScorerError naming it and
    its row (it runs on in a daemon thread, which the process's exit ends)."""
    where: dict[str, Any] = {}
    done: dict[str, Any] = {}

    def work() -> None:
        try:
            out = []
            for prompt, completion, row in rows:
                values = {}
                for s in scorers:
                    where.update(scorer=s.spec, row=row.get("id"))
                    values[s.label] = score(s, prompt, completion, row)
                out.append(values)
            done["values"] = out
        except BaseException as err:  # handed to the caller's thread
            done["error"] = err

    thread = threading.Thread(target=work, name="pomona-scorer", daemon=True)
    thread.start()
    thread.join(limit_s)
    if thread.is_alive():
        raise ScorerError(f"scorer {where.get('scorer')}: row {where.get('row')}: no score "
                          f"within {limit_s:g} s (evaluation.score_timeout_s: the time "
                          "limit of one evaluation's scoring)")
    if "error" in done:
        raise done["error"]
    return done["values"]


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
