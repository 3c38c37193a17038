"""Issue 67 (round 5), cases 1, 2, 6 and 7: an adapter is whole or refused, and an export
never replaces a file it did not write.

Through the verbs' own entry point (``engine.cli.main``, what ``python -m engine`` and
``pomona export``/``score`` run), in process: each refusal is one line on stderr, exit 2,
and writes nothing.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import mlx.core as mx
import pytest

from engine.cli import main
from engine.model import export as export_module
from engine.model.adapters import ADAPTER_FILE, CONFIG_FILE
from engine.model.export import export
from engine.model.gguf_export import exported_here
from tests.test_gguf_export import trained

pytestmark = pytest.mark.integration


@pytest.fixture
def adapter(tmp_path: Path, tiny_model: Path) -> Path:
    return trained(tiny_model, tmp_path / "adapter")


def refused(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    capsys.readouterr()
    rc = main(list(argv))
    lines = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(lines) == 1, lines
    return lines[0]


def verbs(adapter: Path, tiny_model: Path, tiny_data: Path, out: Path) -> list[list[str]]:
    """The export and the score of ``adapter``: both must refuse it alike."""
    return [["export", str(adapter), "--gguf", str(out / "x.gguf")],
            ["score", "--model", str(tiny_model), "--adapter", str(adapter), "--data",
             str(tiny_data), "--out", str(out / "s.jsonl")]]


def drop_tensor(adapter: Path, name: str | None = None) -> str:
    weights = mx.load(str(adapter / ADAPTER_FILE))
    name = name or sorted(weights)[-1]
    mx.save_safetensors(str(adapter / ADAPTER_FILE), {k: v for k, v in weights.items()
                                                      if k != name})
    return name


def test_an_adapter_missing_a_tensor_or_read_as_dora_is_refused(
        adapter: Path, tiny_model: Path, tiny_data: Path, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    """Case 2: mlx-lm loads adapters with strict=False, so a missing factor stayed its random
    init (two exports of one adapter differed, exit 0); DoRA over LoRA tensors lacks ``m``."""
    config = json.loads((adapter / CONFIG_FILE).read_text())
    (adapter / CONFIG_FILE).write_text(json.dumps({**config, "fine_tune_type": "dora"}))
    for argv in verbs(adapter, tiny_model, tiny_data, tmp_path):
        line = refused(capsys, *argv)
        assert line.endswith(".m); it is not a whole adapter for this config. Train or copy "
                             "it again") or ".m)" in line, line
    (adapter / CONFIG_FILE).write_text(json.dumps(config))
    name = drop_tensor(adapter)
    for argv in verbs(adapter, tiny_model, tiny_data, tmp_path):
        line = refused(capsys, *argv)
        assert name in line and "lacks 1 of" in line, line
    assert not [p for p in tmp_path.iterdir() if p.name not in {"adapter"}]


def test_a_diverged_adapter_or_scale_is_refused(adapter: Path, tiny_model: Path,
                                               tiny_data: Path, tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    """Case 6: NaN in a factor exported (its import then called the GGUF damaged) and scored
    0.000 on every row with exit 0; so did a NaN ``scale``."""
    weights = mx.load(str(adapter / ADAPTER_FILE))
    name = sorted(weights)[0]
    bad = {**weights, name: weights[name] * float("nan")}
    mx.save_safetensors(str(adapter / ADAPTER_FILE), bad)
    for argv in verbs(adapter, tiny_model, tiny_data, tmp_path):
        assert name in refused(capsys, *argv)
    mx.save_safetensors(str(adapter / ADAPTER_FILE), weights)
    config = json.loads((adapter / CONFIG_FILE).read_text())
    config["lora_parameters"]["scale"] = float("nan")
    (adapter / CONFIG_FILE).write_text(json.dumps(config))  # json writes NaN, reads it back
    for argv in verbs(adapter, tiny_model, tiny_data, tmp_path):
        assert "scale" in refused(capsys, *argv)
    assert not list(tmp_path.glob("*.gguf")) and not list(tmp_path.glob("*.jsonl"))


def test_a_cut_or_garbage_adapter_file_and_a_bad_model_field_are_one_line(
        adapter: Path, tiny_model: Path, tiny_data: Path, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    """Case 7: a truncated safetensors (``invalid data offsets``), garbage (``Invalid json
    header length``) and ``"model": 5`` gave 75-78-line tracebacks."""
    data = (adapter / ADAPTER_FILE).read_bytes()
    for broken in (data[: len(data) // 2], b"\x00garbage" * 8):
        (adapter / ADAPTER_FILE).write_bytes(broken)
        for argv in verbs(adapter, tiny_model, tiny_data, tmp_path):
            assert "not a readable safetensors file" in refused(capsys, *argv)
    (adapter / ADAPTER_FILE).write_bytes(data)
    config = json.loads((adapter / CONFIG_FILE).read_text())
    (adapter / CONFIG_FILE).write_text(json.dumps({**config, "model": 5}))
    assert '"model" is 5' in refused(capsys, *verbs(adapter, tiny_model, tiny_data,
                                                    tmp_path)[0])
    sweep = tmp_path / "sweep"  # a sweep not ranked yet: no best-adapter/
    sweep.mkdir()
    (sweep / "results.parquet").write_bytes(b"")
    assert "run `pomona leaderboard" in refused(capsys, "export", str(sweep), "--gguf",
                                                 str(tmp_path / "z.gguf"))
    assert "--model /nonexistent: no such" in refused(
        capsys, "export", str(adapter), "--gguf", str(tmp_path / "y.gguf"), "--model",
        "/nonexistent")


def test_an_export_never_replaces_a_file_that_appeared_while_it_ran(
        adapter: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """Case 1: the export checked its file absent, fused (minutes on a real model), then
    ``os.replace``d over whatever was there by then: of two exports to one ``--gguf`` both
    said exported. A pipeline's re-export of its own file is the one replace."""
    out = tmp_path / "out.gguf"
    real_fuse = export_module.fuse

    def fuse_then_another_export(base, adapter):  # a second export finishes first
        fused = real_fuse(base, adapter)
        out.write_bytes(b"the other export's bytes")
        return fused

    monkeypatch.setattr(export_module, "fuse", fuse_then_another_export)
    line = refused(capsys, "export", str(adapter), "--gguf", str(out))
    assert "appeared there while this export ran" in line, line
    assert out.read_bytes() == b"the other export's bytes"
    assert [p.name for p in tmp_path.iterdir()] != [] and not list(tmp_path.glob(".*tmp*"))
    out.unlink()
    monkeypatch.setattr(export_module, "fuse", real_fuse)
    assert export(adapter, out, kind="q8_0") == out and exported_here(out)
    assert export(adapter, out, kind="f16", ours=exported_here) == out  # the pipeline's own
    # the low cases: the second export of the CLI names what the file is; a file as a folder
    assert "an earlier export wrote it" in refused(capsys, "export", str(adapter), "--gguf",
                                                   str(out))
    assert f"{out} is a file, not a folder" in refused(capsys, "export", str(adapter),
                                                       "--gguf", str(out / "x.gguf"))
    empty = tmp_path / "empty.gguf"  # made by the user to be written: the check lets it in
    empty.touch()
    assert export(adapter, empty, kind="q8_0") == empty and exported_here(empty)


def test_a_killed_exports_temporaries_are_cleaned_and_a_live_ones_kept(
        adapter: Path, tmp_path: Path) -> None:
    """Low case: SIGKILL mid-export left ``.NAME.PID-….tmp.gguf`` (a whole model's bytes)
    that nothing removed. A dead pid's old one goes; this live process's stays, and so
    does another host's (its pid means nothing here)."""
    from engine.host.atomic import HOST

    out = tmp_path / "out.gguf"
    dead = 2**22 + 17  # above Linux's default pid_max: no such process
    stale = tmp_path / f".out.gguf.{dead}-0badcafe{HOST}.tmp.gguf"
    live = tmp_path / f".out.gguf.{os.getpid()}-0badcafe{HOST}.tmp.gguf"
    elsewhere = tmp_path / f".out.gguf.{dead}-0badcafe{'0' * 6}.tmp.gguf"  # another host's
    for tmp in (stale, live, elsewhere):
        tmp.write_bytes(b"half a model")
        os.utime(tmp, (1, 1))
    export(adapter, out, kind="q8_0")
    assert not stale.exists() and live.exists() and elsewhere.exists() and exported_here(out)
