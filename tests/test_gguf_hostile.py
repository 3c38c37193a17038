"""Hostile GGUF headers and values (issue 52, cases 10, 11 and 15): each refused by
`model import` and by `train --model` in one line naming the file and the key or tensor,
before anything is built from it, and nothing written. The files are tests/test_gguf_import.py's
tiny llama, corrupted one key or tensor at a time."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from cli.main import app
from tests.test_gguf_import import llama_gguf, one_error

pytestmark = pytest.mark.unit
ROOT = Path(__file__).parent.parent
SAMPLE = ROOT / "datasets" / "sample" / "explicit.jsonl"


def train_error(path: Path, tmp_path: Path) -> str:
    """The one error line of `train --model path` (nothing trained, nothing cached)."""
    result = CliRunner().invoke(app, ["train", "--model", str(path), "--data",
                                      str(SAMPLE.parent), "--out", str(tmp_path / "run"),
                                      "--steps", "1"])
    errors = [x for x in result.output.splitlines() if x.startswith("error:")]
    assert result.exit_code == 2 and len(errors) == 1, result.output
    assert "Traceback" not in result.output, result.output
    return errors[0]


def refused_everywhere(path: Path, tmp_path: Path, field: str) -> None:
    """`model import` and `train --model` both refuse ``path`` in one line naming it and
    ``field``; no --out, no cached import."""
    out = tmp_path / "out"
    for line in (one_error(str(path), "--out", str(out)), train_error(path, tmp_path)):
        assert line.startswith(f"error: {path}: ") and field in line, line
    assert not out.exists()
    assert not list((tmp_path / "cache").rglob("config.json"))


CHILD = """
import sys, time
import gguf, mlx.core, mlx_lm, numpy  # loaded first: the time measured is the refusal's
from typer.testing import CliRunner
from cli.main import app
# CPU seconds bound the work: a loaded CI box (two workers on two cores) stretches the wall
start, wall = time.process_time(), time.perf_counter()
result = CliRunner().invoke(app, sys.argv[1:])
seconds, wall = time.process_time() - start, time.perf_counter() - wall
# VmHWM: this process image's own peak (wait4's ru_maxrss keeps the forking parent's, a
# pytest worker's 1.4 GB, across the exec)
peak = next(int(x.split()[1]) * 1024 for x in open("/proc/self/status")
            if x.startswith("VmHWM:"))
print(f"{seconds:.3f} {wall:.3f} {result.exit_code} {peak}")
sys.stdout.write(result.output)
"""


def run_measured(args: list[str], env: dict[str, str], limit_s: float = 30.0
                 ) -> tuple[float, float, int, int, str]:
    """(CPU seconds the verb ran, its wall seconds, its exit code, the child's peak RSS in
    bytes, its output) of ``pomona ARGS`` in a fresh process; killed after ``limit_s``
    (then both seconds are inf)."""
    try:
        proc = subprocess.run([sys.executable, "-c", CHILD, *args], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=limit_s)
    except subprocess.TimeoutExpired as err:
        return float("inf"), float("inf"), -1, 0, str(err.stdout or "")
    text = proc.stdout + proc.stderr
    if proc.returncode != 0:
        return float("inf"), float("inf"), proc.returncode, 0, text
    seconds, wall, code, peak = text.splitlines()[0].split()
    return float(seconds), float(wall), int(code), int(peak), text


DEEP = "tensor 'blk.2.attn_norm.weight' (and 1799981 more) is missing: the metadata says "
NONE = "the metadata says block_count 200000, but the file holds no blk.* tensors"


@pytest.mark.parametrize("verb, layers, message", [
    ("import", 2, DEEP), ("train", 2, DEEP), ("import", 0, NONE)])
def test_a_block_count_beyond_the_tensors_is_refused_in_2_cpu_s_under_1_gb(
        verb: str, layers: int, message: str, tmp_path: Path) -> None:
    """Case 10: block_count 200000 over tensors of 2 blocks took 23 GB and never finished:
    mlx-lm's model was built at the stated depth before any tensor was compared. The
    blocks the tensor names hold are now compared first (no blocks at all: likewise)."""
    path = llama_gguf(tmp_path / "deep.gguf", layers=layers, block_count=200_000)
    args = {"import": ["model", "import", str(path), "--out", str(tmp_path / "out")],
            "train": ["train", "--model", str(path), "--data", str(SAMPLE.parent), "--out",
                      str(tmp_path / "run"), "--steps", "1"]}[verb]
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache"),
           "OPENBLAS_NUM_THREADS": "1"}
    seconds, wall, code, peak, output = run_measured(args, env)
    errors = [x for x in output.splitlines() if x.startswith("error:")]
    assert code == 2 and len(errors) == 1, output
    assert errors[0].startswith(f"error: {path}: {message}"), errors[0]
    assert seconds < 2.0 and wall < 15.0 and peak < 2**30, (seconds, wall, peak)
    assert not (tmp_path / "out").exists()
    assert not list((tmp_path / "cache").rglob("config.json"))


def test_a_block_number_that_is_no_number_is_one_line(tmp_path: Path, monkeypatch) -> None:
    """The block check that precedes the model build reads each ``blk.N`` as a number: a
    tensor ``blk.x.attn_norm.weight`` must be refused naming it (not end as "invalid
    literal for int()", naming neither the file nor the tensor)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    path = llama_gguf(tmp_path / "m.gguf", values={"blk.x.attn_norm.weight": np.ones(32)})
    refused_everywhere(path, tmp_path, "GGUF tensor 'blk.x.attn_norm.weight' has no llama "
                                       "counterpart")


nan = float("nan")


@pytest.mark.parametrize("meta, field", [
    ({"llama.attention.head_count": 0}, "llama.attention.head_count is 0"),
    ({"llama.attention.head_count": -2}, "llama.attention.head_count is -2"),
    ({"llama.attention.head_count": 64}, "llama.attention.head_count is 64, more than "
                                         "llama.embedding_length 32"),
    ({"llama.attention.head_count_kv": 0}, "llama.attention.head_count_kv is 0"),
    ({"llama.attention.head_count_kv": 3}, "llama.attention.head_count_kv is 3, which does "
                                           "not divide"),
    ({"llama.attention.layer_norm_rms_epsilon": -0.5},
     "llama.attention.layer_norm_rms_epsilon is -0.5; it must be a finite number above 0"),
    ({"llama.attention.layer_norm_rms_epsilon": 0.0},  # MLX's RMSNorm refuses it at build
     "llama.attention.layer_norm_rms_epsilon is 0.0"),
    ({"llama.attention.layer_norm_rms_epsilon": "tiny"},
     "llama.attention.layer_norm_rms_epsilon is 'tiny', not a number"),
    ({"llama.embedding_length": 1 << 30}, "llama.embedding_length is 1073741824, more than "
                                          "any tensor's dimension (the largest: 64, of "
                                          "'token_embd.weight')"),
    ({"llama.feed_forward_length": 1 << 20}, "llama.feed_forward_length is 1048576"),
    ({"llama.attention.key_length": 4096}, "llama.attention.key_length is 4096"),
    ({"llama.attention.key_length": 48}, "llama.attention.head_count × head size 48 is 96"),
])
def test_a_count_of_zero_or_below_is_one_line_naming_the_key(meta: dict, field: str,
                                                             tmp_path: Path,
                                                             monkeypatch) -> None:
    """Case 11: head_count 0 was a ZeroDivisionError traceback in `model import` and
    `train --model`; a negative head count or layer-norm eps, and dimensions no tensor
    holds, got no further check. Each is one line naming the file and the key."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    refused_everywhere(llama_gguf(tmp_path / "m.gguf", meta=meta), tmp_path, field)


def test_a_tensor_count_the_file_cannot_hold_is_one_line(tmp_path: Path, monkeypatch) -> None:
    """Case 11: a header stating 2^62 tensors read as "cut short (IndexError: index 0 is out
    of bounds ...)": now the count, and the file's size."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    path = llama_gguf(tmp_path / "m.gguf")
    data = bytearray(path.read_bytes())
    keys = struct.unpack("<Q", data[16:24])[0]
    data[8:16] = struct.pack("<Q", 2**62)  # after the magic and the version
    path.write_bytes(data)
    refused_everywhere(path, tmp_path, f"its header states {2**62} tensors and {keys} "
                                       f"metadata keys, more than a file of {len(data)} bytes")


def test_rope_freqs_with_nan_say_so(tmp_path: Path, monkeypatch) -> None:
    """Case 11: rope_freqs of the right size holding a NaN said "rope_freqs holds 8 values,
    the rope needs 8", contradicting itself."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    factors = np.ones(8, np.float32)
    factors[5] = nan
    path = llama_gguf(tmp_path / "m.gguf", values={"rope_freqs.weight": factors})
    refused_everywhere(path, tmp_path, "tensor 'rope_freqs.weight' holds 1 NaN or infinite "
                                       "values")


@pytest.mark.parametrize("broken, field", [
    ({"values": {"blk.1.ffn_down.weight": np.full((32, 64), nan)}},
     "tensor 'blk.1.ffn_down.weight' holds 2048 NaN or infinite values"),
    ({"values": {"output_norm.weight": np.r_[np.ones(31), np.inf]}},
     "tensor 'output_norm.weight' holds 1 NaN or infinite values"),
    ({"meta": {"llama.rope.freq_base": nan}}, "llama.rope.freq_base is nan"),
    ({"meta": {"llama.rope.freq_base": 0.0}}, "llama.rope.freq_base is 0.0"),
    ({"meta": {"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": -2.0}},
     "llama.rope.scaling.factor is -2.0; it must be a finite number above 0"),
    ({"meta": {"llama.context_length": 0}}, "llama.context_length is 0"),
])
def test_non_finite_values_and_impossible_rope_are_refused_at_import(broken: dict, field: str,
                                                                     tmp_path: Path,
                                                                     monkeypatch) -> None:
    """Case 15: NaN/inf weights, a NaN rope base, a negative rope factor and context length
    0 imported with rc 0; training then ran on wrong positions, or failed blaming the
    architecture. Each is refused at import naming the file and the tensor or key."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    refused_everywhere(llama_gguf(tmp_path / "m.gguf", **broken), tmp_path, field)


def test_the_refusals_leave_valid_files_alone(tmp_path: Path) -> None:
    """The checks pass a file that sets every key they read to a valid value (rope
    scaling, a rope base, a key length, a tiny eps): the refusals above are the damage's,
    not the keys'."""
    meta = {"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 2.0,
            "llama.rope.freq_base": 5e5, "llama.attention.key_length": 16,
            "llama.attention.layer_norm_rms_epsilon": 2.0**-40}
    result = CliRunner().invoke(app, ["model", "import", str(llama_gguf(tmp_path / "m.gguf",
                                                                        meta=meta)),
                                      "--out", str(tmp_path / "out"), "--dtype", "float32"])
    assert result.exit_code == 0, result.output
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["rope_scaling"] == {"rope_type": "linear", "factor": 2.0}
    assert config["head_dim"] == 16 and config["rms_norm_eps"] == 2.0**-40
