"""Shared fixtures: tiny self-made models built once per test session.

Tests run float32 on CPU (bf16 matmuls skip BLAS there and are slow: docs/design.md).
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import replace
from pathlib import Path

import pytest

from tasks.models.model_factory import ModelSpec, init_model


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The longest files first (marker ``long``, ``long(2)`` before ``long``), the rest in
    their order: pytest-xdist (``./run test``: a file per worker at a time) starts the
    demo and the sweeps at once and ends on short files, with no worker left idle while
    the other finishes a long one."""

    def weight(item: pytest.Item) -> int:
        mark = item.get_closest_marker("long")
        return 0 if mark is None else (mark.args[0] if mark.args else 1)

    items.sort(key=lambda item: -weight(item))


# Small enough to build in ~1 s and train in seconds; quantizable with group size 64.
TINY = ModelSpec(layers=4, hidden=64, heads=4, kv_heads=2, intermediate=128, vocab=512)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A float32 llama-family model directory in the Hugging Face layout."""
    return init_model(TINY, tmp_path_factory.mktemp("models") / "tiny-llama")


@pytest.fixture(scope="session")
def tiny_model_q4(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same model, 4-bit quantized through mlx_lm.convert."""
    out = tmp_path_factory.mktemp("models") / "tiny-llama-q4"
    return init_model(replace(TINY, quantize=4), out)


@pytest.fixture(scope="session")
def tiny_qwen2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A qwen2 model: tied head, q/k/v biases, no BOS token."""
    return init_model(replace(TINY, arch="qwen2"), tmp_path_factory.mktemp("models") / "tiny-qwen2")


@pytest.fixture(scope="session")
def tiny_data(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Tokenized sort pairs for the tiny model: 64 train + 16 valid rows (engine JSONL)."""
    from engine.data.pairs import write_pairs_jsonl
    from tests.pairs import tokenized_pairs

    out = tmp_path_factory.mktemp("data") / "pairs.jsonl"
    train = tokenized_pairs(tiny_model, 64, seed=0, task="sort")
    valid = tokenized_pairs(tiny_model, 16, seed=1, task="sort")
    write_pairs_jsonl(train, out, split="train")
    with out.open("a") as f:
        f.write(write_pairs_jsonl(valid, out.with_name("v.jsonl"), split="valid").read_text())
    return out


@pytest.fixture(scope="session")
def _ray_owner():
    """Shuts down, at the end of a worker's session, the Ray ``ray_cluster`` started, then
    restores the environment that Ray needed while it ran (``env``: a MonkeyPatch)."""
    import ray

    env = pytest.MonkeyPatch()
    yield env
    if ray.is_initialized():
        ray.shutdown()
    env.undo()


@pytest.fixture(scope="module")
def ray_cluster(_ray_owner):
    """A private local Ray with 2 CPU slots and 2 fake GPUs (never joins another cluster),
    started once per worker and kept across modules (a start costs ~5 s and its worker
    processes' imports); a module that runs a cluster of its own (test_cluster.py) shuts it
    down first, and the next module starts it again."""
    import ray

    if not ray.is_initialized():
        tmp = tempfile.mkdtemp(prefix="ray", dir="/tmp")  # AF_UNIX paths: 107 bytes at most
        _ray_owner.setenv("RAY_TMPDIR", tmp)  # kept while this Ray runs (across modules)
        if "RAY_AUTH_MODE" not in os.environ:
            _ray_owner.setenv("RAY_AUTH_MODE", "disabled")
        # Trials start with MLX's queue capped only under a limit (tests/test_gang.py); not
        # because the shell that ran the tests set it (Ray's workers inherit this env).
        _ray_owner.delenv("MLX_MAX_MB_PER_BUFFER", raising=False)
        ray.init(num_cpus=2, num_gpus=2, include_dashboard=False, _temp_dir=tmp,
                 runtime_env={"env_vars": {"PYTHONPATH": str(Path(__file__).resolve()
                                                             .parents[1])}},
                 log_to_driver=False)
    yield ray


@pytest.fixture(scope="session")
def prefect_api(tmp_path_factory: pytest.TempPathFactory):
    """A real Prefect API (a temporary server and database), shared: it takes ~20 s to start."""
    from prefect.testing.utilities import prefect_test_harness

    with pytest.MonkeyPatch.context() as env:
        env.setenv("PREFECT_HOME", str(tmp_path_factory.mktemp("prefect")))
        with prefect_test_harness(server_startup_timeout=180):
            yield


@pytest.fixture
def private_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """This test's own cache root (reference files and the file-hash cache): nothing it
    does reads or writes the user's ``~/.cache``."""
    root = tmp_path / "xdg-cache"
    monkeypatch.setenv("XDG_CACHE_HOME", str(root))
    return root


@pytest.fixture(scope="session")
def parity(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The demo's task for the tiny model: 32 train and 8 valid parity pairs (GRPO and
    online pairs train on them)."""
    from engine.data.pairs import write_pairs_jsonl
    from tests.pairs import tokenized_pairs

    out = tmp_path_factory.mktemp("parity") / "parity.jsonl"
    write_pairs_jsonl(tokenized_pairs(tiny_model, 32, seed=0, task="parity"), out, "train")
    valid = write_pairs_jsonl(tokenized_pairs(tiny_model, 8, seed=1, task="parity"),
                              out.with_name("v.jsonl"), "valid")
    with out.open("a") as f:
        f.write(valid.read_text())
    return out
