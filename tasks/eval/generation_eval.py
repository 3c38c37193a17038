"""Scored generations: what an adapter answers on held-out prompts, and how often it is right.

For each held-out split, the first ``valid_prompts`` / ``test_prompts`` prompts (the
same rows for the base model, every trial and the soup, so they compare pair by pair)
are completed greedily in batches (engine/forward/generation.py), every completion is scored by
every scorer (tasks/eval/scorers.py), and the split gets, per scorer label:

- ``gen/<split>/<label>``: the mean score, with ``…/n``, ``…/low`` and ``…/high`` (its
  95 % interval: tasks/eval/intervals.py);
- ``paired/<split>/gen/<label>``: the per-row scores by row id, for the board's paired
  test against the base (tasks/eval/paired.py; not a board column);

and ``gen/<split>/tokens_per_sec``, ``gen/<split>/tokens``. The completions, with their
scores and the chosen response, are the rows of the adapter's ``generations.jsonl``. A
budget of 0 prompts turns it off (no columns, nothing divided by zero).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

from tasks.eval.intervals import estimate
from tasks.eval.scorers import Scorer, distinct, parse_scorers, score_rows

DEFAULTS = {"scorers": (Scorer("exact", "exact"),), "valid_prompts": 64, "test_prompts": 64,
            "max_tokens": 32, "batch_size": 32, "score_timeout_s": 300.0}


@dataclass(frozen=True)
class GenerationSettings:
    """How much each evaluation generates and how it is scored (``evaluation:`` in a
    spec). The defaults keep it a small share of a sweep: 64 prompts a split, 32 tokens.
    ``scorers`` are parsed once, where the spec or the flags are read (``parse_generation``,
    ``parse_scorers``): what crosses Prefect and Ray is the parsed value."""

    scorers: tuple[Scorer, ...] = DEFAULTS["scorers"]
    valid_prompts: int = DEFAULTS["valid_prompts"]
    test_prompts: int = DEFAULTS["test_prompts"]
    max_tokens: int = DEFAULTS["max_tokens"]
    batch_size: int = DEFAULTS["batch_size"]
    # One evaluation's scoring, all rows and scorers, in seconds: a scorer that hangs (an
    # unreachable judge) ends the evaluation in one line instead of holding the sweep.
    score_timeout_s: float = DEFAULTS["score_timeout_s"]

    def __post_init__(self) -> None:
        distinct(self.scorers)  # parsed (importable, checked) where read; labels distinct
        for name in ("valid_prompts", "test_prompts", "max_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"evaluation.{name}={value!r}: expected an integer >= 0")
        if isinstance(self.batch_size, bool) or not isinstance(self.batch_size, int) or (
                self.batch_size < 1):
            raise ValueError(f"evaluation.batch_size={self.batch_size!r}: expected an "
                             "integer >= 1")
        limit = self.score_timeout_s
        if isinstance(limit, bool) or not isinstance(limit, int | float) or not (
                0 < limit < float("inf")):
            raise ValueError(f"evaluation.score_timeout_s={limit!r}: expected a number of "
                             "seconds > 0")

    @property
    def labels(self) -> tuple[str, ...]:
        return tuple(s.label for s in self.scorers)

    def prompts(self, split: str) -> int:
        """The budget of ``split``: 0 when generation is off (no tokens either)."""
        return 0 if self.max_tokens == 0 else getattr(self, f"{split}_prompts")

    @property
    def on(self) -> bool:
        return self.max_tokens > 0 and (self.valid_prompts > 0 or self.test_prompts > 0)

    def with_prompts(self, prompts: int | None) -> GenerationSettings:
        """Both splits' budgets set to ``prompts`` (None: unchanged)."""
        return self if prompts is None else replace(self, valid_prompts=prompts,
                                                    test_prompts=prompts)


def check_prompts_flag(prompts: int | None) -> None:
    """``--generations``: None (the spec's budget), 0 (no generation) or more; ValueError
    naming the flag (the field behind it, ``evaluation.valid_prompts``, means nothing to a
    user of the flag)."""
    if prompts is not None and prompts < 0:
        raise ValueError(f"--generations {prompts}: expected 0 (no generation) or more "
                         "held-out prompts a split")


NO_GENERATION = GenerationSettings(valid_prompts=0, test_prompts=0)  # loss figures only


def parse_generation(raw: Any) -> GenerationSettings:
    """A spec's ``evaluation:`` mapping (``prompts`` sets both splits' budgets)."""
    if raw is None:
        return GenerationSettings()
    if not isinstance(raw, dict):
        raise ValueError(f"evaluation: expected a mapping, got {raw!r}")
    known = {f.name for f in fields(GenerationSettings)} | {"prompts"}
    if unknown := sorted(set(raw) - known):
        raise ValueError(f"evaluation: unknown key(s) {', '.join(unknown)}; expected "
                         f"{sorted(known)}")
    values = dict(raw)
    if "prompts" in values:
        both = values.pop("prompts")
        values = {"valid_prompts": both, "test_prompts": both, **values}
    if "scorers" in values:  # the one parse of a spec's scorers
        values["scorers"] = parse_scorers(values["scorers"])
    try:
        return GenerationSettings(**values)
    except TypeError as err:
        raise ValueError(f"evaluation: {err}") from None


def check_rank_by(rank_by: Any, settings: GenerationSettings) -> str:
    """A spec's ``rank_by``: "" (the sweep's metric), a validation metric (``val/…``), or
    ``gen/valid/<label>`` of a scorer the evaluation runs with a validation budget."""
    if rank_by in ("", None):
        return ""
    if not isinstance(rank_by, str) or not rank_by.startswith(("val/", "gen/valid/")):
        raise ValueError(f"rank_by={rank_by!r}: expected a validation metric (val/loss, "
                         "val/rewards/accuracies) or a generation score on the valid split "
                         "(gen/valid/exact)")
    label = rank_by.removeprefix("gen/valid/")
    if rank_by.startswith("gen/") and label not in settings.labels:
        raise ValueError(f"rank_by={rank_by}: no scorer labelled {label!r} in "
                         f"evaluation.scorers (labels: {', '.join(settings.labels)})")
    if rank_by.startswith("gen/") and settings.prompts("valid") == 0:
        raise ValueError(f"rank_by={rank_by}: evaluation generates no valid prompts "
                         "(valid_prompts or max_tokens is 0)")
    return rank_by


def decoded_row(tokenizer, pair, split: str) -> dict[str, Any]:
    """A held-out pair as text: its id, split, prompt, chosen and rejected response
    (special tokens such as the chat template's end-of-turn left out)."""
    def text(ids) -> str:
        return tokenizer.decode(list(ids), skip_special_tokens=True)

    return {"id": pair.id, "split": split, "prompt": text(pair.prompt),
            "chosen": text(pair.chosen), "rejected": text(pair.rejected)}


@dataclass(frozen=True)
class HeldOut:
    """One held-out prompt as generation reads it: its token ids, and its row as scorers
    read it (id, split, prompt, ``chosen``: the answer, and ``rejected``)."""

    prompt: tuple[int, ...]
    row: dict[str, Any]


def held_out_pairs(tokenizer, pairs_by_split: dict[str, list]) -> dict[str, list[HeldOut]]:
    """Each split's pairs as held-out prompts, their chosen responses the answers."""
    return {split: [HeldOut(tuple(p.prompt), decoded_row(tokenizer, p, split)) for p in pairs]
            for split, pairs in pairs_by_split.items()}


def held_out_prompts(prompts: Any) -> dict[str, list[HeldOut]]:
    """A prompts dataset's valid and test rows (engine/data/prompts.py ``PromptSet``) as
    held-out prompts, each answer what a scorer reads as the chosen response."""
    return {split: [HeldOut(p.prompt, {**p.row(), "split": split})
                    for p in getattr(prompts, split)] for split in ("valid", "test")}


def generation_metrics(model, tokenizer, held_out: dict[str, list[HeldOut]],
                       settings: GenerationSettings) -> tuple[dict[str, Any], list[dict]]:
    """The ``gen/*`` and ``paired/*/gen/*`` metrics of ``model`` on each split's first
    prompts, and the scored completions (generations.jsonl's rows)."""
    from engine.forward.generation import greedy_batch

    scorers = settings.scorers
    metrics: dict[str, Any] = {}
    rows: list[dict] = []
    for split, items in held_out.items():
        chosen = items[: settings.prompts(split)]
        if not chosen:
            continue
        done = greedy_batch(model, tokenizer, [h.prompt for h in chosen],
                            settings.max_tokens, settings.batch_size)
        rows_ = [h.row for h in chosen]
        values = score_rows(scorers, [(r["prompt"], c, r)
                                      for r, c in zip(rows_, done.texts, strict=True)],
                            settings.score_timeout_s)
        scored = [{**row, "generated": completion, "scores": v}
                  for row, completion, v in zip(rows_, done.texts, values, strict=True)]
        rows += scored
        metrics.update(split_columns(split, scored, scorers))
        metrics[f"gen/{split}/tokens"] = done.generated
        metrics[f"gen/{split}/tokens_per_sec"] = done.tokens_per_sec
    return metrics, rows


def split_columns(split: str, scored: list[dict], scorers) -> dict[str, Any]:
    """Mean, n and 95 % interval of each scorer on one split, and its per-row scores."""
    out: dict[str, Any] = {}
    for s in scorers:
        values = [r["scores"][s.label] for r in scored]
        est = estimate(values)
        name = f"gen/{split}/{s.label}"
        out.update({name: est.mean, f"{name}/n": est.n, f"{name}/low": est.low,
                    f"{name}/high": est.high,
                    f"paired/{split}/gen/{s.label}": {r["id"]: r["scores"][s.label]
                                                      for r in scored}})
    return out


def check_scorers(settings: GenerationSettings, rows: list[dict[str, Any]]) -> None:
    """Each scorer tried on ``rows`` (decoded held-out rows) with the chosen response as
    the completion, before a sweep starts: a scorer that raises, or returns NaN or a
    non-number, or hangs past ``score_timeout_s``, is a ScorerError naming it and the row
    now, not after hours of trials."""
    score_rows(settings.scorers,
               [(row["prompt"], row["chosen"], row) for row in rows], settings.score_timeout_s)


def check_scorers_on_data(settings: GenerationSettings, model: str, data: str,
                          rows: int = 32) -> None:
    """``check_scorers`` on the first held-out rows of ``data`` (tokenized for ``model``),
    decoded with the model's tokenizer: on the driver, before any trial starts."""
    if not settings.on:
        return
    from mlx_lm.utils import load_tokenizer

    from engine.model.source import model_dir

    tokenizer = load_tokenizer(model_dir(model))
    limits = {split: min(rows, settings.prompts(split)) for split in ("valid", "test")}
    held_out = [h.row for items in held_out_rows(data, tokenizer, limits).values()
                for h in items]
    check_scorers(settings, held_out)


def held_out_rows(data: str, tokenizer: Any, limits: dict[str, int]
                  ) -> dict[str, list[HeldOut]]:
    """``data``'s first ``limits[split]`` valid and test rows as held-out prompts (only
    those decoded): a pair dataset's pairs, or a prompts dataset's prompts (read as they
    were tokenized; no model needed)."""
    from engine.data.pairs import load_pairs, read_data
    from engine.data.prompts import holds_prompts, prompts_of_table
    from engine.data.unpaired import refuse_unpaired

    path = Path(data)
    refuse_unpaired(path, "held-out answers are scored against pairs' chosen responses")
    if holds_prompts(path):
        every = held_out_prompts(prompts_of_table(read_data(path), path, tokenizer, None))
        return {split: items[: limits[split]] for split, items in every.items()}
    pairs = load_pairs(path)
    return held_out_pairs(tokenizer, {split: pairs.split(split)[: limits[split]]
                                      for split in ("valid", "test")})


def check_scorers_on_raw(settings: GenerationSettings, raw: str, rows: int = 32) -> None:
    """``check_scorers`` on the first ``rows`` valid pairs of raw preference data, as text:
    the pipeline's check before its flow starts (its tokenized rows exist only inside the
    flow), so a broken scorer starts no server and no cluster. Rows are parsed only until
    ``rows`` are found: tokenize reads the whole data later."""
    if not settings.on:
        return
    from tasks.data.preference_rows import raw_rows

    check_scorers(settings, list(itertools.islice(raw_rows(Path(raw)), rows)))
