"""The engine benchmarks run end to end at toy sizes and print what the docs promise."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from engine.host.command_queue import bounded_mb

pytestmark = pytest.mark.integration
TOY = ["--layers", "2", "--hidden", "64", "--heads", "4", "--kv-heads", "2", "--vocab", "500",
       "--repeats", "1", "--json"]


def bench(*args: str) -> dict:
    proc = subprocess.run([sys.executable, "-m", "benchmarks", *args], capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_memory_bench_rows_and_ratios() -> None:
    out = bench("memory", *TOY, "--seq", "128", "--head-chunk", "32",
                "--rows", "plain,seg1,seg1:1,head_dense,head_bounded")
    assert [r["name"] for r in out["rows"]] == ["plain", "seg1", "seg1:1", "head_dense",
                                                "head_bounded"]
    assert all(r["peak_mb"] > 0 and r["act_mb"] > 0 and r["step_s"] > 0 and r["rss_mb"] > 0
               for r in out["rows"])
    assert {"seg1_act_vs_plain", "seg1:1_time_vs_plain", "head_bounded_act_vs_dense"} \
        <= set(out["ratios"])


def test_memory_bench_on_a_4bit_base() -> None:
    out = bench("memory", *TOY, "--seq", "128", "--head-chunk", "32", "--quantize", "4",
                "--intermediate", "128",
                "--rows", "plain,seg1")
    plain, seg1 = out["rows"]
    assert out["config"]["quantize"] == 4 and plain["weights_mb"] > 0
    assert seg1["act_mb"] < plain["act_mb"]


def test_memory_limit_reaches_mlx_and_a_negative_one_is_refused(capsys) -> None:
    """``--memory-limit-gb`` is MLX's limit for the row, in GiB as the engine's
    ``memory_limit_gb`` (a GB/GiB mix-up or a dropped flag fails); below 0, exit 2."""
    import mlx.core as mx

    from benchmarks.bench_args import parse
    from benchmarks.memory_bench import make_step
    from benchmarks.row_runner import measure

    a = parse([*TOY, "--seq", "64", "--head-chunk", "32", "--memory-limit-gb", "0.5"])
    before = mx.set_memory_limit(2**40)
    try:
        assert measure("seg1", a, make_step)["step_s"] > 0
        assert mx.set_memory_limit(2**40) == 2**29
    finally:
        mx.set_memory_limit(before)
    with pytest.raises(SystemExit) as exit_:
        parse(["--memory-limit-gb", "-1"])
    assert exit_.value.code == 2 and "--memory-limit-gb -1.0: must be >= 0" in \
        capsys.readouterr().err


def test_prefix_bench_rows() -> None:
    out = bench("prefix", *TOY, "--seq", "96", "--ratios", "4:1")
    assert {(r["ratio"], r["path"]) for r in out["rows"]} == {
        ("4:1", "two_forward"), ("4:1", "shared"), ("4:1", "shared_mask")}
    assert out["rows"][0]["prompt_tokens"] + out["rows"][0]["response_tokens"] // 2 == 97
    assert "4:1_shared_time_vs_two_forward" in out["ratios"]


def test_attention_bench_one_process_per_shape() -> None:
    out = bench("attention", *TOY, "--shapes", "64:64,33:50")
    assert [(r["q"], r["k"]) for r in out["rows"]] == [(64, 64), (33, 50)]
    assert all(r["fwd_ms"] > 0 and r["fwd_bwd_ms"] > 0 for r in out["rows"])


def test_profile_times_every_phase_and_block() -> None:
    out = bench("profile", *TOY, "--seq", "64", "--head-chunk", "16", "--segment-size", "1")
    assert [p["phase"] for p in out["phases"]] == ["embed", "forward 0-1", "forward 1-2", "head",
                                                   "backward 1-2", "backward 0-1"]
    assert all(p["ms"] > 0 for p in out["phases"])
    assert {(b["block"], b["pass"]) for b in out["blocks"]} == {
        (n, k) for n in ("attention", "mlp", "layer") for k in ("fwd", "fwd+bwd")}
    shared = bench("profile", *TOY, "--seq", "64", "--head-chunk", "16", "--segment-size", "2",
                   "--prefix", "--pad-multiple", "16")
    assert [p["phase"] for p in shared["phases"]] == ["embed", "forward 0-2", "head",
                                                      "backward 0-2"]


def test_ops_bench_splits_the_attention_block() -> None:
    out = bench("ops", *TOY, "--seq", "64")
    ops = [r["op"] for r in out["rows"]]
    assert {"q_proj", "q_proj_base", "q_proj_mlx_lm", "rope_q", "sdpa", "o_proj", "block",
            "block_norope", "lora_q", "lora_q_addmm", "lora_qkv", "lora_qkv_shared_a", "layer",
            "layer_compiled"} <= set(ops)
    assert all(r["fwd_ms"] > 0 and r["fwd_bwd_ms"] > 0 for r in out["rows"])


def toy_layer():
    """The ops bench's one-layer toy model (float32), every LoRA B nonzero (so that A's
    gradient is too): its decoder layer."""
    import argparse

    import mlx.core as mx

    from benchmarks.bench_args import parse
    from benchmarks.bench_model import build_model
    from engine.model.load import lora_modules

    a = parse([*TOY[:-3], "--seq", "16", "--dtype", "float32"], "ops", "")
    _, stack = build_model(argparse.Namespace(**{**vars(a), "layers": 1}))
    for i, (_, m) in enumerate(lora_modules(stack.layers[0])):
        m.lora_b = mx.random.normal(m.lora_b.shape, key=mx.random.key(i)) * 0.1
    return stack.layers[0]


def assert_vjps_close(want, got, rtol: float) -> None:
    """Two ``mx.vjp`` results (outputs, gradients) within ``rtol`` of each array's largest."""
    import mlx.core as mx

    for w, o in zip([*want[0], *want[1]], [*got[0], *got[1]], strict=True):
        assert float(mx.abs(w - o).max()) <= rtol * float(mx.abs(w).max())


def test_ops_bench_lora_variants_compute_the_engines_projection() -> None:
    """The LoRA rows time the engine's call (its class's output, 1e-6 of the largest) and
    the fused ones the same maths: outputs and the gradients of x and every factor equal
    (float32, B nonzero so A's gradient is too; 1e-5 of the largest, the addmm epilogue
    rounds once where the plain sum rounds thrice)."""
    import mlx.core as mx

    from benchmarks.ops_bench import lora_ops

    attn = toy_layer().self_attn
    x = mx.random.normal((2, 16, 64), key=mx.random.key(9))
    rows = lora_ops(attn, x)
    (q, q_args), (qkv, qkv_args) = rows["lora_q"], rows["lora_qkv"]
    engine = [attn.q_proj(x), mx.concatenate([attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)],
                                             -1)]
    for want, got in zip(engine, [q(*q_args), qkv(*qkv_args)], strict=True):  # its own class
        assert float(mx.abs(want - got).max()) <= 1e-6 * float(mx.abs(want).max())
    for plain, fused in (("lora_q", "lora_q_addmm"), ("lora_qkv", "lora_qkv_shared_a")):
        (f, args), (g, _) = rows[plain], rows[fused]
        cot = mx.random.normal(f(*args).shape, key=mx.random.key(3))
        assert_vjps_close(mx.vjp(f, args, [cot]), mx.vjp(g, args, [cot]), 1e-5)


def test_ops_bench_compiled_layer_computes_the_layer() -> None:
    """``layer`` is the decoder layer itself and ``layer_compiled`` the same maths: output
    and the gradients of x and every LoRA factor within 1e-5 of the largest (float32; the
    fused kernels round in another order), and the traced calls leave the layer holding
    its own factors."""
    import mlx.core as mx

    from benchmarks.ops_bench import layer_fn
    from engine.model.load import lora_modules

    layer = toy_layer()
    fn, factors = layer_fn(layer)
    x = mx.random.normal((2, 16, 64), key=mx.random.key(9))
    assert mx.array_equal(fn(x, *factors), layer(x, "causal", None))
    cot = mx.random.normal((2, 16, 64), key=mx.random.key(3))
    both = lambda *p: mx.vjp(fn, list(p), [cot])  # noqa: E731
    want, got = both(x, *factors), mx.compile(both)(x, *factors)
    assert all(float(mx.abs(g).max()) > 0 for g in want[1][1:])  # the factors are wired in
    assert_vjps_close(want, got, 1e-5)
    loras = [m for _, m in lora_modules(layer)]
    assert all(m.lora_b is b for m, b in zip(loras, factors[1::2], strict=True))


def test_train_bench_runs_the_real_trainer(tmp_path, capsys) -> None:
    """`pomona bench train`: the trainer's steady-state step on pairs of exactly --seq
    tokens (tokens/s counts both sequences of every pair), its phases, the engine's own
    step beside it, mlx-lm-lora's train_orpo on the same model and pairs (with and without
    its checkpointing, its semantics said), and TRL's row says why it is missing here
    rather than vanishing."""
    from benchmarks.train_bench import main

    args = ["--seq", "96", "--pairs", "2", "--layers", "2", "--hidden", "64", "--heads", "4",
            "--kv-heads", "2", "--intermediate", "128", "--vocab", "512", "--dtype", "float32",
            "--warmup", "1", "--steps", "2", "--head-chunk", "32", "--peak-tflops", "1",
            "--trl", "--peer", "mlx-lm-lora", "--json", "--work", str(tmp_path)]
    assert main(args) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    pomona, engine, peer, peer_gc, trl = out["rows"]
    assert pomona["name"] == "pomona" and pomona["pairs"] == 2 and len(pomona["steps_s"]) == 2
    assert pomona["tokens_per_s"] == pytest.approx(2 * 96 * 2 / pomona["step_s"])
    assert pomona["mfu"] > 0 and pomona["peak_mb"] > 0
    # its prompts ran once: less computed than the plain passes the MFU counts
    assert pomona["prefix_share_rate"] == 1 and 0 < pomona["mfu_computed"] < pomona["mfu"]
    phases = pomona["phases_ms"]  # where the trainer's step goes, each phase timed
    assert set(phases) == {"batches", "step_grads", "update", "wait"}
    assert 0 < phases["step_grads"] < pomona["step_s"] * 1e3 and phases["update"] > 0
    assert sum(phases.values()) == pytest.approx(pomona["step_s"] * 1e3, rel=0.2)
    assert engine["name"] == "engine" and len(engine["steps_s"]) == 2 and engine["shared"]
    assert out["ratios"]["trainer_step_vs_engine_step"] == pytest.approx(
        pomona["step_s"] / engine["step_s"])
    assert (peer["name"], peer_gc["name"]) == ("mlx-lm-lora", "mlx-lm-lora_gc"), peer
    for row in (peer, peer_gc):  # the same pairs: both sequences' 96 inputs counted
        assert row["seq"] == 96 and len(row["steps_s"]) == 2 and row["peak_mb"] > 0
        assert row["tokens_per_s"] == pytest.approx(2 * 96 * 2 / row["step_s"])
        assert "response" in row["semantics"] and row["mfu"] > 0
        assert row["mfu_computed"] > row["mfu"]  # every token, logits at every position
    assert out["ratios"]["pomona_vs_mlx-lm-lora"] == pytest.approx(
        pomona["tokens_per_s"] / peer["tokens_per_s"])
    assert trl["name"] == "trl" and "not installed" in trl["error"]
    assert (tmp_path / "run" / "adapters.safetensors").exists()  # the trainer really ran


def test_train_bench_never_writes_into_a_foreign_folder(tmp_path, capsys) -> None:
    """--work gets a model, pairs.jsonl and run/: a folder that is not one of its own is
    refused and left as it was; a bad count is one line, exit 2."""
    from benchmarks.train_bench import main

    (tmp_path / "thesis.txt").write_text("mine")
    assert main(["--work", str(tmp_path), "--seq", "64"]) == 2
    assert [p.name for p in tmp_path.iterdir()] == ["thesis.txt"]
    assert main(["--pairs", "0"]) == 2
    assert "--pairs 0: must be at least 1" in capsys.readouterr().err
    for bad, says in ((["--profile-repeats", "0"], "--profile-repeats 0: must be at least 1"),
                      (["--quantize", "4"], "--quantize 4: only with --preset"),
                      (["--preset", "e4b-mini", "--preset-layers", "3"],
                       "e4b-mini needs at least 5")):  # a traceback in mlx-lm otherwise
        assert main(bad) == 2
        assert says in capsys.readouterr().err



def test_allreduce_cost_counts_lora_parameters_as_the_formula_does() -> None:
    """docs/cluster.md's gradient bytes: r·(in + out) per adapted linear. Llama 3.1 8B,
    q/k/v/o, r=16: 32 layers × 16 × (2·(4096 + 4096) + 2·(4096 + 1024)) = 13,631,488;
    all linears add the MLP's 3 × 16 × (4096 + 14336) per layer."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "allreduce_cost.py"
    spec = importlib.util.spec_from_file_location("allreduce_cost", path)
    cost = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cost)
    llama8b = cost.models()["Llama 3.1 8B"]
    qkvo = 32 * 16 * (2 * (4096 + 4096) + 2 * (4096 + 1024))
    assert cost.lora_params(llama8b, cost.QKVO) == qkvo == 13_631_488
    assert cost.lora_params(llama8b) == qkvo + 32 * 3 * 16 * (4096 + 14336)


def test_trl_kind_runs_where_mlx_is_absent() -> None:
    """`python -m benchmarks trl` runs in a torch-only environment: the front end loads no
    MLX (transformers would import it when it can). Would catch a front end that imports
    the engine's CLI, the loss code or the BLAS check before picking the kind."""
    code = ("import runpy, sys\n"
            "class NoMlx:\n"
            "    def find_spec(self, name, path, target=None):\n"
            "        if name.split('.')[0] == 'mlx':\n"
            "            raise ImportError('mlx is absent here')\n"
            "sys.meta_path.insert(0, NoMlx())\n"
            "sys.argv = ['benchmarks', 'trl', '--help']\n"
            "runpy.run_module('benchmarks', run_name='__main__')\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "python -m benchmarks trl" in proc.stdout


LEVERS = "levers,mlp_chunk=32,memory_limit_gb=50,env.MLX_MAX_OPS_PER_BUFFER=40"


def test_train_bench_rows_of_a_published_shape(tmp_path, capsys, monkeypatch) -> None:
    """`pomona bench train --preset`: the trainer under named rows on a published shape's
    structure (here E4B's at a CPU's size), each row's step and peak against the first,
    and --profile's stage split by Gemma 4 layer type with each kind's peak."""
    from benchmarks.train_bench import main

    monkeypatch.delenv("MLX_MAX_MB_PER_BUFFER", raising=False)
    args = ["--preset", "e4b-mini", "--dtype", "float32", "--seq", "128", "--warmup", "1",
            "--steps", "1", "--segment-size", "1", "--head-chunk", "32", "--row", "plain",
            "--row", LEVERS, "--profile",
            "--profile-repeats", "1", "--json", "--work", str(tmp_path)]
    assert main(args) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    plain, levers = out["rows"]
    assert (plain["name"], levers["name"]) == ("plain", LEVERS)
    # A row setting MLX's once-a-process variables: every row in a process of its own; one
    # under a memory limit starts as `pomona train` would, MLX's queue capped.
    assert levers["env"] == {"MLX_MAX_OPS_PER_BUFFER": "40",
                             "MLX_MAX_MB_PER_BUFFER": str(bounded_mb())}
    assert plain["env"] == {}
    assert len({plain["pid"], levers["pid"], os.getpid()}) == 3
    assert out["host"]["cpus"] >= 1 and len(out["host"]["load_avg"]) == 3  # who built them
    assert plain["prefix_share_rate"] == 0 and levers["prefix_share_rate"] == 1
    assert out["vs_first"][levers["name"]]["step"] == pytest.approx(
        levers["step_s"] / plain["step_s"])
    assert set(plain["profile"]["ms"]) == {"forward", "step", "update"}
    kinds = levers["profile"]["ms"]
    for kind in ("sliding own-kv", "full own-kv", "sliding kv-shared", "full kv-shared"):
        assert kinds[f"forward {kind}"] > 0 and kinds[f"backward {kind}"] > 0
        assert levers["profile"]["peak_gb"][f"backward {kind}"] > 0
    assert kinds["head"] > 0 and kinds["update"] > 0
    host = levers["profile"]["host_ms"]  # Python's graphs, MLX's queueing, the device
    assert set(host) == {"build", "dispatch", "wait"} and all(v > 0 for v in host.values())
    runs = tmp_path / "runs"
    assert (runs / LEVERS.replace(",", "_").replace("=", "-") /
            "adapters.safetensors").exists()  # it trained
    assert main([*args[:-2], "--row", "levers,mlp_chunks=32"]) == 2  # a misspelt field
    assert "'mlp_chunks=32' is not FIELD=VALUE" in capsys.readouterr().err
    assert main([*args[:-2], "--row", "levers,env.=1"]) == 2  # a variable with no name
    assert "env.NAME=VALUE" in capsys.readouterr().err


def test_shape_refusals_are_one_line(tmp_path, capsys) -> None:
    """Item 14: `bench shape --preset e4b-mini --layers 2` was mlx-lm's KeyError traceback
    (shared K/V layers with no donor of their type) and a taken --out a FileExistsError
    traceback (benchmarks/shapes.py:67). Now one line and rc 2, nothing written."""
    from benchmarks.__main__ import main

    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "notes.txt").write_text("mine")
    for args, message in ((["--layers", "2", "--out", str(tmp_path / "new")],
                           "--layers 2: preset e4b-mini needs at least 10"),
                          (["--out", str(taken)], "not an empty folder")):
        assert main(["shape", "--preset", "e4b-mini", *args]) == 2
        lines = [x for x in capsys.readouterr().err.splitlines() if x.strip()]
        assert len(lines) == 1 and message in lines[0], lines
    assert not (tmp_path / "new").exists() and os.listdir(taken) == ["notes.txt"]


