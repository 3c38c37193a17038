"""Bounded asynchronous evaluation: the device works while Python builds the next graph.

The segmented backward and the bounded head evaluate stage by stage so that only one
stage's buffers live at a time. A synchronous ``mx.eval`` per stage leaves the device idle
while Python builds each graph (~1 ms a stage on an H200 at 2k tokens); ``async_eval``
alone queues every stage at once and, on CUDA, holds all their buffers.
"""

from __future__ import annotations

import os
from collections import deque

import mlx.core as mx


class InFlight:
    """Evaluate asynchronously with at most ``depth`` evaluations queued.

    Depth 1 is a synchronous eval per stage. Depth 2 builds stage i+1's graph while stage
    i runs, so the device never waits on Python; only two stages' buffers are alive. An
    unbounded queue (``async_eval`` alone) let CUDA hold every stage's buffers at once.
    """

    def __init__(self, depth: int = 2):
        if depth < 1:
            raise ValueError(f"inflight={depth}: must be at least 1")
        # The memory log reads the peak after each stage, so it wants them synchronous.
        self.depth = 1 if os.environ.get("POMONA_SEG_MEM_LOG") == "1" else depth
        self.queue: deque[tuple] = deque()

    def push(self, *arrays) -> None:
        mx.async_eval(*arrays)
        self.queue.append(arrays)
        while len(self.queue) >= self.depth:
            mx.eval(*self.queue.popleft())

    def drain(self) -> None:
        while self.queue:
            mx.eval(*self.queue.popleft())
