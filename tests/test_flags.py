"""One declaration of the engine verbs' flags (engine/host/flags.py), two front ends:
``python -m engine`` (argparse) and ``pomona`` (typer) parse the same command line to the
same values, the line a re-run replays parses back to them, and a usage mistake in any
pomona verb is one line naming the command."""

from __future__ import annotations

from typing import Any

import pytest
from typer.testing import CliRunner

from cli.main import app
from engine import cli as engine_cli

pytestmark = pytest.mark.unit

LINES = {
    "train": ["--model", "m", "--data", "d", "--steps", "3", "--lora-keys", "a.q",
              "--lora-keys", "a.v", "--no-bias-correction", "--learning-rate=-1e-4",
              "--loss", "dpo", "--dpo-beta", "0.2", "--reference", "base"],
    "score": ["--model", "m", "--data", "d", "--out", "s.jsonl", "--batch-size", "2",
              "--allow-tokenizer-mismatch", "--simpo-gamma", "0.5"],
    "export": ["run", "--gguf", "o.gguf", "--type", "q8_0"],
}


def parsed(verb: str, line: list[str], monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """The values ``pomona VERB LINE`` hands the engine's runner."""
    seen: dict[str, Any] = {}
    monkeypatch.setitem(engine_cli.RUNNERS, verb, lambda values: seen.update(values) or 0)
    result = CliRunner().invoke(app, [verb, *line])
    assert result.exit_code == 0, result.output
    return seen


@pytest.mark.parametrize("verb", sorted(LINES))
def test_both_front_ends_parse_a_line_alike(verb: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Would catch: a flag one front end has and the other lacks, or parses otherwise."""
    ours = parsed(verb, LINES[verb], monkeypatch)
    theirs = vars(engine_cli.verb_parser(verb).parse_args(LINES[verb]))
    norm = lambda values: dict(engine_cli.given(values))  # noqa: E731 (lists as tuples)
    assert norm(ours) == norm(theirs) and set(ours) == set(theirs)
    assert sum(v is not None for v in ours.values()) == len(norm(ours)) >= 3


def test_the_replayed_line_parses_back() -> None:
    """The line `train` re-runs itself with (MLX's queue capped) reads the same values:
    a negative number, a repeated key and a switched-off bool included."""
    flags = engine_cli.train_flags()
    values = vars(engine_cli.verb_parser("train").parse_args(LINES["train"]))
    again = engine_cli.verb_parser("train").parse_args(engine_cli.command_line(flags, values))
    assert vars(again) == values
    assert values["lora_keys"] == ["a.q", "a.v"] and values["bias_correction"] is False


@pytest.mark.parametrize("line, said", [
    (["train", "--stepz", "3"], "pomona train: No such option: --stepz"),
    (["train", "--steps", "three"], "pomona train: Invalid value for '--steps'"),
    (["export", "--gguf", "o.gguf"], "pomona export: Missing argument"),
    (["data", "synth", "--n"], "pomona data synth: Option '--n' requires an argument"),
    (["nonesuch"], "pomona: No such command 'nonesuch'"),
])
def test_a_usage_mistake_is_one_line(line: list[str], said: str) -> None:
    """Would catch: typer's usage box (several lines) back, or a line not naming the verb,
    or on stdout (typer's box went to stderr)."""
    result = CliRunner().invoke(app, line)
    lines = [x for x in result.stderr.splitlines() if x.strip()]
    assert result.exit_code == 2 and len(lines) == 1 and not result.stdout, result.output
    assert lines[0].startswith(f"error: {said}") and "--help lists the options" in lines[0]


def test_help_and_errors_as_typed() -> None:
    """-h is --help, in every verb; a bracket a user typed is printed, not read as rich
    markup (`[/]` raised MarkupError); `pomona --help` loads no MLX (the engine's flags
    are built when an engine verb runs)."""
    import subprocess
    import sys

    for line in (["-h"], ["train", "-h"], ["data", "synth", "-h"]):
        result = CliRunner().invoke(app, line)
        assert result.exit_code == 0 and "Usage: pomona" in result.output, result.output
    result = CliRunner().invoke(app, ["no[/]pe"])
    assert result.exit_code == 2 and "No such command 'no[/]pe'" in result.output
    probe = "import sys, cli.main; print(sorted({'mlx', 'numpy'} & set(sys.modules)))"
    loaded = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    assert loaded.stdout.strip() == "[]", loaded.stdout + loaded.stderr
