"""TensorBoard: event files per trial under the sweep's ``tb/`` folder, so that
``tensorboard --logdir runs/SWEEP/tb`` overlays the trials' curves: every metric line at
its step, the trial's settings and outcome as text, its evaluation at its last step.
Written by tensorboardX (no TensorFlow or torch)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tasks.track.sweep_files import evaluation_of, record_metrics

TB = "tb"


class TensorBoardSink:
    """One writer per trial, under ``sweep_dir/tb/<trial id>``."""

    name = "tensorboard"

    def __init__(self, sweep_dir: Path) -> None:
        import tensorboardX  # noqa: F401  (refused now, not at the first trial)

        self.root = Path(sweep_dir) / TB
        self.writers: dict[str, Any] = {}
        self.where = str(self.root)
        self.session = 1

    def writer(self, run: str) -> Any:
        from tensorboardX import SummaryWriter

        if run not in self.writers:
            self.writers[run] = SummaryWriter(str(self.root / run))
        return self.writers[run]

    def begin(self, info: dict[str, Any], session: int, part: dict[str, Any]) -> None:
        self.session = session

    def trial(self, trial_id: str, params: dict[str, Any], t: dict[str, Any],
              part: dict[str, Any]) -> None:
        rows = "\n".join(f"| {k} | {v} |" for k, v in sorted(params.items()))
        if "run" not in t:  # a trial trained again (a lone run's folder): tb/<id>-<session>
            again = (self.root / trial_id).exists()
            t["run"] = f"{trial_id}-{self.session}" if again else trial_id
        self.writer(t["run"]).add_text("settings", f"| setting | value |\n|---|---|\n{rows}", 0)

    def metrics(self, trial_id: str, t: dict[str, Any], records: list[dict[str, Any]]
                ) -> None:
        w = self.writer(t["run"])
        for r in records:
            for k, v in record_metrics(r).items():
                w.add_scalar(k, v, int(r["step"]))
            t["last_step"] = max(t.get("last_step", 0), int(r["step"]))
        w.flush()

    def outcome(self, trial_id: str, t: dict[str, Any], row: dict[str, Any]) -> None:
        keys = ("status", "reason", "node", "attempts", "duration_s")
        self.writer(t["run"]).add_text("outcome", json.dumps(
            {k: row.get(k) for k in keys}, default=str), t.get("last_step", 0))
        self.writer(t["run"]).flush()

    def evaluation(self, trial_id: str, t: dict[str, Any], row: dict[str, Any]) -> None:
        w = self.writer(t["run"])
        for k, v in evaluation_of(row).items():
            w.add_scalar(k, v, t.get("last_step", 0))
        w.flush()

    def board(self, part: dict[str, Any], rows: list[dict[str, Any]], board_dir: Path
              ) -> None:
        pass

    def best(self, part: dict[str, Any], adapter: Path, trial_id: str | None) -> None:
        pass

    def adapter(self, trial_id: str, t: dict[str, Any], files: list[Path]) -> None:
        pass

    def end(self, part: dict[str, Any], status: str) -> None:
        pass

    def close(self) -> None:
        for w in self.writers.values():
            w.close()
        self.writers.clear()
