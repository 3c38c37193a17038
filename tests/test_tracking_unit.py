"""Tracking without a server: report_to's validation, the metric lines a sync sends (each
step once, a retried attempt's repeats not again), the ledger's sessions, a failing
tracker as one warning line, TensorBoard's event files read back by TensorBoard's reader."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from tasks.board.results_table import write_results
from tasks.sweep.spec_file import parse_spec
from tasks.sweep.sweep_spec import SpecError
from tasks.track.ledger import TrackLedger
from tasks.track.report_to import ReportTo
from tasks.track.sweep_files import new_records
from tasks.track.tracker import Tracker

pytestmark = pytest.mark.unit


def test_report_to_parses_lists_one_name_and_none() -> None:
    assert ReportTo.parse(["mlflow", "TensorBoard"]).targets == ("mlflow", "tensorboard")
    assert ReportTo.parse("mlflow").targets == ("mlflow",)
    assert not ReportTo.parse(["none"]) and not ReportTo.parse(None)
    with pytest.raises(ValueError, match=r"--report-to: 'mlfow' is not a tracker"):
        ReportTo.parse(["mlfow"], "--report-to")
    with pytest.raises(ValueError, match="names a tracker twice"):
        ReportTo.parse(["mlflow", "mlflow"])
    with pytest.raises(ValueError, match=r"--report-to: none .* cannot be combined .*mlflow"):
        ReportTo.parse(["none", "mlflow"], "--report-to")  # issue 67: it contradicted itself


def test_an_mlflow_store_that_is_unset_or_unwritable_is_one_line_at_once(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 67, cases 10 and 11: with MLFLOW_TRACKING_URI unset or empty, report_to:
    [mlflow] silently wrote mlflow.db and mlruns/ into the checkout; sqlite:////proc/x.db
    stalled a sweep about 100 s in SQLAlchemy's retries. Both are said before anything
    starts, in well under a second."""
    import time

    from tasks.track.sinks import tracker_problem

    mlflow = ReportTo(("mlflow",))
    monkeypatch.chdir(tmp_path)
    for unset in ("", "  "):
        monkeypatch.setenv("MLFLOW_TRACKING_URI", unset)
        assert "MLFLOW_TRACKING_URI is not set" in tracker_problem(mlflow)
    monkeypatch.delenv("MLFLOW_TRACKING_URI")
    assert f"into {tmp_path}" in tracker_problem(mlflow) and not list(tmp_path.iterdir())
    started = time.monotonic()
    for uri in ("sqlite:////proc/x.db", f"sqlite:///{tmp_path}"):  # no file can be, a folder
        monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
        assert f"MLFLOW_TRACKING_URI={uri}: no database can be written" in tracker_problem(
            mlflow)
    assert time.monotonic() - started < 1
    for fine in (f"sqlite:///{tmp_path}/new/mlflow.db", "http://127.0.0.1:9"):
        monkeypatch.setenv("MLFLOW_TRACKING_URI", fine)
        assert tracker_problem(mlflow) is None


def test_a_spec_names_its_trackers() -> None:
    base = {"name": "s", "model": "m", "data": "d", "fixed": {"steps": 2}}
    assert parse_spec({**base, "report_to": ["mlflow"]}).report_to.targets == ("mlflow",)
    assert not parse_spec(base).report_to
    with pytest.raises(SpecError, match=r"spec: report_to: 'wandbx' is not a tracker"):
        parse_spec({**base, "report_to": ["wandbx"]})
    with pytest.raises(SpecError, match="report_to: expected a list"):
        parse_spec({**base, "report_to": {"mlflow": 1}})


def _lines(path: Path, records: list[dict], partial: str = "") -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records) + partial)


def test_new_records_send_each_step_once(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    train = [{"step": s, "split": "train", "loss": 1.0 / s} for s in (1, 2, 3)]
    _lines(path, [*train, {"step": 3, "split": "valid", "val/loss": 0.5}], '{"step": 4')
    got = new_records(path, {})
    assert [(r["step"], r["split"]) for r in got] == [(1, "train"), (2, "train"),
                                                      (3, "train"), (3, "valid")]
    # a retried attempt starts its file afresh: steps up to those sent are not sent again
    _lines(path, [{"step": s, "split": "train", "loss": 0.1} for s in (1, 2, 3, 4)])
    assert [r["step"] for r in new_records(path, {"train": 3, "valid": 3})] == [4]


class _Failing:
    """A tracker whose server is down: every call raises."""

    name, where = "mlflow", "http://127.0.0.1:1"

    def begin(self, *args) -> None:
        raise ConnectionError("Connection refused")

    def close(self) -> None:
        pass


def _sweep(tmp_path: Path) -> Path:
    sweep = tmp_path / "sweep"
    for tid in ("t-a", "t-b"):
        _lines(sweep / tid / "metrics.jsonl",
               [{"step": s, "split": "train", "loss": 2.0 - s / 4} for s in (1, 2, 3, 4)])
    write_results([{"trial_id": t, "status": "completed", "node": "n1", "attempts": 1,
                    "duration_s": 3.0, "param/learning_rate": lr}
                   for t, lr in (("t-a", 1e-3), ("t-b", 1e-4))], sweep / "results.parquet")
    return sweep


def test_a_failure_is_said_in_a_few_words() -> None:
    from tasks.track.tracker import short_reason

    refused = ("API request to http://127.0.0.1:9/api/2.0/mlflow/experiments/get-by-name "
               "failed with exception HTTPConnectionPool(host='127.0.0.1', port=9): Max "
               "retries exceeded with url: /x (Caused by NewConnectionError(\"HTTPConnection("
               "host='127.0.0.1', port=9): Failed to establish a new connection: [Errno 111] "
               "Connection refused\"))")
    assert short_reason(RuntimeError(refused)) == "cannot reach it (Connection refused)"
    assert short_reason(ValueError("bad\n  value")) == "bad value"


def test_a_down_tracker_costs_one_warning_line_and_is_left_alone(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch) -> None:
    import tasks.track.tracker as tracker_mod

    sweep = _sweep(tmp_path)
    monkeypatch.setattr(tracker_mod, "make_sink", lambda name, where: _Failing())
    tracker = Tracker.start(sweep, ReportTo(("mlflow",)), {"name": "s"})
    with caplog.at_level(logging.WARNING, logger="pomona.track"):
        for _ in range(3):
            tracker.sync()
        Tracker.resume(sweep).sync()  # the board's stage, later in the session: quiet too
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "Connection refused" in lines[0], lines
    assert f"pomona track {sweep}" in lines[0]
    assert TrackLedger.read(sweep).part("mlflow")["down"]


def test_tensorboard_event_files_hold_each_trials_curve(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    sweep = _sweep(tmp_path)
    tracker = Tracker.start(sweep, ReportTo(("tensorboard",)), {"name": "s"})
    tracker.sync(end="FINISHED")
    tracker.sync()  # again: nothing new, nothing twice
    tracker.close()
    for tid in ("t-a", "t-b"):
        events = EventAccumulator(str(sweep / "tb" / tid))
        events.Reload()
        loss = events.Scalars("loss")
        assert [e.step for e in loss] == [1, 2, 3, 4]
        assert [e.value for e in loss] == pytest.approx([1.75, 1.5, 1.25, 1.0])
    # a new session of the folder: a cached trial's curve is not written twice; a trial
    # trained again is a run of its own (tb/<id>-<session>), not spliced onto the old one
    write_results([{"trial_id": "t-a", "status": "completed", "skipped": True},
                   {"trial_id": "t-b", "status": "completed", "skipped": False}],
                  sweep / "results.parquet")
    _lines(sweep / "t-b" / "metrics.jsonl", [{"step": 1, "split": "train", "loss": 9.0}])
    again = Tracker.start(sweep, ReportTo(("tensorboard",)), {"name": "s"})
    again.sync(end="FINISHED")
    again.close()
    assert sorted(p.name for p in (sweep / "tb").iterdir()) == ["t-a", "t-b", "t-b-2"]
    for run, curve in (("t-a", [1, 2, 3, 4]), ("t-b", [1, 2, 3, 4]), ("t-b-2", [1])):
        events = EventAccumulator(str(sweep / "tb" / run))
        events.Reload()
        assert [e.step for e in events.Scalars("loss")] == curve, run
    assert TrackLedger.read(sweep).data["session"] == 2


def test_pomona_track_sends_a_run_to_a_tracker_it_did_not_report_to(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from cli.main import app

    sweep = _sweep(tmp_path)
    runner = CliRunner()
    refused = runner.invoke(app, ["track", str(tmp_path / "sweep")])
    assert refused.exit_code == 2, refused.output
    assert "reported to no tracker; name one with --report-to" in refused.output
    bad = runner.invoke(app, ["track", str(sweep), "--report-to", "mlfow"])
    assert "--report-to: 'mlfow' is not a tracker" in bad.output and bad.exit_code == 2
    sent = runner.invoke(app, ["track", str(tmp_path), "--report-to", "tensorboard"])
    assert sent.exit_code == 0, sent.output  # a pipeline's folder: its sweep/ found
    assert f"tensorboard: {tmp_path} sent to {sweep / 'tb'}" in sent.output
    assert sorted(p.name for p in (sweep / "tb").iterdir()) == ["t-a", "t-b"]


def test_wandb_offline_runs_hold_each_trials_curve_and_the_board(tmp_path: Path,
                                                                  monkeypatch) -> None:
    from tasks.board.results_table import write_results as write_board
    from tests.wandb_records import runs

    for name in ("WANDB_MODE", "WANDB_DIR", "WANDB_PROJECT"):
        monkeypatch.delenv(name, raising=False)
    sweep = _sweep(tmp_path)
    tracker = Tracker.start(sweep, ReportTo(("wandb",)), {"name": "s"})
    tracker.sync(end="FINISHED")
    best = tmp_path / "best-adapter"
    best.mkdir()
    (best / "SOURCE").write_text("t-a\n")
    (best / "adapters.safetensors").write_bytes(b"weights")
    write_board([{"trial_id": "t-a", "status": "completed", "rank": 1,
                  "eval/test/loss": 0.5}], tmp_path / "leaderboard.parquet")
    tracker.board(tmp_path)
    tracker.close()
    import wandb

    wandb.teardown()  # its service writes the run files: every record on disk before reading
    found = runs(sweep)
    assert set(found) == {"t-a", "t-b", "leaderboard"}
    for tid in ("t-a", "t-b"):
        assert found[tid]["group"] == "s #1" and found[tid]["exit"] == 0
        assert [(h["_step"], h["loss"]) for h in found[tid]["history"]] == [
            (1, 1.75), (2, 1.5), (3, 1.25), (4, 1.0)]
    board = found["leaderboard"]
    assert board["history"][0]["leaderboard/_type"] == "table-file"
    assert "artifact" in board["kinds"]  # the best adapter


def test_a_memory_sweep_refuses_trackers() -> None:
    spec = {"name": "m", "model": "m", "data": "d", "kind": "memory",
            "grid": {"segment_size": [1, 2]}, "report_to": ["tensorboard"]}
    with pytest.raises(SpecError, match="report_to: a memory sweep measures and trains nothing"):
        parse_spec(spec)


def test_a_new_session_sends_none_of_the_last_runs_files(tmp_path: Path) -> None:
    """results.parquet and a trial's metrics.jsonl hold the last run's until this run
    writes them: a live sync reads the driver's rows, and files written since it began."""
    import os

    sweep = _sweep(tmp_path)  # an earlier run's rows and curves, an hour old
    hour_ago = os.path.getmtime(sweep / "t-a" / "metrics.jsonl") - 3600
    os.utime(sweep / "t-a" / "metrics.jsonl", (hour_ago, hour_ago))
    tracker = Tracker.start(sweep, ReportTo(("tensorboard",)), {"name": "s"})
    tracker.sync({"t-a": {"learning_rate": 1e-3}}, rows={})  # t-a asked, not started
    t = TrackLedger.read(sweep).trial("tensorboard", "t-a")
    assert t.get("opened") and not t.get("steps") and not t.get("outcome")
    _lines(sweep / "t-a" / "metrics.jsonl", [{"step": 1, "split": "train", "loss": 0.5}])
    tracker.sync({"t-a": {}}, rows={"t-a": {"trial_id": "t-a", "status": "completed"}},
                 end="FINISHED")
    tracker.close()
    t = TrackLedger.read(sweep).trial("tensorboard", "t-a")
    assert t["steps"] == {"train": 1} and t["outcome"] == "completed"


def test_a_killed_drivers_old_results_are_not_this_sessions(tmp_path: Path) -> None:
    """A driver killed hard before its first trial ended leaves the last session's
    results.parquet: pomona track sends its cached rows only, never old outcomes."""
    import time

    sweep = tmp_path / "sweep"
    old = time.time() - 3600
    write_results([{"trial_id": "t-old", "status": "completed", "ended": old},
                   {"trial_id": "t-cached", "status": "completed", "ended": old,
                    "skipped": True}], sweep / "results.parquet")
    tracker = Tracker.start(sweep, ReportTo(("tensorboard",)), {"name": "s"})
    tracker.sync()
    tracker.close()
    trials = TrackLedger.read(sweep).part("tensorboard")["trials"]
    assert set(trials) == {"t-cached"} and trials["t-cached"]["outcome"] == "completed"


def test_a_session_without_tensorboard_keeps_its_record(tmp_path: Path) -> None:
    sweep = _sweep(tmp_path)
    for report_to in (("tensorboard",), (), ("tensorboard",)):  # on, off (--report-to none), on
        write_results([{"trial_id": t, "status": "completed", "skipped": report_to == ()
                        or (sweep / "tb").exists()} for t in ("t-a", "t-b")],
                      sweep / "results.parquet")
        tracker = Tracker.start(sweep, ReportTo(report_to), {"name": "s"})
        if tracker is not None:
            tracker.sync(end="FINISHED")
            tracker.close()
    assert sorted(p.name for p in (sweep / "tb").iterdir()) == ["t-a", "t-b"]  # none again
    assert TrackLedger.read(sweep).data["session"] == 3


def test_a_users_tracking_json_is_never_replaced(tmp_path: Path,
                                                 caplog: pytest.LogCaptureFixture) -> None:
    """A file of that name Pomona did not write: the run goes on untracked, one warning
    line; pomona track refuses in one line; the file is byte for byte as it was."""
    from typer.testing import CliRunner

    from cli.main import app

    sweep = _sweep(tmp_path)
    mine = sweep / "tracking.json"
    mine.write_text('{"my": "notes"}\n')
    with caplog.at_level(logging.WARNING, logger="pomona.track"):
        assert Tracker.start(sweep, ReportTo(("tensorboard",)), {"name": "s"}) is None
    assert len(caplog.records) == 1 and "not a tracking ledger" in caplog.records[0].getMessage()
    refused = CliRunner().invoke(app, ["track", str(sweep), "--report-to", "tensorboard"])
    assert refused.exit_code == 2 and "refusing to replace it" in refused.output
    assert mine.read_text() == '{"my": "notes"}\n' and not (sweep / "tb").exists()


def test_a_caught_up_trial_sends_the_params_a_live_one_does(tmp_path: Path) -> None:
    """Issue 67, low: a trial caught up by `pomona track` had 39 params where a live one
    had 41 (`resume` and `lora_keys`, None, were dropped). Through results.parquet, where
    an ORPO trial's row also holds a KTO trial's columns as None: each trial's params are
    its plan's, no more and no fewer."""
    import pyarrow.parquet as pq

    from tasks.board.results_table import write_results
    from tasks.sweep.trial_plan import TrialPlan
    from tasks.track.sweep_files import params_of

    plans = [TrialPlan.make(f"t{i}", {"model": "m", "data": "d", "out": f"o/t{i}",
                                      "loss": loss}) for i, loss in enumerate(["orpo", "kto"])]
    write_results([{"trial_id": p.id, "status": "completed",
                    **{f"param/{k}": v for k, v in p.params().items()}} for p in plans],
                  tmp_path / "results.parquet")
    rows = pq.read_table(tmp_path / "results.parquet").to_pylist()
    for plan, row in zip(plans, rows, strict=True):
        assert params_of(row) == plan.params(), plan.id
    assert {"resume", "lora_keys"} <= set(params_of(rows[0]))


def test_a_list_setting_is_one_text_live_and_caught_up() -> None:
    """Review of issue 67's params: ``lora_keys`` went live as "('self_attn.q_proj',)" and
    came back from results.parquet as a list ("['self_attn.q_proj']", or JSON text in a
    column of mixed values): MLflow refuses a param sent again with another value."""
    from tasks.track.mlflow_sink import param_text

    live, table, mixed = ("self_attn.q_proj",), ["self_attn.q_proj"], '["self_attn.q_proj"]'
    assert param_text(live) == param_text(table) == param_text(mixed) == mixed
    assert param_text(None) == "None" and param_text(0.1) == "0.1"
