"""The `pomona` CLI and the demo: real commands on real files."""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import mlx_lm
import pytest
from typer.testing import CliRunner

from cli.main import app

pytestmark = pytest.mark.integration
runner = CliRunner()


def test_help_lists_the_verbs() -> None:
    result = runner.invoke(app, ["--help"])
    assert result.exit_code == 0
    for verb in ("model", "data", "demo"):
        assert verb in result.output


def test_the_cli_waits_for_a_fresh_temporary_prefect_server() -> None:
    """Prefect's 20 s wait lost to a fresh database's migrations on a busy 2-core box: any
    verb raises it. Importing the CLI leaves the environment as it was (issue 38)."""
    code = textwrap.dedent("""
        import os
        before = dict(os.environ)
        import cli.main
        assert dict(os.environ) == before, set(os.environ.items()) ^ set(before.items())
        try:
            cli.main.app(["data", "stats", "/nonexistent"], standalone_mode=False)
        except (Exception, SystemExit):
            pass  # the verb refuses the path; the defaults were set before it ran
        from prefect.settings import PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS as S
        print(S.value())
    """)
    env = {k: v for k, v in os.environ.items() if k not in {
        "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "PREFECT_SERVER_ANALYTICS_ENABLED"}}
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=env)
    assert run.returncode == 0, run.stderr[-2000:]
    assert int(run.stdout.split()[-1]) >= 120, run.stdout


def test_every_help_page_prints() -> None:
    """Each verb's --help, the engine's verbs (built when they run) and bench's pass-through
    too (a '%' in a help text crashed argparse's `train --help`)."""
    import typer.main

    from benchmarks.__main__ import KINDS
    from benchmarks.__main__ import main as benchmarks_main
    from engine.cli import main as engine_main

    def leaves(cmd, path: list[str]):
        subs = getattr(cmd, "commands", None)
        if not subs:
            yield path
        for name, sub in (subs or {}).items():
            yield from leaves(sub, [*path, name])

    verbs = list(leaves(typer.main.get_command(app), []))
    assert ["data", "tokenize"] in verbs and ["train"] in verbs
    pages = [[*v, "--help"] for v in verbs] + [["model", "--help"], ["data", "--help"]]
    pages += [["bench", k, "--help"] for k in KINDS]
    for args in pages:
        result = runner.invoke(app, args)
        assert result.exit_code == 0, (args, result.output, result.exception)
        assert "usage" in result.output.lower(), (args, result.output)
    import dataclasses

    from engine.settings.config import TrainConfig

    train_help = runner.invoke(app, ["train", "--help"], terminal_width=200).output
    assert "Usage: pomona train [OPTIONS]" in train_help  # typer's, as every other verb's
    flags = [f"--{f.name.replace('_', '-')}" for f in dataclasses.fields(TrainConfig)]
    assert [f for f in flags if f not in train_help] == []  # every field, from the dataclass
    for verb in ("score", "export"):
        assert f"Usage: pomona {verb} [OPTIONS]" in runner.invoke(app, [verb, "--help"]).output
    engine_help = io.StringIO()
    with contextlib.redirect_stdout(engine_help):
        assert engine_main(["train", "--help"]) == 0
    assert [f for f in flags if f not in engine_help.getvalue()] == []  # the same flags
    assert engine_main(["--help"]) == 0 and engine_main([]) == 2
    assert engine_main(["bench", "memory"]) == 2  # benchmarks: python -m benchmarks
    assert benchmarks_main(["--help"]) == 0 and benchmarks_main(["nope"]) == 2


def test_model_init_cli_writes_a_loadable_model(tmp_path: Path) -> None:
    out = tmp_path / "m"
    args = ["model", "init", "--out", str(out), "--layers", "1", "--hidden", "64",
            "--intermediate", "128", "--vocab", "400", "--arch", "qwen2"]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "qwen2" and config["num_hidden_layers"] == 1
    model, _ = mlx_lm.load(str(out))
    assert len(model.layers) == 1
    again = runner.invoke(app, args)  # refuses to clobber without --overwrite
    assert again.exit_code == 2 and "--overwrite" in again.output


def test_model_init_cli_rejects_bad_shape(tmp_path: Path) -> None:
    result = runner.invoke(app, ["model", "init", "--out", str(tmp_path / "m"), "--hidden", "100"])
    assert result.exit_code == 2
    assert "hidden=100" in result.output
    assert not (tmp_path / "m").exists()


def test_data_synth_cli(tmp_path: Path) -> None:
    out = tmp_path / "d.jsonl"
    result = runner.invoke(app, ["data", "synth", "--task", "reverse", "--n", "7", "--seed", "2",
                                 "--layout", "conversational", "--out", str(out)])
    assert result.exit_code == 0, result.output
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 7 and isinstance(rows[0]["prompt"], list)
    bad = runner.invoke(app, ["data", "synth", "--task", "nope", "--out", str(out)])
    assert bad.exit_code == 2 and "unknown task 'nope'" in bad.output


@pytest.mark.slow
def test_pomona_train_with_simpo(tiny_model: Path, tiny_data: Path, tmp_path: Path) -> None:
    """`--loss simpo` trains through `pomona train`: TRL's reward metrics, no ORPO extras,
    and the adapter records the SimPO weights it was trained with."""
    out = tmp_path / "run"
    result = runner.invoke(app, ["train", "--model", str(tiny_model), "--data", str(tiny_data),
                                 "--out", str(out), "--steps", "3", "--batch-size", "2",
                                 "--loss", "simpo", "--simpo-beta", "2.5", "--simpo-gamma",
                                 "0.3", "--segment-size", "2", "--head-chunk", "16",
                                 "--val-every", "0", "--learning-rate", "1e-3"])
    assert result.exit_code == 0, result.output
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if r["split"] == "train"]
    assert train and all("rewards/margins" in r and "log_odds_ratio" not in r for r in train)
    config = json.loads((out / "adapter_config.json").read_text())["pomona"]
    assert config["loss"] == "simpo" and config["simpo_beta"] == 2.5
    assert config["simpo_gamma"] == 0.3 and "orpo_lambda" not in config
