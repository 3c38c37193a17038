"""A command's flags, declared once from the frozen dataclass it fills: one ``Flag`` per
field, its help from the field's ``help`` metadata. Two front ends render the same flags:
argparse here, for ``python -m engine`` (standard library only: it runs on hosts that have
MLX and nothing else, a GPU host), and typer in cli/options.py, for ``pomona``.

A flag the user did not give parses to None, so the dataclass's own default (or a
``--config`` file's value) holds: a parser never holds a second copy of a default.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Union, get_args, get_origin, get_type_hints


@dataclass(frozen=True)
class Flag:
    """One command-line flag: ``--name-with-dashes`` (or a positional argument)."""

    name: str  # the dataclass field's name
    kind: type  # int, float, str, bool, or tuple: a repeatable flag of strings
    help: str
    default: Any = None  # what holds when it is not given, for the help text only
    required: bool = False
    positional: bool = False
    metavar: str | None = None

    @property
    def option(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def text(self) -> str:
        """The help line: the field's help and the default that holds (none shown for an
        empty one: a required value the dataclass checks)."""
        text = f"{self.help} (repeat the flag for more)" if self.kind is tuple else self.help
        return text if self.default in (None, "") else f"{text} (default: {self.default})"


def flag_field(help: str, default: Any = dataclasses.MISSING, **more: Any) -> Any:
    """A dataclass field declared as a flag: its help, its default (none: required) and
    ``positional`` or ``choices`` (checked by ``check_choices``)."""
    return dataclasses.field(default=default, metadata={"help": help, **more})


def field_flags(cls: type) -> list[Flag]:
    """``cls``'s fields as flags: a field with no default is required; ``positional`` and
    ``choices`` metadata make a positional argument and a metavar listing the choices."""
    hints = get_type_hints(cls)
    return [Flag(f.name, flag_kind(hints[f.name]), f.metadata["help"],
                 None if f.default is dataclasses.MISSING else f.default,
                 required=f.default is dataclasses.MISSING,
                 positional=f.metadata.get("positional", False),
                 metavar=choices_metavar(f.metadata.get("choices")))
            for f in dataclasses.fields(cls)]


def choices_metavar(choices: tuple[str, ...] | None) -> str | None:
    return None if choices is None else "{" + ",".join(map(str, choices)) + "}"


def flag_kind(hint: Any) -> type:
    """The flag's type from a field's: optional unwrapped; a tuple is a repeatable string
    flag; a structured value (a loss, a reference) is read from its text by the dataclass."""
    if get_origin(hint) in (Union, types.UnionType):
        hint = next(a for a in get_args(hint) if a is not type(None))
    if get_origin(hint) is tuple:
        return tuple
    return hint if hint in (bool, int, float, str) else str


def add_flags(parser: argparse.ArgumentParser, flags: list[Flag]) -> None:
    """``flags`` as argparse arguments; each parses to None when not given."""
    for flag in flags:
        text = flag.text.replace("%", "%%")  # argparse %-formats help: "25%" crashed --help
        if flag.positional:
            parser.add_argument(flag.name, help=text)
            continue
        parser.add_argument(flag.option, dest=flag.name, default=None, help=text,
                            required=flag.required, **_argparse(flag))


def _argparse(flag: Flag) -> dict[str, Any]:
    if flag.kind is bool:
        return {"action": argparse.BooleanOptionalAction}
    shown = {} if flag.metavar is None else {"metavar": flag.metavar}
    if flag.kind is tuple:  # `--lora-keys a --lora-keys b`, as pomona's typer takes it; and
        # `--lora-keys a b`, as python -m engine always took it (recorded commands use it)
        return {"action": "extend", "nargs": "+", **shown}
    return {"type": flag.kind, **shown}


def check_choices(value: Any) -> None:
    """ValueError naming the flag where a field of the dataclass ``value`` holds a value
    outside its ``choices`` metadata (None passes: not given)."""
    for f in dataclasses.fields(value):
        choices, chosen = f.metadata.get("choices"), getattr(value, f.name)
        if choices is not None and chosen is not None and chosen not in choices:
            raise ValueError(f"--{f.name.replace('_', '-')} {chosen}: expected one of "
                             f"{', '.join(map(str, choices))}")


def given(values: dict[str, Any]) -> Iterator[tuple[str, Any]]:
    """The flags the user gave: every value that is not None (a repeated flag as a tuple)."""
    for name, value in values.items():
        if value is not None:
            yield name, tuple(value) if isinstance(value, list) else value


def command_line(flags: list[Flag], values: dict[str, Any]) -> list[str]:
    """The arguments that parse back to ``values`` (None: not given), for a process that
    runs the command again: ``--name=value`` (a value may start with '-')."""
    line: list[str] = []
    positional: list[str] = []  # last, after "--": a value may start with '-'
    for flag in flags:
        value = values.get(flag.name)
        if value is None:
            continue
        if flag.positional:
            positional.append(str(value))
        elif flag.kind is bool:
            line.append(flag.option if value else "--no-" + flag.option[2:])
        elif flag.kind is tuple:
            line += [f"{flag.option}={item}" for item in value]
        else:
            line.append(f"{flag.option}={value}")
    return [*line, "--", *positional] if positional else line
