"""Issue 71, step 3: every option is declared once (cli/shared_options.py). Read off the
typer app itself, no two commands show one name with different help texts or defaults;
where the commands' defaults differ (``--out``), the default is None and the one help
says what holds for each command."""

from __future__ import annotations

import pytest
import typer

from cli.main import app

pytestmark = pytest.mark.unit


def options(command: object, path: tuple[str, ...] = ()) -> list[tuple[str, str, object, str]]:
    """(option, help, default, command) of every option of every command under ``command``."""
    if hasattr(command, "commands"):
        return [o for name, sub in command.commands.items()
                for o in options(sub, (*path, name))]
    return [(p.opts[0], p.help, p.default, " ".join(path)) for p in command.params
            if type(p).__name__.endswith("Option")]


def differing(found: list[tuple[str, str, object, str]]) -> dict[str, list[str]]:
    """Each option name some two commands declare with a different (help, default), with
    the commands that do."""
    by: dict[str, dict[tuple[str, str], list[str]]] = {}
    for name, text, default, command in found:
        by.setdefault(name, {}).setdefault((text, repr(default)), []).append(command)
    return {name: [", ".join(c) for c in meanings.values()]
            for name, meanings in by.items() if len(meanings) > 1}


def test_every_option_has_one_help_and_one_default() -> None:
    found = options(typer.main.get_command(app))
    assert not differing(found), differing(found)
    shared = {name for name, *_ in found if sum(o[0] == name for o in found) > 1}
    assert {"--out", "--model", "--seed", "--dtype", "--layout", "--report-to"} <= shared
    old = [("--out", "Dataset directory to write.", None, "data tokenize"),
           ("--out", "Output directory.", "runs/pipeline", "pipeline"),
           ("--out", "Output directory.", "runs/scheduled", "serve")]
    assert set(differing(old)["--out"]) == {"data tokenize", "pipeline", "serve"}
