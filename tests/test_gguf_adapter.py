"""Issue 70, step 1: an adapter alone as llama.cpp's LoRA GGUF (`pomona export RUN
--gguf-adapter OUT.gguf`, engine/model/gguf_adapter.py).

What llama.cpp does with the file (src/llama-adapter.cpp, llama-graph's build_lora_mm) is
``W + alpha / rank · (lora_b @ lora_a)`` on the base GGUF's tensor ``W``. Checked here, for
every family the fused export writes: that sum, over the base's GGUF tensors, equals the
fused export's tensors within 1e-5 relative to the largest (float32; measured 2026-12-07:
at most 1.7e-7). llama.cpp itself loading the file: benchmarks/llama_cpp_check.sh, with its
output in docs/results/.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from engine.model.export import ExportSettings, export_adapter
from engine.model.gguf_adapter import adapter_tensors, lora_pairs, one_rank
from engine.model.gguf_export import GGUF_ARCH, exported_here, fuse, gguf_tensors
from tasks.models.model_factory import init_model
from tests.test_gguf_export import CASES, trained

ROOT = Path(__file__).resolve().parents[1]


def read(path: Path) -> tuple[dict[str, np.ndarray], dict[str, object]]:
    import gguf

    from engine.model.gguf_import import read_metadata

    reader = gguf.GGUFReader(str(path))
    return ({t.name: np.array(t.data, np.float32) for t in reader.tensors},
            read_metadata(reader))


@pytest.mark.integration
@pytest.mark.parametrize("case", sorted(CASES))
def test_llama_cpps_sum_of_base_and_adapter_is_the_fused_export(case: str,
                                                                tmp_path: Path) -> None:
    import gguf

    model = init_model(CASES[case], tmp_path / "model")
    adapter = trained(model, tmp_path / "adapter")
    out = export_adapter(adapter, tmp_path / "lora.gguf")
    tensors, meta = read(out)
    arch = GGUF_ARCH[json.loads((model / "config.json").read_text())["model_type"]]
    assert meta["general.type"] == "adapter" and meta["adapter.type"] == "lora"
    assert meta["general.architecture"] == arch and exported_here(out)
    rank = json.loads((adapter / "adapter_config.json").read_text())["lora_parameters"]["rank"]
    scale = meta["adapter.lora.alpha"] / rank
    base, fused = gguf_tensors(fuse(str(model), None), arch), gguf_tensors(
        fuse(str(model), adapter), arch)
    changed = {k for k in fused if not np.array_equal(fused[k], base[k])}
    assert changed and changed == {k.removesuffix(".lora_a") for k in tensors
                                   if k.endswith(".lora_a")}
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], CASES[case].layers)
    for name in changed:
        a, b = tensors[f"{name}.lora_a"], tensors[f"{name}.lora_b"]
        assert a.shape == (rank, base[name].shape[1]) and b.shape == (base[name].shape[0], rank)
        got = base[name] + scale * (b @ a)  # llama.cpp's update, in its layout
        err = np.abs(got - fused[name]).max() / np.abs(fused[name]).max()
        assert err < 1e-5, (name, err)
        assert name.rsplit(".", 1)[0] in names.mapping.values() or any(
            isinstance(v, tuple) and v[1] == name.rsplit(".", 1)[0]
            for v in names.mapping.values()), name


@pytest.mark.unit
def test_what_llama_cpps_adapters_cannot_hold_is_refused_naming_it() -> None:
    src = Path("a/adapters.safetensors")
    a, b = np.zeros((8, 2), np.float32), np.zeros((2, 8), np.float32)
    with pytest.raises(ValueError, match=re.escape("q_proj.m is not a LoRA factor")):
        lora_pairs({"model.layers.0.self_attn.q_proj.lora_a": a,
                    "model.layers.0.self_attn.q_proj.m": a[0]}, src)
    with pytest.raises(ValueError, match="without its other"):
        lora_pairs({"model.layers.0.self_attn.q_proj.lora_a": a}, src)
    pairs = lora_pairs({"model.layers.0.self_attn.q_proj.lora_a": a,
                        "model.layers.0.self_attn.q_proj.lora_b": b}, src)
    with pytest.raises(ValueError, match=re.escape("ranks [2, 3] differ")):
        one_rank({**pairs, "x.weight": (np.zeros((8, 3)), np.zeros((3, 8)))}, src)
    config = {"num_attention_heads": 2, "num_key_value_heads": 1, "tie_word_embeddings": True}
    for name in ("lm_head.weight", "model.embed_tokens.weight"):
        with pytest.raises(ValueError, match=re.escape(f"LoRA on {name}")):
            adapter_tensors({name: (a, b)}, config, "llama")
    head = adapter_tensors({"lm_head.weight": (a, b)}, {**config, "tie_word_embeddings": False},
                           "qwen2")
    assert {k: v.shape for k, v in head.items()} == {"output.weight.lora_a": (2, 8),
                                                      "output.weight.lora_b": (8, 2)}


@pytest.mark.unit
def test_a_spec_asks_for_the_adapter_alone_with_or_without_the_fused_file() -> None:
    assert ExportSettings.parse({"gguf_adapter": True}) == ExportSettings("", True)
    assert ExportSettings.parse({"gguf": "q8_0", "gguf_adapter": True}).any
    for bad in ({"gguf_adapter": False}, {"gguf_adapter": "yes"}, {"adapter": True}, {}):
        with pytest.raises(ValueError, match="export"):
            ExportSettings.parse(bad)


@pytest.mark.integration
def test_pomona_export_writes_both_files_or_neither(tmp_path: Path, tiny_model: Path) -> None:
    sweep = tmp_path / "sweep"
    adapter = trained(tiny_model, sweep / "best-adapter")
    weights = dict(mx.load(str(adapter / "adapters.safetensors")))
    (tmp_path / "taken.gguf").write_text("a user's file\n")

    def export_cli(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "cli.main", "export", str(sweep), *args],
                              capture_output=True, text=True, cwd=ROOT, timeout=120)

    proc = export_cli("--gguf-adapter", str(tmp_path / "lora.gguf"), "--gguf",
                      str(tmp_path / "taken.gguf"))
    assert proc.returncode == 2 and "exists" in proc.stderr, proc.stderr
    assert not (tmp_path / "lora.gguf").exists()  # refused before either was written
    assert (tmp_path / "taken.gguf").read_text() == "a user's file\n"
    proc = export_cli("--gguf-adapter", str(tmp_path / "lora.gguf"), "--gguf",
                      str(tmp_path / "fused.gguf"))
    assert proc.returncode == 0, proc.stderr
    assert "(adapter, f32" in proc.stderr and "(fused, f32" in proc.stderr
    tensors, _ = read(tmp_path / "lora.gguf")
    assert len(tensors) == len(weights)  # every factor, no base weight
    assert sum(v.nbytes for v in tensors.values()) < 0.1 * (tmp_path / "fused.gguf").stat(
    ).st_size
    proc = export_cli("--gguf-adapter", str(tmp_path / "lora.gguf"))
    assert proc.returncode == 2 and "exists" in proc.stderr  # never written over
    config = json.loads((adapter / "adapter_config.json").read_text())
    (adapter / "adapter_config.json").write_text(json.dumps(
        {**config, "fine_tune_type": "dora"}))
    proc = export_cli("--gguf-adapter", str(tmp_path / "dora.gguf"), "--gguf",
                      str(tmp_path / "dora-fused.gguf"))
    assert proc.returncode == 2 and "fine_tune_type dora" in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "dora.gguf").exists()
    assert not (tmp_path / "dora-fused.gguf").exists()  # refused before the fused file


@pytest.mark.unit
def test_a_pipeline_never_writes_its_lora_gguf_over_a_users_file(tmp_path: Path) -> None:
    from engine.host.outputs import RefusedOutput
    from flows.pipeline import check_export_target

    (tmp_path / "best-adapter-lora.gguf").write_text("my notes\n")
    check_export_target(tmp_path, ExportSettings("f16"))  # the fused file's name is free
    with pytest.raises(RefusedOutput, match="gguf_adapter: true"):
        check_export_target(tmp_path, ExportSettings("f16", gguf_adapter=True))
    assert (tmp_path / "best-adapter-lora.gguf").read_text() == "my notes\n"
