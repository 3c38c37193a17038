"""One model set-up for every path: a config's model loaded, its LoRA attached, its stack
checked, its levers set.

``prepare_training(cfg)`` is what the trainer, the memory and speed probes and the
benchmarks start from; ``prepare_scoring(model, adapter)`` what evaluation, ``score`` and
DPO's reference start from (no new LoRA; an adapter as mlx-lm loads it). A path that set
the model up its own way measured a model training never runs: the probe once left out
``mlp_chunk`` (issue 38), so ``segment_size: auto`` picked a size for another path.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import mlx.nn as nn

from engine.backward.compiled import compile_segments
from engine.check.load_check import checked_stack
from engine.model.load import LoraSpec, attach_lora, load_model, resolve_lora_keys
from engine.model.recompute import chunk_mlps, mlp_chunks
from engine.model.shared_lora import share_lora_inputs
from engine.settings.config import TrainConfig


@dataclass
class Prepared:
    """A loaded, checked model: what every training and scoring path reads."""

    model: nn.Module
    tokenizer: Any
    stack: Any  # engine/model/arch's Stack: embed → layers → norm → head
    check: dict[str, Any] = field(default_factory=dict)  # the load check's figures
    lora: LoraSpec | None = None  # the attached LoRA with explicit keys; None: scoring
    trainable: int = 0  # LoRA parameters

    @property
    def pad_id(self) -> int:
        return self.tokenizer.pad_token_id or 0

    @contextmanager
    def as_config(self, cfg: TrainConfig) -> Iterator[None]:
        """Inside: the levers set as ``cfg`` trains (a probe's variant), put back after."""
        with mlp_chunks(self.stack.layers, cfg.mlp_chunk):
            yield


def lora_spec(cfg: TrainConfig) -> LoraSpec:
    """The LoRA ``cfg`` asks for (keys None: the family's default targets, resolved at
    attach)."""
    return LoraSpec(cfg.lora_rank, cfg.lora_scale, cfg.lora_dropout, cfg.lora_keys,
                    cfg.lora_layers)


def refuse_lora_beyond(cfg: TrainConfig, model: nn.Module) -> None:
    """LoRA settings the model cannot take, refused in one line: mlx-lm would adapt every
    block for a ``lora_layers`` past the count, and a rank above the width is no low-rank
    update."""
    layers = len(model.layers)
    if cfg.lora_layers > layers:
        raise ValueError(f"lora_layers={cfg.lora_layers}: {cfg.model} has {layers} blocks; "
                         f"give at most {layers}, or -1 for all")
    width = getattr(getattr(model, "args", None), "hidden_size", None)
    if isinstance(width, int) and cfg.lora_rank > width:
        raise ValueError(f"lora_rank={cfg.lora_rank}: above {cfg.model}'s hidden size "
                         f"{width}; a LoRA rank is a small fraction of it (8-64)")


def prepare_training(cfg: TrainConfig) -> Prepared:
    """``cfg.model`` with a fresh LoRA from ``cfg.seed``, checked on whole MLPs (as the
    model ships), then its MLPs chunked at ``cfg.mlp_chunk`` as every step runs them."""
    model, tokenizer = load_model(cfg.model)
    refuse_lora_beyond(cfg, model)
    spec = resolve_lora_keys(model, lora_spec(cfg))  # the family's targets, saved explicitly
    trainable = attach_lora(model, spec, cfg.seed)
    stack, check = checked_stack(model)
    if cfg.mlp_chunk:
        chunk_mlps(stack.layers, cfg.mlp_chunk)
    if cfg.shared_lora_inputs:  # after the check: its copy attaches its own LoRA
        share_lora_inputs(stack.layers)
    # A replay would freeze dropout's Python-side seed: a run with dropout stays uncompiled.
    compile_segments(stack, cfg.compile and not cfg.lora_dropout)
    return Prepared(model, tokenizer, stack, check, spec, trainable)


def prepare_pack(cfgs: Sequence[TrainConfig]) -> list[Prepared]:
    """The pack of ``cfgs`` (engine/model/packed_lora.py): their model loaded once, one
    adapter per config drawn from their shared seed, the stack checked through adapter 0's
    view (the pack's layers are its layers), the MLPs chunked as every step runs them; one
    Prepared per adapter, sharing the model, each with its own LoRA and count."""
    from engine.model.packed_lora import adapter_of, alone, pack_lora

    model, tokenizer = load_model(cfgs[0].model)
    for cfg in cfgs:
        refuse_lora_beyond(cfg, model)
    specs = [resolve_lora_keys(model, lora_spec(cfg)) for cfg in cfgs]
    pack_lora(model, specs, cfgs[0].seed)
    with alone(model, 0):
        stack, check = checked_stack(model)
    if cfgs[0].mlp_chunk:
        chunk_mlps(stack.layers, cfgs[0].mlp_chunk)
    counts = [sum(w.size for w in adapter_of(model, i).values()) for i in range(len(cfgs))]
    return [Prepared(model, tokenizer, stack, check, spec, count)
            for spec, count in zip(specs, counts, strict=True)]


def prepare_scoring(model: str, adapter: str | None = None,
                    attach: Callable[[nn.Module], None] | None = None) -> Prepared:
    """``model`` for forward-only passes: ``adapter`` loaded as mlx-lm loads it, or
    ``attach`` run on the base (DPO's reference adapter, checked against its base), then
    the load check."""
    loaded, tokenizer = load_model(model, adapter)
    if attach is not None:
        attach(loaded)
    stack, check = checked_stack(loaded)
    return Prepared(loaded, tokenizer, stack, check)
