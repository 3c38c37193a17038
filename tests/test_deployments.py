"""Schedules: prefect.yaml and `pomona serve` describe the pipeline on a cron with an
explicit timezone, one run at a time."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.unit
ROOT = Path(__file__).resolve().parents[1]


def test_prefect_yaml_deploys_the_pipeline_nightly() -> None:
    from prefect.schedules import Cron

    config = yaml.safe_load((ROOT / "prefect.yaml").read_text())
    [dep] = config["deployments"]
    path, name = dep["entrypoint"].split(":")
    module = importlib.import_module(path.removesuffix(".py").replace("/", "."))
    flow = getattr(module, name)
    assert flow.name == "pomona-pipeline"
    assert set(dep["parameters"]) <= set(flow.parameters.properties)
    cluster = flow.validate_parameters(dep["parameters"])["cluster"]  # as a run reads it
    assert (cluster.address, cluster.placement.gpus) == ("auto", 1)
    assert {"raw", "model", "spec", "out"} <= set(dep["parameters"])
    [sched] = dep["schedules"]
    assert sched["timezone"] and Cron(sched["cron"], timezone=sched["timezone"])
    assert dep["concurrency_limit"] == 1
    assert (ROOT / dep["parameters"]["spec"]).exists()
    assert (ROOT / dep["parameters"]["raw"]).exists()


def test_serve_builds_a_scheduled_one_at_a_time_deployment() -> None:
    from flows.pipeline import pipeline_deployment

    dep = pipeline_deployment("nightly", "30 1 * * 1-5", "America/New_York",
                              {"raw": "r", "model": "m", "spec": "s", "out": "o"})
    [schedule] = dep.schedules
    assert schedule.schedule.cron == "30 1 * * 1-5"
    assert schedule.schedule.timezone == "America/New_York"
    assert dep.concurrency_limit == 1
    assert dep.parameters["spec"] == "s"


def test_serve_s_cluster_parameter_is_read_back_by_a_run() -> None:
    """`pomona serve` sends the cluster as a mapping (a deployment's parameters are JSON);
    a run validates it back into the value the CLI built."""
    import dataclasses

    from flows.pipeline import pipeline
    from tasks.nodes.cluster import Cluster

    built = Cluster.of("10.0.0.5:6379", gpus=True, resource="mlx_gpu")
    sent = {"raw": "r", "model": "m", "spec": "s", "out": "o",
            "cluster": dataclasses.asdict(built)}
    assert pipeline.validate_parameters(sent)["cluster"] == built
