"""``report_to``: which experiment trackers a run reports to, validated once.

    report_to: [mlflow, tensorboard, wandb]   # a sweep or pipeline spec
    pomona sweep SPEC --report-to mlflow --report-to tensorboard

The default is none. ``none`` alone turns a spec's trackers off from the command line.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, TypeVar

TRACKERS = ("mlflow", "tensorboard", "wandb")
Settings = TypeVar("Settings")  # a settings value with a ``report_to`` (a sweep spec)


@dataclass(frozen=True)
class ReportTo:
    """The trackers a run reports to, each once, in the order given."""

    targets: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for name in self.targets:
            if name not in TRACKERS:
                raise ValueError(f"report_to: {name!r} is not a tracker; expected "
                                 f"{', '.join(TRACKERS)} (or none)")
        if len(set(self.targets)) != len(self.targets):
            raise ValueError(f"report_to: {list(self.targets)} names a tracker twice")

    def __bool__(self) -> bool:
        return bool(self.targets)

    @classmethod
    def parse(cls, value: Any, where: str = "report_to") -> ReportTo:
        """A spec's value (a list, one name, ``none``, or None) or the CLI's repeated flag
        (a list); ValueError naming ``where`` and the bad value."""
        names = [value] if isinstance(value, str) else value
        if names is None:
            return cls()
        if not isinstance(names, list | tuple) or not all(isinstance(n, str) for n in names):
            raise ValueError(f"{where}: expected a list of tracker names, got {value!r}")
        names = [n.strip().lower() for n in names]
        if names == ["none"]:
            return cls()
        if "none" in names:
            raise ValueError(f"{where}: none turns tracking off and cannot be combined with "
                             f"trackers ({', '.join(n for n in names if n != 'none')})")
        try:
            return cls(tuple(names))
        except ValueError as err:
            raise ValueError(str(err).replace("report_to", where, 1)) from None


def with_report_to(settings: Settings, flags: list[str] | None) -> Settings:
    """``settings`` (a sweep spec) reporting to the ``--report-to`` ``flags`` instead of
    its own trackers; None (no flag given): its own."""
    if flags is None:
        return settings
    return dataclasses.replace(settings, report_to=ReportTo.parse(flags, "--report-to"))
