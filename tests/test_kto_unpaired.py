"""Issue 70, step 3: KTO on its own data, TRL's unpaired layout (a prompt, one completion and
a ``label``): its JSON Schema, tokenize, the rows read as pairs of a row and its KL partner
(engine/data/unpaired.py), TRL's maths within 1e-4, and a real `python -m engine train`.

The float64 reference transcribes TRL's KTOTrainer (trl/experimental/kto/kto_trainer.py,
huggingface/trl at 00c8b065): ``_get_kl_dataset`` (each row's KL completion is the previous
row's), ``kto_loss`` (z0 = the batch mean of ``policy_KL_logps − reference_KL_logps``,
detached and clamped at 0; ``1 − σ(β(r − z0))`` for the desirable rows, ``1 − σ(β(z0 − r))``
for the undesirable, each times its weight) and ``get_batch_loss_metrics`` (the loss is
``losses.nanmean()`` over the batch's rows).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import jsonschema
import mlx.core as mx
import numpy as np
import pytest

from engine.data.batch import Pair, make_batch
from engine.data.unpaired import with_partners
from engine.losses import Norms, pair_loss, spec_of
from engine.losses.spec import LossSpec
from tests.parity import assert_finite_differences
from tests.test_kto import rows, sigmoid

ROOT = Path(__file__).resolve().parents[1]
SAMPLE = ROOT / "datasets" / "sample" / "unpaired.jsonl"
TOL = 1e-4  # relative, float32 against float64 (the acceptance's TRL parity)


def trl_unpaired(completion, partner, ref_completion, ref_partner, labels, beta, dw, uw
                 ) -> tuple[float, float]:
    """TRL's KTO loss on one forward batch of unpaired rows (summed log-probs [B] each;
    ``partner``: the KL completions under each row's prompt), and its KL point; float64."""
    kl = max(float((partner - ref_partner).mean()), 0.0)
    ratio = completion - ref_completion
    chosen = dw * (1 - sigmoid(beta * (ratio[labels] - kl)))
    rejected = uw * (1 - sigmoid(beta * (kl - ratio[~labels])))
    return float(np.concatenate([chosen, rejected]).mean()), kl


def unpaired_case(seed: int, shift: float, b: int = 5):
    """Token log-probs [2B, T] (rows 0..B−1 the completions, B..2B−1 the KL partners), their
    masks, summed reference log-probs [2B] and labels [B] (both kinds present)."""
    rng = np.random.default_rng(seed)
    lp, resp = rows(rng, 2 * b)
    sums = (lp.astype(np.float64) * resp).sum(-1)
    ref = sums + rng.normal(0, 1.5, 2 * b)
    ref[b:] = sums[b:] - shift + rng.normal(0, 0.2, b)  # the partners: z0 near ``shift``
    labels = np.array([True, False] + list(rng.random(b - 2) < 0.5))
    return lp, resp, ref.astype(np.float32), labels


def ours(lp, resp, ref, labels, spec: LossSpec) -> tuple[mx.array, dict[str, mx.array]]:
    b = len(labels)
    return pair_loss(mx.array(lp), mx.array(resp), mx.zeros(resp.shape), spec,
                     Norms(1.0, float(b)), mx.array(ref), None,
                     mx.array(labels.astype(np.float32)))


@pytest.mark.unit
@pytest.mark.parametrize("beta,dw,uw,shift", [(0.1, 1.0, 1.0, 0.8), (0.5, 1.0, 1.33, 2.0),
                                              (0.2, 0.7, 1.0, -1.0)])
def test_unpaired_kto_equals_trls_maths(beta: float, dw: float, uw: float,
                                        shift: float) -> None:
    """Loss and KL point within 1e-4, and the gradient: central differences of TRL's loss
    with its KL point held (TRL detaches it), none through the KL partners. The last case's
    KL point is negative, clamped to 0."""
    lp, resp, ref, labels = unpaired_case(int(beta * 10 + dw * 3), shift)
    b = len(labels)
    spec = LossSpec(spec_of("kto", kto_beta=beta, kto_desirable_weight=dw,
                            kto_undesirable_weight=uw).loss, unpaired=True)

    def want(x: np.ndarray, kl: float | None = None) -> float:
        s = (x * resp).sum(-1)
        if kl is not None:  # the KL point as TRL's backward sees it: a constant
            s = np.concatenate([s[:b], ref[b:] + kl])
        return trl_unpaired(s[:b], s[b:], ref[:b].astype(np.float64),
                            ref[b:].astype(np.float64), labels, beta, dw, uw)[0]

    loss, metrics = ours(lp, resp, ref, labels, spec)
    s = (lp.astype(np.float64) * resp).sum(-1)
    kl = trl_unpaired(s[:b], s[b:], ref[:b], ref[b:], labels, beta, dw, uw)[1]
    assert (kl == 0.0) == (shift < 0)
    assert float(loss) == pytest.approx(want(lp), rel=TOL)
    assert float(metrics["kl"]) / b == pytest.approx(kl, rel=TOL, abs=1e-6)
    ratio = beta * (s[:b] - ref[:b])
    assert float(metrics["rewards/chosen"]) == pytest.approx(ratio[labels].sum(), rel=TOL)
    assert float(metrics["rewards/rejected"]) == pytest.approx(ratio[~labels].sum(), rel=TOL)
    grad = np.array(mx.grad(lambda x: ours(x, resp, ref, labels, spec)[0])(mx.array(lp)))
    assert not grad[b:].any()  # the KL partners: no gradient
    assert_finite_differences(grad[:b], lambda x: want(np.concatenate([x, lp[b:]]), kl),
                              lp[:b], resp[:b])


@pytest.mark.unit
def test_pairs_and_unpaired_rows_never_meet_the_other_kinds_maths() -> None:
    lp, resp, ref, labels = unpaired_case(0, 0.5)
    kto = spec_of("kto").loss
    with pytest.raises(ValueError, match="the batch holds unpaired rows, the loss was set up "
                                         "for pairs"):
        ours(lp, resp, ref, labels, LossSpec(kto))
    with pytest.raises(ValueError, match="the batch holds pairs"):
        pair_loss(mx.array(lp), mx.array(resp), mx.zeros(resp.shape),
                  LossSpec(kto, unpaired=True), Norms(1.0, 5.0), mx.array(ref), None)
    assert LossSpec(kto).needs_kl and not LossSpec(kto, unpaired=True).needs_kl


@pytest.mark.unit
def test_each_row_takes_the_previous_rows_completion_as_its_kl_partner() -> None:
    rows_ = [Pair(f"r{i}", [i], [10 + i], [10 + i], label=i % 2 == 0) for i in range(3)]
    paired = with_partners(rows_)
    assert [list(p.rejected) for p in paired] == [[12], [10], [11]]  # TRL's offset of one
    assert [list(p.chosen) for p in paired] == [[10], [11], [12]]
    assert make_batch(paired).labels.tolist() == [1.0, 0.0, 1.0]
    assert [list(p.rejected) for p in with_partners(rows_[:1])] == [[10]]  # its own
    assert [p.id for p in paired] == ["r0~after~r2", "r1~after~r0", "r2~after~r1"]
    long = [Pair("a", [1, 2, 3], [4, 5], [4, 5]), Pair("b", [6], [7, 8, 9, 10, 11], [7])]
    assert [list(p.rejected) for p in with_partners(long, max_length=5)] == [[7, 8], [4, 5]]


@pytest.mark.unit
def test_unpaired_rows_follow_their_schema_and_tokenize(tiny_model: Path,
                                                        tmp_path: Path) -> None:
    """The sample validates against the schema (a pair row does not); tokenize makes an
    unpaired dataset, each bad row a counted reject with its reason."""
    import pyarrow.parquet as pq

    from engine.data.pairs import load_pairs
    from tasks.data.tokenize import tokenize_dataset
    from tasks.data.tokenize_options import TokenizeOptions

    schema = json.loads((ROOT / "datasets/schema/unpaired.schema.json").read_text())
    check = jsonschema.Draft202012Validator(schema)
    sample = [json.loads(x) for x in SAMPLE.read_text().splitlines()]
    assert not [e for r in sample for e in check.iter_errors(r)]
    assert list(check.iter_errors({**sample[0], "chosen": "x"}))
    raw = tmp_path / "raw"
    raw.mkdir()
    (raw / "a.jsonl").write_text(SAMPLE.read_text())
    bad = [{"prompt": "p", "completion": "c", "label": "yes"}, {"prompt": "p2", "completion": "c"},
           {"prompt": "p3", "completion": "c", "label": True, "chosen": "x"},
           {"prompt": "p4", "completion": "c4", "label": False}]
    (raw / "b.jsonl").write_text("".join(json.dumps(r) + "\n" for r in bad))
    conversational = {"prompt": [{"role": "user", "content": "Hi?"}],
                      "completion": [{"role": "assistant", "content": "Hello"}], "label": False}
    assert not list(check.iter_errors(conversational))
    (raw / "d.jsonl").write_text(json.dumps(conversational) + "\n")
    (raw / "c.jsonl").write_text(json.dumps({"prompt": "p", "chosen": "a", "rejected": "b"}))
    report = tokenize_dataset(raw, str(tiny_model), tmp_path / "ds",
                              TokenizeOptions(max_bad_fraction=0.1))
    manifest = json.loads((tmp_path / "ds" / "manifest.json").read_text())
    assert manifest["kind"] == "unpaired" and report.rows == len(sample) + 2
    assert report.rejects == {"wrong_type:label": 1, "missing_field:label": 1,
                              "unexpected_field:chosen": 1, "kind_mismatch:pairs": 1}
    table = pq.read_table(next((tmp_path / "ds").glob("shard-*.parquet")))
    assert table.column_names == ["id", "group", "prompt_ids", "completion_ids", "label",
                                  "split"]
    data = load_pairs(tmp_path / "ds")
    assert data.unpaired and {p.label for p in data.train} == {True, False}
    by_id = {r["id"]: r["label"] for r in sample}
    rows_of = [p.id.split("~after~")[0] for p in data.train]
    assert len(set(rows_of)) == len(rows_of) and sum(r in by_id for r in rows_of) > 50
    assert all(p.label == by_id[r] for p, r in zip(data.train, rows_of, strict=True)
               if r in by_id)
    # what reads pairs alone refuses it in one line, before any work
    from engine.data.prompts import prompts_for
    from engine.data.unpaired import refuse_unpaired
    from flows.pipeline import check_pipeline_inputs
    from tasks.sweep.sweep_spec import SpecError

    with pytest.raises(ValueError, match=r"KTO's data.: a sweep's leaderboard"):
        refuse_unpaired(tmp_path / "ds", "a sweep's leaderboard scores preference pairs")
    with pytest.raises(ValueError, match="a sampling loss samples from prompts"):
        prompts_for(tmp_path / "ds", str(tiny_model), None, None)  # GRPO, online pairs
    spec = tmp_path / "spec.yaml"
    spec.write_text("name: s\nmodel: m\ndata: d\nfixed: {loss: kto}\n")
    with pytest.raises(SpecError, match="unpaired rows"):
        check_pipeline_inputs(str(SAMPLE), str(tiny_model), str(spec))


@pytest.mark.integration
def test_python_m_engine_train_trains_kto_on_unpaired_rows(tiny_model: Path,
                                                           tmp_path: Path) -> None:
    """Before the first step the loss is exactly TRL's at the reference (r = 0, z0 = 0:
    every row 1 − σ(0) = 0.5); training lowers it; another loss and `score` refuse the
    data in one line."""
    from tasks.data.tokenize import tokenize_dataset

    data = tokenize_dataset(SAMPLE, str(tiny_model), tmp_path / "ds").out

    def engine(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "engine", *args], capture_output=True,
                              text=True, cwd=ROOT, timeout=300)

    common = ["--model", str(tiny_model), "--data", str(data), "--batch-size", "8",
              "--lora-rank", "4", "--head-chunk", "16"]
    proc = engine("train", *common, "--out", str(tmp_path / "run"), "--loss", "kto",
                  "--kto-beta", "0.5", "--steps", "12", "--learning-rate", "5e-3",
                  "--val-every", "12", "--val-batches", "2")
    assert proc.returncode == 0, proc.stderr[-2000:]
    records = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text()
               .splitlines()]
    val = [r for r in records if r["split"] == "valid"]
    train = [r for r in records if r["split"] == "train"]
    assert val[0]["step"] == 0 and val[0]["val/kl"] == 0.0
    assert val[0]["val/loss"] == pytest.approx(0.5, abs=1e-5)
    assert val[-1]["val/loss"] < 0.49 and train[-1]["loss"] < 0.45, records  # 0.46, 0.37
    assert train[-1]["kl"] > 0  # z0 moved off 0 as the policy left its reference
    refused = engine("train", *common, "--out", str(tmp_path / "orpo"), "--steps", "1")
    assert refused.returncode != 0 and "train them with --loss kto" in refused.stderr
    scored = engine("score", "--model", str(tiny_model), "--data", str(data), "--out",
                    str(tmp_path / "s.jsonl"))
    assert scored.returncode == 2 and "score reads preference pairs" in scored.stderr
