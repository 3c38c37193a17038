"""``pomona train``, ``score`` and ``export``: the engine's verbs (engine/cli.py), their
flags rendered by typer from the declaration ``python -m engine`` renders with argparse, so
both take the same options and ``pomona train --help`` lists every TrainConfig field."""

from __future__ import annotations

from typing import Any

import typer

from cli.options import flag_params, signed


def add_engine_verbs(app: typer.Typer) -> None:
    """Register each engine verb on ``app``, its help the engine's own."""
    from engine.cli import VERBS

    for verb, (flags, about) in VERBS.items():
        app.command(verb, help=about)(signed(_runner(verb), flag_params(flags())))


def _runner(verb: str) -> Any:
    def run(**values: Any) -> None:
        from engine.cli import RUNNERS

        raise typer.Exit(code=RUNNERS[verb](values))

    return run
