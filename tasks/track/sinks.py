"""The trackers' one interface (``Sink``), which client each needs, and each made by name
(tasks/track/mlflow_sink.py, tensorboard_sink.py, wandb_sink.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

from tasks.track.report_to import ReportTo

INSTALL = "pip install 'pomona[tracking]'"
CLIENTS = {"mlflow": "mlflow", "tensorboard": "tensorboardX", "wandb": "wandb"}


class Sink(Protocol):
    """One tracker. Each call sends one thing and notes what it made (a run's id) in the
    ledger's ``part`` (the sink's) or ``t`` (the trial's) as soon as it exists, so a call
    that failed midway and is made again goes on from there; the tracker marks the thing
    sent once the call returns."""

    name: str
    where: str

    def begin(self, info: dict[str, Any], session: int, part: dict[str, Any]) -> None: ...
    def trial(self, trial_id: str, params: dict[str, Any], t: dict[str, Any],
              part: dict[str, Any]) -> None: ...
    def metrics(self, trial_id: str, t: dict[str, Any], records: list[dict[str, Any]]
                ) -> None: ...
    def outcome(self, trial_id: str, t: dict[str, Any], row: dict[str, Any]) -> None: ...
    def evaluation(self, trial_id: str, t: dict[str, Any], row: dict[str, Any]) -> None: ...
    def board(self, part: dict[str, Any], rows: list[dict[str, Any]], board_dir: Path
              ) -> None: ...
    def best(self, part: dict[str, Any], adapter: Path, trial_id: str | None) -> None: ...
    def adapter(self, trial_id: str, t: dict[str, Any], files: list[Path]) -> None: ...
    def end(self, part: dict[str, Any], status: str) -> None: ...
    def close(self) -> None: ...


def missing_client(report_to: ReportTo) -> str | None:
    """What to install when a tracker's client is missing (said before a cluster starts,
    not at the first trial), else None."""
    import importlib.util

    for name in report_to.targets:
        if importlib.util.find_spec(CLIENTS[name]) is None:
            return f"report_to: {name} needs its client ({CLIENTS[name]}): {INSTALL}"
    return None


def make_sink(name: str, folder: Path) -> Sink:
    """The tracker ``name``, writing its local files (if any) under ``folder``."""
    if name == "mlflow":
        from tasks.track.mlflow_sink import MlflowSink

        return MlflowSink()
    if name == "wandb":
        from tasks.track.wandb_sink import WandbSink

        return WandbSink(folder)
    from tasks.track.tensorboard_sink import TensorBoardSink

    return TensorBoardSink(folder)
