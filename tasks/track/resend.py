"""``pomona track RUN_DIR``: what a run's trackers missed (a server that was down, a
tracker added since), sent from the run's own files, nothing twice. RUN_DIR is a sweep's
folder, a pipeline's (its sweep in ``sweep/``) or a ``pomona train --report-to`` run's;
the board is whichever of a pipeline's and its sweep's folders holds
``leaderboard.parquet``.
"""

from __future__ import annotations

import os
from pathlib import Path

from tasks.track.ledger import LEDGER, TrackLedger
from tasks.track.report_to import ReportTo
from tasks.track.sinks import tracker_problem
from tasks.track.sweep_files import BOARD, RESULTS, RunFolder, SweepFolder
from tasks.track.tracker import Tracker


class TrackError(RuntimeError):
    """A tracker that still cannot be reached: its reason, in one line."""


def sweep_folder(run_dir: Path) -> Path:
    """The sweep's folder in ``run_dir`` (itself, or its ``sweep/``)."""
    for folder in (run_dir, run_dir / "sweep"):
        if (folder / RESULTS).is_file() or (folder / LEDGER).is_file():
            return folder
    raise FileNotFoundError(f"{run_dir}: no run's results here (a sweep's {RESULTS}, a "
                            f"pipeline's sweep/{RESULTS}, or the {LEDGER} of a `pomona train "
                            "--report-to` run)")


def track_run(run_dir: Path, report_to: ReportTo | None = None) -> dict[str, str]:
    """Send the run's files to its trackers (its own ``report_to``, plus ``report_to``):
    each tracker's place, by name. TrackError when one still fails; ValueError when the
    run names no tracker and ``report_to`` none."""
    run_dir = Path(run_dir)
    folder = sweep_folder(run_dir)
    ledger = TrackLedger.read(folder)
    if ledger is None or not ledger.report_to:
        if not report_to:
            raise ValueError(f"{run_dir}: this run reported to no tracker; name one with "
                             "--report-to")
        name = (run_dir if folder != run_dir else folder).resolve().name
        ledger = TrackLedger.begin(folder, report_to.targets, {"name": name, "sweep_dir":
                                                               str(folder.resolve())})
        ledger.data["started"] = 0  # every file of the run is its own, however old
    elif report_to:
        ledger.data["report_to"] = [*ledger.report_to, *(n for n in report_to.targets
                                                          if n not in ledger.report_to)]
    if not ledger.data.get("board"):
        board = next((f for f in (run_dir, folder) if (f / BOARD).is_file()), None)
        ledger.data["board"] = os.path.relpath(board.resolve(), folder.resolve()) if board \
            else None
    if problem := tracker_problem(ReportTo(tuple(ledger.report_to))):
        raise ValueError(problem)  # an MLflow store unset: never mlruns/ in the caller's folder
    ledger.save()
    lone = ledger.data.get("info", {}).get("kind") == "train"  # pomona train --report-to
    view = RunFolder(folder, ledger.data.get("row")) if lone else SweepFolder(folder)
    tracker = Tracker(folder, ledger, retry_down=True, warn=False, view=view)
    tracker.sync(end="FINISHED")
    tracker.close()
    if tracker.failed:  # TrackError says it, once
        raise TrackError("; ".join(f"{k}: {v}" for k, v in tracker.failed.items()))
    return {s.name: s.where for s in tracker.sinks}
