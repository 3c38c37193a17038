"""``pomona train --report-to``: one training run reported to trackers. The engine stays
pure: it trains as ``python -m engine train`` in a child process (its own memory-limit
re-exec and Ctrl-C as ever), and this process follows the run's folder as a sweep's
driver does (tasks/track/tracker.py): the metric lines as they are written, then its
outcome and its adapter. The run's ledger (``tracking.json``) and TensorBoard files
(``tb/``) go into its ``--out`` once the engine holds it.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from engine.host.outputs import mark_kind
from tasks.track.report_to import ReportTo
from tasks.track.sweep_files import RunFolder
from tasks.track.tracker import Tracker

EXIT_STATUS = {0: "completed", 130: "cancelled"}  # any other code: failed


def track_train(engine_args: list[str], out: Path, report_to: ReportTo,
                params: dict[str, Any], every_s: float = 2.0) -> int:
    """Train with ``python -m engine train ENGINE_ARGS`` into ``out``, its files sent to
    ``report_to`` while it trains and after; the engine's exit code."""
    view, started = RunFolder(Path(out)), time.time()
    info = {"name": view.trial_id, "kind": "train", "out": str(Path(out).resolve())}
    live = {view.trial_id: params}
    tracker: Tracker | None = None
    proc = subprocess.Popen([sys.executable, "-m", "engine", "train", *engine_args])
    while True:
        try:
            proc.wait(timeout=every_s)
        except subprocess.TimeoutExpired:
            pass
        except KeyboardInterrupt:  # the engine heard Ctrl-C too: it stops and says how
            continue
        if tracker is None and mark_kind(view.path) == "run":  # the engine holds --out
            tracker = Tracker.start(view.path, report_to, info, view=view)
        if proc.returncode is not None:
            break
        if tracker is not None:
            tracker.sync(live)
    if tracker is not None:
        view.row = {"status": EXIT_STATUS.get(proc.returncode, "failed"),
                    "node": socket.gethostname(), "attempts": 1,
                    "duration_s": time.time() - started, "ended": time.time()}
        tracker.sync(live, end=True)
        tracker.close()
    return proc.returncode
