"""A reference is a type (engine/settings/reference_kind.py): ``base`` or an adapter directory, read
from a word in one place and written back as that word."""

from __future__ import annotations

import pytest

from engine.settings.config import TrainConfig
from engine.settings.reference_kind import BASE, AdapterRef, adapter_path, parse_reference
from engine.train.reference import ReferenceSpec, resolved_reference
from tasks.sweep.spec_file import parse_spec

pytestmark = pytest.mark.unit


def test_the_word_base_and_a_path_are_two_types() -> None:
    assert parse_reference("base") is BASE and parse_reference(None) is BASE
    assert parse_reference("runs/sft") == AdapterRef("runs/sft")
    assert adapter_path(BASE) is None and adapter_path(AdapterRef("a")) == "a"
    for bad in ("", 3, ["a"]):
        with pytest.raises(ValueError, match="expected base or an adapter directory"):
            parse_reference(bad)
    assert resolved_reference("rel").path.startswith("/")  # as stored and keyed


def test_a_config_and_a_spec_carry_the_type_and_write_the_word(tmp_path) -> None:
    config = TrainConfig().replace(reference=str(tmp_path))
    assert config.reference == AdapterRef(str(tmp_path)) and TrainConfig().reference is BASE
    assert config.to_dict()["reference"] == str(tmp_path)
    assert TrainConfig.from_dict(config.to_dict()) == config
    assert ReferenceSpec("m", "d", "base").reference is BASE
    spec = parse_spec({"name": "s", "model": "m", "data": "d", "fixed": {"loss": "dpo"},
                       "grid": {"reference": ["base", str(tmp_path)]},
                       "metric": "val/logps/accuracies"})
    kinds = sorted(type(p.config.reference).__name__ for p in spec.trials(tmp_path / "o"))
    assert kinds == ["AdapterRef", "Base"]
    with pytest.raises(ValueError, match="reference=3"):
        TrainConfig().replace(reference=3)
