"""LoRA adapters on disk in mlx-lm's format, and training checkpoints.

``adapters.safetensors`` + ``adapter_config.json`` (``fine_tune_type``, ``num_layers``,
``lora_parameters{rank, scale, dropout, keys}``) so ``mlx_lm.load(model, adapter_path=DIR)``,
``mlx_lm.generate`` and ``mlx_lm.fuse`` take them as they are. Every file is written to a
temporary name and renamed, so a crash never leaves a half file under the real name, and
a write that fails (a full disk) removes its temporary and raises an OSError naming the file.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten

from engine.host.atomic import written
from engine.losses import LOSSES, LossSpec, spec_of
from engine.model.adapter_file import ADAPTER_FILE, CONFIG_FILE, read_adapter_weights
from engine.model.content_key import adapter_fingerprint
from engine.model.load import LoraSpec
from engine.settings.reference_kind import BASE, AdapterRef, Reference, parse_reference

log = logging.getLogger(__name__)


def run_write_text(path: Path, text: str) -> None:
    """``text`` to ``path`` inside a folder this process holds (a run, a sweep's soup):
    its one writer may use a fixed temporary name (engine/host/atomic.py)."""
    with written(path, tmp=path.with_name(f".{path.name}.tmp")) as tmp:
        tmp.write_text(text)


def run_save_arrays(path: Path, arrays: dict[str, mx.array],
                    metadata: dict[str, str] | None = None) -> None:
    # mlx appends the suffix to a name without it
    with written(path, tmp=path.with_name(f".{path.name}.tmp.safetensors")) as tmp:
        mx.save_safetensors(str(tmp), arrays, metadata=metadata or {})


def adapter_config(spec: LoraSpec, num_layers: int, extra: dict[str, Any]) -> dict[str, Any]:
    """mlx-lm's adapter_config.json (plus Pomona's own keys, which mlx-lm ignores)."""
    params: dict[str, Any] = {"rank": spec.rank, "scale": spec.scale, "dropout": spec.dropout}
    if spec.keys is not None:
        params["keys"] = list(spec.keys)
    return {"fine_tune_type": "lora", "num_layers": num_layers, "lora_parameters": params,
            **extra}


def save_adapters(model: nn.Module, out: Path, spec: LoraSpec, num_layers: int,
                  extra: dict[str, Any] | None = None) -> Path:
    """Write the model's LoRA weights and config to ``out``; return ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    weights = dict(tree_flatten(model.trainable_parameters()))
    run_save_arrays(out / ADAPTER_FILE, weights)
    config = adapter_config(spec, num_layers, extra or {})
    run_write_text(out / CONFIG_FILE, json.dumps(config, indent=2) + "\n")
    return out


def trained_loss(adapter_dir: str | Path | None) -> LossSpec | None:
    """The loss an adapter was trained with (its config's ``pomona`` block), or None for
    no adapter or one another tool wrote."""
    path = Path(adapter_dir) / CONFIG_FILE if adapter_dir else None
    if path is None or not path.is_file():
        return None
    try:
        block = json.loads(path.read_text()).get("pomona") or {}
        if "loss" not in block:
            return None
        kind = block["loss"]
        own = LOSSES[kind].names() if kind in LOSSES else ()
        return spec_of(kind, block.get("nll_span", "full"),
                       **{k: v for k, v in block.items() if k in own})
    except (ValueError, AttributeError, TypeError) as err:  # not JSON, not a mapping, a bad value
        raise ValueError(f"{path}: its pomona block does not name a loss Pomona knows "
                         f"({err})") from None



def pairs_scored_under(adapter_dir: str | Path | None) -> LossSpec:
    """The loss an adapter's pairs are scored under (``pomona score``, evaluation): its
    own, or the default loss's where it has none (the base, another tool's adapter) or
    trained on groups (GRPO's loss scores no pairs: its adapter is judged by its answers)."""
    own = trained_loss(adapter_dir)
    return own if own is not None and not own.loss.on_groups else LossSpec()

def trained_reference(adapter_dir: str | Path | None) -> Reference:
    """The reference a DPO adapter trained against (its pomona block), else ``BASE``. A
    reference adapter whose bytes changed since (retrained in place) is said by name: its
    log-probs are recomputed from the new bytes, not the ones the adapter trained against."""
    path = Path(adapter_dir) / CONFIG_FILE if adapter_dir else None
    if path is None or not path.is_file():
        return BASE
    with contextlib.suppress(ValueError, AttributeError):
        block = json.loads(path.read_text()).get("pomona") or {}
        reference = parse_reference(str(block.get("reference", "base")))
        recorded = block.get("reference_key")
        if isinstance(reference, AdapterRef) and recorded and recorded != (
                now := adapter_fingerprint(reference.path)):
            log.warning("%s: its DPO reference %s changed since training (reference_key %s "
                        "recorded, %s now): the reference log-probs are recomputed from the "
                        "changed adapter, so the DPO loss is not the one it trained on",
                        path, reference, recorded, now)
        return reference
    return BASE


def load_adapter_weights(model: nn.Module, adapter_dir: Path) -> None:
    """Load adapter weights into a model that already has matching LoRA layers."""
    model.update(tree_unflatten(list(fitting_adapter_weights(model, adapter_dir).items())))


def fitting_adapter_weights(model: nn.Module, adapter_dir: Path) -> dict[str, mx.array]:
    """The adapter's LoRA tensors, each checked against ``model``'s LoRA parameter of its
    name and shape, all of them there: else one line naming the first misfit."""
    path = Path(adapter_dir) / ADAPTER_FILE
    if not path.exists():
        raise FileNotFoundError(f"no {ADAPTER_FILE} in {adapter_dir}")
    weights = read_adapter_weights(adapter_dir)  # readable and finite, or one line
    ours = dict(tree_flatten(model.trainable_parameters()))
    problems = [f"{k}: not a LoRA parameter of this model" for k in weights if k not in ours]
    problems += [f"{k}: shape {tuple(v.shape)} != {tuple(ours[k].shape)}"
                 for k, v in weights.items() if k in ours and v.shape != ours[k].shape]
    problems += [f"{k}: missing from the adapter" for k in ours if k not in weights]
    if problems:
        # one line: a LoRA rank change alone mismatches every factor of every layer
        raise ValueError(f"{path} does not fit this model/LoRA config ({len(problems)} "
                         f"tensors; first: {problems[0]}): give the LoRA settings it was "
                         "trained with")
    return weights


def save_checkpoint(model: nn.Module, optimizer: Any, out: Path, step: int,
                    state: dict[str, Any], spec: LoraSpec, num_layers: int) -> Path:
    """Adapters + optimizer state + step/seed into ``out/checkpoints/step_NNNNNNN``."""
    final = out / "checkpoints" / f"step_{step:07d}"
    tmp = final.with_name(f".{final.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        save_adapters(model, tmp, spec, num_layers)
        run_save_arrays(tmp / "optimizer.safetensors", dict(tree_flatten(optimizer.state)))
        run_write_text(tmp / "state.json", json.dumps({"step": step, **state}, indent=2)
                          + "\n")
    except BaseException:  # a full disk: no half checkpoint left behind
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)  # the checkpoint appears complete or not at all
    return final


def latest_checkpoint(out: Path) -> Path | None:
    ckpts = sorted((out / "checkpoints").glob("step_*"))
    return ckpts[-1] if ckpts else None


def prune_checkpoints(out: Path, keep: int) -> None:
    for old in sorted((out / "checkpoints").glob("step_*"))[:-keep] if keep > 0 else []:
        shutil.rmtree(old, ignore_errors=True)


def load_checkpoint(model: nn.Module, optimizer: Any, ckpt: Path) -> dict[str, Any]:
    """Restore adapters and optimizer state; return state.json (step, seed, ...)."""
    load_adapter_weights(model, ckpt)
    opt_state = mx.load(str(ckpt / "optimizer.safetensors"))
    optimizer.state = tree_unflatten(list(opt_state.items()))
    return json.loads((ckpt / "state.json").read_text())


def prepare_out(out: Path, resume_step: int | None) -> None:
    """Clear what an earlier run in ``out`` wrote that this one writes again.

    A fresh start (``resume_step`` None) removes the old adapter, summary, metrics and
    checkpoints, as mlx-lm overwrites its ``--adapter-path`` (and a sweep re-runs a trial in
    its directory): a run killed later leaves no old adapter beside its new metrics, and
    ``resume: auto`` never picks up an old run's checkpoint. A resume keeps the
    checkpoints, trims metrics.jsonl back to the checkpoint's step (the steps after it run
    again) and removes the final adapter and summary until it writes them anew. Files the
    trainer does not write are left alone; ``out`` is a Pomona run (``claim_run``).
    """
    log = out / "metrics.jsonl"
    for stale in (out / ADAPTER_FILE, out / CONFIG_FILE, out / "summary.json"):
        stale.unlink(missing_ok=True)
    if resume_step is None:
        log.unlink(missing_ok=True)
        shutil.rmtree(out / "checkpoints", ignore_errors=True)
    elif log.exists():
        def kept(line: str) -> bool:
            try:
                return int(json.loads(line)["step"]) <= resume_step
            except (ValueError, KeyError, TypeError):
                return False  # a line cut short by the kill
        lines = log.read_text().splitlines(keepends=True)
        run_write_text(log, "".join(line for line in lines if kept(line)))


def is_run_dir(path: Path) -> bool:
    """Whether ``path`` holds a run an earlier Pomona wrote, before runs carried the mark
    of engine/host/outputs.py: its summary, an adapter config with Pomona's block, its metrics
    log or a checkpoint (a run killed early has only some of them)."""
    def first_json(name: str) -> Any:
        try:
            with (path / name).open() as f:
                return json.loads(f.read() if name.endswith(".json") else f.readline())
        except (OSError, ValueError):
            return None

    summary, config, record = (first_json(n) for n in ("summary.json", CONFIG_FILE,
                                                        "metrics.jsonl"))
    return ((isinstance(summary, dict) and "trainable_params" in summary)
            or (isinstance(config, dict) and isinstance(config.get("pomona"), dict))
            or (isinstance(record, dict) and {"step", "split"} <= record.keys())
            or any((c / "state.json").is_file() for c in (path / "checkpoints").glob("step_*")))
