"""The reference pass of a sweep's DPO trials, as one Prefect task run per reference.

Every DPO trial of a sweep trains against the same reference log-probs (engine/
reference.py): the base model's, or a reference adapter's, on the sweep's data. They are
made once, before the trials start, in a Ray task on a trial's placement (a GPU where
there is one; the driver never loads the model), with a progress artifact; trials then
find them in the cache (or in the file ``reference_logps`` names). A re-run of the flow
finds them too: Prefect reports the task run Cached, keyed on the reference's content
key while its file is in the driver's cache. The file lives in the cache of the node that
made it: on a cluster without a shared filesystem, a trial on another node makes its own
copy once (engine/train/reference.py's lock keeps that to one per node).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from prefect import get_run_logger, task
from prefect.artifacts import create_progress_artifact, update_progress_artifact

from engine.losses import LOSSES
from engine.settings.forward_options import ForwardOptions
from engine.settings.reference_kind import adapter_path
from engine.train.reference import ReferenceSpec, cache_dir, ensure_reference, resolved_reference
from tasks.nodes.placement import Placement
from tasks.nodes.trial_inputs import SweepFiles, fetched
from tasks.prefect.pipeline_tasks import artifact_key
from tasks.sweep.sweep_spec import SweepSpec


def reference_needs(spec: SweepSpec) -> list[tuple[ReferenceSpec, ForwardOptions]]:
    """One (reference, forward options) per distinct reference the spec's trials of a loss
    that reads one (DPO, KTO: with its KL partners) train against; none when no trial
    does or the spec names its own file."""
    losses = {spec.fixed.get("loss", "orpo"), *spec.grid.get("loss", [])}
    dist = spec.space.get("loss")
    if dist is not None and dist.kind == "choice":
        losses |= set(dist.args)
    kinds = {LOSSES[k].needs_kl for k in losses if k in LOSSES and LOSSES[k].needs_reference}
    if not kinds or spec.fixed.get("reference_logps") or spec.grid.get(
            "reference_logps"):  # the spec names its own files
        return []
    references = spec.grid.get("reference") or [spec.fixed.get("reference", "base")]
    drawn = spec.space.get("reference")
    if drawn is not None and drawn.kind == "choice":  # every reference a search may draw
        references = [*references, *drawn.args]
    defaults = ForwardOptions()  # TrainConfig's
    options = ForwardOptions(**{
        f.name: spec.grid[f.name][0] if spec.grid.get(f.name) else spec.fixed.get(
            f.name, getattr(defaults, f.name)) for f in dataclasses.fields(ForwardOptions)})
    return [(ReferenceSpec(spec.model, spec.data, resolved_reference(r), kl), options)
            for r in dict.fromkeys(references) for kl in sorted(kinds)]


class ProgressBox:
    """A Ray actor the reference pass reports (pairs done, pairs in all) to."""

    def __init__(self) -> None:
        self.value = (0, 0)

    def set(self, done: int, total: int) -> None:
        self.value = (done, total)

    def get(self) -> tuple[int, int]:
        return self.value


def make_reference(spec: ReferenceSpec, options: ForwardOptions, box: Any,
                   inputs: dict[str, Any] | None = None) -> tuple[str, bool, float]:
    """``ensure_reference`` where Ray placed it, on this node's copies of ``inputs``
    (tasks/nodes/trial_inputs.py): (file, was cached, seconds). The file stays in that node's
    cache; a trial elsewhere makes its own copy once (the same content key)."""
    started = time.perf_counter()
    spec = dataclasses.replace(spec, **fetched(inputs))
    path, cached = ensure_reference(spec, None, options,
                                    lambda done, total: box.set.remote(done, total))
    return str(path), cached, time.perf_counter() - started


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
    """DPO's reference log-probs for ``spec``, made once in a Ray task on ``placement``."""
    logger = get_run_logger()
    progress = create_progress_artifact(0.0, key=artifact_key(label, "reference"),
                                        description=f"reference log-probs: {spec.reference} "
                                                    f"on {spec.data}")
    made = reference_on_ray(spec, options, placement,
                            lambda pct: update_progress_artifact(progress, pct))
    logger.info("reference log-probs (%s) %s in %.1f s: %s", spec.reference,
                "were cached" if made["cached"] else "computed", made["seconds"], made["path"])
    return made


def reference_on_ray(spec: ReferenceSpec, options: ForwardOptions, placement: Placement,
                     progress: Callable[[float], Any] | None = None) -> dict[str, Any]:
    """DPO's reference log-probs for ``spec``, made in a Ray task on ``placement`` before
    any trial starts (the Prefect flow and ``pomona sweep`` alike): ``progress`` hears the
    percent done. Returns the file, whether it was cached, the seconds and the key."""
    import ray

    box = ray.remote(num_cpus=0)(ProgressBox).remote()
    paths = {"model": spec.model, "data": spec.data, "reference": adapter_path(spec.reference)}
    inputs = SweepFiles().for_paths({k: v for k, v in paths.items() if v and Path(v).exists()})
    ref = placement.fresh_task(make_reference).remote(spec, options, box, inputs)
    while not ray.wait([ref], timeout=2.0)[0]:
        done, total = ray.get(box.get.remote())
        if total and progress is not None:
            progress(100.0 * done / total)
    path, cached, seconds = ray.get(ref)
    if progress is not None:
        progress(100.0)
    ray.kill(box)
    return {"path": path, "cached": cached, "seconds": seconds, "key": spec.key()}


def make_references(spec: SweepSpec, placement: Placement) -> list[dict[str, Any]]:
    """Every reference ``spec``'s DPO trials train against, made before the trials (the
    CLI's route; the flow runs each as a task run, ``run_reference_task``)."""
    return [reference_on_ray(reference, options, placement)
            for reference, options in reference_needs(spec)]
