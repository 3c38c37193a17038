"""GRPO's KL reference π_ref (Shao et al. 2024, eq. 3): the base, every LoRA's scale set
to 0, or an adapter's LoRA swapped into the policy's own LoRA layers for the reference pass
(``reference: DIR``: an SFT warm start as the reference, as TRL's ``ref_model`` is the
model training started from). Either way no second copy of the model is held: only the
reference adapter's LoRA tensors, and the policy's are put back after each pass.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten

from engine.model.adapter_file import read_adapter_config
from engine.model.adapters import fitting_adapter_weights
from engine.model.load import lora_modules
from engine.settings.reference_kind import AdapterRef, Reference
from engine.train.reference import check_reference_base


@contextmanager
def lora_off(model: nn.Module) -> Iterator[None]:
    """Inside: the base model (every LoRA's scale 0: its update adds exactly nothing)."""
    with lora_scaled(model, 0.0):
        yield


@contextmanager
def lora_scaled(model: nn.Module, scale: float) -> Iterator[None]:
    """Inside: every LoRA layer at ``scale``; each one's own put back after."""
    modules = [m for _, m in lora_modules(model)]
    scales = [m.scale for m in modules]
    for m in modules:
        m.scale = scale
    try:
        yield
    finally:
        for m, s in zip(modules, scales, strict=True):
            m.scale = s


@dataclass(frozen=True)
class KlReference:
    """The model the KL is taken against: the base (``weights`` None) or an adapter's LoRA
    tensors and scale, worn by the policy's LoRA layers for the pass."""

    weights: dict[str, mx.array] | None = None
    scale: float = 0.0
    name: str = "base"

    @contextmanager
    def worn(self, model: nn.Module) -> Iterator[None]:
        """Inside: ``model`` is the reference, in eval mode (no LoRA dropout); after, the
        policy again, its own tensors, scales and mode."""
        if self.weights is None:
            with lora_off(model):
                yield
            return
        own, training = dict(tree_flatten(model.trainable_parameters())), model.training
        try:
            model.update(tree_unflatten(list(self.weights.items())))
            model.eval()
            with lora_scaled(model, self.scale):
                yield
        finally:
            model.update(tree_unflatten(list(own.items())))
            model.train(training)


BASE_REFERENCE = KlReference()


def kl_reference(reference: Reference, model: nn.Module, base: str) -> KlReference:
    """``reference`` made ready for ``model``'s LoRA: the base as it is; an adapter read,
    checked to be trained on ``base`` (where its config records the base's content key, as
    Pomona's do) and to fit the policy's LoRA tensor for tensor (its rank, keys and
    layers), its scale given; else one line naming it."""
    if not isinstance(reference, AdapterRef):
        return BASE_REFERENCE
    folder = Path(reference.path).expanduser()
    if not folder.is_dir():
        raise ValueError(f"reference adapter {folder}: no such directory (give an adapter "
                         "folder, or base)")
    config = read_adapter_config(folder)
    check_reference_base(folder, config, base)
    try:
        weights = fitting_adapter_weights(model, folder)
    except (FileNotFoundError, ValueError) as err:
        raise ValueError(f"reference adapter {folder}: {err} (its pass wears the "
                         "reference's LoRA in the policy's own layers, so train with the "
                         "reference's --lora-rank, keys and layers)") from None
    scale = (config.get("lora_parameters") or {}).get("scale")
    if scale is None:  # mlx-lm's own loader needs it too
        raise ValueError(f"reference adapter {folder}: its adapter_config.json gives no "
                         "lora_parameters.scale, so its LoRA's strength is unknown")
    return KlReference(weights, float(scale), str(folder))
