"""Typer options from flags declared once (engine/host/flags.py): the flags of the frozen
dataclass a command fills, one ``--option`` per field with its ``help`` metadata, so the
command line and the dataclass cannot drift apart; ``python -m engine`` renders the same
flags with argparse. A flag not given is None, and the dataclass's default holds.

    @app.command("init")
    @fills(ModelSpec, "spec")
    def model_init(out: Annotated[Path, typer.Option(help=...)], spec: ModelSpec) -> None:
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from dataclasses import fields
from typing import Annotated, Any

import typer

from cli.shared_options import HELP
from engine.host.flags import Flag, field_flags, given


def flag_params(flags: list[Flag]) -> list[inspect.Parameter]:
    """One keyword-only typer parameter per flag: an argument where the flag is positional,
    else an option named from the field (a bool: ``--x/--no-x``) whose value is None when
    not given (a tuple flag: repeated, ``--lora-keys a --lora-keys b``)."""
    return [inspect.Parameter(flag.name, inspect.Parameter.KEYWORD_ONLY,
                              default=inspect.Parameter.empty if flag.required else None,
                              annotation=_annotation(flag))
            for flag in flags]


def _annotation(flag: Flag) -> Any:
    if flag.positional:
        return Annotated[str, typer.Argument(help=flag.text, show_default=False)]
    kind = list[str] if flag.kind is tuple else flag.kind
    text = HELP.get(flag.option, flag.text)  # an option other commands take: its one help
    return Annotated[kind if flag.required else kind | None,
                     typer.Option(help=text, metavar=flag.metavar, show_default=False)]


def signed(run: Callable[..., Any], params: list[inspect.Parameter]) -> Callable[..., Any]:
    """``run`` with the signature typer reads its parameters from."""
    run.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
    run.__annotations__ = {p.name: p.annotation for p in params}
    return run


def fills(cls: type, param: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """A decorator: the command's ``param`` (a ``cls``) is offered as one option per field
    of ``cls`` and handed to the command built from them."""

    def decorate(command: Callable[..., Any]) -> Callable[..., Any]:
        params: list[inspect.Parameter] = []
        for p in inspect.signature(command, eval_str=True).parameters.values():
            # Keyword-only: a required option may then follow one with a default.
            params += (flag_params(field_flags(cls)) if p.name == param
                       else [p.replace(kind=inspect.Parameter.KEYWORD_ONLY)])
        names = [f.name for f in fields(cls)]

        @functools.wraps(command)
        def run(**kwargs: Any) -> Any:
            value = cls(**dict(given({n: kwargs.pop(n) for n in names})))
            return command(**kwargs, **{param: value})

        return signed(run, params)

    return decorate
