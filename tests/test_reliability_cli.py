"""Issue 14's acceptance through the real CLI: a user's mistake in `pomona train`, `pomona
sweep` or `pomona pipeline` exits 2 with one line naming the file and key, never a
traceback, and the sweep refuses before any Ray or Prefect start-up. Each verb runs one
case as its own process, as a user runs it; the other cases run the same typer app in
this process."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from cli.main import app

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[1]


def pomona(*args: str, process: bool = False) -> tuple[int, list[str]]:
    """Exit code and non-blank output lines of ``pomona ARGS``: in this process through
    typer's CliRunner (~1 s less a case), or, with ``process``, as a user runs it."""
    env = {"RAY_ADDRESS": "", "PREFECT_API_URL": ""}
    if process:
        proc = subprocess.run([sys.executable, "-m", "cli.main", *args], capture_output=True,
                              text=True, timeout=180, cwd=ROOT, env={**os.environ, **env})
        code, out = proc.returncode, proc.stdout + proc.stderr
    else:
        result = CliRunner().invoke(app, list(args), env=env)
        code, out = result.exit_code, result.output
        assert result.exception is None or isinstance(result.exception, SystemExit), out
    assert "Traceback" not in out, out
    return code, [line for line in out.splitlines() if line.strip()]


def one_error(*args: str, process: bool = False) -> str:
    code, lines = pomona(*args, process=process)
    assert code == 2 and len(lines) == 1, (code, lines)
    return lines[0]


def test_train_config_mistakes_are_one_line(tmp_path: Path) -> None:
    """A Python tag or malformed YAML in --config was a traceback; NaN, inf and negative
    settings started training (NaN crashed at step 2). Would catch: any of them again."""
    config = tmp_path / "run.yaml"
    cases = {"x: !!python/object/apply:os.system [echo hi]\n": "not valid YAML (line 1)",
             "steps: [1\n": "not valid YAML",
             "learning_rate: .nan\n": "learning_rate=nan: must be a finite number",
             "grad_clip: -1\n": "grad_clip=-1.0: must be >= 0",
             "lora_rank: eight\n": "lora_rank='eight': expected an integer"}
    for text, message in cases.items():
        config.write_text(text)
        line = one_error("train", "--config", str(config), "--model", "m", "--data", "d")
        assert f"{config}: {message}" in line, line
    for flag, value, message in [("--learning-rate", "nan", "learning_rate=nan"),
                                 ("--learning-rate", "-1e-4", "learning_rate=-0.0001"),
                                 ("--weight-decay", "-0.5", "weight_decay=-0.5"),
                                 ("--grad-clip", "inf", "grad_clip=inf")]:
        line = one_error("train", "--model", "m", "--data", "d", f"{flag}={value}",
                         process=flag == "--grad-clip")  # one as a user runs it
        assert message in line, line


def test_flags_merge_over_the_config_before_it_is_checked(tmp_path: Path) -> None:
    """Issue 52, case 16: kto_beta in --config with --loss kto on the command line was
    refused as "this run's loss is orpo": the file was checked before the flags, which
    the help says override it, were merged."""
    from engine.cli import config_from_args

    config = tmp_path / "kto.yaml"
    config.write_text("kto_beta: 0.25\nsteps: 3\n")
    cfg = config_from_args(["--config", str(config), "--loss", "kto", "--model", "m"])
    assert (cfg.loss.kind, cfg.loss.kto_beta, cfg.steps) == ("kto", 0.25, 3)
    line = one_error("train", "--config", str(config), "--loss", "kto", "--model", "m",
                     "--data", str(tmp_path / "no-data"))
    assert "this run's loss" not in line and "no-data: no such dataset" in line, line
    line = one_error("train", "--config", str(config), "--loss", "cpo", "--model", "m",
                     "--data", "d")
    assert f"{config}: kto_beta: a setting of loss kto, and this run's loss is cpo" in line


def test_sweep_spec_mistakes_are_one_line_before_ray_starts(tmp_path: Path) -> None:
    """The issue's grid [3.0e-4, .nan, 1e-4] ran every trial and then lost them all with a
    traceback; a missing model path let every trial fail one by one. Would catch: a spec
    mistake that is not refused, with its file and key, before anything starts."""
    spec = tmp_path / "sweep.yaml"
    model, data = tmp_path / "model", tmp_path / "pairs.jsonl"
    model.mkdir()
    data.write_text('{"prompt_ids": [1], "chosen_ids": [2], "rejected_ids": [3]}\n')
    head = f"name: s\nmodel: {model}\ndata: {data}\n"
    cases = {head + "grid: {learning_rate: [3.0e-4, .nan, 1e-4]}\n":
             "grid.learning_rate=nan: must be a finite number",
             head + "fixed: {weight_decay: -1e-2}\n": "fixed.weight_decay=-0.01: must be >= 0",
             head + "x: !!python/object/apply:os.system [echo hi]\n": "not valid YAML (line 4)",
             head + "grid: {seed: [0, 1}\n": "not valid YAML",
             f"name: s\nmodel: {tmp_path}/nope/model\ndata: {data}\n": "model not found",
             f"name: s\nmodel: {model}\ndata: {tmp_path}/nope.jsonl\n": "nope.jsonl"}
    for i, (text, message) in enumerate(cases.items()):
        spec.write_text(text)
        line = one_error("sweep", str(spec), "--out", str(tmp_path / "out"), process=i == 0)
        assert message in line and (str(spec) in line or "not found" in line), line
    assert not (tmp_path / "out").exists()
    assert str(tmp_path) in one_error("sweep", str(tmp_path))  # a directory, not a spec
    assert "no.yaml" in one_error("sweep", str(tmp_path / "no.yaml"))  # not there at all


def test_pipeline_input_mistakes_are_one_line(tmp_path: Path) -> None:
    """A bad spec, raw path or model path failed inside the Prefect flow run, with its
    traceback. Would catch: pipeline inputs not checked before the flow starts."""
    raw, model, spec = tmp_path / "raw.jsonl", tmp_path / "model", tmp_path / "spec.yaml"
    raw.write_text("{}\n")
    model.mkdir()
    spec.write_text("name: p\nmodel: m\ndata: d\ngrid: {learning_rate: [1e-4, .inf]}\n")
    line = one_error("pipeline", str(raw), str(model), str(spec), "--out", str(tmp_path / "o"),
                     process=True)
    assert f"{spec}: grid.learning_rate=inf" in line, line
    spec.write_text("name: p\nmodel: m\ndata: d\ngrid: {learning_rate: [1e-4]}\n")
    line = one_error("pipeline", str(tmp_path / "none.jsonl"), str(model), str(spec))
    assert "none.jsonl" in line, line
    line = one_error("pipeline", str(raw), str(tmp_path / "no-model"), str(spec))
    assert "no-model" in line, line
    line = one_error("pipeline", str(raw), str(model), str(spec), "--generations", "-1")
    assert line.startswith("error: --generations -1: expected 0"), line
    spec.write_text("name: p\nmodel: m\ndata: d\nevaluation: {scorers: [python:no_mod:f]}\n")
    line = one_error("pipeline", str(raw), str(model), str(spec))
    assert "scorer python:no_mod:f: cannot import it" in line, line


# Issue 28 --------------------------------------------------------------------------------

def test_settings_that_train_nothing_or_the_wrong_thing_are_refused() -> None:
    """Item 10: lr 0, simpo_beta 0 (gradient 0), lora_scale 0, lora_layers 0 (adapts every
    layer) or -2, pad_multiple -2, min_lr_ratio 1.5 (the lr climbs past its peak) all
    trained. Would catch: any of them accepted again."""
    for flag, message in [("--learning-rate=0", "learning_rate=0.0: must be > 0"),
                          ("--loss=simpo --simpo-beta=0", "simpo_beta=0.0: must be > 0"),
                          ("--lora-scale=0", "lora_scale=0.0: must be > 0"),
                          ("--lora-layers=0", "lora_layers=0: adapt the last N >= 1"),
                          ("--lora-layers=-2", "lora_layers=-2: adapt the last N >= 1"),
                          ("--pad-multiple=-2", "pad_multiple=-2: must be -1 (auto) or >= 0"),
                          ("--min-lr-ratio=1.5", "min_lr_ratio=1.5: must be in [0, 1]"),
                          # issue 67: 1e-300 is zero in float32 and trained nothing
                          ("--learning-rate=1e-300", "learning_rate=1e-300: below float32")]:
        line = one_error("train", "--model", "m", "--data", "d", *flag.split())
        assert message in line, (flag, line)


def test_grid_values_that_are_one_number_are_refused(tmp_path: Path) -> None:
    """Item 10: grid [8, 8.0, "8"] gave duplicate trial ids (one trial run twice, into one
    folder). Would catch: values equal after coercion accepted as separate trials."""
    from tasks.sweep.spec_file import parse_spec
    from tasks.sweep.sweep_spec import SpecError

    with pytest.raises(SpecError, match=r"grid.lora_rank: 8.0 repeats 8 \(both are 8"):
        parse_spec({"name": "s", "model": "m", "data": "d",
                    "grid": {"lora_rank": [8, 8.0, "8"]}})
    with pytest.raises(SpecError, match=r"grid.learning_rate: '1e-4' repeats 0.0001"):
        parse_spec({"name": "s", "model": "m", "data": "d",
                    "grid": {"learning_rate": [1e-4, "1e-4"]}})


def test_leaderboard_without_a_sweep_is_one_line(tmp_path: Path) -> None:
    """Item 11: `pomona leaderboard` on a missing folder (or one with no results) was a
    traceback from inside a Prefect flow. Would catch: the flow started before the check."""
    data = tmp_path / "pairs.jsonl"
    data.write_text('{"prompt_ids": [1], "chosen_ids": [2], "rejected_ids": [3], '
                    '"split": "valid"}\n')
    for folder in (tmp_path / "missing", tmp_path):
        line = one_error("leaderboard", str(folder), "--model", str(tmp_path), "--data",
                         str(data))
        assert str(folder) in line and ("no such folder" in line or "results.parquet" in line)


def test_an_address_that_is_no_ray_address_is_one_line(tmp_path: Path) -> None:
    """Item 11: `--address garbage` was Ray's ValueError traceback (sweep, pipeline,
    leaderboard, demo). Would catch: any verb handing it to ray.init unchecked."""
    spec = tmp_path / "s.yaml"
    spec.write_text(f"name: s\nmodel: {tmp_path}\ndata: {spec}\n")
    for args in (["sweep", str(spec)], ["demo", "--out", str(tmp_path / "demo")],
                 ["pipeline", str(spec), str(tmp_path), str(spec)],
                 ["leaderboard", str(tmp_path), "--model", "m", "--data", "d"]):
        line = one_error(*args, "--address", "garbage")
        assert "--address 'garbage': expected auto or a Ray head's HOST:PORT" in line, line
    from tasks.nodes.ray_session import check_address

    for fine in (None, "auto", "10.0.0.5:6379", "ray://head:10001", "[::1]:6379"):
        check_address(fine)


def test_score_batch_size_zero_is_one_line(tiny_model: Path, tiny_data: Path,
                                           tmp_path: Path) -> None:
    """Item 11: `score --batch-size 0` loaded the model and the data, then died in a
    traceback (range() arg 3 must not be zero). Would catch: the size not checked."""
    line = one_error("score", "--model", str(tiny_model), "--data", str(tiny_data), "--out",
                     str(tmp_path / "s.jsonl"), "--batch-size", "0")
    assert "--batch-size 0: must be at least 1" in line, line


def test_ui_ports_no_server_can_be_told_are_one_line(monkeypatch) -> None:
    """Item 11: `ui --port 99999` was a traceback; `--port 0` advertised port 0 to the UI.
    Would catch: either port handed to the server."""
    def execv(path: str, argv: list[str]) -> None:  # the server would replace this process
        raise AssertionError(f"started {argv}")

    monkeypatch.setattr(os, "execv", execv)
    for port in ("99999", "0", "-1"):
        line = one_error("ui", "--port", port)
        assert f"--port {port}: choose a port from 1 to 65535" in line, line


def test_training_that_goes_non_finite_is_one_line(monkeypatch) -> None:
    """Item 11: a run ending in NonFiniteLoss printed its traceback with exit 1. Would
    catch: the CLI letting it through."""
    import engine.train.trainer as trainer
    from engine.train.steps import NonFiniteLoss

    def diverges(cfg: object, callbacks: object = ()) -> None:
        raise NonFiniteLoss("step 3: loss nan on pairs ['a', 'b']")

    monkeypatch.setattr(trainer, "train", diverges)
    line = one_error("train", "--model", "m", "--data", "d")
    assert line.startswith("error: step 3: loss nan on pairs ['a', 'b']; nothing saved"), line


# Issue 67 --------------------------------------------------------------------------------

def test_a_key_twice_an_empty_spec_and_a_pipelines_own_keys(tmp_path: Path,
                                                           tiny_model: Path) -> None:
    """Cases 13 and 14 and a low one: `pomona train --config` took the last of a key given
    twice (the sweep spec refused the same file); `pomona pipeline` required `model:` and
    `data:`, which its help says it replaces; an empty spec said "expected a mapping, got
    NoneType"."""
    config = tmp_path / "run.yaml"
    config.write_text("steps: 3\nlearning_rate: 1e-4\nsteps: 5\n")
    line = one_error("train", "--config", str(config), "--model", "m", "--data", "d")
    assert f"{config}: key 'steps' given twice (line 3)" in line, line
    config.write_text("steps: &x [1, *x]\n")  # a recursive alias: walked once, not forever
    assert "steps" in one_error("train", "--config", str(config), "--model", "m", "--data", "d")
    spec = tmp_path / "spec.yaml"
    spec.write_text("")
    assert "the spec is empty" in one_error("sweep", str(spec))
    from flows.pipeline import check_pipeline_inputs

    raw = tmp_path / "raw.jsonl"
    raw.write_text('{"prompt": "p", "chosen": "a", "rejected": "b"}\n')
    spec.write_text("name: p\ngrid: {learning_rate: [1e-4]}\n")  # no model, no data
    check_pipeline_inputs(str(raw), str(tiny_model), str(spec))  # accepted: both given


def test_a_pipeline_whose_export_would_replace_a_users_file_is_refused_first(
        tmp_path: Path, tiny_model: Path) -> None:
    """Case 8: `pomona pipeline` into its own folder, where best-adapter.gguf was the user's
    file, refused only after the whole sweep and evaluation (180 lines, 3 tracebacks,
    naming `--gguf`, leaderboard.md and best-adapter/ rewritten by then)."""
    import json

    raw, spec, out = tmp_path / "raw.jsonl", tmp_path / "spec.yaml", tmp_path / "out"
    raw.write_text('{"prompt": "p", "chosen": "a", "rejected": "b"}\n')
    spec.write_text("name: p\nexport: {gguf: q8_0}\n")
    out.mkdir()
    (out / ".pomona").write_text(json.dumps({"kind": "pipeline"}))  # an earlier pipeline's
    (out / "best-adapter.gguf").write_text("the user's own model\n")
    (out / "leaderboard.md").write_text("# the earlier board\n")
    line = one_error("pipeline", str(raw), str(tiny_model), str(spec), "--out", str(out))
    assert f"{out / 'best-adapter.gguf'}: a file Pomona did not write" in line, line
    assert "export: {gguf: q8_0}" in line and "--gguf" not in line, line
    assert (out / "best-adapter.gguf").read_text() == "the user's own model\n"
    assert (out / "leaderboard.md").read_text() == "# the earlier board\n"
    assert sorted(p.name for p in out.iterdir()) == [".pomona", "best-adapter.gguf",
                                                     "leaderboard.md"]
