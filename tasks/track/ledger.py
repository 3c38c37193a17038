"""``tracking.json`` in a sweep's folder: what the run reports to, the sweep's tags, and
what each tracker has been sent (its runs, each trial's last step per split, which
outcomes, evaluations and board), saved after every send. A tracker that was down is
marked so: the rest of the run leaves it alone, and ``pomona track`` sends what it missed,
nothing twice.

Each ``pomona sweep`` (or pipeline) of a folder is a session: a new MLflow parent run of
the trials it holds. TensorBoard's event files are per trial, not per session: its part
is carried over (``carried``), so a cached trial's curve is not written again, while a
trial trained again is a new run (a lone run's folder, trained again, is a new run in
each tracker).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.host.atomic import atomic_write_text

LEDGER = "tracking.json"
PER_TRIAL_SINKS = ("tensorboard",)  # their record outlives a session
SERVER_SINKS = ("mlflow",)  # a run left RUNNING by a killed driver stays so unless ended


@dataclass
class TrackLedger:
    """The ledger of one sweep folder, as read and as it grows."""

    path: Path
    data: dict[str, Any]

    @classmethod
    def read(cls, sweep_dir: Path) -> TrackLedger | None:
        path = Path(sweep_dir) / LEDGER
        if not path.is_file():
            return None
        try:
            data = json.loads(path.read_text())
        except (ValueError, UnicodeDecodeError):
            data = None
        if not (isinstance(data, dict) and isinstance(data.get("session"), int)
                and isinstance(data.get("sinks"), dict)):
            raise ValueError(f"{path}: not a tracking ledger Pomona wrote; refusing to "
                             "replace it (move it out of the way)")
        return cls(path, data)

    @classmethod
    def begin(cls, folder: Path, report_to: tuple[str, ...], info: dict[str, Any]
              ) -> TrackLedger:
        """A new session of ``folder`` (never over a file there that is no ledger): a sweep's
        per-trial sinks keep the earlier sessions' trials, marked ``carried``; runs a killed
        session left open are listed ``stale`` for their tracker to end. Both are kept
        for a tracker this session does not report to, for a later one that does."""
        old = cls.read(folder)  # a file there that is no ledger: ValueError, left as it is
        before = old.data.get("sinks", {}) if old else {}
        carry = info.get("kind") != "train"  # a lone run trained again: a new run
        sinks: dict[str, dict[str, Any]] = {}
        for name in (*report_to, *(n for n in before if n not in report_to)):
            kept = before.get(name, {}).get("trials", {}) if carry else {}
            part: dict[str, Any] = ({"trials": {t: {**rec, "carried": True}
                                                for t, rec in kept.items()}}
                                    if name in PER_TRIAL_SINKS and kept else {})
            if name in SERVER_SINKS and (stale := unended(before.get(name, {}))):
                part["stale"] = stale  # kept until a session that reports there ends them
            if part or name in report_to:
                sinks[name] = part
        session = (old.data.get("session", 0) if old else 0) + 1
        ledger = cls(Path(folder) / LEDGER, {
            "report_to": list(report_to), "session": session, "started": time.time(),
            "info": info, "board": None, "sinks": sinks})
        ledger.save()
        return ledger

    @property
    def report_to(self) -> tuple[str, ...]:
        return tuple(self.data.get("report_to", ()))

    def part(self, sink: str) -> dict[str, Any]:
        """``sink``'s record (created empty): runs, trials, down."""
        return self.data.setdefault("sinks", {}).setdefault(sink, {})

    def trial(self, sink: str, trial_id: str) -> dict[str, Any]:
        return self.part(sink).setdefault("trials", {}).setdefault(trial_id, {})

    def save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(self.path, json.dumps(self.data, indent=1, default=str))


def unended(part: dict[str, Any]) -> list[str]:
    """The runs of a sink's session that were never ended (its driver was killed): the
    parent and every trial with no outcome."""
    trials = [t["run"] for t in part.get("trials", {}).values()
              if "run" in t and not t.get("outcome") and not t.get("carried")]
    parent = [part["parent"]] if part.get("parent") and not part.get("ended") else []
    return [*parent, *trials, *part.get("stale", [])]
