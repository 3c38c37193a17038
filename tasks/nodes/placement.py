"""Where one trial runs: a GPU, a custom resource a cluster declares, or CPU slots.

A trial's actor asks Ray for exactly one GPU (``num_gpus=1``: Ray >= 2.60 reports an
Apple-Silicon GPU as GPU 1, and sets CUDA_VISIBLE_DEVICES on CUDA hosts), or one unit of a
custom resource (``ray start --resources '{"mlx_gpu": 1}'``), or one CPU slot when there
is no GPU. Probes, evaluations and references run on the same placement.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any


def preload_env(environ: Mapping[str, str] = os.environ,
                platform: str = sys.platform) -> dict[str, str]:
    """The driver's OpenBLAS preload, for processes on Linux workers: one started with a
    plain ``ray start`` would otherwise train at a quarter of the speed (engine/host/blas.py)."""
    preload = environ.get("LD_PRELOAD", "")
    return {"LD_PRELOAD": preload} if platform == "linux" and "libopenblas" in preload else {}


@dataclass(frozen=True)
class Placement:
    """What one trial holds: a GPU, a custom resource, or CPU slots."""

    gpus: int = 0  # 1 = one GPU per trial
    resource: str | None = None  # e.g. "mlx_gpu", declared by `ray start --resources`
    cpus: float = 1.0  # slot size when there is no GPU

    def options(self, env: Mapping[str, str] | None = None) -> dict[str, Any]:
        """Ray options of a process on this placement, started with ``env`` set (MLX reads
        some settings once, at import: engine/host/command_queue.py)."""
        # An actor that asks for a GPU or custom resource but not num_cpus would also hold
        # a CPU for life (docs/design.md, Ray and Prefect): ask for none.
        if self.resource:
            held: dict[str, Any] = {"num_cpus": 0, "resources": {self.resource: 1}}
        elif self.gpus:
            held = {"num_cpus": 0, "num_gpus": 1}
        else:
            held = {"num_cpus": self.cpus}
        env = {**preload_env(), **(env or {})}
        return {**held, "runtime_env": {"env_vars": env}} if env else held

    def fresh_task(self, fn: Callable[..., Any], env: Mapping[str, str] | None = None) -> Any:
        """``fn`` as a Ray task on this placement, in a fresh worker process each call
        (MLX's peak and memory are per process: probes and evaluations measure alone)."""
        import ray

        return ray.remote(max_calls=1)(fn).options(**self.options(env))
