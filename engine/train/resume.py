"""Resuming a run: which checkpoint, and whether this run's settings may continue it.

A checkpoint's ``state.json`` records the settings that shape the trajectory
(``run_settings``); a resume whose settings differ in any of them is refused naming the
field and both values, since the adapter would describe settings the run only partly
used. What cannot change the updates (``steps``, to extend a run; reporting, validation,
checkpoint cadence; the exact memory levers) may change.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from engine.losses import READERS
from engine.model.adapters import latest_checkpoint
from engine.model.content_key import adapter_fingerprint, model_fingerprint, reference_key
from engine.settings.config import TrainConfig
from engine.train.reference import data_digest

# Fields a resume may change: bookkeeping, or the memory levers whose gradients equal the
# plain path's (docs/design.md, "memory levers"). Every other field shapes the updates.
MAY_CHANGE = frozenset({
    "out", "steps", "resume", "report_every", "val_every", "val_batches", "best_metric",
    "best_mode", "checkpoint_every", "keep_checkpoints", "verify", "memory_limit_gb",
    "segment_size", "head_chunk", "mlp_chunk", "inflight", "prefix_share",
    "prefix_attention", "pad_multiple", "model", "data", "reference", "reference_logps",
    "warm_start", "score_timeout_s"})
# Inputs are compared by content, never by path (a moved model is the same model).
CONTENT_FIELDS = ("model", "data", "warm_start", "reference")


def run_settings(cfg: TrainConfig) -> dict[str, Any]:
    """The settings a checkpoint records: every trajectory field, inputs by content."""
    settings = {k: v for k, v in cfg.to_dict().items() if k not in MAY_CHANGE}
    settings["lora_keys"] = list(cfg.lora_keys) if cfg.lora_keys is not None else None
    settings["model"] = model_fingerprint(cfg.model)
    settings["data"] = data_digest(cfg.data)
    settings["warm_start"] = adapter_fingerprint(cfg.warm_start) if cfg.warm_start else None
    settings["reference"] = reference_key(cfg.reference)
    return json.loads(json.dumps(settings))  # as state.json gives it back


def resume_checkpoint(cfg: TrainConfig, out: Path) -> Path | None:
    """The checkpoint ``cfg.resume`` names: the latest in ``out`` ("auto"), a checkpoint
    folder, or a run folder (its latest checkpoint); ValueError in one line otherwise."""
    if not cfg.resume:
        return None
    if cfg.resume == "auto":
        return latest_checkpoint(out)
    given = Path(cfg.resume).expanduser()
    if (given / "state.json").is_file():
        return given
    if (given / "checkpoints").is_dir():
        latest = latest_checkpoint(given)
        if latest is not None:
            return latest
    raise ValueError(f"resume={cfg.resume}: neither a checkpoint (checkpoints/step_N with "
                     "state.json) nor a run folder holding one; give one, or 'auto'")


def read_state(ckpt: Path) -> dict[str, Any]:
    """A checkpoint's state.json; ValueError in one line when it is missing or broken."""
    try:
        state = json.loads((ckpt / "state.json").read_text())
        int(state["step"])
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise ValueError(f"{ckpt}: not a readable checkpoint ({err}); resume from another "
                         "one, or start afresh without --resume") from None
    return state


def check_resume(cfg: TrainConfig, ckpt: Path, state: dict[str, Any]) -> None:
    """Refuse, in one line, a resume whose trajectory settings differ from the checkpoint's
    (older checkpoints recorded only the seed), or whose ``steps`` end before its step."""
    recorded = state.get("settings") or {"seed": state.get("seed", cfg.seed)}
    ours = run_settings(cfg) if "settings" in state else {"seed": cfg.seed}
    # fixed pairs record no ``pairs`` (engine/losses/sampled.py): absent is fixed, both ways
    was, now = recorded.get("pairs", "fixed"), ours.get("pairs", "fixed")
    if "settings" in state and recorded.get("loss") == ours.get("loss") and was != now:
        raise ValueError(f"resume from {ckpt}: pairs was {was!r} there, {now!r} now; a "
                         "resume must keep every setting that alters the run: give the old "
                         "value, or start afresh in another --out")
    for name, was in recorded.items():
        if name in READERS and name not in ours:  # another loss's (older checkpoints kept
            continue                             # all): the loss's own name differs then
        now = ours.get(name)
        if now != was and not (isinstance(was, str) and now == [was]):  # one name, as a
            # list now (an older checkpoint's dpo_loss_type)
            raise ValueError(f"resume from {ckpt}: {name} was {was!r} there, {now!r} now; "
                             "a resume must keep every setting that alters the run: give "
                             f"the old value, or start afresh in another --out")
    step = int(state["step"])
    if cfg.steps < step:  # equal: the run ended there, its adapter is written from it
        raise ValueError(f"resume from {ckpt}: steps={cfg.steps} is below the "
                         f"checkpoint's step {step}: give --steps {step} or more")
