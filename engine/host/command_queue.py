"""How far MLX queues GPU work ahead of the device: bounded in a process with a memory limit.

MLX keeps a command buffer's arrays alive until the device has run it, and lets the host
queue up to 10 buffers ahead (transforms.cpp). On CUDA a buffer holds up to 1000 MB on an
H100/H200 (MLX's sm90 default): Gemma 4 E4B, 4-bit, one 8k pair peaked at 16.0 GB where
the step's live set is ~9 GB. Past ``memory_limit_gb`` MLX then drains the device buffer by
buffer: 1.4× the step. With buffers capped at 100 MB the same step peaked at 9.65 GB for
1.17–1.18×, steadily; at 40 MB, 9.2 GB for 1.08–1.44×, varying from run to run
(docs/performance.md). On Metal the cap is 40 MB, MLX's own default on a base Mac mini
(50 on a Max or Ultra): a limited run there queues no more than MLX would. Without a
limit the cap is not set: at 2k, where the segmented step is bound by the host queueing
kernels, small buffers cost 1.5×.

MLX reads the cap once, when the process makes its first GPU stream (at import), so it is
an environment variable of the process that trains: ``python -m engine`` and ``pomona``
re-execute themselves with it, a sweep's Ray actors and probes start with it (the driver's
platform picks the value: a cluster mixing Macs and CUDA machines sets the variable where
the driver starts). A value the user set is kept.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Mapping

from engine.host.reexec import reexec

QUEUE_MB = "MLX_MAX_MB_PER_BUFFER"
METAL_MB, CUDA_MB = 40, 100  # Metal: MLX's default on a base Mac; CUDA: measured on an H200
_entry = [False]  # True in a process started by a CLI entry point: it may re-execute


def queue_env(memory_limit_gb: float, environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """Variables a process training under ``memory_limit_gb`` starts with (none without a
    limit): the cap, the one set in ``environ`` if any (a Ray worker on another machine
    does not inherit the driver's environment)."""
    if memory_limit_gb <= 0:
        return {}
    return {QUEUE_MB: environ.get(QUEUE_MB, str(bounded_mb()))}


def bounded_mb(platform: str = sys.platform) -> int:
    """The cap a limited run starts with where the user set none: Metal's own on a Mac
    (MLX runs on Metal there), CUDA's measured one elsewhere (a CPU run ignores it)."""
    return METAL_MB if platform == "darwin" else CUDA_MB


def entry_point() -> None:
    """Called by ``python -m engine`` and ``pomona``: this process is theirs to re-execute."""
    _entry[0] = True


def ensure_queue(memory_limit_gb: float, argv: list[str]) -> None:
    """Re-execute as ``python ARGV`` with the cap when this process trains under a limit,
    started without one, and is a CLI's own (a library caller, or a failed exec, gets
    ``queue_note``'s warning instead)."""
    env = queue_env(memory_limit_gb)
    if env and QUEUE_MB not in os.environ and _entry[0]:
        reexec(argv, env)


def queue_note(memory_limit_gb: float) -> tuple[int, str] | None:
    """The log level and line of a run under a limit: the cap it trains with (info), or
    that it has none (a warning); None without a limit."""
    if memory_limit_gb <= 0:
        return None
    if QUEUE_MB in os.environ:
        return logging.INFO, (f"memory limit {memory_limit_gb:g} GiB; MLX command buffers "
                              f"capped at {os.environ[QUEUE_MB]} MB ({QUEUE_MB})")
    return logging.WARNING, (
        f"memory limit {memory_limit_gb:g} GiB with MLX's default command buffers: on CUDA "
        f"the host may queue GBs past the limit, then wait buffer by buffer; start the "
        f"process with {QUEUE_MB}={bounded_mb()} (engine/host/command_queue.py)")
