"""Which model a reference-reading loss (DPO, KTO) compares against: ``BASE`` (the base with
LoRA off) or an ``AdapterRef`` (an adapter directory for the base: SFT, then DPO). Types,
not strings: a spec, the CLI, YAML and an adapter's config write ``base`` or a path, and
``parse_reference`` is the one place that reads the word."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Base:
    """The base model, LoRA off: the default reference (written ``base``)."""

    def __str__(self) -> str:
        return "base"


BASE = Base()


@dataclass(frozen=True)
class AdapterRef:
    """An adapter directory for the base model, as the reference (written as its path)."""

    path: str

    def __post_init__(self) -> None:
        if not self.path or self.path == "base":
            raise ValueError(f"reference={self.path!r}: expected base or an adapter directory")

    def __str__(self) -> str:
        return self.path

    def resolved(self) -> AdapterRef:
        """The folder's absolute path, as stored and keyed (a relative one would name
        another folder, or none, where ``score`` later runs)."""
        return AdapterRef(str(Path(self.path).expanduser().resolve()))


Reference = Base | AdapterRef


def parse_reference(value: str | Reference | None) -> Reference:
    """``base`` (or None) as ``BASE``, any other path as its ``AdapterRef``; a Reference as
    it is. ValueError for an empty string or a value that is no path."""
    if value is None or isinstance(value, Base):
        return BASE
    if isinstance(value, AdapterRef):
        return value
    if not isinstance(value, str) or not value:
        raise ValueError(f"reference={value!r}: expected base or an adapter directory")
    return BASE if value == "base" else AdapterRef(value)


def adapter_path(reference: Reference) -> str | None:
    """The adapter directory of ``reference``, None for the base."""
    return reference.path if isinstance(reference, AdapterRef) else None
