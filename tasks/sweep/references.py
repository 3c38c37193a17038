"""A sweep's reference pass: the reference log-probs its trials train against (DPO, KTO
with its KL partners), made once before any trial starts, in a Ray task on a trial's
placement (a GPU where there is one; the driver never loads the model).

    for reference, options in reference_needs(plan): ...   # read from the planned trials
    made = make_references(plan, placement)                 # the CLI's route
    reference_on_ray(reference, options, placement, progress)   # one, the flow's task's

Each need is read from a planned trial's own TrainConfig (``reference_of``, as the trial
reads it), so what is made is what the trials look for. The file lives in the cache of the
node that made it: on a cluster without a shared filesystem, a trial on another node
makes its own copy once (engine/train/reference.py's lock keeps that to one per node).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from engine.settings.forward_options import ForwardOptions
from engine.settings.reference_kind import adapter_path
from engine.train.reference import ReferenceSpec, ensure_reference
from tasks.nodes.placement import Placement
from tasks.nodes.trial_inputs import InputServer, fetched
from tasks.sweep.sweep_plan import SweepPlan


def reference_needs(plan: SweepPlan) -> list[tuple[ReferenceSpec, ForwardOptions]]:
    """One (reference, forward options) per distinct reference the planned trials of a
    loss that reads one train against (the first such trial's options); none for a trial
    that names its own file (``reference_logps``)."""
    from engine.train.run_parts import reference_of

    needs: dict[ReferenceSpec, ForwardOptions] = {}
    for trial in plan.reference_trials():
        config = trial.config
        if config.loss.needs_reference and not config.reference_logps:
            reference, _, options = reference_of(config, plan.inputs.spec.ranks_per_trial)
            needs.setdefault(reference, options)
    return list(needs.items())


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


def reference_on_ray(spec: ReferenceSpec, options: ForwardOptions, placement: Placement,
                     progress: Callable[[float], Any] | None = None) -> dict[str, Any]:
    """The reference log-probs for ``spec``, made in a Ray task on ``placement`` before
    any trial starts (the Prefect flow and ``pomona sweep`` alike): ``progress`` hears the
    percent done. Returns the file, whether it was cached, the seconds and the key."""
    import ray

    box = ray.remote(num_cpus=0)(ProgressBox).remote()
    paths = {"model": spec.model, "data": spec.data, "reference": adapter_path(spec.reference)}
    inputs = InputServer().for_paths({k: v for k, v in paths.items() if v and Path(v).exists()})
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


def make_references(plan: SweepPlan, placement: Placement) -> list[dict[str, Any]]:
    """Every reference ``plan``'s trials train against, made before the trials (the CLI's
    route; the flow runs each as a task run: tasks/prefect/reference_task.py)."""
    return [reference_on_ray(reference, options, placement)
            for reference, options in reference_needs(plan)]
