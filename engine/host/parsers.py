"""Command-line parsers shared by ``python -m engine`` and ``python -m benchmarks``:
standard library only, so a front end that imports them loads no MLX (TRL's benchmark
runs where MLX must stay off the path)."""

from __future__ import annotations

import argparse
import sys


class OneLineParser(argparse.ArgumentParser):
    """argparse whose mistakes are one line (argparse prints its whole usage first)."""

    def error(self, message: str) -> None:  # type: ignore[override]
        hint = (" (a value starting with '-' goes after '=': --learning-rate=-1e-4)"
                if "expected one argument" in message else "")
        print(f"error: {self.prog}: {message}{hint}; --help lists the options",
              file=sys.stderr)
        raise SystemExit(2)


def command_parser(prog: str, commands: dict[str, str],
                   description: str | None = None) -> argparse.ArgumentParser:
    """A parser that picks the subcommand; each subcommand parses its own arguments."""
    p = OneLineParser(prog=prog, description=description,
                      formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True, metavar="{" + ",".join(commands) + "}")
    for name, help_ in commands.items():
        sub.add_parser(name, help=help_, add_help=False)  # its --help is its own parser's
    return p
