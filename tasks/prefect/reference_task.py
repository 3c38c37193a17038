"""The reference pass of a sweep's trials as one Prefect task run per reference, with a
progress artifact: each made in a Ray task before the trials start (tasks/sweep/
references.py: what is needed, and how it is made). A re-run of the flow finds them too:
Prefect reports the task run Cached, keyed on the reference's content key while its file
is in the driver's cache.
"""

from __future__ import annotations

from typing import Any

from prefect import get_run_logger, task
from prefect.artifacts import create_progress_artifact, update_progress_artifact

from engine.settings.forward_options import ForwardOptions
from engine.train.reference import ReferenceSpec, cache_dir
from tasks.nodes.placement import Placement
from tasks.prefect.pipeline_tasks import artifact_key
from tasks.sweep.references import reference_needs, reference_on_ray
from tasks.sweep.sweep_plan import SweepPlan


def reference_tasks(plan: SweepPlan, placement: Placement) -> list[dict[str, Any]]:
    """Every reference ``plan``'s trials train against, one task run each, before the
    trials (``run_sweep``'s ``before_trials``)."""
    name = plan.inputs.spec.name
    return [run_reference_task(reference, options, placement, f"{name}-{i}")
            for i, (reference, options) in enumerate(reference_needs(plan))]


def reference_cache_key(context: Any, inputs: dict[str, Any]) -> str:
    return f"reference-{inputs['spec'].key()}"


def run_reference_task(spec: ReferenceSpec, options: ForwardOptions, placement: Placement,
                       label: str) -> dict[str, Any]:
    """``reference_task``, Cached by Prefect on the reference's content key while its file
    is in the cache, run afresh (and the file made) when it is not."""
    present = (cache_dir() / f"{spec.key()}.parquet").is_file()
    return reference_task.with_options(refresh_cache=not present)(spec, options, placement,
                                                                   label)


@task(cache_key_fn=reference_cache_key, persist_result=True, result_serializer="json",
      task_run_name="reference-{label}")
def reference_task(spec: ReferenceSpec, options: ForwardOptions, placement: Placement,
                   label: str) -> dict[str, Any]:
    """The reference log-probs for ``spec``, made once in a Ray task on ``placement``."""
    logger = get_run_logger()
    progress = create_progress_artifact(0.0, key=artifact_key(label, "reference"),
                                        description=f"reference log-probs: {spec.reference} "
                                                    f"on {spec.data}")
    made = reference_on_ray(spec, options, placement,
                            lambda pct: update_progress_artifact(progress, pct))
    logger.info("reference log-probs (%s) %s in %.1f s: %s", spec.reference,
                "were cached" if made["cached"] else "computed", made["seconds"], made["path"])
    return made
