"""Issue 36, items 1, 9, 12 and 2 (writer side): what Pomona writes again never takes a
user's file with it, and a dataset has one writer and is never replaced under a reader.

Each test puts a user's files where a re-run writes (best-adapter/, soup/, plots/, the
files beside a dataset or a synthetic file) and compares their SHA-256 before and after.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file
from typer.testing import CliRunner

from cli.main import app
from engine.host.outputs import RefusedOutput, lock_file, reading, replacing

pytestmark = pytest.mark.integration
USER_FILES = {"README.md": b"# my notes\n", "tokenizer.json": b'{"mine": true}\n',
              "extra/eval.txt": b"0.91\n"}


def plant(folder: Path) -> dict[str, str]:
    """Write the user's files into ``folder``; their SHA-256 by name."""
    for name, data in USER_FILES.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_bytes(data)
    return digests(folder)


def digests(folder: Path) -> dict[str, str]:
    return {n: hashlib.sha256((folder / n).read_bytes()).hexdigest() for n in USER_FILES}


def adapter(path: Path, seed: int) -> Path:
    """A small mlx-lm adapter directory (two modules, rank 2)."""
    rng = np.random.default_rng(seed)
    path.mkdir(parents=True)
    weights = {f"model.layers.{i}.self_attn.q_proj.lora_{ab}": rng.normal(size=shape)
               .astype(np.float32) for i in range(2) for ab, shape in (("a", (8, 2)),
                                                                         ("b", (2, 8)))}
    save_file(weights, str(path / "adapters.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps({
        "fine_tune_type": "lora", "num_layers": 2,
        "lora_parameters": {"rank": 2, "scale": 2.0, "dropout": 0.0}}))
    return path


def one_error(result, *needles: str) -> str:
    lines = result.output.strip().splitlines()
    assert result.exit_code == 2 and len(lines) == 1, result.output
    assert lines[0].startswith("error: ") and "Traceback" not in result.output
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


def test_leaderboard_export_keeps_user_files_in_best_adapter(tmp_path: Path) -> None:
    """Item 1: a second export replaced best-adapter/ whole, deleting the README.md and
    tokenizer.json a user added. Also the low item: best-adapter/ was mode 0700 (mkdtemp)."""
    from tasks.board.leaderboard import copy_best

    a, b = adapter(tmp_path / "t1", 1), adapter(tmp_path / "t2", 2)
    best = copy_best([{"trial_id": "t1", "rank": 1, "adapter": str(a)}], tmp_path)
    mine = plant(best)
    again = copy_best([{"trial_id": "t2", "rank": 1, "adapter": str(b)}], tmp_path)
    assert again == best and digests(best) == mine
    assert (best / "SOURCE").read_text() == "t2\n"
    for name in ("adapters.safetensors", "adapter_config.json"):
        assert (best / name).read_bytes() == (b / name).read_bytes()
    assert sorted(p.name for p in best.iterdir()) == sorted(
        ["SOURCE", "adapters.safetensors", "adapter_config.json", "README.md",
         "tokenizer.json", "extra"])  # no temporary left behind
    plain = tmp_path / "plain"
    plain.mkdir()  # what the umask gives any new folder
    assert best.stat().st_mode & 0o777 == plain.stat().st_mode & 0o777


def test_soup_rewrite_keeps_user_files(tmp_path: Path) -> None:
    """Item 1, soup/: a second soup replaces its own two files and nothing else."""
    from tasks.board.soup import make_soup

    adapters = [adapter(tmp_path / f"t{i}", i) for i in range(3)]
    soup = make_soup(adapters[:2], tmp_path / "soup")
    mine = plant(soup)
    make_soup(adapters[1:], soup)
    assert digests(soup) == mine
    assert json.loads((soup / "adapter_config.json").read_text())["pomona"]["soup_of"] == [
        str(a) for a in adapters[1:]]


def test_plots_rewrite_keeps_user_files(tmp_path: Path) -> None:
    """Item 1, plots/: a re-run writes curves.png again; a user's files there, even one
    under the old fixed temporary name (.curves.png.tmp.png), stay byte for byte."""
    from tasks.board.plots import curves_png

    run = tmp_path / "t1"
    run.mkdir()
    (run / "metrics.jsonl").write_text(
        "".join(json.dumps({"split": "train", "step": s, "loss": 1.0 / s}) + "\n"
                for s in (1, 2, 3)))
    rows = [{"trial_id": "t1", "adapter": str(run)}]
    plots = tmp_path / "plots"
    curves_png(rows, "val/loss", plots / "curves.png")
    mine = plant(plots)
    (plots / ".curves.png.tmp.png").write_bytes(b"user's")
    assert curves_png(rows, "val/loss", plots / "curves.png") == plots / "curves.png"
    assert digests(plots) == mine and (plots / ".curves.png.tmp.png").read_bytes() == b"user's"
    assert (plots / "curves.png").read_bytes()[:4] == b"\x89PNG"
    assert not [p for p in plots.iterdir() if p.name.endswith(".tmp")]


def test_synth_keeps_a_user_file_named_like_its_temporary(tmp_path: Path) -> None:
    """Item 9: `data synth --out U/x.jsonl` wrote over a user's U/x.jsonl.tmp."""
    out = tmp_path / "x.jsonl"
    user = tmp_path / "x.jsonl.tmp"
    user.write_bytes(b"my draft\n")
    result = CliRunner().invoke(app, ["data", "synth", "--out", str(out), "--n", "4"])
    assert result.exit_code == 0, result.output
    assert user.read_bytes() == b"my draft\n" and len(out.read_text().splitlines()) == 4
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x.jsonl", "x.jsonl.tmp"]


def tokenize(model: Path, src: Path, out: Path):
    return CliRunner().invoke(app, ["data", "tokenize", "--input", str(src), "--model",
                                    str(model), "--out", str(out)])


@pytest.fixture
def raw(tmp_path: Path) -> Path:
    from tasks.data.synthetic import synth_rows, write_rows

    return write_rows(list(synth_rows("sort", 40, seed=0)), tmp_path / "raw.jsonl")


@pytest.mark.parametrize("side", ["ds.rejects.jsonl", "ds.failed.rejects.jsonl"])
def test_tokenize_refuses_a_user_file_where_its_rejects_go(tiny_model: Path, raw: Path,
                                                           tmp_path: Path, side: str) -> None:
    """Item 9: `data tokenize --out U/ds` overwrote (or, after a good run, deleted) a user's
    U/ds.rejects.jsonl and U/ds.failed.rejects.jsonl. Now: one line, rc 2, file intact; a
    rejects file Pomona wrote is still replaced."""
    user = tmp_path / side
    user.write_bytes(b"my own notes, not rejects\n")
    one_error(tokenize(tiny_model, raw, tmp_path / "ds"), side, "did not write")
    assert user.read_bytes() == b"my own notes, not rejects\n"
    assert not (tmp_path / "ds").exists()
    user.write_text(json.dumps({"source": "a", "line": 1, "reason": "empty", "raw": {}}) + "\n")
    assert tokenize(tiny_model, raw, tmp_path / "ds").exit_code == 0


def hold(kind: str, folder: Path) -> subprocess.Popen:
    """Another process holding ``folder``'s dataset lock (``replacing`` or ``reading``)."""
    code = (f"import sys, time\nfrom engine.host.outputs import {kind}\nwith {kind}(sys.argv[1]):\n"
            "    print('held', flush=True)\n    time.sleep(60)\n")
    proc = subprocess.Popen([sys.executable, "-c", code, str(folder)], stdout=subprocess.PIPE,
                            text=True, cwd=Path(__file__).resolve().parents[1])
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_a_second_tokenize_into_one_out_is_refused_naming_the_holder(
        tiny_model: Path, raw: Path, tmp_path: Path) -> None:
    """Item 12: two `data tokenize` runs into one --out at once both exited 0 (the last
    won). The second is now refused in one line naming the first one's pid."""
    out = tmp_path / "ds"
    proc = hold("replacing", out)
    try:
        one_error(tokenize(tiny_model, raw, out), str(out), f"pid {proc.pid}", "writing")
        assert not (out / "manifest.json").exists()
    finally:
        proc.kill()
        proc.wait()
    assert tokenize(tiny_model, raw, out).exit_code == 0  # released when its holder died


def test_a_dataset_being_read_is_not_replaced(tiny_model: Path, raw: Path,
                                              tmp_path: Path) -> None:
    """Item 2, writer side: `data tokenize` and `data preprocess` replaced a dataset a
    sweep was reading. While a reader holds it they are refused in one line; a cache hit
    (nothing replaced) still answers; a reader is refused while a writer holds it."""
    from engine.data.pairs import load_pairs

    out = tmp_path / "ds"
    assert tokenize(tiny_model, raw, out).exit_code == 0
    before = (out / "manifest.json").read_bytes()
    other = raw.with_name("other.jsonl")
    other.write_text(raw.read_text().replace("Sort", "Order"))
    proc = hold("reading", out)
    try:
        one_error(tokenize(tiny_model, other, out), "reading it")
        one_error(CliRunner().invoke(app, ["data", "preprocess", str(out)]), "reading it")
        assert tokenize(tiny_model, raw, out).exit_code == 0  # a cache hit replaces nothing
        with reading(out):  # readers share
            pass
    finally:
        proc.kill()
        proc.wait()
    assert (out / "manifest.json").read_bytes() == before
    with replacing(out), pytest.raises(RefusedOutput, match="replacing this dataset"):
        load_pairs(out)
    assert len(load_pairs(out).train) > 0  # released
    assert lock_file(out).parent == out.parent  # beside the dataset: outlives its swap


def test_a_lock_file_of_a_users_is_refused(tmp_path: Path) -> None:
    """Item 9's rule for the lock beside a dataset: a user's file under its name is never
    written over."""
    lock = lock_file(tmp_path / "ds")
    lock.write_bytes(b"mine\n")
    with pytest.raises(RefusedOutput, match="not a lock file Pomona wrote"), \
            replacing(tmp_path / "ds"):
        pass
    assert lock.read_bytes() == b"mine\n"


def test_preprocess_out_link_says_it_is_a_link(tiny_model: Path, raw: Path,
                                               tmp_path: Path) -> None:
    """Low item: a `preprocess --out` symlink to a folder said "is not a folder"."""
    out = tmp_path / "ds"
    assert tokenize(tiny_model, raw, out).exit_code == 0
    (tmp_path / "target").mkdir()
    os.symlink(tmp_path / "target", tmp_path / "link")
    started = time.perf_counter()
    one_error(CliRunner().invoke(app, ["data", "preprocess", str(out), "--out",
                                       str(tmp_path / "link")]), "symbolic link", "target")
    assert time.perf_counter() - started < 30
