"""A slot's warm actor (``reuse_actors: true``, Ray Tune's name): the process a worker thread's
last trial ran in, kept for its next trial instead of a fresh one, saving the process's start
and its imports (about 3 s a trial on CPU: docs/performance.md, ``pomona bench sweep``).

A trial starts in it from the state a fresh process gives: each run loads its model, draws its
LoRA and batches from its own seed and sets its memory limit for itself (engine/train/), and
the actor's queue settings (engine/host/command_queue.py) are part of what it is kept for. It
is kept only after a trial that completed, while the process holds less than its limit (the
trial's ``memory_limit_gb``, else half the node's memory); anything else (a failed, lost,
diverged or cancelled trial, other queue settings) gets a fresh process.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

MEMORY_SHARE = 0.5  # of the node's memory, where the trial sets no limit of its own


def env_key(env: dict[str, str]) -> tuple[tuple[str, str], ...]:
    """What an actor was started with, as the slot compares it."""
    return tuple(sorted(env.items()))


def resident_gb() -> tuple[float, float]:
    """This process's resident memory and the node's total, in GiB (the actor's side)."""
    import psutil

    return psutil.Process().memory_info().rss / 2**30, psutil.virtual_memory().total / 2**30


@dataclass
class WarmSlot:
    """One worker thread's kept actor, if any, and the settings it was started with."""

    key: tuple[tuple[str, str], ...] = ()
    actor: Any = None

    def take(self, key: tuple[tuple[str, str], ...]) -> Any:
        """The kept actor when it was started as ``key`` asks (it leaves the slot), else
        None (a kept one of other settings killed)."""
        actor, self.actor = self.actor, None
        if actor is not None and self.key == key:
            return actor
        kill(actor)
        return None

    def keep(self, key: tuple[tuple[str, str], ...], actor: Any, memory_limit_gb: float) -> bool:
        """Keep ``actor`` for the next trial if its process fits its limit; whether kept."""
        import ray

        held, total = ray.get(actor.resident_gb.remote())
        if held >= (memory_limit_gb if memory_limit_gb > 0 else MEMORY_SHARE * total):
            return False
        self.key, self.actor = key, actor
        return True

    def close(self) -> None:
        """The kept actor killed (the worker's trials are done)."""
        kill(self.actor)
        self.actor = None


def kill(actor: Any) -> None:
    if actor is not None:
        import ray

        ray.kill(actor)
