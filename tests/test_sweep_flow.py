"""The sweep as a Prefect flow against a real Prefect API and a local Ray: each trial a
task run, a progress artifact at 100%, a table artifact with every trial; DPO's reference
pass one task run before them, Cached when the flow runs its trial again."""

from __future__ import annotations

import re

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.long]  # conftest.py: scheduled first


def test_sweep_flow_runs_each_trial_as_a_task_run(prefect_api, ray_cluster, tiny_model,
                                                  tiny_data, tmp_path, monkeypatch) -> None:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    from flows.sweep_flow import sweep_flow
    from tests.pairs import uncached_copy

    data = uncached_copy(tiny_data, tmp_path / "pairs.jsonl")
    spec = tmp_path / "flow.yaml"
    spec.write_text(f"name: Flow_Test\nmodel: {tiny_model}\ndata: {data}\n"
                    "max_concurrent: 1\nfixed: {steps: 2, batch_size: 2, lora_rank: 4, "
                    "val_every: 1, val_batches: 1}\ngrid: {loss: [orpo, dpo]}\n"
                    "metric: val/nll_loss\n")  # the loss searched like any key
    # One slot: the second trial's task run waits its turn (a queued trial, as on a lab)
    state = sweep_flow(str(spec), str(tmp_path / "out"), return_state=True)
    assert state.is_completed(), state
    rows = state.result()
    assert [r["status"] for r in rows] == ["completed"] * 2
    import pyarrow.parquet as pq

    results = pq.read_table(tmp_path / "out" / "results.parquet").to_pylist()
    assert sorted(r["param/loss"] for r in results) == ["dpo", "orpo"]
    assert all(r["best/val/nll_loss"] > 0 for r in results)  # ranked on a metric all share
    # Every effective setting is a column, a default the spec left out too (learning_rate).
    assert {r["param/learning_rate"] for r in results} == {1e-5}
    assert {r["param/batch_size"] for r in results} == {2}
    assert all(r["param/head_chunk"] == 0 and r["param/reference"] == "base" for r in results)
    trained = {p: p.stat().st_mtime_ns for p in (tmp_path / "out").rglob("adapters.safetensors")}
    assert len(trained) == 2, trained
    # ORPO's trial cached, DPO's adapter gone: it trains again, its reference Cached (a
    # sweep whose trials are all cached makes none); reporting to an MLflow server that
    # is not there: one warning line
    dpo = next(r["trial_id"] for r in results if r["param/loss"] == "dpo")
    (tmp_path / "out" / dpo / "adapters.safetensors").unlink()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:9")
    again = sweep_flow(str(spec), str(tmp_path / "out"), report_to=["mlflow"],
                       return_state=True)
    assert again.is_completed(), again
    assert [r["trial_id"] for r in again.result()] == [r["trial_id"] for r in rows]
    assert {p: p.stat().st_mtime_ns for p in trained if p.parent.name != dpo} == {
        p: t for p, t in trained.items() if p.parent.name != dpo}  # ORPO's not trained again
    with get_client(sync_client=True) as client:
        flow_run = client.read_flow_run(state.state_details.flow_run_id)
        task_runs = client.read_task_runs()
        names = sorted(t.name for t in task_runs if t.flow_run_id == flow_run.id)
        assert names == sorted([*(r["trial_id"] for r in rows), "reference-Flow_Test-0"])
        second = [t for t in task_runs if t.flow_run_id == again.state_details.flow_run_id
                  and t.name.startswith("reference-")]
        first = next(t for t in task_runs if t.flow_run_id == flow_run.id
                     and t.name.startswith("reference-"))
        assert first.state.name == "Completed" and len(second) == 1, (first.state, second)
        assert second[0].state.name == "Cached", second[0].state
        again_runs = [t.name for t in task_runs if t.flow_run_id == again.state_details.flow_run_id]
        assert sorted(again_runs) == sorted([second[0].name, dpo]), again_runs  # ORPO's cached
        assert all(t.state.name == "Completed" for t in task_runs if t.flow_run_id == flow_run.id)
        from prefect.client.schemas.filters import LogFilter, LogFilterTaskRunId

        trial_run = next(t for t in task_runs if t.name == rows[0]["trial_id"])
        logs = client.read_logs(LogFilter(task_run_id=LogFilterTaskRunId(any_=[trial_run.id])))
        text = "\n".join(log.message for log in logs)
        # the worker's records, each as its one line (issue 54: no dict reaches the log)
        tid = rows[0]["trial_id"]
        assert re.search(rf"^{tid} step 2/2 loss \S+ acc \S+ lr \S+ \S+ tok/s \S+ GB$", text,
                         re.M), text
        assert re.search(rf"^{tid} step 1/2 valid loss \S+ acc \S+$", text, re.M), text
        assert "completed" in text and "{" not in text, text
        from prefect.client.schemas.filters import LogFilterFlowRunId
        from prefect.logging.handlers import APILogHandler

        APILogHandler().flush()  # the run's last lines, sent
        flow_logs = client.read_logs(LogFilter(flow_run_id=LogFilterFlowRunId(
            any_=[again.state_details.flow_run_id])))
        warned = [log.message for log in flow_logs if log.message.startswith("warning: ")]
        assert len(warned) == 1 and warned[0].startswith("warning: mlflow"), warned
        keys = ArtifactFilter(key=ArtifactFilterKey(any_=["flow-test-progress",
                                                          "flow-test-trials"]))
        arts = {a.key: a for a in client.read_artifacts(artifact_filter=keys)}
    assert float(arts["flow-test-progress"].data) == 100.0
    table = arts["flow-test-trials"].data
    assert all(r["trial_id"] in table for r in rows)


def test_a_packed_sweep_flow_keeps_a_task_run_per_trial(prefect_api, ray_cluster, tiny_model,
                                                        tiny_data, tmp_path) -> None:
    """`pack: 3` over [orpo, simpo, dpo]: one pack (one process), three task runs named by
    their trials, each Completed with its own records in its log, the trials table naming
    the pack; run again, nothing trains. Would catch: a pack's trials folded into one task
    run, or a task run ending before its pack."""
    from prefect.client.orchestration import get_client

    from flows.sweep_flow import sweep_flow
    from tests.pairs import uncached_copy

    data = uncached_copy(tiny_data, tmp_path / "pairs.jsonl")
    spec = tmp_path / "packed.yaml"
    spec.write_text(f"name: Packed_Flow\nmodel: {tiny_model}\ndata: {data}\npack: 3\n"
                    "fixed: {steps: 2, batch_size: 2, lora_rank: 4, val_every: 0}\n"
                    "grid: {loss: [orpo, simpo, dpo]}\nmetric: val/nll_loss\n")
    state = sweep_flow(str(spec), str(tmp_path / "out"), return_state=True)
    assert state.is_completed(), state
    rows = state.result()
    assert [r["status"] for r in rows] == ["completed"] * 3
    import pyarrow.parquet as pq

    results = pq.read_table(tmp_path / "out" / "results.parquet").to_pylist()
    assert len({r["pack"] for r in results}) == 1 and len({r["pid"] for r in results}) == 1
    assert {r["pack_size"] for r in results} == {3}
    again = sweep_flow(str(spec), str(tmp_path / "out"), return_state=True)
    assert again.is_completed(), again
    with get_client(sync_client=True) as client:
        runs = [t for t in client.read_task_runs()
                if t.flow_run_id == state.state_details.flow_run_id]
        trials = {t.name: t for t in runs if not t.name.startswith("reference-")}
        assert sorted(trials) == sorted(r["trial_id"] for r in rows)
        assert all(t.state.name == "Completed" for t in trials.values())
        again_runs = [t.name for t in client.read_task_runs()
                      if t.flow_run_id == again.state_details.flow_run_id]
        assert not [n for n in again_runs if not n.startswith("reference-")]  # all cached


def test_pomonas_warnings_reach_the_flow_runs_log(prefect_api) -> None:
    """A tracker's and the sweep's warning lines, logged inside ``in_run_log`` (as
    sweep_stage logs a failed pack probe), are on the flow run's log once each. Would
    catch: a pack probe's failure said only on a console no one watches."""
    import logging

    from prefect import flow
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId
    from prefect.logging.handlers import APILogHandler

    from tasks.prefect.run_log import in_run_log

    @flow(name="warns")
    def warns() -> None:
        with in_run_log():
            logging.getLogger("pomona.sweep").warning("warning: pack: auto: probe failed")
            logging.getLogger("pomona.track").warning("warning: mlflow: down")
            logging.getLogger("pomona.other").warning("warning: not shown")

    state = warns(return_state=True)
    APILogHandler().flush()
    with get_client(sync_client=True) as client:
        logs = client.read_logs(LogFilter(flow_run_id=LogFilterFlowRunId(
            any_=[state.state_details.flow_run_id])))
    said = [log.message for log in logs if log.message.startswith("warning: ")]
    assert sorted(said) == ["warning: mlflow: down", "warning: pack: auto: probe failed"]
