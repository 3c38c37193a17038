"""Command options derived from the frozen dataclass a command fills, as engine/cli.py
derives its parser from TrainConfig: one ``--option`` per field, with the field's default
and its ``help`` metadata, so the command line and the dataclass cannot drift apart.

    @app.command("init")
    @fills(ModelSpec, "spec")
    def model_init(out: Annotated[Path, typer.Option(help=...)], spec: ModelSpec) -> None:
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from dataclasses import fields
from typing import Annotated, Any, get_type_hints

import typer


def field_options(cls: type) -> list[inspect.Parameter]:
    """One keyword-only typer option per field of the dataclass ``cls``."""
    hints = get_type_hints(cls)
    return [inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=f.default,
                              annotation=Annotated[hints[f.name],
                                                   typer.Option(help=f.metadata["help"])])
            for f in fields(cls)]


def fills(cls: type, param: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """A decorator: the command's ``param`` (a ``cls``) is offered as one option per field
    of ``cls`` and handed to the command built from them."""

    def decorate(command: Callable[..., Any]) -> Callable[..., Any]:
        params: list[inspect.Parameter] = []
        for p in inspect.signature(command, eval_str=True).parameters.values():
            # Keyword-only: a required option may then follow one with a default.
            params += (field_options(cls) if p.name == param
                       else [p.replace(kind=inspect.Parameter.KEYWORD_ONLY)])
        names = [f.name for f in fields(cls)]

        @functools.wraps(command)
        def run(**kwargs: Any) -> Any:
            value = cls(**{n: kwargs.pop(n) for n in names})
            return command(**kwargs, **{param: value})

        run.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
        run.__annotations__ = {p.name: p.annotation for p in params}
        return run

    return decorate
