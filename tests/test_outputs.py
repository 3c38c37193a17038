"""Issue 28, items 1-4, 7 and part of 11: no verb deletes or overwrites what it did not write.

Every verb that takes an output path is run, through the real CLI, at a folder of a user's
own files (several under names Pomona writes) and, where it writes a file, at a user's
file: each must refuse with one line and leave every byte as it was. Then the cases the
issue found: a score written over its own input, the demo replacing a model it did not
make, two writers in one folder, a read-only sweep folder and a full disk. Each test
failed on 30513f4 (its docstring says how).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from engine.host.outputs import MARK, claim
from tests.test_reliability_cli import one_error, pomona

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[1]
SAMPLE = ROOT / "datasets" / "sample" / "explicit.jsonl"


def user_folder(path: Path) -> dict[str, bytes]:
    """A folder of a user's own files, most under names some verb writes; its bytes."""
    files = {"notes.txt": b"my thesis\n", "summary.json": b'{"mine": true}\n',
             "metrics.jsonl": b'{"epoch": 1, "loss": 0.5}\n', "checkpoints/keep.bin": b"\0\1",
             "leaderboard.md": b"# my own board\n", "model/config.json": b'{"mine": 1}\n',
             "model/weights.bin": b"\7" * 64}
    for name, data in files.items():
        (path / name).parent.mkdir(parents=True, exist_ok=True)
        (path / name).write_bytes(data)
    pq.write_table(pa.table({"a": [1, 2]}), path / "results.parquet")
    return tree(path)


def tree(path: Path) -> dict[str, bytes]:
    """Every file under ``path`` (hidden ones too), by relative path."""
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*"))
            if p.is_file()}


def spec_file(path: Path, model: Path, data: Path) -> Path:
    path.write_text(f"name: s\nmodel: {model}\ndata: {data}\n"
                    "grid: {learning_rate: [1.0e-4]}\nfixed: {steps: 1, batch_size: 2}\n")
    return path


@pytest.fixture(scope="module")
def dataset(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tokenized Pomona dataset directory (the sample explicit pairs, tiny model)."""
    from tasks.data.tokenize import tokenize_dataset

    out = tmp_path_factory.mktemp("ds") / "tok"
    tokenize_dataset(SAMPLE, str(tiny_model), out)
    return out


VERBS = ("model init", "model init --overwrite", "model import", "model fetch", "data synth",
         "data tokenize", "data preprocess", "train", "score", "sweep", "pipeline", "demo",
         "leaderboard")


def gguf_file(tmp: Path) -> Path:
    """A file named like a GGUF (the output is refused before it is read)."""
    path = tmp / "model.gguf"
    path.write_bytes(b"GGUF")
    return path


def verb_args(verb: str, out: Path, model: Path, data: Path, dataset: Path, tmp: Path
              ) -> list[list[str]]:
    """The command lines of ``verb`` that write to folder ``out`` (or a user file in it)."""
    spec = str(spec_file(tmp / "spec.yaml", model, data))
    m, d = str(model), str(data)
    return {
        "model init": [["model", "init", "--out", str(out)]],
        "model init --overwrite": [["model", "init", "--out", str(out), "--overwrite"]],
        "model import": [["model", "import", str(gguf_file(tmp)), "--out", str(out)]],
        "model fetch": [["model", "fetch", "smollm2", "--out", str(out)]],  # before a download
        "data synth": [["data", "synth", "--out", str(out)],
                       ["data", "synth", "--out", str(out / "metrics.jsonl")]],
        "data tokenize": [["data", "tokenize", "--input", str(SAMPLE), "--model", m, "--out",
                           str(out)]],
        "data preprocess": [["data", "preprocess", str(dataset), "--out", str(out)]],
        "train": [["train", "--model", m, "--data", d, "--out", str(out), "--steps", "1"]],
        "score": [["score", "--model", m, "--data", d, "--out", str(out)],
                  ["score", "--model", m, "--data", d, "--out", str(out / "metrics.jsonl")]],
        "sweep": [["sweep", spec, "--out", str(out)]],
        "pipeline": [["pipeline", str(SAMPLE), m, spec, "--out", str(out)]],
        "demo": [["demo", "--out", str(out)]],
        "leaderboard": [["leaderboard", str(out), "--model", m, "--data", d]],
    }[verb]


@pytest.mark.parametrize("verb", VERBS)
def test_a_folder_of_user_files_survives_every_verb(verb: str, tiny_model: Path,
                                                    tiny_data: Path, dataset: Path,
                                                    tmp_path: Path) -> None:
    """Items 2-4 and the rule under them, per verb. On 30513f4 `model init --overwrite`
    deleted the folder, `train` deleted checkpoints/ and overwrote summary.json and
    metrics.jsonl, `data synth` and `score` overwrote the user's file (and `score --out
    DIR` was a traceback), `sweep` and `leaderboard` read the user's results.parquet into
    tracebacks, `pipeline` wrote over leaderboard.md and `demo` replaced model/."""
    out = tmp_path / "mine"
    out.mkdir()
    before = user_folder(out)
    for args in verb_args(verb, out, tiny_model, tiny_data, dataset, tmp_path):
        line = one_error(*args)
        assert str(out) in line, line
    assert tree(out) == before


def test_score_never_writes_over_an_input(tiny_model: Path, tiny_data: Path, dataset: Path,
                                          tmp_path: Path) -> None:
    """Item 1: `score --out` equal to its --data file, or a shard inside the dataset, exited
    0 with the input overwritten by scores; and `score --out DIR` was a traceback
    (item 11). A score file it wrote is still replaced."""
    data = tmp_path / "pairs.jsonl"
    data.write_bytes(tiny_data.read_bytes())
    shard = dataset / "shard-00000.parquet"
    dataset_bytes = tree(dataset)
    m = str(tiny_model)
    assert "would replace the input" in one_error("score", "--model", m, "--data", str(data),
                                                  "--out", str(data))
    line = one_error("score", "--model", m, "--data", str(dataset), "--out", str(shard))
    assert "inside the input folder" in line, line
    assert "is a folder" in one_error("score", "--model", m, "--data", str(data), "--out",
                                      str(tmp_path))
    assert data.read_bytes() == tiny_data.read_bytes() and tree(dataset) == dataset_bytes
    scores = tmp_path / "scores.jsonl"
    for _ in range(2):  # the second replaces the first: a score file is Pomona's own
        code, _lines = pomona("score", "--model", m, "--data", str(data), "--out",
                              str(scores), "--split", "valid")
        assert code == 0 and len(scores.read_text().splitlines()) == 16


def test_demo_and_model_init_replace_only_models_pomona_made(tmp_path: Path) -> None:
    """Items 3 and 4: `demo --out DIR` replaced DIR/model without asking (init_model with
    overwrite=True), and `model init --overwrite` deleted any folder. Now a model without
    Pomona's mark, or one holding a user's file, is refused; a plain one of ours is not."""
    out = tmp_path / "demo"
    with claim(out, ("pipeline",)):  # a demo folder of Pomona's, holding a user's model
        pass
    (out / "model").mkdir()
    before = user_folder(out / "model")
    line = one_error("demo", "--out", str(out))
    assert str(out / "model") in line and "not a model Pomona made" in line, line
    assert tree(out / "model") == before
    ours = tmp_path / "ours"
    args = ("model", "init", "--out", str(ours), "--layers", "1", "--hidden", "32",
            "--vocab", "300")
    assert pomona(*args)[0] == 0 and pomona(*args, "--overwrite")[0] == 0
    (ours / "notes.txt").write_text("mine")
    assert "notes.txt" in one_error(*args, "--overwrite")
    assert (ours / "notes.txt").read_text() == "mine"


def test_a_run_of_an_earlier_version_is_still_resumed(tiny_model: Path, tiny_data: Path,
                                                      tmp_path: Path) -> None:
    """The rule keeps runs written before the mark: a run folder without ``.pomona`` (as
    30513f4 wrote it) resumes, and a user's note beside it is left alone. Would catch: a
    mark so strict that an old run, or a sweep's old trial folder, is refused."""
    out = tmp_path / "run"
    base = ("train", "--model", str(tiny_model), "--data", str(tiny_data), "--out", str(out),
            "--batch-size", "2", "--checkpoint-every", "1", "--val-every", "0")
    assert pomona(*base, "--steps", "1")[0] == 0
    (out / MARK).unlink()
    (out / "notes.txt").write_text("mine")
    assert pomona(*base, "--steps", "2", "--resume", "auto")[0] == 0
    assert (out / "notes.txt").read_text() == "mine"
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_0000001",
                                                                       "step_0000002"]


def test_a_second_train_into_a_busy_out_is_refused_naming_the_holder(
        tiny_model: Path, tiny_data: Path, tmp_path: Path) -> None:
    """Item 7: two writers into one --out both ran, their steps interleaved in
    metrics.jsonl. On 30513f4 the second train exited 0."""
    out = tmp_path / "run"
    holder = subprocess.Popen(
        [sys.executable, "-m", "engine", "train", "--model", str(tiny_model), "--data",
         str(tiny_data), "--out", str(out), "--steps", "100000", "--batch-size", "2"],
        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 120
        while not (out / "metrics.jsonl").exists():  # training: it holds the folder
            assert holder.poll() is None and time.time() < deadline, "holder never trained"
            time.sleep(0.2)
        line = one_error("train", "--model", str(tiny_model), "--data", str(tiny_data),
                         "--out", str(out), "--steps", "1")
        assert f"pid {holder.pid}" in line and str(out) in line, line
    finally:
        holder.kill()
        holder.wait()


def test_a_second_sweep_is_refused_before_ray_and_a_dead_holder_frees_the_folder(
        tiny_model: Path, tiny_data: Path, tmp_path: Path, no_ray: None) -> None:
    """Item 7: two sweeps into one --out both exited 0 with duplicate steps. The lock is
    the OS's: a killed holder (no clean exit) leaves the folder free."""
    out, spec = tmp_path / "sweep", spec_file(tmp_path / "s.yaml", tiny_model, tiny_data)
    code = f"from engine.host.outputs import claim\nwith claim({str(out)!r}, ('sweep',)):\n" \
           "    print('held', flush=True)\n    input()\n"
    holder = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        line = one_error("sweep", str(spec), "--out", str(out))
        assert f"pid {holder.pid}" in line and str(out) in line, line
        assert not ray_started()
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    with claim(out, ("sweep",)):  # no stale lock after the kill
        pass


def ray_started() -> bool:
    return "ray" in sys.modules and sys.modules["ray"].is_initialized()


@pytest.fixture
def no_ray() -> None:
    """No Ray in this process before the test (the worker's shared one, conftest.py's
    ray_cluster, is shut down; the next module using it starts it again)."""
    if ray_started():
        sys.modules["ray"].shutdown()


def test_a_sweep_on_a_read_only_out_is_refused_before_any_trial(tiny_model: Path,
                                                                tiny_data: Path,
                                                                tmp_path: Path,
                                                                no_ray: None) -> None:
    """Item 11: a read-only --out was found only after every trial ran (a traceback).
    As root, mode bits stop nothing, so the folder is one the kernel refuses to anyone."""
    if os.geteuid() == 0:
        if not Path("/sys/kernel").is_dir():
            pytest.skip("root, and no sysfs to be refused by")
        out = Path("/sys/kernel/pomona-sweep")
    else:
        out = tmp_path / "ro"
        out.mkdir()
        out.chmod(0o555)
    spec = spec_file(tmp_path / "s.yaml", tiny_model, tiny_data)
    line = one_error("sweep", str(spec), "--out", str(out))
    assert str(out) in line and "cannot write" in line, line
    assert not ray_started()


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs Linux's /dev/full")
def test_train_on_a_full_disk_is_one_line_and_leaves_no_temporary(
        tiny_model: Path, tiny_data: Path, tmp_path: Path) -> None:
    """Item 11: a full disk while saving was a traceback (MLX's RuntimeError) or an error
    without the file's name, and the temporary file stayed. The disk is made full for one
    temporary name: it points at /dev/full, where every write fails with ENOSPC."""
    out = tmp_path / "run"
    args = ("train", "--model", str(tiny_model), "--data", str(tiny_data), "--out", str(out),
            "--steps", "1", "--batch-size", "2", "--val-every", "0")
    assert pomona(*args)[0] == 0
    for final, tmp in (("adapters.safetensors", ".adapters.safetensors.tmp.safetensors"),
                       ("summary.json", ".summary.json.tmp")):
        (out / tmp).symlink_to("/dev/full")
        code, lines = pomona(*args)  # the steps' progress lines, then the error's one
        errors = [x for x in lines if "error" in x]
        assert code == 2 and errors == lines[-1:], lines
        assert str(out / final) in errors[0], errors
        assert not [p.name for p in out.iterdir() if ".tmp" in p.name]


@pytest.mark.unit
def test_a_holder_caught_before_its_mark_is_written_is_still_named(tmp_path: Path) -> None:
    """Issue 67, low: `pomona track` run twice at once said "pid unknown": the second read
    the mark in the moment the first had truncated it, before writing its pid."""
    import fcntl
    import json
    import threading

    from engine.host.outputs import MARK, RefusedOutput, claim

    out = tmp_path / "run"
    out.mkdir()
    fd = os.open(out / MARK, os.O_RDWR | os.O_CREAT, 0o644)  # the first holder: locked,
    fcntl.flock(fd, fcntl.LOCK_EX)  # its mark still empty
    writer = threading.Timer(0.05, lambda: os.pwrite(
        fd, json.dumps({"kind": "run", "pid": 4242}).encode(), 0))
    writer.start()
    try:
        with pytest.raises(RefusedOutput, match=r"another Pomona process \(pid 4242\)"), \
                claim(out, ("run",)):
            pass
    finally:
        writer.join()
        os.close(fd)


def test_a_claim_that_fails_before_writing_leaves_no_folder_it_made(tmp_path: Path) -> None:
    """A run refused after its claim (a verifier failing once the model loaded) left an
    empty folder holding only the mark. A folder the claim made goes again where nothing
    else was written; a folder that was there, a file written, or success keep it."""
    def failing(out: Path, write: bool = False) -> None:
        with pytest.raises(RuntimeError), claim(out, ("run",)):
            if write:
                (out / "metrics.jsonl").write_text("{}\n")
            raise RuntimeError("refused")

    failing(tmp_path / "new" / "run")
    assert not (tmp_path / "new" / "run").exists()
    (tmp_path / "mine").mkdir()
    failing(tmp_path / "mine")
    assert (tmp_path / "mine").is_dir()
    failing(tmp_path / "wrote", write=True)
    assert (tmp_path / "wrote" / "metrics.jsonl").exists()
    with claim(tmp_path / "ok", ("run",)):
        pass
    assert (tmp_path / "ok" / MARK).exists()
