"""The trackers' one interface (``Sink``), which client each needs, and each made by name
(tasks/track/mlflow_sink.py, tensorboard_sink.py, wandb_sink.py)."""

from __future__ import annotations

import errno
import os
import tempfile
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


def tracker_problem(report_to: ReportTo) -> str | None:
    """What a tracker lacks, said before a cluster starts (not at the first trial): its
    client, or for MLflow a store named (``mlflow_store_problem``); else None."""
    import importlib.util

    for name in report_to.targets:
        if importlib.util.find_spec(CLIENTS[name]) is None:
            return f"report_to: {name} needs its client ({CLIENTS[name]}): {INSTALL}"
    if "mlflow" in report_to.targets:
        return mlflow_store_problem(os.environ.get("MLFLOW_TRACKING_URI", ""))
    return None


def mlflow_store_problem(uri: str) -> str | None:
    """Why MLflow cannot log to ``uri`` (MLFLOW_TRACKING_URI), found in a moment: unset,
    MLflow writes ``mlflow.db`` and ``mlruns/`` into whatever folder the command runs in;
    a SQLite file where no file can be made stalls it in minutes of SQLAlchemy retries."""
    if not uri.strip():
        return ("report_to: mlflow: MLFLOW_TRACKING_URI is not set, so MLflow would write "
                f"mlflow.db and mlruns/ into {Path.cwd()}. Set it to your server "
                "(http://host:5000) or a store (sqlite:////abs/path/mlflow.db)")
    if not uri.startswith("sqlite:///") or uri.endswith(":memory:"):
        return None
    db = Path(uri[len("sqlite:///"):])
    folder = next((p for p in (db.parent, *db.parent.parents) if p.exists()), Path("/"))
    try:
        if db.exists() and not db.is_file():
            raise IsADirectoryError(errno.EISDIR, "not a file")
        fd, probe = tempfile.mkstemp(dir=folder, prefix=".pomona-probe-")
        os.close(fd)
        os.unlink(probe)
    except OSError as err:
        return (f"report_to: mlflow: MLFLOW_TRACKING_URI={uri}: no database can be written "
                f"there ({folder}: {err.strerror or err}); name a file in a folder you can "
                "write to")
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
