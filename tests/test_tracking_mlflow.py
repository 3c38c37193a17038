"""A sweep reporting to a real MLflow server (SQLite backend, artifacts served over HTTP,
a random free port on 127.0.0.1), read back through MLflow's own client: the parent run,
a child run per trial with its params and ``loss`` at every report step, the evaluation,
the best adapter as an artifact and a model version. Then the server killed mid-sweep:
the sweep completes with one warning line, and ``pomona track`` sends what was missed,
with no metric step twice."""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from tasks.board.leaderboard import copy_best, rank_trials, write_leaderboard
from tasks.eval.evaluate import evaluate_adapter
from tasks.nodes.placement import Placement
from tasks.sweep.run import run_sweep
from tasks.sweep.spec_file import parse_spec
from tasks.track.resend import track_run
from tasks.track.tracker import track_board

pytestmark = [pytest.mark.slow, pytest.mark.long]  # conftest.py: scheduled first
STEPS = 4


class MlflowServer:
    """``mlflow server`` on a free port of 127.0.0.1, its store and artifacts in ``root``;
    stopped (SIGKILL, its process group) and started again on the same port and store."""

    def __init__(self, root: Path):
        self.root, self.proc = root, None
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.uri = f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        mlflow = Path(sys.executable).with_name("mlflow")
        cmd = [str(mlflow), "server", "--host", "127.0.0.1", "--port", str(self.port),
               "--backend-store-uri", f"sqlite:///{self.root / 'mlflow.db'}",
               "--artifacts-destination", str(self.root / "artifacts"), "--workers", "1"]
        log = (self.root / "server.log").open("a")
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=log, start_new_session=True)
        deadline = time.time() + 90
        while time.time() < deadline:
            try:
                with urllib.request.urlopen(f"{self.uri}/health", timeout=1):
                    return
            except OSError:
                assert self.proc.poll() is None, (self.root / "server.log").read_text()[-2000:]
                time.sleep(0.2)
        raise TimeoutError(f"mlflow server not up: {(self.root / 'server.log').read_text()}")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)  # the server and its workers
            self.proc.wait()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    s = MlflowServer(tmp_path_factory.mktemp("mlflow"))
    s.start()
    yield s
    s.stop()


@pytest.fixture
def client(server: MlflowServer, monkeypatch: pytest.MonkeyPatch):
    from mlflow import MlflowClient

    monkeypatch.setenv("MLFLOW_TRACKING_URI", server.uri)
    return MlflowClient(server.uri)


def _spec(name: str, model: Path, data: Path, report_to: list[str]):
    return parse_spec({"name": name, "model": str(model), "data": str(data),
                       "fixed": {"steps": STEPS, "batch_size": 2, "lora_rank": 4,
                                 "val_every": 2, "report_every": 1},
                       "grid": {"learning_rate": [1e-3, 1e-4]}, "report_to": report_to})


def _children(client, name: str) -> tuple[object, list]:
    experiment = client.get_experiment_by_name(name)
    [parent] = client.search_runs([experiment.experiment_id],
                                  "tags.`pomona.session` = '1'")
    children = client.search_runs([experiment.experiment_id],
                                  f"tags.`mlflow.parentRunId` = '{parent.info.run_id}'")
    return parent, sorted(children, key=lambda r: r.info.run_name)


def _loss_steps(client, run) -> list[int]:
    return sorted(m.step for m in client.get_metric_history(run.info.run_id, "loss"))


def test_a_sweep_and_its_board_reach_a_real_mlflow_server(
        ray_cluster, server, client, tiny_model, tiny_data, tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    sweep = tmp_path / "sweep"
    rows = run_sweep(_spec("tracked", tiny_model, tiny_data, ["mlflow", "tensorboard"]),
                     sweep, Placement())
    assert [r["status"] for r in rows] == ["completed", "completed"]
    # the board as the pipeline's aggregate writes it, then its tracking step
    evals = {r["trial_id"]: evaluate_adapter(str(tiny_model), r["adapter"],
                                             str(tiny_data)).metrics for r in rows}
    board = rank_trials(rows, evals, "val/loss", "min")
    write_leaderboard(board, tmp_path, "val/loss", "tracked")
    best = copy_best(board, tmp_path)
    track_board(sweep, tmp_path)

    parent, children = _children(client, "tracked")
    assert parent.data.tags["pomona.model_key"] and parent.data.tags["pomona.data_fingerprint"]
    assert [c.info.run_name for c in children] == sorted(r["trial_id"] for r in rows)
    for child in children:
        assert child.info.status == "FINISHED"
        assert float(child.data.params["learning_rate"]) in (1e-3, 1e-4)
        assert child.data.params["steps"] == str(STEPS)
        assert _loss_steps(client, child) == list(range(1, STEPS + 1))
        assert [m.step for m in client.get_metric_history(child.info.run_id, "val/loss")] \
            == [0, 2, 4]
        assert child.data.tags["pomona.state"] == "completed" and child.data.tags["pomona.node"]
        assert child.data.metrics["attempts"] == 1
        assert child.data.metrics["eval/valid/loss"] == pytest.approx(
            evals[child.info.run_name]["eval/valid/loss"])
        assert "eval/valid/logps/accuracies/low" in child.data.metrics
        assert child.data.metrics["rank"] in (1, 2)
    names = {a.path for a in client.list_artifacts(parent.info.run_id, "best-adapter")}
    assert "best-adapter/adapters.safetensors" in names
    got = client.download_artifacts(parent.info.run_id, "best-adapter/adapters.safetensors",
                                    str(tmp_path / "dl"))
    assert Path(got).read_bytes() == (best / "adapters.safetensors").read_bytes()
    [version] = client.search_model_versions("name = 'pomona-tracked'")
    assert version.run_id == parent.info.run_id
    assert {a.path for a in client.list_artifacts(parent.info.run_id, "leaderboard")} >= {
        "leaderboard/leaderboard.md", "leaderboard/table.json"}
    for r in rows:  # TensorBoard: each trial's loss curve, read by TensorBoard's reader
        events = EventAccumulator(str(sweep / "tb" / r["trial_id"]))
        events.Reload()
        assert [e.step for e in events.Scalars("loss")] == list(range(1, STEPS + 1))


def test_a_server_killed_mid_sweep_costs_one_warning_and_track_sends_the_rest(
        ray_cluster, server, client, tiny_model, tiny_data, tmp_path: Path,
        caplog: pytest.LogCaptureFixture) -> None:
    sweep, killed = tmp_path / "sweep", []

    def progress(kind: str, summary: dict) -> None:
        if kind == "finished" and not killed:  # the first trial ended: the server goes
            server.stop()
            killed.append(summary["trial_id"])

    try:
        with caplog.at_level(logging.WARNING, logger="pomona.track"):
            rows = run_sweep(_spec("killed", tiny_model, tiny_data, ["mlflow"]), sweep,
                             Placement(), progress=progress)
    finally:
        server.start()  # the same store and port
    assert [r["status"] for r in rows] == ["completed", "completed"]
    warnings = [r.getMessage() for r in caplog.records if r.name == "pomona.track"]
    assert len(warnings) == 1 and "mlflow" in warnings[0], warnings
    assert f"pomona track {sweep}" in warnings[0]

    assert track_run(sweep) == {"mlflow": server.uri}
    assert track_run(sweep) == {"mlflow": server.uri}  # again: nothing sent twice
    parent, children = _children(client, "killed")
    assert parent.info.status == "FINISHED" and len(children) == 2
    for child in children:
        assert _loss_steps(client, child) == list(range(1, STEPS + 1))  # no step twice
        assert child.info.status == "FINISHED"


def test_pomona_train_reports_its_run(server, client, tiny_model, tiny_data,
                                      tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from cli.main import app

    out = tmp_path / "lone-run"
    result = CliRunner().invoke(app, [
        "train", "--model", str(tiny_model), "--data", str(tiny_data), "--out", str(out),
        "--steps", str(STEPS), "--batch-size", "2", "--lora-rank", "4", "--report-every", "1",
        "--val-every", "0", "--report-to", "mlflow", "--report-to", "tensorboard"])
    assert result.exit_code == 0, result.output
    [run] = client.search_runs([client.get_experiment_by_name("Default").experiment_id],
                               "attributes.run_name = 'lone-run'")
    assert run.info.status == "FINISHED" and run.data.params["steps"] == str(STEPS)
    assert _loss_steps(client, run) == list(range(1, STEPS + 1))
    names = {a.path for a in client.list_artifacts(run.info.run_id, "adapter")}
    assert names == {"adapter/adapters.safetensors", "adapter/adapter_config.json"}
    assert (out / "tb" / "lone-run").is_dir()
    assert track_run(out) == {"mlflow": server.uri, "tensorboard": str(out / "tb")}
    # trained again into its folder on data that is not there: a failed run of its own,
    # with its settings, and neither the earlier curve nor the earlier adapter (that
    # curve's last line a few seconds old, as between two runs a user starts)
    past = time.time() - 5
    os.utime(out / "metrics.jsonl", (past, past))
    again = CliRunner().invoke(app, [
        "train", "--model", str(tiny_model), "--data", str(tmp_path / "none.jsonl"),
        "--out", str(out), "--steps", str(STEPS), "--report-to", "mlflow"])
    assert again.exit_code == 2, again.output
    runs = client.search_runs([client.get_experiment_by_name("Default").experiment_id],
                              "attributes.run_name = 'lone-run'", order_by=["start_time"])
    assert len(runs) == 2 and runs[1].info.status == "FAILED", runs
    assert runs[1].data.params["steps"] == str(STEPS) and not _loss_steps(client, runs[1])
    assert not client.list_artifacts(runs[1].info.run_id, "adapter")


def test_runs_a_killed_driver_left_running_are_ended_by_the_next_session(
        server, client, tmp_path: Path) -> None:
    from tasks.track.ledger import TrackLedger
    from tasks.track.report_to import ReportTo
    from tasks.track.tracker import Tracker

    experiment = client.create_experiment("stale")
    parent = client.create_run(experiment).info.run_id
    trial = client.create_run(experiment, tags={"mlflow.parentRunId": parent}).info.run_id
    sweep = tmp_path / "sweep"
    TrackLedger(sweep / "tracking.json", {
        "report_to": ["mlflow"], "session": 1, "info": {"name": "stale"},
        "sinks": {"mlflow": {"experiment": experiment, "parent": parent,
                             "trials": {"t-x": {"run": trial, "steps": {"train": 2}}}}}}).save()
    tracker = Tracker.start(sweep, ReportTo(("mlflow",)), {"name": "stale"})
    tracker.sync(end=True)
    assert [client.get_run(r).info.status for r in (parent, trial)] == ["KILLED", "KILLED"]
    assert "stale" not in TrackLedger.read(sweep).part("mlflow")
