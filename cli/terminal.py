"""The terminal every verb writes to: one console, the one-line error a verb exits with,
and the command group that makes a usage mistake (an unknown flag, a missing or bad value)
one such line too, on stderr as typer's was, naming the command, instead of typer's box."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import Any

import typer
from rich.console import Console
from rich.markup import escape
from typer.core import TyperGroup

console = Console(soft_wrap=True)  # long paths in messages stay whole, copyable
errors = Console(soft_wrap=True, stderr=True)

# click's UsageError and NoArgsIsHelpError (click >= 8.2), from the click typer runs on
_CLICK = sys.modules[typer.BadParameter.__module__]
USAGE_ERROR, NO_ARGS = _CLICK.UsageError, getattr(_CLICK, "NoArgsIsHelpError", ())


def fail(message: str, to: Console = console) -> typer.Exit:
    """Print ``message`` as an error and return the exit to raise (status 2, like typer);
    the message as written (a path's or a flag's brackets are not markup)."""
    to.print(f"[bold red]error:[/] {escape(message)}")
    return typer.Exit(code=2)


@contextlib.contextmanager
def one_line(ctx: Any) -> Iterator[None]:
    """A usage mistake raised inside as one line on stderr: ``error: pomona train: No such
    option: --step``; where click's parser names no command, the one ``ctx`` invoked."""
    try:
        yield
    except NO_ARGS:
        raise
    except USAGE_ERROR as err:
        if err.ctx is not None or ctx is None:
            where = err.ctx.command_path if err.ctx is not None else "pomona"
        else:
            where = " ".join(filter(None, [ctx.command_path, ctx.invoked_subcommand]))
        message = f"{where}: {err.format_message().rstrip('.')}; --help lists the options"
        raise fail(message, errors) from None


class OneLineGroup(TyperGroup):
    """pomona and its groups of verbs (``typer.Typer(cls=OneLineGroup)``): every usage
    mistake one line, in the group or a verb under it."""

    def make_context(self, name: Any, args: Any, parent: Any = None, **extra: Any) -> Any:
        with one_line(parent):
            return super().make_context(name, args, parent, **extra)

    def invoke(self, ctx: Any) -> Any:
        with one_line(ctx):
            return super().invoke(ctx)
