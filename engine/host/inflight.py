"""Bounded asynchronous evaluation: the device works while Python builds the next graph.

The segmented backward and the bounded head evaluate stage by stage so that only one
stage's buffers live at a time. A synchronous ``mx.eval`` per stage leaves the device idle
while Python builds each graph (~1 ms a stage on an H200 at 2k tokens); ``async_eval``
alone queues every stage at once and, on CUDA, holds all their buffers.
"""

from __future__ import annotations

import os
import sys
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import mlx.core as mx

# Called with a phase name after each stage of a step; while any is registered (or the
# memory log is on) stages run one at a time, so a phase's time and peak are its own.
_observers: list[Callable[[str], None]] = []
_silent = [0]  # > 0 while a load-time check runs steps no one asked to watch
# While observed: host seconds spent queueing stages (``async_eval``: MLX builds and
# launches the kernels) and waiting for the device (``eval``); the rest of a stage's time
# is Python building its graph. ``bench train --profile`` reads them per stage.
clock = {"dispatch": 0.0, "wait": 0.0}


@contextmanager
def silent_phases() -> Iterator[None]:
    """Inside: phases are neither logged nor observed (engine/check/load_check.py)."""
    _silent[0] += 1
    try:
        yield
    finally:
        _silent[0] -= 1


@contextmanager
def observe_phases(fn: Callable[[str], None]) -> Iterator[None]:
    """Inside: ``fn(phase)`` after every stage (``bench profile`` times steps this way)."""
    _observers.append(fn)
    try:
        yield
    finally:
        _observers.remove(fn)


def phase_done(phase: str) -> None:
    """A stage finished: log the memory (POMONA_SEG_MEM_LOG=1) and tell the observers."""
    if _silent[0]:
        return
    if os.environ.get("POMONA_SEG_MEM_LOG") == "1":
        # The phase where the monotone peak jumps is where memory lives.
        print(f"[seg-mem] {phase}: peak {mx.get_peak_memory() / 2**20:.1f} MiB, "
              f"active {mx.get_active_memory() / 2**20:.1f} MiB", file=sys.stderr)
    for fn in list(_observers):
        fn(phase)


def _synchronous() -> bool:
    return os.environ.get("POMONA_SEG_MEM_LOG") == "1" or bool(_observers)


class InFlight:
    """Evaluate asynchronously with at most ``depth`` evaluations queued.

    Depth 1 is a synchronous eval per stage. Depth 2 builds stage i+1's graph while stage
    i runs, so the device never waits on Python; only two stages' buffers are alive. An
    unbounded queue (``async_eval`` alone) let CUDA hold every stage's buffers at once.
    """

    def __init__(self, depth: int = 2):
        if depth < 1:
            raise ValueError(f"inflight={depth}: must be at least 1")
        # The memory log and phase observers read each stage alone: synchronous then.
        self.depth = 1 if _synchronous() else depth
        self.queue: deque[tuple] = deque()

    def push(self, *arrays) -> None:
        if _observers:  # a profiled step: the host's part and the device's, apart
            t0 = time.perf_counter()
            mx.async_eval(*arrays)
            t1 = time.perf_counter()
            mx.eval(*arrays)  # observed stages are synchronous (depth 1)
            clock["dispatch"] += t1 - t0
            clock["wait"] += time.perf_counter() - t1
            return
        mx.async_eval(*arrays)
        self.queue.append(arrays)
        while len(self.queue) >= self.depth:
            mx.eval(*self.queue.popleft())

    def drain(self) -> None:
        while self.queue:
            mx.eval(*self.queue.popleft())
