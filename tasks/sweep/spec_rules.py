"""Rules a sweep spec is checked against across its keys: the batch sizes ranks split, the
metric trials of different losses are ranked on, the pruner's settings (tasks/sweep/spec_file.py
parses; these refuse)."""

from __future__ import annotations

from typing import Any

from engine.losses import (
    ACROSS_LOSSES,
    LOSSES,
    OWNERS,
    READERS,
    shared_metrics,
    validation_metrics,
)
from engine.losses.sampled import SAMPLED_FIELDS
from engine.settings.config import DEFAULT_LOSS, TrainConfig
from tasks.eval.rewards import Reward
from tasks.eval.scorers import ScorerError
from tasks.sweep.trial_plan import AUTO

PRUNING_DEFAULTS = {"startup_trials": 2, "warmup_steps": 0}


class SpecError(ValueError):
    """A sweep spec problem, naming the key."""


def check_kind(kind: str, search: str, autos: list[str], report_to: Any) -> None:
    """``kind``: train, or memory (grid points measured, with explicit segment sizes and
    nothing trained for a tracker to follow)."""
    if kind not in ("train", "memory"):
        raise SpecError(f"kind={kind!r}: expected train or memory")
    if kind == "memory" and (search != "grid" or autos):
        raise SpecError("kind: memory measures grid points (search: grid, explicit segment "
                        "sizes)")
    if kind == "memory" and report_to:
        raise SpecError("report_to: a memory sweep measures and trains nothing to track; "
                        "drop report_to or use kind: train")


def check_pack(pack: Any, search: str, kind: str, ranks: int, autos: list[str],
               budget: float) -> None:
    """A spec's ``pack`` > 1 or ``auto`` where packs can run (tasks/sweep/packs.py): listed
    trials (grid or random: Optuna asks one trial at a time), one process each (no gangs),
    a training sweep, no ``auto`` segment size (its probe measures one adapter; a pack holds
    k copies of its activations). ``memory_budget_gb`` is what ``auto`` fits packs to
    (tasks/sweep/pack_sizes.py); with a fixed N it is refused: a trial's budget, which a
    pack's process would hold for all of its trials."""
    auto = pack is AUTO
    if auto and budget <= 0:
        raise SpecError("pack: auto needs memory_budget_gb > 0 (what each pack's process "
                        "must fit in)")
    if not auto and pack <= 1:
        return
    for wrong, why in ((search == "optuna", "search: optuna asks trials one at a time"),
                       (kind == "memory", "kind: memory measures one process per point"),
                       (ranks > 1, "ranks_per_trial > 1: a pack trains in one process"),
                       (bool(autos), f"{autos[0] if autos else ''}: auto fits one adapter, "
                                     "not a pack's copies"),
                       (budget > 0 and not auto, "memory_budget_gb is a trial's; a pack's "
                                                 "process holds several (pack: auto fits "
                                                 "packs to it)")):
        if wrong:
            raise SpecError(f"pack: {pack}: {why}; give pack: 1")


def check_ranks(ranks: int, kind: str, fixed: dict, grid: dict, space: dict) -> None:
    """Every batch size a trial may get splits over ``ranks`` (each rank takes its share of
    every global batch), known before any rank starts."""
    if kind == "memory":
        raise SpecError("ranks_per_trial: a memory sweep measures one process per point")
    if "batch_size" in space:
        raw = space["batch_size"]
        values = raw.get("choice") if isinstance(raw, dict) else None
        if not isinstance(values, list):
            raise SpecError(f"space.batch_size: with ranks_per_trial {ranks} give a choice of "
                            "multiples of it (a range would draw sizes the ranks cannot split)")
        sources = [("space.batch_size", values)]
    elif "batch_size" in grid:
        sources = [("grid.batch_size", grid["batch_size"])]
    else:
        sources = [("fixed.batch_size" if "batch_size" in fixed else "batch_size (default)",
                    [fixed.get("batch_size", TrainConfig().batch_size)])]
    for where, values in sources:
        bad = [v for v in values if not isinstance(v, int) or v % ranks]
        if bad:
            raise SpecError(f"{where}={bad[0]!r}: must be a multiple of ranks_per_trial={ranks} "
                            "(each rank trains its share of every batch)")


def searched(name: str, grid: dict, space: dict) -> set:
    """The values a search gives field ``name`` (its grid list or its space's choice: as
    written, or parsed, a ``Dist``)."""
    dist = space.get(name)
    choice = (dist.get("choice", []) if isinstance(dist, dict) else dist.args
              if getattr(dist, "kind", None) == "choice" else [])
    return set(grid.get(name, [])) | set(choice)


def spec_losses(fixed: dict, grid: dict, space: dict) -> set[str]:
    """The losses a spec's trials train with."""
    return searched("loss", grid, space) or {fixed.get("loss", DEFAULT_LOSS.kind)}


def check_loss_settings(fixed: dict, grid: dict, space: dict) -> None:
    """A loss's own setting (``orpo_lambda``) is given only where a trial trains with that
    loss: each trial takes its own loss's settings (tasks/sweep/trial_plan.own_loss_fields)."""
    losses = spec_losses(fixed, grid, space)
    for where, section in (("fixed", fixed), ("grid", grid), ("space", space)):
        for name in section:
            readers = [r.kind for r in READERS.get(name, ())]
            if readers and not set(readers) & losses:
                raise SpecError(f"{where}.{name}: a setting of loss {' or '.join(readers)}, "
                                "which no trial of this sweep trains with (its losses: "
                                f"{', '.join(sorted(losses))})")


def check_metric_of_losses(metric: str, fixed: dict, grid: dict, space: dict) -> None:
    """A search over ``loss`` must rank trials on a metric every loss shares; one loss,
    on a metric it reports (else every trial would train and then go unranked)."""
    losses = searched("loss", grid, space)
    online = sorted(k for k in losses if k in LOSSES and LOSSES[k].on_groups)
    if online and len(online) < len(losses):
        raise SpecError(f"loss: {online[0]} and {sorted(losses - set(online))[0]} share no "
                        "validation metric to rank on (a reward's val/reward, a pair loss's "
                        "val/loss); sweep them apart")
    shared = shared_metrics(losses)
    for name, owner in OWNERS.items():  # a loss's variants (its loss_type: choices)
        types = searched(name, grid, space)  # (a reward is the verifier's, on any variant)
        if (len(types) > 1 and "choices" in owner.field(name).metadata and not owner.on_groups
                and len(READERS[name]) == 1):  # pairs: fixed or online rank on one scale
            loss = owner.kind  # e.g. sigmoid and IPO: two scales (IPO starts at 1/(4β²))
            named = {"+".join(t) if isinstance(t, tuple) else t for t in types}  # DPO's lists
            losses, shared = losses | {f"{loss}-{t}" for t in named}, ACROSS_LOSSES
    if len(losses) > 1 and metric not in shared:
        raise SpecError(f"metric={metric}: not comparable across losses {sorted(losses)}; "
                        f"rank a search over loss on one of {', '.join(shared)}")
    for loss in sorted(losses or {fixed.get("loss", DEFAULT_LOSS.kind)}):
        if loss in LOSSES and metric not in (names := validation_metrics(LOSSES[loss]())):
            raise SpecError(f"metric={metric}: loss {loss} does not report it; it reports "
                            f"{', '.join(names)}")


def pruning_of(raw: Any, search: str) -> dict[str, int]:
    """The ``pruning:`` setting: off, Optuna's defaults, or the keys given over them."""
    if raw is False or raw is None:
        return {}
    if search != "optuna":
        raise SpecError("pruning: needs search: optuna (the pruner is Optuna's)")
    if raw is True:
        return dict(PRUNING_DEFAULTS)
    if not isinstance(raw, dict) or set(raw) - set(PRUNING_DEFAULTS):
        raise SpecError(f"pruning: expected true or a mapping with keys "
                        f"{sorted(PRUNING_DEFAULTS)}, got {raw!r}")
    if not all(isinstance(v, int) and v >= 0 for v in raw.values()):
        raise SpecError(f"pruning: values must be integers >= 0, got {raw!r}")
    return {**PRUNING_DEFAULTS, **raw}


def online_losses(fixed: dict, grid: dict, space: dict) -> list[str]:
    """The spec's losses that learn from a reward (GRPO: engine/losses/group.py)."""
    return sorted(k for k in spec_losses(fixed, grid, space) if k in LOSSES
                  and LOSSES[k].on_groups)


def default_metric(fixed: dict, grid: dict, space: dict) -> str:
    """The metric a spec that names none ranks on: ``val/reward`` when every trial learns
    from a reward (it reports no ``val/loss``), else ``val/loss``."""
    online = online_losses(fixed, grid, space)
    return "val/reward" if online and set(online) == spec_losses(fixed, grid, space) \
        else "val/loss"


def samplers(fixed: dict, grid: dict, space: dict) -> list[str]:
    """What in a spec samples its own completions and rewards them: each loss over groups
    (``loss grpo``), and ``pairs: online`` where a trial's pair loss builds its pairs."""
    pairs = searched("pairs", grid, space) | ({fixed["pairs"]} if "pairs" in fixed else set())
    return ([f"loss {k}" for k in online_losses(fixed, grid, space)]
            + (["pairs: online"] if "online" in pairs else []))


def check_online(fixed: dict, grid: dict, space: dict, pack: Any, ranks: int,
                 autos: list[str] = ()) -> None:
    """A trial that samples and learns from a reward: each ``reward`` the spec gives read
    now (a scorer that cannot be imported, a bad weight: refused before a cluster starts),
    and trained one trial to a process on one rank (its rollouts sample one adapter's
    policy); online pairs' lengths are their samples', so no probe sizes them."""
    online = samplers(fixed, grid, space)
    if not online:
        unread = [f"{where}.{n}" for where, section in (("fixed", fixed), ("grid", grid),
                                                         ("space", space))
                  for n in SAMPLED_FIELDS if n in section]
        if unread:  # a fixed pair trial would drop it: refused, as train refuses it
            raise SpecError(f"{unread[0]}: read by loss grpo or by pairs: online, and no "
                            "trial of this sweep samples; give pairs: online or drop it")
        return
    if pack is AUTO or pack > 1:
        raise SpecError(f"pack: {pack}: {online[0]} trains one trial to a process (a "
                        "pack shares pairs' steps; rollouts sample each adapter's own); give "
                        "pack: 1")
    if ranks > 1:
        raise SpecError(f"ranks_per_trial: {ranks}: {online[0]} trains on one rank in a "
                        "sweep for now; give ranks_per_trial: 1")
    if "pairs: online" in online and autos:
        raise SpecError(f"{autos[0]}: auto with pairs: online: the memory probe sizes the "
                        "data's pairs, not the samples online pairs train on; give a number")
    if not any("reward" in section for section in (fixed, grid, space)):
        raise SpecError(f"{online[0]} learns from a reward: give fixed.reward (task:NAME, "
                        "contains, or python:module:function; several in a list)")
    for where, section in (("fixed", fixed), ("grid", grid), ("space", space)):
        raw = section.get("reward")
        values = ([] if raw is None else [raw] if where == "fixed" else raw if where == "grid"
                  else raw.get("choice", []) if isinstance(raw, dict) else [])
        for value in values:
            try:
                Reward.parse(value, f"{where}.reward")
            except ScorerError as err:
                said = str(err)
                raise SpecError(said if said.startswith(where) else f"{where}.reward: {said}"
                                ) from None


def check_prompt_sweep(fixed: dict, grid: dict, space: dict, data: str,
                       judged: bool) -> None:
    """A sweep of prompt data (prompts and answers, no pairs): every trial a loss over
    sampled groups (a pair loss, online pairs too, reads pairs), and an evaluation that
    judges answers (``judged``: scorers and a prompt budget), as nothing else scores it."""
    pairs = sorted(k for k in spec_losses(fixed, grid, space)
                   if k in LOSSES and not LOSSES[k].on_groups)
    if pairs:
        raise SpecError(f"loss {pairs[0]}: trains on pairs, and {data} holds prompts alone "
                        "(prompts and answers): give loss grpo, or pair data")
    if not judged:
        raise SpecError(f"evaluation: {data} holds prompts alone, judged by their answers: "
                        "give evaluation.scorers (the reward's, such as task:NAME) and a "
                        "prompt budget above 0")
