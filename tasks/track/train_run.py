"""``pomona train --report-to``: one training run reported to trackers. The engine stays
pure: it trains as ``python -m engine train`` in a child process (its memory-limit
re-exec and Ctrl-C as ever), and this process follows the run's folder as a sweep's
driver does (tasks/track/tracker.py): the metric lines as they are written, then its
outcome and, completed, its adapter. The run's ledger (``tracking.json``, with its final
row, for ``pomona track``) and TensorBoard files (``tb/``) go into its ``--out`` once the
engine holds it.
"""

from __future__ import annotations

import contextlib
import json
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from engine.host.outputs import MARK
from tasks.track.report_to import ReportTo
from tasks.track.sweep_files import RunFolder
from tasks.track.tracker import Tracker

EXIT_STATUS = {0: "completed", 130: "cancelled"}  # any other code: failed


def holder(folder: Path) -> int | None:
    """The pid holding ``folder`` as a run (engine/host/outputs.py's mark), if any."""
    try:
        mark = json.loads((folder / MARK).read_text())
    except (OSError, ValueError):
        return None
    return mark.get("pid") if isinstance(mark, dict) and mark.get("kind") == "run" else None


def exit_code(returncode: int) -> int:
    """A child's return code as a shell's exit status (killed by signal N: 128 + N)."""
    return 128 - returncode if returncode < 0 else returncode


def track_train(engine_args: list[str], out: Path, report_to: ReportTo,
                params: dict[str, Any], every_s: float = 2.0) -> int:
    """Train with ``python -m engine train ENGINE_ARGS`` into ``out``, its files sent to
    ``report_to`` while it trains and after; the engine's exit status. The child is its
    own process group: a Ctrl-C here reaches it once, forwarded as SIGINT (so is a
    SIGTERM sent to this process: the engine stops as on Ctrl-C, saying how to resume),
    and this process waits for it to stop."""
    view, started = RunFolder(Path(out)), time.time()
    info = {"name": view.trial_id, "kind": "train", "out": str(Path(out).resolve())}
    live, tracker, tried = {view.trial_id: params}, None, False
    child: list[subprocess.Popen] = []
    forward = lambda _sig, _frame: child and child[0].send_signal(signal.SIGINT)  # noqa: E731
    before = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        child.append(proc := subprocess.Popen(
            [sys.executable, "-m", "engine", "train", *engine_args], start_new_session=True))
        while True:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=every_s)
            if not tried and holder(view.path) == proc.pid:  # the engine holds --out
                tried, tracker = True, Tracker.start(view.path, report_to, info, view=view)
                if tracker is not None:  # its files count from the launch, not from here
                    tracker.ledger.data["started"] = started
            if proc.returncode is not None:
                break
            if tracker is not None:
                tracker.sync(live)
        if tracker is not None:
            finish(tracker, view, proc.returncode, started, live)
    finally:
        if child:
            child[0].wait()
        for s, handler in before.items():
            signal.signal(s, handler)
    return exit_code(child[0].returncode)


def finish(tracker: Tracker, view: RunFolder, returncode: int, started: float,
           live: dict[str, dict[str, Any]]) -> None:
    """The run's row, with its settings (kept in its ledger, so that ``pomona track``
    sends it whatever failed here), and the last sync."""
    params = {f"param/{k}": v for k, v in live[view.trial_id].items()}
    view.row = {"status": EXIT_STATUS.get(returncode, "failed"), "node": socket.gethostname(),
                "attempts": 1, "duration_s": time.time() - started, "ended": time.time(),
                **params}
    tracker.ledger.data["row"] = view.row
    tracker.ledger.save()
    tracker.sync(live, end="FINISHED")
    tracker.close()
