"""Issue 71, step 3 (its first part): the options several commands take to build one
value, the cluster (``--address``, ``--gpus``, ``--resource``), ``--report-to`` and
``--generations``, are each declared once in cli/main.py. Read off the typer app itself, every
command that takes one of them shows one help text and one default. Other names
(``--out``, ``--model``) still mean different things in different commands."""

from __future__ import annotations

import pytest
import typer

from cli.main import app

pytestmark = pytest.mark.unit
ONE_MEANING = ("--address", "--gpus", "--resource", "--report-to", "--generations")


def options(command: object, path: tuple[str, ...] = ()) -> list[tuple[str, str, object, str]]:
    """(option, help, default, command) of every option of every command under ``command``."""
    if hasattr(command, "commands"):
        return [o for name, sub in command.commands.items()
                for o in options(sub, (*path, name))]
    return [(p.opts[0], p.help, p.default, " ".join(path)) for p in command.params
            if type(p).__name__.endswith("Option")]


def test_each_shared_option_has_one_help_and_one_default() -> None:
    found = options(typer.main.get_command(app))
    for name in ONE_MEANING:
        takers = [o for o in found if o[0] == name]
        assert len(takers) >= 2, (name, takers)  # shared, or it would not be listed here
        assert len({(h, repr(d)) for _, h, d, _ in takers}) == 1, (name, takers)
