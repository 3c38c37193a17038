"""The next step's micro-batches, built on a worker thread while this step runs."""

from __future__ import annotations

from collections.abc import Callable


class Prefetch:
    """Builds the next step's micro-batches on a worker thread while this step runs: the
    numpy layouts then cost no device time (MLX releases the GIL while it evaluates).
    The order is the iterator's own, so runs stay deterministic; ``steps`` bounds it.
    ``ahead`` False: each made when asked for (online pairs sample the policy as updated)."""

    def __init__(self, make: Callable[[], list], steps: int, ahead: bool = True):
        from concurrent.futures import ThreadPoolExecutor

        self.make, self.left, self.ahead = make, steps, ahead
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pomona-batches")
        self.pending = self.pool.submit(make) if steps > 0 and ahead else None

    def next(self) -> list:
        if not self.ahead:  # batches the policy samples: made after the last update
            self.left -= 1
            return self.make()
        micro = self.pending.result()
        self.left -= 1
        self.pending = self.pool.submit(self.make) if self.left > 0 else None
        if self.pending is None:
            self.pool.shutdown(wait=False)
        return micro
