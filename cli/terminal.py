"""The terminal every verb writes to: one console, the one-line error a verb exits with,
and the command group that makes a usage mistake (an unknown flag, a missing or bad value)
one such line too, naming the command, instead of typer's usage box."""

from __future__ import annotations

import sys
from typing import Any

import typer
from rich.console import Console
from typer.core import TyperGroup

console = Console(soft_wrap=True)  # long paths in messages stay whole, copyable

# click's UsageError and NoArgsIsHelpError, from the click typer runs on (a copy of its own)
_CLICK = sys.modules[typer.BadParameter.__module__]
USAGE_ERROR, NO_ARGS = _CLICK.UsageError, _CLICK.NoArgsIsHelpError


def fail(message: str) -> typer.Exit:
    """Print ``message`` as an error and return the exit to raise (status 2, like typer)."""
    console.print(f"[bold red]error:[/] {message}")
    return typer.Exit(code=2)


def usage_error(err: Any, ctx: Any) -> typer.Exit:
    """A usage mistake as one line: ``error: pomona train: No such option: --step``; where
    click's parser names no command, the one ``ctx`` was invoking."""
    if err.ctx is not None or ctx is None:
        where = err.ctx.command_path if err.ctx is not None else "pomona"
    else:
        where = " ".join(filter(None, [ctx.command_path, ctx.invoked_subcommand]))
    return fail(f"{where}: {err.format_message().rstrip('.')}; --help lists the options")


class OneLineGroup(TyperGroup):
    """pomona and its groups of verbs (``typer.Typer(cls=OneLineGroup)``): every usage
    mistake one line, in the group or a verb under it."""

    def make_context(self, name: Any, args: Any, parent: Any = None, **extra: Any) -> Any:
        try:
            return super().make_context(name, args, parent, **extra)
        except NO_ARGS:
            raise
        except USAGE_ERROR as err:
            raise usage_error(err, parent) from None

    def invoke(self, ctx: Any) -> Any:
        try:
            return super().invoke(ctx)
        except NO_ARGS:
            raise
        except USAGE_ERROR as err:
            raise usage_error(err, ctx) from None
