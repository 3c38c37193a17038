"""Evaluate an adapter (or the untrained base) on the validation and the test split.

Metrics, each under ``eval/<split>/`` for split valid and test: what validation reports
during training, with TRL's names (``engine.forward.scoring.evaluate`` under the adapter's own
loss, engine/losses/) — ``loss``, ``nll_loss``, ``rewards/accuracies`` and
``rewards/margins`` (the loss's own rewards: DPO's relative to its reference),
``logps/chosen``, ``logps/rejected`` (DPO: summed), the loss's extras (ORPO:
``log_odds_ratio``, ``log_odds_chosen``), ``rows`` — and, on mean response log-probs
comparable across losses, ``logps/accuracies`` (share of pairs with ℓw > ℓr) and
``logps/margin`` (ℓw − ℓr).
Valid is what training reported and the sweep ranked on; test was never used to choose
anything, so it is the number a leaderboard reports. A dataset with no test rows
(a test fraction of 0, a ``split`` column naming only train/valid, or too few rows) gets
``eval/test/*`` = None, 0 rows, and its reason in ``eval/test/missing``: never the
validation numbers under the test name. With a generation budget
(tasks/eval/generation_eval.py), the first prompts of each split are also completed greedily
in batches and scored: ``gen/<split>/<scorer>`` with its 95 % interval, and the scored
completions are the evaluation's ``generations`` rows (the driver writes them, once, as
``generations.jsonl``: tasks/prefect/pipeline_tasks.py). Per pair, ``paired/<split>/…``
keeps each row's score by id (preference: 1 where ℓw > ℓr) for the board's paired test
against the base (tasks/eval/paired.py). Runs where it is called: the sweep runs it in a
Ray task on a trial's placement, so models load on GPUs, not on the driver.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.data.prompts import holds_prompts
from engine.losses import LossSpec
from engine.settings.forward_options import ForwardOptions
from tasks.eval.generation_eval import (
    NO_GENERATION,
    GenerationSettings,
    generation_metrics,
    held_out_pairs,
    held_out_prompts,
)
from tasks.eval.intervals import estimate
from tasks.nodes.trial_inputs import fetched

EVAL_SPLITS = ("valid", "test")
EVALUATE = ForwardOptions(batch_size=8)  # where a caller gives none (a pipeline gives its own)
# Every split has these (None without rows); the loss's extras come on top.
METRICS = ("loss", "nll_loss", "rewards/accuracies", "logps/accuracies", "rewards/margins",
           "logps/chosen", "logps/rejected", "logps/margin")
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Evaluation:
    """One evaluation's result: its metrics (the board's columns, JSON) and its scored
    completions, one row each (generations.jsonl's rows), for the caller to keep."""

    metrics: dict[str, Any]
    generations: list[dict[str, Any]] = field(default_factory=list)


def evaluate_adapter(model: str, adapter: str | None, data: str, loss: LossSpec | None = None,
                     options: ForwardOptions = EVALUATE,
                     generation: GenerationSettings = NO_GENERATION,
                     reference: str | None = None) -> Evaluation:
    """The valid and test metrics of ``adapter`` (None: the base model) on ``data``, under
    ``loss`` (None: the adapter's own, else ORPO's defaults); ``options``: its batch, head
    chunk and prefix sharing, as in training (one forward per pair where it pays). Data
    tokenized for another tokenizer is refused unless ``options`` allow it
    (engine/data/data_fit.py). ``reference``: where
    a DPO adapter's reference adapter lies on this node (None: where its config says).
    ``generation``: the generation budget and scorers (NO_GENERATION: none). Writes no
    file: the scored completions come back in the result."""
    from engine.data.data_fit import load_pairs_for
    from engine.data.unpaired import refuse_unpaired
    from engine.forward.layout_policy import scoring_layout
    from engine.forward.scoring import evaluate
    from engine.model.adapters import pairs_scored_under, trained_reference
    from engine.settings.reference_kind import parse_reference
    from engine.train.prepared import prepare_scoring
    from engine.train.reference import ReferenceSpec, attach_reference, ensure_reference

    refuse_unpaired(Path(data), "an evaluation scores preference pairs")
    if holds_prompts(Path(data)):  # no pairs to score: judged by its answers alone
        return evaluate_answers(model, adapter, data, options, generation)
    spec = loss or pairs_scored_under(adapter)  # GRPO's: by its answers and ORPO's metrics
    reference = ReferenceSpec(model, data, parse_reference(reference) if reference
                              else trained_reference(adapter), spec.needs_kl)
    if spec.needs_reference:  # made (or read) before the adapter's model loads: one at a time
        ensure_reference(reference, None, options)
    prepared = prepare_scoring(model, adapter)
    loaded, tokenizer, stack = prepared.model, prepared.tokenizer, prepared.stack
    pairs = load_pairs_for(data, model, stack, options.allow_tokenizer_mismatch)  # ids fit
    if spec.needs_reference:  # DPO's figures read the reference it trained against
        attach_reference(pairs, reference, None, options)
    if not pairs.valid and not pairs.test:
        raise ValueError(f"{data}: no validation or test split to evaluate on")
    layout = scoring_layout(options.prefix_share, prepared.pad_id, spec.nll_span)
    metrics: dict[str, Any] = {}
    for split in EVAL_SPLITS:
        held_out, wins = pairs.split(split), {}
        values = evaluate(loaded, stack, held_out, spec, options.batch_size,
                          head_chunk=options.head_chunk, layout=layout,
                          per_pair=wins) if held_out else {}
        metrics.update(split_metrics(split, values))
        if wins:  # the accuracy's interval, and each pair's win for the paired test
            est = estimate(list(wins.values()))
            metrics.update({f"eval/{split}/logps/accuracies/low": est.low,
                            f"eval/{split}/logps/accuracies/high": est.high,
                            f"paired/{split}/logps/accuracies": wins})
    if not pairs.test:
        metrics["eval/test/missing"] = missing_test_reason(data)
        log.warning("%s", metrics["eval/test/missing"])
    if not pairs.valid:
        metrics["eval/valid/missing"] = missing_valid_reason(data)
        log.warning("%s", metrics["eval/valid/missing"])
    rows: list[dict[str, Any]] = []
    if generation.on:
        values, rows = generation_metrics(loaded, tokenizer, held_out_pairs(tokenizer, {
            split: pairs.split(split)[: generation.prompts(split)] for split in EVAL_SPLITS}),
            generation)
        metrics.update(values)
    return Evaluation(metrics, rows)


def evaluate_answers(model: str, adapter: str | None, data: str, options: ForwardOptions,
                     generation: GenerationSettings) -> Evaluation:
    """A prompts dataset's evaluation (prompts and answers, no pairs): each split's first
    prompts completed greedily and scored, as ``evaluate_adapter`` scores a pair
    dataset's, its pair metrics None (0 rows) with the reason in ``eval/<split>/missing``."""
    from engine.data.prompts import prompts_for
    from engine.train.prepared import prepare_scoring

    if not generation.on:
        raise ValueError(f"{data}: a prompts dataset has no pairs to score; it is judged by "
                         "its answers: give evaluation.scorers and a prompt budget")
    prepared = prepare_scoring(model, adapter)
    prompts = prompts_for(data, model, prepared.stack, prepared.tokenizer,
                          options.allow_tokenizer_mismatch)
    if not prompts.valid and not prompts.test:
        raise ValueError(f"{data}: no validation or test split to evaluate on")
    metrics: dict[str, Any] = {}
    for split in EVAL_SPLITS:
        metrics.update(split_metrics(split, {}))
        metrics[f"eval/{split}/missing"] = (f"{data}: a prompts dataset, no pairs: its "
                                            "answers are scored (gen/*)")
    values, rows = generation_metrics(prepared.model, prepared.tokenizer,
                                      held_out_prompts(prompts), generation)
    return Evaluation({**metrics, **values}, rows)


def evaluate_on_node(inputs: dict[str, Any], model: str, adapter: str | None, data: str,
                     loss: LossSpec | None = None,
                     generation: GenerationSettings = NO_GENERATION,
                     options: ForwardOptions = EVALUATE) -> Evaluation:
    """``evaluate_adapter`` where it runs (a Ray task on a GPU or slot), on this node's
    copies of ``inputs`` (tasks/nodes/trial_inputs.py: the model, adapter, data and reference
    by content); its rows go back to the driver, which writes them."""
    local = fetched(inputs)
    return evaluate_adapter(local.get("model", model), local.get("adapter", adapter),
                            local.get("data", data), loss, options, generation,
                            reference=local.get("reference"))


def split_metrics(split: str, values: dict[str, Any]) -> dict[str, Any]:
    """``eval/<split>/*`` from ``engine.forward.scoring.evaluate``'s metrics; None for each of
    METRICS (0 rows) when the split is empty."""
    if not values.get("rows"):
        return {**{f"eval/{split}/{m}": None for m in METRICS}, f"eval/{split}/rows": 0}
    return {f"eval/{split}/{k}": v for k, v in values.items()}


def missing_test_reason(data: str) -> str:
    """Why ``data`` has no test metrics, and how to get a test split."""
    fix = ("re-tokenize it, or run `pomona data preprocess` on it: test rows come out of "
           "train, valid keeps its rows" if Path(data).is_dir() else
           "give some rows split \"test\", or drop the split column for a hash of the id")
    return (f"{data}: no test rows (written before the test split, a split column naming only "
            f"train/valid, or too few rows), so no test metrics; validation numbers are "
            f"selection-biased, not a substitute. To get a test split, {fix}")


def missing_valid_reason(data: str) -> str:
    """Why ``data`` has no validation metrics, and what that costs the board."""
    return (f"{data}: no valid rows, so no validation metrics and nothing to rank trials on; "
            "re-tokenize (or `pomona data preprocess`) with --valid-fraction above 0")


def held_out_problem(data: str) -> str | None:
    """Why ``data`` has nothing to evaluate on (no valid and no test rows), or None."""
    from engine.data.pairs import load_pairs

    try:
        rows = json.loads((Path(data) / "manifest.json").read_text())["rows"]
        valid, test = rows.get("valid", 0), rows.get("test", 0)
    except (OSError, ValueError, KeyError, TypeError, AttributeError):  # a file: read it
        pairs = load_pairs(data)
        valid, test = len(pairs.valid), len(pairs.test)
    if valid or test:
        return None
    return (f"{data}: no valid and no test rows, nothing to evaluate on; re-tokenize (or "
            "`pomona data preprocess`) with --valid-fraction and --test-fraction above 0")
