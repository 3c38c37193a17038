"""KTO (engine/losses/kto.py) against TRL's KTOTrainer maths in float64, its KL partners and
KL point, its refusals, and real runs through ``pomona train`` and a sweep.

The float64 reference transcribes trl/experimental/kto/kto_trainer.py (huggingface/trl at
00c8b065): ``kto_loss`` (z0 = the batch mean of ``policy_KL_logps − reference_KL_logps``,
clamped at 0; the desirable and undesirable losses of Eq. 7) and ``get_batch_loss_metrics``
(``losses.nanmean()`` over the batch's examples, rewards and summed logps averaged over
each kind's count); each pair is one desirable and one undesirable example.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pyarrow.parquet as pq
import pytest

from engine.data.batch import Pair, make_batch
from engine.forward.scoring import kl_point
from engine.losses import Norms, pair_loss, spec_of
from tests.parity import assert_finite_differences

TOL = 1e-4  # relative, float32 against float64 (the acceptance's TRL parity)


def sigmoid(x: np.ndarray) -> np.ndarray:
    return 1 / (1 + np.exp(-x))


def trl_kto(chosen, rejected, kl_policy, ref_chosen, ref_rejected, kl_ref, beta, dw, uw
            ) -> tuple[float, dict[str, float]]:
    """TRL's KTO loss and logged metrics (summed log-probs [B] each; KL rows [K]), float64."""
    kl = max(float((kl_policy - kl_ref).mean()), 0.0)
    chosen_ratio, rejected_ratio = chosen - ref_chosen, rejected - ref_rejected
    losses = np.concatenate([dw * (1 - sigmoid(beta * (chosen_ratio - kl))),
                             uw * (1 - sigmoid(beta * (kl - rejected_ratio)))])
    rewards_c, rewards_r = beta * chosen_ratio, beta * rejected_ratio
    return float(losses.mean()), {
        "kl": kl, "rewards/chosen": rewards_c.mean(), "rewards/rejected": rewards_r.mean(),
        "rewards/margins": rewards_c.mean() - rewards_r.mean(),
        "logps/chosen": chosen.mean(), "logps/rejected": rejected.mean()}


def rows(rng: np.random.Generator, n: int, t: int = 8) -> tuple[np.ndarray, np.ndarray]:
    """Token log-probs [n, T] and response masks of ragged lengths."""
    lp = -rng.uniform(0.05, 2.0, (n, t)).astype(np.float32)
    resp = np.zeros((n, t), np.float32)
    for i in range(n):
        start = int(rng.integers(1, t - 3))
        resp[i, start:int(rng.integers(start + 1, t + 1))] = 1
    return lp, resp


def case(seed: int, shift: float, b: int = 3):
    """A batch [2B, T], its summed reference log-probs [2B] and its KL partners' rows and
    references, ``shift`` moving the policy above (> 0) or below its reference there."""
    rng = np.random.default_rng(seed)
    lp, resp = rows(rng, 2 * b)
    sums = (lp.astype(np.float64) * resp).sum(-1)
    ref = (sums + rng.normal(0, 1.5, 2 * b)).astype(np.float32)
    kl_lp, kl_resp = rows(rng, 2 * b)
    kl_sums = (kl_lp.astype(np.float64) * kl_resp).sum(-1)
    kl_ref = (kl_sums - shift + rng.normal(0, 0.2, 2 * b)).astype(np.float32)
    return lp, resp, ref, kl_sums, kl_ref


def ours(lp, resp, ref, kl_sums, kl_ref, spec) -> tuple[float, dict[str, float]]:
    b = len(lp) // 2
    kl = kl_point(float((kl_sums.astype(np.float32) - kl_ref).sum()), 2 * b)
    nll = np.zeros_like(resp)
    loss, sums = pair_loss(mx.array(lp), mx.array(resp), mx.array(nll), spec,
                           Norms(1.0, float(b)), mx.array(ref), kl)
    return float(loss), {k: float(v) / b for k, v in sums.items()}


@pytest.mark.unit
@pytest.mark.parametrize("beta,dw,uw,shift", [(0.1, 1.0, 1.0, 0.8), (0.5, 1.0, 1.33, 2.0),
                                              (0.2, 0.7, 1.0, -1.0)])
def test_kto_equals_trls_maths(beta: float, dw: float, uw: float, shift: float) -> None:
    """Loss and metrics within 1e-4; the last case's KL point is negative, clamped to 0."""
    lp, resp, ref, kl_sums, kl_ref = case(int(beta * 10 + dw * 3), shift)
    b = len(lp) // 2
    sums = (lp.astype(np.float64) * resp).sum(-1)
    want, metrics = trl_kto(sums[:b], sums[b:], kl_sums, ref[:b].astype(np.float64),
                            ref[b:].astype(np.float64), kl_ref.astype(np.float64), beta, dw, uw)
    assert (metrics["kl"] == 0.0) == (shift < 0)
    spec = spec_of("kto", kto_beta=beta, kto_desirable_weight=dw, kto_undesirable_weight=uw)
    loss, got = ours(lp, resp, ref, kl_sums, kl_ref, spec)
    assert loss == pytest.approx(want, rel=TOL)
    for name, value in metrics.items():
        assert got[name] == pytest.approx(value, rel=TOL, abs=1e-6), name


@pytest.mark.unit
def test_kto_gradient_equals_finite_differences_of_the_reference() -> None:
    """The KL point is a constant to the gradient (TRL detaches it)."""
    lp, resp, ref, kl_sums, kl_ref = case(3, 0.8)
    b = len(lp) // 2
    spec = spec_of("kto", kto_beta=0.5)
    kl = kl_point(float((kl_sums.astype(np.float32) - kl_ref).sum()), 2 * b)
    zeros = mx.zeros(resp.shape)

    def loss_of(x: mx.array) -> mx.array:
        return pair_loss(x, mx.array(resp), zeros, spec, Norms(1.0, b), mx.array(ref), kl)[0]

    def want(x: np.ndarray) -> float:
        s = (x * resp).sum(-1)
        return trl_kto(s[:b], s[b:], kl_sums, ref[:b].astype(np.float64),
                       ref[b:].astype(np.float64), kl_ref.astype(np.float64), 0.5, 1, 1)[0]

    assert_finite_differences(np.array(mx.grad(loss_of)(mx.array(lp))), want, lp, resp)


@pytest.mark.unit
def test_kl_partners_pair_each_prompt_with_the_previous_responses() -> None:
    from engine.train.reference import kl_partners

    pairs = [Pair(f"p{i}", [i, 10 + i], [20 + i], [30 + i, 40 + i]) for i in range(3)]
    partners = kl_partners(pairs)
    assert [q.id for q in partners] == ["p0~kl", "p1~kl", "p2~kl"]
    assert [list(q.prompt) for q in partners] == [list(p.prompt) for p in pairs]
    assert [list(q.chosen) for q in partners] == [[22], [20], [21]]  # TRL's offset of one
    assert [list(q.rejected) for q in partners] == [[32, 42], [30, 40], [31, 41]]
    with_ref = [Pair(p.id, p.prompt, p.chosen, p.rejected, (0.0, 0.0), q)
                for p, q in zip(pairs, [Pair(q.id, q.prompt, q.chosen, q.rejected, (1.0, 2.0))
                                        for q in partners], strict=True)]
    batch = make_batch(with_ref, "full")
    assert batch.kl is not None and batch.kl.ids == [q.id for q in partners]
    assert batch.kl.ref.tolist() == [1.0, 1.0, 1.0, 2.0, 2.0, 2.0]
    assert make_batch(pairs, "full").kl is None


@pytest.mark.unit
def test_bad_kto_settings_are_refused_by_name() -> None:
    for bad, why in (({"kto_beta": 0.0}, "kto_beta"), ({"kto_beta": float("nan")}, "kto_beta"),
                     ({"kto_desirable_weight": -1.0}, "kto_desirable_weight"),
                     ({"kto_desirable_weight": 0.0, "kto_undesirable_weight": 0.0}, "both 0")):
        with pytest.raises(ValueError, match=why):
            spec_of("kto", **bad)
    with pytest.raises(ValueError, match="KL point"):
        lp, resp, ref, _, _ = case(1, 1.0)
        pair_loss(mx.array(lp), mx.array(resp), mx.zeros(resp.shape), spec_of("kto"),
                  Norms(1.0, 3.0), mx.array(ref))


@pytest.mark.integration
@pytest.mark.usefixtures("private_cache")
def test_a_split_of_one_pair_is_said_to_be_its_own_kl_partner(
        tiny_model: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A KTO run on a train split of one pair read that pair as its own KL partner (its KL
    point is then the pair itself, not a mismatched one) and said nothing; through training's
    own path (reference pass, partners, one step) it is now one warning naming the split,
    and none for the valid split of two pairs."""
    import logging

    from engine.data.pairs import write_pairs_jsonl
    from engine.settings.config import TrainConfig
    from engine.train.trainer import train
    from tests.pairs import tokenized_pairs

    pairs = tokenized_pairs(tiny_model, 3, seed=4, task="sort")
    data = write_pairs_jsonl(pairs[:1], tmp_path / "one.jsonl", split="train")
    valid = write_pairs_jsonl(pairs[1:], tmp_path / "v.jsonl", split="valid")
    with data.open("a") as f:
        f.write(valid.read_text())
    cfg = TrainConfig().replace(model=str(tiny_model), data=str(data), out=str(tmp_path / "o"),
                                loss="kto", steps=1, batch_size=1, lora_rank=4, val_every=0)
    with caplog.at_level(logging.WARNING, logger="engine"):
        train(cfg)
    said = [r.getMessage() for r in caplog.records if "KL partner" in r.getMessage()]
    assert len(said) == 1 and "train split" in said[0] and "\n" not in said[0], said
    assert "reads the pair itself" in said[0]


@pytest.mark.integration
def test_the_kl_point_spans_the_optimizer_batch(tiny_model: Path) -> None:
    """Two micro-batches of two pairs equal one of four (grad_accum): one KL point over the
    whole optimizer batch, not one per micro-batch."""
    from engine.backward.step import step_grads
    from engine.settings.config import TrainConfig
    from tests.pairs import tokenized_pairs
    from tests.parity import assert_same, lora_model, with_reference

    model, stack = lora_model(tiny_model)
    pairs = with_reference(model, stack, tokenized_pairs(tiny_model, 4, seed=23))
    spec, cfg = spec_of("kto", kto_beta=0.5), TrainConfig(loss="kto")
    one = step_grads(model, stack, [make_batch(pairs, "full")], spec, cfg, step=1)
    two = step_grads(model, stack, [make_batch(pairs[:2], "full"),
                                    make_batch(pairs[2:], "full")], spec, cfg, step=1)
    assert one[1]["kl"] / 4 == pytest.approx(two[1]["kl"] / 4, rel=1e-5)
    assert one[1]["kl"] > 0
    pick = ("rewards/chosen", "rewards/rejected", "kl")
    assert_same((mx.array(two[0]), {k: two[1][k] for k in pick}, two[2]),
                (mx.array(one[0]), {k: one[1][k] for k in pick}, one[2]))


@pytest.mark.integration
def test_pomona_train_trains_kto_with_every_lever(tiny_model: Path, tiny_data: Path,
                                                  tmp_path: Path, monkeypatch) -> None:
    """``pomona train --loss kto`` (segmented, bounded head, shared prefix, --verify): the
    reference file holds the pairs' and their KL partners' log-probs, the adapter records
    its loss, and the validation loss falls."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    out = tmp_path / "kto"
    cmd = [sys.executable, "-m", "cli.main", "train", "--model", str(tiny_model), "--data",
           str(tiny_data), "--out", str(out), "--loss", "kto", "--kto-beta", "0.5",
           "--steps", "12", "--batch-size", "8", "--learning-rate", "2e-3", "--lora-rank", "8",
           "--segment-size", "2", "--head-chunk", "16", "--prefix-share", "on",
           "--val-every", "12", "--verify"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    block = json.loads((out / "adapter_config.json").read_text())["pomona"]
    assert block["loss"] == "kto" and block["kto_beta"] == 0.5 and block["reference"] == "base"
    [ref_file] = (tmp_path / "cache" / "pomona" / "reference").glob("*.parquet")
    ids = pq.read_table(ref_file).column("id").to_pylist()
    assert len(ids) == 2 * 80 and sum(i.endswith("~kl") for i in ids) == 80
    vals = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    first, last = [r for r in vals if "val/loss" in r]
    assert "val/kl" in last and last["val/loss"] < first["val/loss"], (first, last)
