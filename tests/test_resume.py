"""Resume refusals: changed settings, a run folder, a LoRA rank change, steps below the
checkpoint (issue 36, items 3 and 4 and the interrupt/resume low items)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from engine.train.trainer import train
from tests.test_trainer import cfg

pytestmark = [pytest.mark.integration]


@pytest.fixture(scope="module")
def killed_run(tiny_model, tiny_data, tmp_path_factory) -> tuple[Path, object]:
    """A run of 2 steps with a checkpoint at step 2, as a kill after it leaves it."""
    out = tmp_path_factory.mktemp("resume") / "run"
    run = cfg(tiny_model, tiny_data, out, steps=2, checkpoint_every=2)
    train(run)
    return out, run.replace(steps=4, resume="auto")


@pytest.mark.parametrize("field,value", [("learning_rate", 5e-4), ("seed", 7),
                                         ("batch_size", 2), ("loss", "simpo"),
                                         ("lora_rank", 8)])
def test_resume_with_a_changed_setting_is_refused(killed_run, field, value) -> None:
    """Old code resumed with rc 0 under the new setting (only the seed was recorded)."""
    _, resume = killed_run
    with pytest.raises(ValueError) as err:
        train(resume.replace(**{field: value}))
    message = str(err.value)
    assert "\n" not in message and field in message
    assert repr(resume.to_dict()[field]) in message and repr(value) in message


def test_resume_may_extend_steps_and_accepts_a_run_folder(killed_run, tmp_path) -> None:
    """A run folder given to --resume resumed from its latest checkpoint (old code: a
    RuntimeError on optimizer.safetensors); more steps and another report cadence are fine."""
    import shutil

    out, resume = killed_run
    copy = tmp_path / "copy"
    shutil.copytree(out, copy)
    result = train(resume.replace(out=str(copy), resume=str(copy), report_every=2))
    assert result.steps == 4 and result.final


def test_resume_of_a_folder_without_checkpoints_is_one_line(killed_run, tmp_path) -> None:
    _, resume = killed_run
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="neither a checkpoint") as err:
        train(resume.replace(out=str(tmp_path / "o"), resume=str(tmp_path / "empty")))
    assert "\n" not in str(err.value)


def test_steps_below_the_checkpoint_are_refused(killed_run) -> None:
    """Old code: rc 0 with an empty summary."""
    _, resume = killed_run
    with pytest.raises(ValueError, match="below the checkpoint's step 2"):
        train(resume.replace(steps=1))


def test_cli_rank_change_on_resume_is_one_line(killed_run) -> None:
    out, resume = killed_run
    proc = subprocess.run(
        [sys.executable, "-m", "engine", "train", "--model", resume.model, "--data",
         resume.data, "--out", str(out), "--steps", "4", "--batch-size", "4",
         "--learning-rate", "1e-3", "--lora-scale", "2.0", "--report-every", "1",
         "--val-every", "0", "--checkpoint-every", "2", "--lora-rank", "16",
         "--resume", "auto"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error")]
    assert len(errors) == 1 and "lora_rank" in errors[0] and "Traceback" not in proc.stderr


def test_sigint_prints_the_step_to_resume_from(killed_run, monkeypatch, capsys) -> None:
    """Old code: exit 130 with a traceback and no hint."""
    import engine.train.trainer
    from engine.cli import main as engine_main

    out, resume = killed_run

    def interrupted(*_a, **_k):
        raise KeyboardInterrupt

    monkeypatch.setattr(engine.train.trainer, "train", interrupted)
    rc = engine_main(["train", "--model", resume.model, "--data", resume.data, "--out", str(out)])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 130 and "resume from step 2" in err[-1] and "--resume auto" in err[-1]


@pytest.mark.parametrize("kw,needle", [
    ({"steps": 10**20}, "steps=100000000000000000000: too large"),
    ({"loss": "dpo", "dpo_loss_type": "ipo", "dpo_label_smoothing": 0.1}, "ipo: it has no label"),
])
def test_silently_ignored_or_absurd_values_are_refused(kw, needle) -> None:
    from engine.settings.config import TrainConfig

    with pytest.raises(ValueError, match=needle):
        TrainConfig().replace(model="m", data="d", **kw).validate()


def test_ignored_options_are_warned(tiny_model, tiny_data, tmp_path, caplog) -> None:
    """A reference file with SFT and a warmup past the steps were ignored in silence."""
    import logging

    refs = tmp_path / "refs.parquet"
    refs.write_bytes(b"")
    with caplog.at_level(logging.WARNING):
        train(cfg(tiny_model, tiny_data, tmp_path / "run", loss="sft", steps=1,
                  warmup_steps=5, reference_logps=str(refs)))
    assert "is not read: loss sft" in caplog.text and "warmup_steps=5" in caplog.text


@pytest.mark.parametrize("kw,needle", [({"lora_layers": 100}, "has 4 blocks"),
                                       ({"lora_rank": 1000000}, "above .* hidden size 64")])
def test_lora_settings_past_the_model_are_refused(tiny_model, tiny_data, tmp_path, kw,
                                                  needle) -> None:
    with pytest.raises(ValueError, match=needle):
        train(cfg(tiny_model, tiny_data, tmp_path / "run", **kw))
