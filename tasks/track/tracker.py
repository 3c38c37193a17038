"""The tracker: a run's files sent to its trackers (tasks/track/report_to.py) by the
driver, while the run goes and after.

    tracker = Tracker.start(sweep_dir, report_to, info)   # a session begins
    with tracker.live(asked_now, rows_now): ...trials...    # synced every few seconds
    track_board(sweep_dir, board_dir)                     # the pipeline's board
    Tracker.resume(sweep_dir, retry_down=True).sync()     # pomona track

Each sync sends what the ledger (tasks/track/ledger.py) says a tracker has not had of
this session's trials: their settings, their metric lines (tasks/track/sweep_files.py:
only files written this session, or a cached trial's), their outcomes, the board. The
ledger is saved after each send. A tracker that fails (down, slow, refusing) costs one
warning line: it is left alone for the rest of the session, training and the board go
on, and ``pomona track`` sends what it missed.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from tasks.track.ledger import LEDGER, TrackLedger
from tasks.track.report_to import ReportTo
from tasks.track.sinks import Sink, make_sink
from tasks.track.sweep_files import (
    BEST,
    BOARD,
    RUN_STATUS,
    RunFolder,
    SweepFolder,
    new_records,
    number,
    params_of,
    read_rows,
)

log = logging.getLogger("pomona.track")
BOARD_ONLY = ("baseline", "soup")  # leaderboard rows that are no trial
Rows = dict[str, dict[str, Any]]  # trial id -> its row (results.parquet's)
# A file's mtime comes from the kernel's coarse clock (a tick, ≤ 10 ms, behind time.time()):
# what was written this long before a session began is still its own. Not more: a lone
# run trained again into its folder starts within a second of the last one's last line.
SLACK_S = 0.1


class Tracker:
    """One folder's trackers and ledger; ``sync`` may be called from any thread."""

    def __init__(self, folder: Path, ledger: TrackLedger, retry_down: bool = False,
                 warn: bool = True, view: SweepFolder | RunFolder | None = None):
        self.dir, self.ledger, self.warn = Path(folder), ledger, warn
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
    def start(cls, folder: Path, report_to: ReportTo, info: dict[str, Any],
              view: SweepFolder | RunFolder | None = None) -> Tracker | None:
        """A new session of ``folder`` (None when it reports to nothing: a ledger there
        then begins a session of no trackers, so the board is sent to none either). A
        ledger that cannot be written: one warning line, and the run goes on untracked."""
        if not report_to and not (Path(folder) / LEDGER).exists():
            return None  # never tracked: nothing to write
        try:
            ledger = TrackLedger.begin(Path(folder), report_to.targets, info)
        except (OSError, ValueError) as err:
            if report_to:  # reporting nowhere, a file there that is no ledger is no matter
                log.warning("warning: tracking %s: %s; the run goes on untracked", folder, err)
            return None
        return cls(folder, ledger, view=view) if report_to else None

    @classmethod
    def resume(cls, folder: Path, retry_down: bool = False, warn: bool = True,
               view: SweepFolder | RunFolder | None = None) -> Tracker | None:
        """The folder's current session (None when it has none, or no trackers)."""
        ledger = TrackLedger.read(Path(folder))
        if ledger is None or not ledger.report_to:
            return None
        return cls(folder, ledger, retry_down, warn, view)

    def down(self, name: str, where: str, err: BaseException) -> None:
        """One warning line; the tracker is left alone for the rest of the session."""
        reason = short_reason(err)
        self.failed[name] = reason
        self.ledger.part(name)["down"] = reason
        with contextlib.suppress(OSError):  # a ledger that cannot be saved: warned below
            self.ledger.save()
        if self.warn:
            log.warning("warning: %s (%s) failed: %s; the run goes on without it, and "
                        "`pomona track %s` sends what it missed", name, where, reason, self.dir)

    def sync(self, live: dict[str, dict[str, Any]] | None = None, rows: Rows | None = None,
             end: str | None = None) -> None:
        """Send every tracker what it has not had: ``live`` the settings of trials asked
        so far; ``rows`` the session's rows as its driver holds them (None: its files');
        ``end``: the session is over, with this MLflow status (FINISHED, KILLED)."""
        with self.lock:
            rows = self.session_rows(self.view.rows() if rows is None else rows)
            for sink in list(self.sinks):
                try:
                    self._sync(sink, rows, live or {}, end)
                except Exception as err:
                    self.sinks.remove(sink)
                    with contextlib.suppress(Exception):
                        sink.close()
                    self.down(sink.name, sink.where, err)

    def session_rows(self, rows: Rows) -> Rows:
        """The rows of this session's trials: cached ones, and those that ended since it
        began (a results table a killed driver left holds the last session's)."""
        since = self.ledger.data.get("started", 0) - SLACK_S
        return {tid: r for tid, r in rows.items()
                if r.get("skipped") or (number(r.get("ended")) or since) >= since}

    def _sync(self, sink: Sink, rows: Rows, live: dict[str, dict[str, Any]],
              end: str | None) -> None:
        ledger, part = self.ledger, self.ledger.part(sink.name)
        sink.begin(ledger.data.get("info", {}), ledger.data.get("session", 1), part)
        ledger.save()
        params = {**live, **{tid: params_of(r) or live.get(tid, {})  # a row made live: none
                             for tid, r in rows.items()}}
        earlier = [t for t, rec in part.get("trials", {}).items()
                   if t not in params and not rec.get("carried")]  # asked, no row yet
        for tid in [*params, *earlier]:
            self._sync_trial(sink, tid, params.get(tid, {}), rows.get(tid), part)
        self._sync_board(sink, part)
        if end:
            sink.end(part, end)
            ledger.save()

    def _sync_trial(self, sink: Sink, tid: str, params: dict[str, Any],
                    row: dict[str, Any] | None, part: dict[str, Any]) -> None:
        ledger, t = self.ledger, self.ledger.trial(sink.name, tid)
        cached = bool(row and row.get("skipped"))
        if t.pop("carried", False) and not cached:
            t.clear()  # an earlier session's record of a trial trained again: a new run
        if not t.get("opened"):
            sink.trial(tid, params, t, part)
            t["opened"] = True
            ledger.save()
        self._sync_metrics(sink, tid, t, cached)
        if row and row.get("status") in RUN_STATUS and not t.get("outcome"):
            sink.outcome(tid, t, row)
            t["outcome"] = row["status"]
            ledger.save()
        if (row and row.get("status") == "completed" and not t.get("adapter")
                and (files := self.view.adapter(tid))):
            sink.adapter(tid, t, files)  # a lone run's (a sweep's best: the board's)
            t["adapter"] = True
            ledger.save()

    def _sync_metrics(self, sink: Sink, tid: str, t: dict[str, Any], cached: bool) -> None:
        """The trial's metric lines past those sent, from a file written this session (a
        cached trial's: from before); each file read again only once it changed."""
        path = self.view.metrics(tid)
        stamp = _stat(path)
        if stamp is None or self.read_at.get((sink.name, tid)) == stamp:
            return
        started = self.ledger.data.get("started", 0) - SLACK_S
        if not cached and stamp[1] < started * 1e9:
            return  # an earlier session's file, not yet started afresh by this attempt
        if records := new_records(path, t.get("steps", {})):
            sink.metrics(tid, t, records)
            steps = t.setdefault("steps", {})
            for r in records:
                steps[str(r.get("split", "train"))] = int(r["step"])
            self.ledger.save()
        self.read_at[(sink.name, tid)] = stamp  # unchanged since: not read again

    def _sync_board(self, sink: Sink, part: dict[str, Any]) -> None:
        """The leaderboard the session wrote (``board``): each trial's evaluation, the
        table, the best adapter, each once."""
        if not (where := self.ledger.data.get("board")):
            return
        board_dir = (self.dir / where).resolve()
        rows = read_rows(board_dir / BOARD)
        for row in rows:
            t = part.get("trials", {}).get(row.get("trial_id"))
            if row.get("status") not in BOARD_ONLY and t and t.get("opened") \
                    and not t.get("eval"):
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
        """A leaderboard was written to ``board_dir`` (again: another metric, other
        scorers): its evaluations, table and best adapter sent anew."""
        self.ledger.data["board"] = os.path.relpath(Path(board_dir).resolve(),
                                                    self.dir.resolve())
        for part in self.ledger.data.get("sinks", {}).values():
            part.pop("board", None)
            part.pop("best", None)
            for t in part.get("trials", {}).values():
                t.pop("eval", None)
        self.ledger.save()
        self.sync()

    @contextlib.contextmanager
    def live(self, asked_now: Callable[[], dict[str, dict[str, Any]]],
             rows_now: Callable[[], Rows], every_s: float = 2.0) -> Iterator[None]:
        """Sync every ``every_s`` while the block runs (``asked_now``: the settings of the
        trials asked so far; ``rows_now``: the session's rows so far), then once more: the
        session ended FINISHED, KILLED by Ctrl-C, or FAILED when the block raised otherwise;
        a failure of that last sync never replaces the block's exception."""
        stop, ended = threading.Event(), "FINISHED"

        def loop() -> None:
            while not stop.wait(every_s):
                self.sync(asked_now(), rows_now())

        thread = threading.Thread(target=loop, name="pomona-track", daemon=True)
        thread.start()
        try:
            yield
        except BaseException as err:
            ended = "KILLED" if isinstance(err, KeyboardInterrupt) else "FAILED"
            raise
        finally:
            stop.set()
            try:
                thread.join()
                self.sync(asked_now(), rows_now(), end=ended)
            except BaseException:  # a second Ctrl-C while it sends: the first one stands
                if ended == "FINISHED":
                    raise
            finally:
                self.close()

    def close(self) -> None:
        for sink in self.sinks:
            with contextlib.suppress(Exception):
                sink.close()


def short_reason(err: BaseException) -> str:
    """A tracker's failure in a few words: a socket's (``cannot reach it (Connection
    refused)``) out of a client's page of wrapped causes, else its first 240 characters."""
    text = " ".join(str(err).split())
    if found := re.search(r"\[Errno -?\d+\] ([^'\")]+)", text):
        return f"cannot reach it ({found.group(1).strip()})"
    return text[:240] or type(err).__name__


def _stat(path: Path) -> tuple[int, int] | None:
    """A file's size and modification time in ns (None while it is not there)."""
    try:
        st = path.stat()
    except OSError:
        return None
    return st.st_size, st.st_mtime_ns


def track_board(sweep_dir: Path, board_dir: Path) -> None:
    """The board written to ``board_dir`` sent to the sweep session's trackers (nothing
    when it reports to none); any failure is one warning line, never the pipeline's."""
    try:
        tracker = Tracker.resume(Path(sweep_dir))
        if tracker is not None:
            tracker.board(board_dir)
            tracker.close()
    except Exception as err:
        log.warning("warning: tracking the board of %s: %s", sweep_dir, err)
