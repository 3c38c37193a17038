"""Where a run's work goes: one Ray cluster and what each trial holds on it.

The CLI builds this value once from ``--address``, ``--gpus`` and ``--resource`` (the
address checked then, before anything starts); a flow opens its session once and hands
the placement down, so no stage connects or builds a placement of its own. A deployment's
parameters carry it as a mapping, which Prefect turns back into this value.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from dataclasses import dataclass, field

from tasks.nodes.placement import Placement
from tasks.nodes.ray_session import check_address, ray_session


@dataclass(frozen=True)
class Cluster:
    """``address``: ``auto``, a head's HOST:PORT or ``ray://HOST:PORT`` (None: RAY_ADDRESS,
    else a private local Ray); ``placement``: a GPU, a custom resource or a CPU slot a
    trial."""

    address: str | None = None
    placement: Placement = field(default_factory=Placement)

    def __post_init__(self) -> None:
        check_address(self.address)  # RayAddressError: one line, before anything starts

    @classmethod
    def of(cls, address: str | None, gpus: bool = False,
           resource: str | None = None) -> Cluster:
        """The cluster the CLI's flags name."""
        return cls(address, Placement(gpus=int(gpus), resource=resource))

    def session(self) -> AbstractContextManager[None]:
        """Connected to it inside (tasks/nodes/ray_session.py); a process already
        connected keeps its connection."""
        return ray_session(self.address)
