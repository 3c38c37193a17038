"""The training step, one after another: what every path that trains runs, the trainer's
loop (engine/train/trainer.py), the memory probe (engine/train/probe.py) and the timing
benchmarks (benchmarks/trainer_timing.py), so what they measure is what trains.

    stepper = Stepper(model, stack, cfg.loss_spec(), cfg, ranks, update)
    for done in stepper.steps(next_micro_batches, first=1, last=cfg.steps): ...

Per step: the micro-batches prefetched on a thread while the last step ran
(engine/host/prefetch.py), their gradients dispatched (engine/backward/step.py), the compiled
clip + AdamW update (engine/backward/update.py) queued before the host waits, one barrier a
step; then the loss read, and a non-finite loss or norm stops the run before anything is
saved.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from engine.backward.distributed import Ranks
from engine.backward.step import dispatch_grads
from engine.host.prefetch import Prefetch
from engine.losses.spec import LossSpec
from engine.settings.config import TrainConfig


class NonFiniteLoss(RuntimeError):
    """The loss or gradient norm became NaN/inf; names the step and the pairs."""


@dataclass(frozen=True)
class StepDone:
    """One step's outcome, read on the host: every rank's loss and sums, its tokens."""

    step: int
    loss: float
    sums: dict[str, float]
    grad_norm: float
    tokens: int  # every rank's
    seconds: float
    pairs: int  # this rank's


@dataclass(frozen=True)
class Stepper:
    """What a step needs: the model set up (engine/train/prepared.py), its loss, the config
    whose levers it runs, the ranks it is split over and the compiled update."""

    model: Any
    stack: Any
    loss: LossSpec
    cfg: TrainConfig
    ranks: Ranks
    update: Callable[[Any], Any]

    def steps(self, batches: Callable[[], list], first: int, last: int, ahead: bool = True
              ) -> Iterator[StepDone]:
        """Steps ``first`` to ``last``, each on the micro-batches one call of ``batches``
        makes (built ahead on a thread; ``ahead`` False: after the last step's update)."""
        prefetch = Prefetch(batches, last - first + 1, ahead)
        for step in range(first, last + 1):
            t0 = time.perf_counter()
            micro = prefetch.next()
            pending = dispatch_grads(self.model, self.stack, micro, self.loss, self.cfg,
                                     step, self.ranks)
            norm = self.update(pending.grads)  # queued before the host waits
            loss, sums = pending.read(self.ranks)
            grad_norm = float(norm)
            check_finite(step, loss, grad_norm, micro)
            tokens = int(sums.pop("tokens"))
            yield StepDone(step, loss, sums, grad_norm, tokens, time.perf_counter() - t0,
                           sum(len(b.ids) for b in micro))


def check_finite(step: int, loss: float, grad_norm: float, micro: Sequence) -> None:
    """NonFiniteLoss naming the step and its first pairs when the loss or the norm is not
    finite (the run stops: this update is never saved)."""
    for name, value in (("loss", loss), ("grad norm", grad_norm)):
        if not math.isfinite(value):
            raise NonFiniteLoss(f"step {step}: {name} {value} on pairs "
                                f"{[i for b in micro for i in b.ids][:8]}")
