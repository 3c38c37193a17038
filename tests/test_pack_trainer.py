"""Trials trained as one pack (engine/train/pack_trainer.py) against each trained alone by
``train``: each folder holds the same records (train and validation, to 1e-5 relative),
checkpoints, summary and adapter (to the pack's parity tolerance, 1e-3 of each tensor's
norm: tests/parity.py's PACK_WEIGHT_RTOL), and the adapter loads in mlx-lm as a lone one
does."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import pytest

from engine.settings.config import TrainConfig
from engine.train.pack_trainer import train_pack
from engine.train.trainer import train
from tests.parity import assert_pack_weights
from tests.test_trainer import assert_phases

pytestmark = pytest.mark.integration

KEPT = ("loss", "grad_norm", "learning_rate", "rewards/accuracies", "nll_loss",
        "val/loss", "val/rewards/accuracies")


def records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def same_records(got: list[dict], want: list[dict]) -> None:
    """The same records, each number to 1e-5 relative or 1e-6 of the log-probs' size (a
    margin is a difference of two: tests/parity.py), the rest equal."""
    a, b = maths(got), maths(want)
    assert [sorted(r) for r in a] == [sorted(r) for r in b]
    for g, w in zip(a, b, strict=True):
        floor = 1e-6 * max(1.0, abs(w.get("logps/chosen", w.get("val/logps/chosen", 1))))
        for key, value in w.items():
            if isinstance(value, float) and not isinstance(value, bool):
                assert g[key] == pytest.approx(value, rel=1e-5, abs=floor, nan_ok=True), key
            else:
                assert g[key] == value, key


def maths(rows: list[dict]) -> list[dict]:
    """The records less what the clock and the allocator say (speed, memory)."""
    return [{k: v for k, v in r.items() if k not in ("tokens_per_sec", "peak_memory_gb")}
            for r in rows]


def test_a_pack_leaves_each_trial_as_its_lone_run(tiny_model: Path, tiny_data: Path,
                                                  tmp_path: Path) -> None:
    """Would catch: a record, validation or checkpoint of another adapter in a folder, the
    pack's weights saved whole, or a trial's view not put back after its books."""
    base = TrainConfig(model=str(tiny_model), data=str(tiny_data), steps=4, batch_size=2,
                       seed=1, lora_rank=4, learning_rate=2e-3, prefix_share="on",
                       report_every=2, val_every=2, checkpoint_every=2)
    cfgs = [base.replace(out=str(tmp_path / "pack" / "a")),
            base.replace(out=str(tmp_path / "pack" / "b"), loss="simpo", lora_rank=8,
                         learning_rate=4e-3, lora_dropout=0.1),
            base.replace(out=str(tmp_path / "pack" / "c"), loss="sft", warmup_steps=2)]
    heard: list[list[dict]] = [[] for _ in cfgs]

    class Hear:
        def __init__(self, i: int):
            self.i = i

        def on_metrics(self, record: dict) -> None:
            heard[self.i].append(record)

    packed = train_pack(cfgs, [[Hear(i)] for i in range(len(cfgs))])
    for result in packed:
        assert_phases(result)  # each trial's, its seconds the pack's
    for i, cfg in enumerate(cfgs):
        lone_out = tmp_path / "alone" / Path(cfg.out).name
        lone = train(cfg.replace(out=str(lone_out)))
        got, want = records(Path(cfg.out)), records(lone_out)
        assert [(r["step"], r["split"]) for r in got] == [(r["step"], r["split"]) for r in want]
        assert heard[i] == got  # each trial hears its own records only
        for g, w in zip(got, want, strict=True):
            for key in KEPT:
                if key in w:
                    assert g[key] == pytest.approx(w[key], rel=1e-5, abs=1e-7), (i, key)
        assert packed[i].steps == lone.steps == 4
        assert packed[i].trainable_params == lone.trainable_params
        assert packed[i].best_val["step"] == lone.best_val["step"]
        ours = Path(cfg.out)
        assert sorted(p.name for p in (ours / "checkpoints").iterdir()) == \
            sorted(p.name for p in (lone_out / "checkpoints").iterdir())
        a = mx.load(str(ours / "adapters.safetensors"))
        b = mx.load(str(lone_out / "adapters.safetensors"))
        assert_pack_weights(a, b, i)
        config = json.loads((ours / "adapter_config.json").read_text())
        assert config == json.loads((lone_out / "adapter_config.json").read_text())


def test_a_trial_that_diverges_leaves_the_pack_and_the_others_go_on(
        tiny_model: Path, tiny_data: Path, tmp_path: Path) -> None:
    """A trial whose loss turns non-finite fails as its lone run fails (NonFiniteLoss naming
    the step; records so far, no adapter) and the others end as a pack without it ends, to
    the parity tolerance (a pack of three blocks its matmuls otherwise than one of two: on
    OpenBLAS's Haswell kernels the last bits differ). Would catch: the pack stopped for one
    trial, a NaN reaching another adapter, or a view or update left at the dropped
    adapter's old place."""
    from engine.train.steps import NonFiniteLoss

    base = TrainConfig(model=str(tiny_model), data=str(tiny_data), steps=4, batch_size=2,
                       seed=1, lora_rank=4, learning_rate=2e-3, report_every=1, val_every=2)
    a, c = base.replace(out=str(tmp_path / "p" / "a")), base.replace(
        out=str(tmp_path / "p" / "c"), loss="simpo", lora_rank=8)
    wild = base.replace(out=str(tmp_path / "p" / "b"), learning_rate=1e30, grad_clip=0.0)
    first, failed, last = train_pack([a, wild, c])
    assert isinstance(failed, NonFiniteLoss)
    assert not (tmp_path / "p" / "b" / "adapters.safetensors").exists()
    with pytest.raises(NonFiniteLoss) as lone:  # the same trial alone fails at that step
        train(wild.replace(out=str(tmp_path / "wild-alone")))
    assert str(failed).split(":")[0] == str(lone.value).split(":")[0]
    same_records(records(tmp_path / "p" / "b"), records(tmp_path / "wild-alone"))
    pair = train_pack([a.replace(out=str(tmp_path / "q" / "a")),
                       c.replace(out=str(tmp_path / "q" / "c"))])
    for result, other in zip((first, last), pair, strict=True):
        assert result.steps == other.steps == 4
        got = mx.load(str(Path(result.out) / "adapters.safetensors"))
        want = mx.load(str(Path(other.out) / "adapters.safetensors"))
        assert_pack_weights(got, want, result.out)
        same_records(records(Path(result.out)), records(Path(other.out)))


@pytest.mark.parametrize("loss, field", [("dpo", "dpo_beta"), ("kto", "kto_beta")])
def test_trials_that_read_a_reference_pack_on_their_one_reference(
        tiny_model: Path, tiny_data: Path, tmp_path: Path, loss: str, field: str) -> None:
    """DPO (or KTO) trials of two β packed with an ORPO trial read the reference log-probs
    made once for the pack (KTO's KL partners with theirs), and each ends as it ends
    alone (records to 1e-5, adapter to PACK_WEIGHT_RTOL in norm). Would catch: the data read
    without the reference or the partners, a copy scored against another's log-probs, or
    a KL point of another adapter's (or of the pack's) policy. (A pack mixing DPO and
    KTO reads KTO's reference file: the same log-probs, from a pass batched otherwise.)"""
    base = TrainConfig(model=str(tiny_model), data=str(tiny_data), steps=3, batch_size=2,
                       seed=2, lora_rank=4, learning_rate=3e-3, report_every=1, val_every=3)
    cfgs = [base.replace(out=str(tmp_path / "p" / "orpo")),
            base.replace(out=str(tmp_path / "p" / "low"), loss=loss, **{field: 0.1}),
            base.replace(out=str(tmp_path / "p" / "high"), loss=loss, **{field: 0.5})]
    packed = train_pack(cfgs)
    for cfg, result in zip(cfgs, packed, strict=True):
        lone_out = tmp_path / "alone" / Path(cfg.out).name
        train(cfg.replace(out=str(lone_out)))
        for g, w in zip(records(Path(result.out)), records(lone_out), strict=True):
            # A margin is a difference of log-probs (tests/parity.py): its floor scales with them
            floor = 1e-6 * max(1.0, abs(w.get("logps/chosen", w.get("val/logps/chosen", 1))))
            for key in ("loss", "grad_norm", "rewards/margins", "kl", "val/loss"):
                if key in w:
                    assert g[key] == pytest.approx(w[key], rel=1e-5, abs=floor), (cfg.out, key)
        a = mx.load(str(Path(result.out) / "adapters.safetensors"))
        b = mx.load(str(lone_out / "adapters.safetensors"))
        assert_pack_weights(a, b, cfg.out)


def test_a_pack_refuses_what_it_cannot_train(tiny_model: Path, tmp_path: Path) -> None:
    base = TrainConfig(model=str(tiny_model), data="d", out=str(tmp_path / "a"))
    with pytest.raises(ValueError, match="one folder each"):
        train_pack([base, base.replace(learning_rate=1e-3)])
    with pytest.raises(ValueError, match="a pack starts fresh"):
        train_pack([base, base.replace(out=str(tmp_path / "b"), resume="auto")])
    with pytest.raises(ValueError, match="share prefix_share"):
        train_pack([base, base.replace(out=str(tmp_path / "b"), prefix_share="off")])
    assert not (tmp_path / "a").exists()  # refused before any folder is made
