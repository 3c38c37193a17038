"""W&B: each trial a run of the project ``WANDB_PROJECT`` (else the sweep's name), grouped
as ``<sweep> #<session>``, its settings as config, every metric line at its step, its
outcome in the summary; the leaderboard, every trial's evaluation in its columns, as a
table of a ``leaderboard`` run of the group, and the best adapter as a ``model`` artifact.
Offline unless ``WANDB_MODE`` says otherwise: files under ``<sweep>/wandb/`` (or
``WANDB_DIR``) that ``wandb sync`` uploads later; no network is needed.
"""

from __future__ import annotations

import os
import re
import uuid
from pathlib import Path
from typing import Any

from tasks.track.sweep_files import cell, number, record_metrics

FINISHED_OK = ("completed", "degenerate")  # a W&B run's exit code 0; others 1


class WandbSink:
    """One session's W&B runs, open while their trials train."""

    name = "wandb"

    def __init__(self, sweep_dir: Path) -> None:
        import wandb  # noqa: F401  (refused now, not at the first trial)

        self.dir = Path(os.environ.get("WANDB_DIR") or sweep_dir)
        self.mode = os.environ.get("WANDB_MODE") or "offline"
        self.where = f"{self.dir / 'wandb'} ({self.mode})"
        self.runs: dict[str, Any] = {}  # W&B run id -> the open run

    def begin(self, info: dict[str, Any], session: int, part: dict[str, Any]) -> None:
        if "project" not in part:
            part["project"] = os.environ.get("WANDB_PROJECT") or _name(info["name"])
            part["group"] = (None if info.get("kind") == "train"
                             else f"{info['name']} #{session}")

    def _open(self, run_id: str, name: str, part: dict[str, Any],
              config: dict[str, Any] | None = None) -> Any:
        import wandb

        if run_id not in self.runs:
            self.runs[run_id] = wandb.init(
                mode=self.mode, dir=str(self.dir), project=part["project"],
                group=part["group"], name=name, id=run_id, config=config, resume="allow",
                reinit="create_new", settings=wandb.Settings(
                    silent=True, console="off", x_disable_stats=True, disable_git=True,
                    save_code=False))
        return self.runs[run_id]

    def trial(self, trial_id: str, params: dict[str, Any], t: dict[str, Any],
              part: dict[str, Any]) -> None:
        if "run" not in t:  # unique in the project, per session
            t.update(run=f"{_name(trial_id)}-{uuid.uuid4().hex[:8]}",
                     project=part["project"], group=part["group"])
        self._open(t["run"], trial_id, part, {k: v for k, v in sorted(params.items())})

    def metrics(self, trial_id: str, t: dict[str, Any], records: list[dict[str, Any]]
                ) -> None:
        run = self._open(t["run"], trial_id, t)
        for r in records:
            run.log(record_metrics(r), step=int(r["step"]))

    def outcome(self, trial_id: str, t: dict[str, Any], row: dict[str, Any]) -> None:
        run = self._open(t["run"], trial_id, t)
        status = str(row.get("status"))
        run.summary.update({"pomona/state": status, "pomona/node": str(row.get("node")),
                            **{k: v for k, raw in (("attempts", row.get("attempts")),
                                                   ("wall_time_s", row.get("duration_s")))
                               if (v := number(raw)) is not None}})
        run.finish(exit_code=0 if status in FINISHED_OK else 1)
        self.runs.pop(t["run"])

    def evaluation(self, trial_id: str, t: dict[str, Any], row: dict[str, Any]) -> None:
        pass  # its trial's run has finished: the board's table holds its columns

    def board(self, part: dict[str, Any], rows: list[dict[str, Any]], board_dir: Path
              ) -> None:
        import wandb

        columns = sorted({k for r in rows for k in r if not k.startswith("param/")})
        table = wandb.Table(columns=columns, data=[[cell(r.get(c)) for c in columns]
                                                   for r in rows])
        run = self._open(self._board_run(part), "leaderboard", part)
        run.log({"leaderboard": table})

    def best(self, part: dict[str, Any], adapter: Path, trial_id: str | None) -> None:
        import wandb

        artifact = wandb.Artifact(f"{part['project']}-best-adapter", type="model",
                                  metadata={"trial_id": trial_id})
        artifact.add_dir(str(adapter))
        self._open(self._board_run(part), "leaderboard", part).log_artifact(artifact)

    def _board_run(self, part: dict[str, Any]) -> str:
        return part.setdefault("board_run", f"leaderboard-{uuid.uuid4().hex[:8]}")

    def adapter(self, trial_id: str, t: dict[str, Any], files: list[Path]) -> None:
        pass  # a lone run's adapter stays in its folder (W&B offline: no upload to make)

    def end(self, part: dict[str, Any], status: str) -> None:
        pass

    def close(self) -> None:
        for run in self.runs.values():
            run.finish()
        self.runs.clear()


def _name(text: str) -> str:
    """``text`` as a W&B project or run id takes it (no ``/\\#?%:;,'``)."""
    return re.sub(r"[^\w.-]+", "-", text) or "pomona"


