"""Data parallel over mx.distributed (ring backend on localhost, each rank its own process):
2 and 3 ranks train the adapter one process trains on the same global batches.

Tolerance: relative error ≤ 3e-5 on every adapter tensor after 4 AdamW steps, as
‖a − b‖ / ‖a‖ (float32; the ranks' sums add the same terms in another order, and Adam
turns a gradient's last-bit wobble near zero into a step of full size: 1.0e-5 measured on
an AMD EPYC with Debian's OpenBLAS 0.3.21; each mistake below moves whole gradients),
and 1e-5 on every step's loss.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from engine.data.batch import Pair
from engine.data.pairs import write_pairs_jsonl

pytestmark = [pytest.mark.slow, pytest.mark.long]  # conftest.py: scheduled first
ROOT = Path(__file__).resolve().parents[1]
LAUNCH = shutil.which("mlx.launch") or str(Path(sys.executable).with_name("mlx.launch"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def uneven_pairs(n: int) -> list[Pair]:
    """Lengths from 6 to ~90 tokens, so ranks' shards hold very different token counts."""
    rng = np.random.default_rng(0)
    ids = lambda k: rng.integers(5, 500, k).tolist()  # noqa: E731
    return [Pair(f"p{i}", ids(3 + (i * 37) % 60), ids(2 + (i * 11) % 25), ids(1 + (i * 7) % 17))
            for i in range(n)]


def train(model: Path, data: Path, out: Path, ranks: int, *extra: str,
          program: tuple[str, ...] = ("-m", "engine"), env_extra: dict | None = None
          ) -> subprocess.CompletedProcess:
    args = [*program, "train", "--model", str(model), "--data", str(data), "--out",
            str(out), "--steps", "4", "--batch-size", "6", "--segment-size", "1",
            "--head-chunk", "16", "--prefix-share", "on", "--val-every", "0",
            "--report-every", "1", "--learning-rate", "1e-3", "--seed", "3", *extra]
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1", "PYTHONPATH": str(ROOT),
           **(env_extra or {})}
    cmd = ([sys.executable, *args] if ranks == 1 else
           [LAUNCH, "-n", str(ranks), "--backend", "ring", "--starting-port", str(free_port()),
            sys.executable, *args])
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT, env=env)


def losses(out: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def one_process(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
                ) -> tuple[Path, Path]:
    """The uneven pairs and the adapter one process trains on them (each rank count's
    test compares its run with this one)."""
    where = tmp_path_factory.mktemp("one-process")
    data = write_pairs_jsonl(uneven_pairs(24), where / "pairs.jsonl", split="train")
    one = train(tiny_model, data, where / "one", 1)
    assert one.returncode == 0, one.stderr[-3000:]
    return data, where / "one"


@pytest.mark.parametrize("ranks", [3])  # two ranks: tests/test_gang.py, through Ray
def test_ranks_train_the_one_process_adapter(ranks: int, tiny_model: Path, one_process,
                                             tmp_path: Path) -> None:
    """Catches: a rank without its offset (every rank training the same pairs), per-rank
    normalisers (the NLL token mean weighted by rank, mlx-lm's mistake), gradients averaged
    instead of summed, or clipped before they are summed. Three ranks: a world size that
    is not a power of two (the same launcher and ring as two, which the gang test runs)."""
    data, one_dir = one_process
    caches = [Path(os.environ.get("TMPDIR") or "/tmp") / f"pomona-rank-{r}" / "mlx"
              for r in range(1, ranks)]
    for cache in caches:
        shutil.rmtree(cache, ignore_errors=True)
    many = train(tiny_model, data, tmp_path / "many", ranks)
    assert many.returncode == 0, many.stderr[-3000:]
    # Ranks > 0 compiled their CPU kernels into caches of their own (no half-written
    # library of one rank loaded by another: engine/backward/distributed.own_jit_cache).
    assert all(cache.is_dir() for cache in caches)
    summary = json.loads((tmp_path / "many" / "summary.json").read_text())
    assert summary["world_size"] == ranks and summary["rank_pairs"] == [24 // ranks] * ranks
    assert losses(tmp_path / "many") == pytest.approx(losses(one_dir), rel=1e-5)
    a = mx.load(str(one_dir / "adapters.safetensors"))
    b = mx.load(str(tmp_path / "many" / "adapters.safetensors"))
    assert a.keys() == b.keys()
    for k in a:
        err = float(mx.linalg.norm((a[k] - b[k]).reshape(-1)))
        assert err <= 3e-5 * float(mx.linalg.norm(a[k].reshape(-1))), k


def test_a_batch_the_ranks_cannot_split_is_refused(tiny_model: Path, tmp_path: Path) -> None:
    """Every rank refuses before training, naming the setting (mlx.launch itself exits 0
    whatever its ranks do: the ranks' own exit codes say it)."""
    data = write_pairs_jsonl(uneven_pairs(12), tmp_path / "pairs.jsonl", split="train")
    run = train(tiny_model, data, tmp_path / "out", 2, "--batch-size", "5")
    text = run.stdout + run.stderr
    assert "batch_size=5 does not split over 2 ranks" in text
    assert "exited with code 2" in text and not (tmp_path / "out" / "adapters.safetensors").exists()


OTHER_MLX_ON_RANK_1 = """import os, runpy, sys
import mlx.core as mx
if os.environ.get("MLX_RANK") == "1":
    mx.__version__ = "0.0.1-other"  # as if that Mac had another MLX installed
sys.argv = ["engine", *sys.argv[1:]]
runpy.run_module("engine", run_name="__main__", alter_sys=True)
"""


def test_ranks_on_different_mlx_versions_are_refused(tiny_model: Path, tmp_path: Path) -> None:
    """Rank 1 reports another MLX: the ranks stop before training with one line naming
    the rank that differs and the speaker's own versions (mixed versions would train
    silently wrong or hang in a collective)."""
    data = write_pairs_jsonl(uneven_pairs(12), tmp_path / "pairs.jsonl", split="train")
    script = tmp_path / "other_mlx.py"
    script.write_text(OTHER_MLX_ON_RANK_1)
    run = train(tiny_model, data, tmp_path / "out", 2, program=(str(script),))
    text = run.stdout + run.stderr
    assert "ranks run different versions: rank(s) [1] differ from rank 0" in text, text[-2000:]
    # Either rank may say it first; mlx.launch then stops the other (exit 2, or -15).
    assert "exited with code 2" in text and "exited with code 0" not in text
    assert not (tmp_path / "out" / "adapters.safetensors").exists()


def test_a_hostfile_without_this_rank_is_refused_by_name(tiny_model: Path, tmp_path: Path
                                                          ) -> None:
    """A hostfile listing fewer ranks than MLX_RANK needs (a Mac left out of it), or a
    malformed one, is one line naming the file, before MLX would hang waiting for it."""
    from engine.backward.distributed import check_hostfile

    hosts = tmp_path / "hosts.json"
    hosts.write_text(json.dumps([["127.0.0.1:5000"], ["127.0.0.1:5001"]]))
    check_hostfile(str(hosts), "1")
    with pytest.raises(ValueError, match=r"hosts.json: no entry for rank 2 \(it lists 2"):
        check_hostfile(str(hosts), "2")
    for bad in ('["127.0.0.1:5000"]', "[[]]", "{"):
        hosts.write_text(bad)
        with pytest.raises(ValueError, match=r"hosts\.json"):
            check_hostfile(str(hosts), "0")
    hosts.write_text(json.dumps([["127.0.0.1:5000"]]))
    data = write_pairs_jsonl(uneven_pairs(12), tmp_path / "pairs.jsonl", split="train")
    run = train(tiny_model, data, tmp_path / "out", 1,
                env_extra={"MLX_HOSTFILE": str(hosts), "MLX_RANK": "1"})
    assert run.returncode == 2 and "no entry for rank 1 (it lists 1 rank(s))" in run.stderr
