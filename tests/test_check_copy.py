"""The load check's float32 structural copy (engine/check/check_copy.py), on every family's tiny
model: it keeps one layer of each kind and each K/V donor with two of its consumers, and
the check on it refuses what the check on the whole model refused."""

from __future__ import annotations

from pathlib import Path

import mlx_lm
import pytest

from engine.backward import segmented
from engine.check.check_copy import same_structure, structural_copy
from engine.check.load_check import checked_stack
from engine.model.arch import make_stack
from engine.model.arch.gemma4 import Gemma4
from tasks.models.model_factory import init_model
from tests.family_specs import MOE, SPECS
from tests.parity import with_lora

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def family(tmp_path_factory: pytest.TempPathFactory):
    root, built = tmp_path_factory.mktemp("families"), {}

    def get(name: str):
        """The family's tiny model, LoRA attached (B non-zero), and its Stack."""
        if name not in built:
            built[name] = init_model({**SPECS, **MOE}[name], root / name)
        model, _ = mlx_lm.load(str(Path(built[name])))
        with_lora(model)
        return model, make_stack(model)

    return get


@pytest.mark.parametrize("name", sorted(SPECS) + ["gemma4"])
def test_the_copy_keeps_every_kind_of_layer(name: str, family) -> None:
    """Catches a reduction that drops a window kind, a donor, or the second consumer a
    donor's cotangent must be summed over (the review found the first version kept one),
    or renumbers layers into other kinds (Gemma 3 picks a kind by index)."""
    model, stack = family(name)
    copy = structural_copy(model, stack)
    assert same_structure(copy, stack) is None
    assert {copy.stack.window(j) for j in range(len(copy.keep))} == {
        stack.window(i) for i in range(len(stack.layers))}
    for donor in stack.donors:
        consumers = [c for c, d in stack.donor_of.items() if d == donor]
        kept = [c for c in consumers if c in copy.keep]
        assert donor in copy.keep and len(kept) == min(len(consumers), 2), (donor, kept)


def test_the_check_sums_a_donors_cotangents_over_its_consumers(family, monkeypatch) -> None:
    """The review's finding: with one consumer per donor in the copy, a segmented backward
    that keeps the last consumer's K/V cotangent instead of the sum passed the check."""
    model, _ = family("gemma4_text")
    monkeypatch.setattr(segmented, "_add_state", lambda acc, more: acc.update(more))
    with pytest.raises(ValueError, match="LoRA gradients through the layer stack differ"):
        checked_stack(model)


def test_a_reduction_that_breaks_is_one_line(family, monkeypatch) -> None:
    """A family hook that builds no valid copy (here consumers without their donors) is a
    ValueError naming the model type, not a KeyError traceback."""
    model, _ = family("gemma4_text")
    monkeypatch.setattr(Gemma4, "check_layers", lambda self: sorted(self.donor_of))
    with pytest.raises(ValueError, match="gemma4_text: the check's"):
        checked_stack(model)
