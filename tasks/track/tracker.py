"""The tracker: a sweep's files sent to its trackers (tasks/track/report_to.py) by the
driver, while the sweep runs and after.

    tracker = Tracker.start(sweep_dir, report_to, info)   # a sweep session begins
    with tracker.live(configs): ...run the trials...      # synced every few seconds
    Tracker.resume(sweep_dir).sync()                      # later: the board, pomona track

Every sync reads the folder's own files (tasks/track/sweep_files.py) and sends what the
ledger (tasks/track/ledger.py) says each tracker has not had yet, saving the ledger after
each send. A tracker that fails (down, slow, refusing) costs one warning line: it is left
alone for the rest of the session, training and the board go on, and ``pomona track``
sends what it missed.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol

from tasks.track.ledger import TrackLedger
from tasks.track.report_to import ReportTo
from tasks.track.sweep_files import (
    BEST,
    BOARD,
    RUN_STATUS,
    RunFolder,
    SweepFolder,
    new_records,
    params_of,
    read_rows,
)

log = logging.getLogger("pomona.track")
BOARD_ONLY = ("baseline", "soup")  # leaderboard rows that are no trial
INSTALL = "pip install 'pomona[tracking]'"


class Sink(Protocol):
    """One tracker: each call sends one thing and records it in the ledger's ``part``
    (the sink's) or ``t`` (the trial's); an exception means nothing was recorded."""

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
    def end(self, part: dict[str, Any]) -> None: ...
    def close(self) -> None: ...


def missing_client(report_to: ReportTo) -> str | None:
    """What to install when a tracker's client is missing (said before a cluster starts,
    not at the first trial), else None."""
    import importlib.util

    modules = {"mlflow": "mlflow", "tensorboard": "tensorboardX", "wandb": "wandb"}
    for name in report_to.targets:
        if importlib.util.find_spec(modules[name]) is None:
            return f"report_to: {name} needs its client ({modules[name]}): {INSTALL}"
    return None


def make_sink(name: str, sweep_dir: Path) -> Sink:
    if name == "mlflow":
        from tasks.track.mlflow_sink import MlflowSink

        return MlflowSink()
    if name == "wandb":
        from tasks.track.wandb_sink import WandbSink

        return WandbSink(sweep_dir)
    from tasks.track.tensorboard_sink import TensorBoardSink

    return TensorBoardSink(sweep_dir)


class Tracker:
    """One sweep folder's trackers and ledger; ``sync`` may be called from any thread."""

    def __init__(self, sweep_dir: Path, ledger: TrackLedger, retry_down: bool = False,
                 warn: bool = True, view: SweepFolder | RunFolder | None = None):
        self.dir, self.ledger, self.warn = Path(sweep_dir), ledger, warn
        self.view = view or SweepFolder(self.dir)  # where its trials' files are
        self.lock = threading.Lock()
        self.sinks: list[Sink] = []
        self.failed: dict[str, str] = {}  # this process's failures: name -> reason
        self.read_at: dict[tuple[str, str], tuple[int, int]] = {}  # a file read to its end
        for name in ledger.report_to:
            part = ledger.part(name)
            if part.get("down") and not retry_down:
                continue  # warned of already this session: pomona track sends it
            part.pop("down", None)
            try:
                self.sinks.append(make_sink(name, self.dir))
            except Exception as err:  # a client that will not start: as a down tracker
                self.down(name, name, err)

    @classmethod
    def start(cls, sweep_dir: Path, report_to: ReportTo, info: dict[str, Any],
              view: SweepFolder | RunFolder | None = None) -> Tracker | None:
        """A new session of ``sweep_dir`` (None when it reports to nothing); ``view``: a
        lone run's folder (default: a sweep's)."""
        if not report_to:
            return None
        return cls(sweep_dir, TrackLedger.begin(Path(sweep_dir), report_to.targets, info),
                   view=view)

    @classmethod
    def resume(cls, sweep_dir: Path, retry_down: bool = False) -> Tracker | None:
        """The folder's current session (None when it has none)."""
        ledger = TrackLedger.read(Path(sweep_dir))
        return cls(sweep_dir, ledger, retry_down) if ledger and ledger.report_to else None

    def down(self, name: str, where: str, err: BaseException) -> None:
        """One warning line; the tracker is left alone for the rest of the session."""
        reason = " ".join(str(err).split())[:240] or type(err).__name__
        self.failed[name] = reason
        self.ledger.part(name)["down"] = reason
        with contextlib.suppress(OSError):  # a ledger that cannot be saved: warned below
            self.ledger.save()
        if self.warn:
            log.warning("warning: %s (%s) failed: %s; the run goes on without it, and "
                        "`pomona track %s` sends what it missed", name, where, reason, self.dir)

    def sync(self, live: dict[str, dict[str, Any]] | None = None, end: bool = False) -> None:
        """Send every tracker what the folder's files hold that it has not had:
        ``live`` the settings of trials asked but not finished; ``end``: the session's
        trials are over (MLflow's parent run is finished)."""
        with self.lock:
            rows = self.view.rows()
            for sink in list(self.sinks):
                try:
                    self._sync(sink, rows, live or {}, end)
                except Exception as err:
                    self.sinks.remove(sink)
                    with contextlib.suppress(Exception):
                        sink.close()
                    self.down(sink.name, sink.where, err)

    def _sync(self, sink: Sink, rows: dict[str, dict[str, Any]],
              live: dict[str, dict[str, Any]], end: bool) -> None:
        ledger, part = self.ledger, self.ledger.part(sink.name)
        sink.begin(ledger.data.get("info", {}), ledger.data.get("session", 1), part)
        ledger.save()
        params = {**live, **{tid: params_of(r) for tid, r in rows.items()}}
        for tid in [*params, *(t for t in part.get("trials", {}) if t not in params)]:
            self._sync_trial(sink, tid, params.get(tid, {}), rows.get(tid), part)
        self._sync_board(sink, part)
        if end:
            sink.end(part)
            ledger.save()

    def _sync_trial(self, sink: Sink, tid: str, params: dict[str, Any],
                    row: dict[str, Any] | None, part: dict[str, Any]) -> None:
        ledger, t = self.ledger, self.ledger.trial(sink.name, tid)
        if "run" not in t:
            sink.trial(tid, params, t, part)
            ledger.save()
        path = self.view.metrics(tid)
        stamp = _stat(path)
        if stamp is not None and self.read_at.get((sink.name, tid)) != stamp:
            if records := new_records(path, t.get("steps", {})):
                sink.metrics(tid, t, records)
                steps = t.setdefault("steps", {})
                for r in records:
                    steps[str(r.get("split", "train"))] = int(r["step"])
                ledger.save()
            self.read_at[(sink.name, tid)] = stamp  # unchanged since: not read again
        if row and row.get("status") in RUN_STATUS and not t.get("outcome"):
            sink.outcome(tid, t, row)
            t["outcome"] = row["status"]
            ledger.save()
        if row and not t.get("adapter") and (files := self.view.adapter(tid)):
            sink.adapter(tid, t, files)  # a lone run's (a sweep's best: the board's)
            t["adapter"] = True
            ledger.save()

    def _sync_board(self, sink: Sink, part: dict[str, Any]) -> None:
        """The leaderboard the session wrote (``board``): each trial's evaluation, the
        table, the best adapter, each once."""
        if not (where := self.ledger.data.get("board")):
            return
        board_dir = (self.dir / where).resolve()
        rows = read_rows(board_dir / BOARD)
        for row in rows:
            t = part.get("trials", {}).get(row.get("trial_id"))
            if row.get("status") not in BOARD_ONLY and t and "run" in t and not t.get("eval"):
                sink.evaluation(row["trial_id"], t, row)
                t["eval"] = True
                self.ledger.save()
        if rows and not part.get("board"):
            sink.board(part, rows, board_dir)
            part["board"] = True
            self.ledger.save()
        best = board_dir / BEST
        if rows and best.is_dir() and not part.get("best"):
            source = best / "SOURCE"
            trial = source.read_text().strip() if source.is_file() else None
            sink.best(part, best, trial)
            part["best"] = trial or True
            self.ledger.save()

    def board(self, board_dir: Path) -> None:
        """The session's leaderboard was written to ``board_dir``: sent, with the best
        adapter."""
        import os

        self.ledger.data["board"] = os.path.relpath(Path(board_dir).resolve(),
                                                    self.dir.resolve())
        self.ledger.save()
        self.sync()

    @contextlib.contextmanager
    def live(self, configs: dict[str, dict[str, Any]], every_s: float = 2.0) -> Iterator[None]:
        """Sync every ``every_s`` while the block runs (``configs``: the settings of the
        trials asked so far, by id, as the scheduler fills it), then once more."""
        stop = threading.Event()

        def loop() -> None:
            while not stop.wait(every_s):
                self.sync(dict(configs))

        thread = threading.Thread(target=loop, name="pomona-track", daemon=True)
        thread.start()
        try:
            yield
        finally:
            stop.set()
            thread.join()
            self.sync(dict(configs), end=True)
            self.close()

    def close(self) -> None:
        for sink in self.sinks:
            with contextlib.suppress(Exception):
                sink.close()


def _stat(path: Path) -> tuple[int, int] | None:
    """A file's size and modification time (None while it is not there)."""
    try:
        st = path.stat()
    except OSError:
        return None
    return st.st_size, st.st_mtime_ns


def track_board(sweep_dir: Path, board_dir: Path) -> None:
    """The board written to ``board_dir`` sent to the sweep session's trackers (nothing
    when the sweep reports to none)."""
    tracker = Tracker.resume(Path(sweep_dir))
    if tracker is not None:
        tracker.board(board_dir)
        tracker.close()
