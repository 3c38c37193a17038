"""MLflow: a sweep session as a parent run, each trial a child run with every setting as
params, its metric lines with their steps, its outcome (node, state, attempts, wall time)
and its evaluation; the leaderboard on the parent as a table, the best adapter as an
artifact, registered as a model version where the server has a registry.

MLflow's own environment is honoured (``MLFLOW_TRACKING_URI``, ``MLFLOW_EXPERIMENT_NAME``;
the experiment is otherwise the sweep's name, or MLflow's Default for a lone
``pomona train``, whose run has no parent). Only the driver talks to the server: the
workers need neither access nor credentials. A down server fails a call in seconds, not
after MLflow's default minutes of retries (unless the user set them).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from tasks.track.sweep_files import (
    BOARD,
    RUN_STATUS,
    cell,
    evaluation_of,
    number,
    record_metrics,
)

# MLflow's request limits: params and metrics in one log_batch, a param's value length.
PARAMS_A_BATCH, METRICS_A_BATCH, PARAM_LENGTH = 100, 1000, 6000
# A server without a model registry answers these (the best adapter stays an artifact).
NO_REGISTRY = ("ENDPOINT_NOT_FOUND", "FEATURE_DISABLED", "NOT_IMPLEMENTED")


def param_text(value: Any) -> str:
    """A param's value as MLflow holds it, one text however it arrives: a live trial's
    tuple and results.parquet's list (or its JSON text) are the same list, and MLflow
    refuses a param sent again with another value."""
    if isinstance(value, list | tuple):
        value = json.dumps(list(value), default=str)
    return str(value)[:PARAM_LENGTH]


def _now_ms() -> int:
    return int(time.time() * 1000)


def _stamp(t: dict[str, Any], step: int = 0) -> int:
    """A metric's timestamp: the run's start plus its step in ms, the same on every send,
    so a batch sent again after a lost reply is one the server already holds (MLflow drops
    a metric equal in key, step, value and timestamp)."""
    return int(t["t0"]) + step


class MlflowSink:
    """One session's runs on the tracking server MLflow's environment names."""

    name = "mlflow"

    def __init__(self) -> None:
        # No retry: a down server costs one warning line within seconds, not minutes of
        # retries (each a line of urllib3's); pomona track sends what it missed.
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")
        from mlflow import MlflowClient

        self.client = MlflowClient()
        self.where = self.client.tracking_uri

    def experiment(self, sweep: str) -> str:
        """MLFLOW_EXPERIMENT_ID or _NAME where set, else the sweep's name (made if new)."""
        if given := os.environ.get("MLFLOW_EXPERIMENT_ID"):
            return given
        name = os.environ.get("MLFLOW_EXPERIMENT_NAME") or sweep
        found = self.client.get_experiment_by_name(name)
        return found.experiment_id if found else self.client.create_experiment(name)

    def begin(self, info: dict[str, Any], session: int, part: dict[str, Any]) -> None:
        """The session's parent run, tagged with the sweep's spec, data, model and code
        (a lone training run, ``kind: train``: its experiment only); each id noted as soon
        as it exists (a call made again goes on from there)."""
        self._end_stale(part)
        if "experiment" not in part:
            lone = info.get("kind") == "train"  # a lone run: MLflow's own Default
            part.update(experiment=self.experiment("Default" if lone else info["name"]),
                        t0=_now_ms())
        if info.get("kind") == "train" or part.get("spec_sent"):
            return
        if "parent" not in part:
            tags = {f"pomona.{k}": str(v)[:5000] for k, v in info.items() if k != "spec"}
            part["parent"] = self.client.create_run(
                part["experiment"], run_name=f"{info['name']} #{session}",
                tags={**tags, "pomona.session": str(session)}).info.run_id
        if info.get("spec") is not None:
            self.client.log_dict(part["parent"], info["spec"], "spec.json")
        part["spec_sent"] = True

    def _end_stale(self, part: dict[str, Any]) -> None:
        """Runs an earlier session left RUNNING (its driver killed) ended KILLED."""
        from mlflow.exceptions import MlflowException

        for run_id in list(part.get("stale", [])):
            try:
                self.client.set_terminated(run_id, "KILLED")
            except MlflowException as err:  # deleted since: nothing to end
                if err.error_code != "RESOURCE_DOES_NOT_EXIST":
                    raise
            part["stale"].remove(run_id)
        part.pop("stale", None)

    def trial(self, trial_id: str, params: dict[str, Any], t: dict[str, Any],
              part: dict[str, Any]) -> None:
        """The trial's child run (a lone run's: its run), every setting as a param."""
        from mlflow.entities import Param

        if "run" not in t:
            parent = {"mlflow.parentRunId": part["parent"]} if part.get("parent") else {}
            t["run"] = self.client.create_run(part["experiment"], run_name=trial_id, tags={
                **parent, "pomona.trial_id": trial_id}).info.run_id
            t["t0"] = _now_ms()
        items = [Param(k, param_text(v)) for k, v in sorted(params.items())]
        for i in range(0, len(items), PARAMS_A_BATCH):  # a param sent again: the same value
            self.client.log_batch(t["run"], params=items[i:i + PARAMS_A_BATCH])

    def metrics(self, trial_id: str, t: dict[str, Any], records: list[dict[str, Any]]
                ) -> None:
        """Metric lines at their steps (``loss`` and ``val/loss`` histories, ...)."""
        from mlflow.entities import Metric

        items = [Metric(k, v, _stamp(t, int(r["step"])), int(r["step"])) for r in records
                 for k, v in record_metrics(r).items()]
        self._log(t["run"], items)

    def _log(self, run_id: str, items: list[Any]) -> None:
        for i in range(0, len(items), METRICS_A_BATCH):
            self.client.log_batch(run_id, metrics=items[i:i + METRICS_A_BATCH])

    def outcome(self, trial_id: str, t: dict[str, Any], row: dict[str, Any]) -> None:
        """Where and how the trial ended: node and state tags, attempts and wall time, the
        run's status."""
        from mlflow.entities import Metric, RunTag

        status = str(row.get("status"))
        tags = [RunTag("pomona.state", status), RunTag("pomona.node", str(row.get("node")))]
        if row.get("reason"):
            tags.append(RunTag("pomona.reason", str(row["reason"])[:5000]))
        if row.get("skipped"):
            tags.append(RunTag("pomona.cached", "true"))
        values = {"attempts": row.get("attempts"), "wall_time_s": row.get("duration_s")}
        metrics = [Metric(k, v, _stamp(t), 0) for k, raw in values.items()
                   if (v := number(raw)) is not None]
        self.client.log_batch(t["run"], metrics=metrics, tags=tags)
        ended = number(row.get("ended"))
        self.client.set_terminated(t["run"], RUN_STATUS.get(status, "FAILED"),
                                   int(ended * 1000) if ended else None)

    def evaluation(self, trial_id: str, t: dict[str, Any], row: dict[str, Any]) -> None:
        """The trial's evaluation (valid and test metrics, intervals, scored generations,
        the paired test against the base) and its rank, on its run."""
        from mlflow.entities import Metric

        self._log(t["run"], [Metric(k, v, _stamp(t), 0) for k, v in evaluation_of(row).items()])

    def board(self, part: dict[str, Any], rows: list[dict[str, Any]], board_dir: Path
              ) -> None:
        """The leaderboard on the parent run: a table, its files, the base's and the
        soup's evaluations (``base/...``, ``soup/...``)."""
        from mlflow.entities import Metric

        parent = part["parent"]
        others = [Metric(f"{r['trial_id']}/{k}", v, _stamp(part), 0) for r in rows
                  if r.get("status") in ("baseline", "soup")
                  for k, v in evaluation_of(r).items()]
        self._log(parent, others)
        for name in (BOARD, "leaderboard.md"):
            if (board_dir / name).is_file():
                self.client.log_artifact(parent, str(board_dir / name), "leaderboard")
        columns = sorted({k for r in rows for k in r if not k.startswith("param/")})
        table = {c: [cell(r.get(c)) for r in rows] for c in columns}
        self.client.log_table(parent, table, "leaderboard/table.json")

    def best(self, part: dict[str, Any], adapter: Path, trial_id: str | None) -> None:
        """The best adapter as the parent run's artifact, and a version of the registered
        model ``pomona-<experiment>`` where the server keeps a registry."""
        parent = part["parent"]
        self.client.log_artifacts(parent, str(adapter), "best-adapter")
        self.client.set_tag(parent, "pomona.best_trial", str(trial_id))
        name = f"pomona-{self.client.get_experiment(part['experiment']).name}"
        if not self._registered(name):
            part["model_version"] = "none (the server keeps no model registry)"
            return
        version = self.client.create_model_version(name, f"runs:/{parent}/best-adapter",
                                                   parent, tags={"pomona.trial_id": str(trial_id)})
        part["model_version"] = f"{name}/{version.version}"

    def _registered(self, name: str) -> bool:
        """The registered model ``name`` made if new; False where the server has no
        registry (any other refusal is raised: a down server, sent again later)."""
        from mlflow.exceptions import MlflowException

        try:
            self.client.create_registered_model(name)
        except MlflowException as err:
            if err.error_code in NO_REGISTRY:
                return False
            if err.error_code != "RESOURCE_ALREADY_EXISTS":
                raise
        return True

    def adapter(self, trial_id: str, t: dict[str, Any], files: list[Path]) -> None:
        """A lone run's trained adapter as its run's artifact ``adapter/``."""
        for f in files:
            self.client.log_artifact(t["run"], str(f), "adapter")

    def end(self, part: dict[str, Any], status: str) -> None:
        """The session's parent run ended (FINISHED, or KILLED by Ctrl-C; a board may
        follow)."""
        if part.get("parent") and not part.get("ended"):
            self.client.set_terminated(part["parent"], status)
            part["ended"] = True

    def close(self) -> None:
        pass

