"""The terminal every verb writes to: one console, and the one-line error it exits with."""

from __future__ import annotations

import typer
from rich.console import Console

console = Console(soft_wrap=True)  # long paths in messages stay whole, copyable


def fail(message: str) -> typer.Exit:
    """Print ``message`` as an error and return the exit to raise (status 2, like typer)."""
    console.print(f"[bold red]error:[/] {message}")
    return typer.Exit(code=2)
