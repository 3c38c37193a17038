"""One trial as a gang of ranks (``ranks_per_trial`` N): data parallel over several Macs.

A gang holds one Ray placement group of N bundles, each what one trial would hold alone
(a GPU: one Mac mini; a custom resource; or a CPU slot). Strategy SPREAD: ranks land on
different nodes when there are enough (GPU bundles on a cluster of one-GPU Macs always
do), and pack where they must (a laptop, tests). One fresh actor per bundle reports its
node's IP, a free port and whether it has a CUDA GPU. On GPU bundles that all have one,
every rank starts with NCCL's rendezvous at rank 0's address (``MLX_RANK``,
``MLX_WORLD_SIZE``, ``NCCL_HOST_IP``, ``NCCL_PORT``); otherwise (Macs, CPUs) the driver
builds the ring hostfile from the addresses (rank r listens on entry r, as ``mlx.launch
--backend ring`` writes it) and every rank starts with ``MLX_RANK`` and ``MLX_HOSTFILE``.
Either way ``engine.backward.distributed.init_ranks`` joins the group, as under ``mlx.launch``.
Rank 0 writes the adapter and its summary is the trial's.

If any rank dies, the others would wait in a collective forever: every rank is killed
and the attempt counts as lost (retried like a lost single actor). A rank that returns a
failure (a bad config, a non-finite loss), or rank 0 pruned by the study (it alone emits
metrics), ends the trial at once, the rest killed. The time limit kills every rank.
"""

from __future__ import annotations

import json
import os
import socket
import tempfile
import time
from pathlib import Path
from typing import Any

from engine.host.command_queue import queue_env
from tasks.nodes.placement import Placement
from tasks.sweep.attempts import Attempts, collect, relay
from tasks.sweep.trial import Summary, TrialActor, checked, outcome, where
from tasks.sweep.trial_plan import TrialPlan


def bundle(placement: Placement) -> dict[str, float]:
    """What one rank holds, as a placement-group bundle."""
    if placement.resource:
        return {placement.resource: 1}
    if placement.gpus:
        return {"GPU": 1}
    return {"CPU": placement.cpus}


def gang_capacity(placement: Placement, resources: dict[str, float]) -> int:
    """Ranks the cluster could hold at once for ``placement`` (one gang needs N)."""
    b = bundle(placement)
    return int(min(resources.get(k, 0) // v for k, v in b.items()))


def node_address() -> str:
    """This node's IP as Ray knows it (what other nodes reach it by)."""
    import ray

    return ray.util.get_node_ip_address()


def free_port(ip: str) -> int:
    """A TCP port free on ``ip`` now (the ring binds it a moment later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((ip, 0))
        return int(s.getsockname()[1])


def rendezvous(places: list[dict[str, Any]], gpus: bool) -> dict[str, Any]:
    """How the ranks find each other: NCCL at rank 0's address when every rank holds a
    CUDA GPU, else the ring over every rank's address (rank r listens on entry r)."""
    if gpus and all(p.get("cuda") for p in places):
        return {"backend": "nccl", "host": places[0]["ip"], "port": places[0]["port"],
                "size": len(places)}
    return {"backend": "ring", "hosts": [[f"{p['ip']}:{p['port']}"] for p in places]}


def rank_environment(meeting: dict[str, Any], rank: int, hostfile: str | None
                     ) -> dict[str, str]:
    """What ``mlx.launch`` exports for ``rank`` (ring: ``hostfile`` holds the hosts)."""
    if meeting["backend"] == "nccl":
        return {"MLX_RANK": str(rank), "MLX_WORLD_SIZE": str(meeting["size"]),
                "NCCL_HOST_IP": meeting["host"], "NCCL_PORT": str(meeting["port"])}
    return {"MLX_RANK": str(rank), "MLX_HOSTFILE": str(hostfile)}


def has_cuda() -> bool:
    import mlx.core as mx

    return mx.cuda.is_available()


# What a rank says when a peer's process or node went away under a collective: MLX's ring
# and NCCL speak before Ray declares the node dead (docs/design.md, lab cluster facts).
PEER_LOST = ("connection to a peer was lost", "[ring]", "NCCL error", "ncclRemoteError",
             "Connection reset by peer", "Broken pipe")


def peer_lost(reason: str) -> bool:
    """Whether a rank's failure is a lost peer (the gang retries whole), not its own."""
    return any(mark in reason for mark in PEER_LOST)


class RankActor(TrialActor):
    """The process one rank of a gang runs in."""

    def address(self) -> dict[str, Any]:
        ip = node_address()
        return {"ip": ip, "port": free_port(ip), "cuda": has_cuda(), **where()}

    def run_rank(self, plan: dict[str, Any], meeting: dict[str, Any], rank: int,
                 study: Any = None, metric: str = "val/loss",
                 inputs: dict[str, Any] | None = None, box: Any = None) -> Summary:
        """Rank ``rank`` of the trial ``TrialPlan.to_dict`` sent, on this node's copies of
        ``inputs`` (rank 0's outputs are the trial's)."""
        path = None
        if meeting["backend"] == "ring":
            fd, path = tempfile.mkstemp(prefix="pomona-hostfile-", suffix=".json")
            with os.fdopen(fd, "w") as f:
                json.dump(meeting["hosts"], f)
        for name in ("MLX_HOSTFILE", "MLX_WORLD_SIZE", "NCCL_HOST_IP", "NCCL_PORT"):
            os.environ.pop(name, None)  # a reused process: nothing of another backend
        os.environ.update(rank_environment(meeting, rank, path))
        try:
            return {**self.run(plan, study, metric, inputs, box), "rank": rank}
        finally:
            if path:
                os.unlink(path)


class Gang:
    """A strategy of the scheduler (tasks/sweep/attempts.py): each attempt as ``ranks`` ranks,
    one actor per bundle of a placement group."""

    def __init__(self, shared: Attempts, ranks: int, wait_s: float = 120.0):
        self.shared, self.ranks = shared, ranks
        self.wait_s = wait_s  # how long a gang may wait for its placement group

    def attempt(self, trial: TrialPlan, attempt: int, first: float) -> Summary | None:
        """One attempt of ``trial`` as ``ranks`` ranks; None when a rank was lost."""
        import ray
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        n, shared, live = self.ranks, self.shared, self.shared.live
        pg = placement_group([bundle(shared.placement)] * n, strategy="SPREAD")
        actors: list[Any] = []
        try:
            ready, _ = ray.wait([pg.ready()], timeout=self.wait_s)
            if not ready:
                return outcome(trial, "failed", f"gang: the cluster did not grant {n} × "
                               f"{bundle(shared.placement)} within {self.wait_s:g} s",
                               first, attempt + 1)
            cls = ray.remote(max_restarts=0, max_task_retries=0)(RankActor)
            for i in range(n):
                strategy = PlacementGroupSchedulingStrategy(placement_group=pg,
                                                            placement_group_bundle_index=i)
                actors.append(cls.options(**shared.placement.options(
                    queue_env(trial.config.memory_limit_gb)),
                                          scheduling_strategy=strategy).remote())
            if not live.register(trial.id, actors):
                return outcome(trial, "cancelled", "sweep interrupted", first, attempt + 1)
            places = ray.get([a.address.remote() for a in actors])
            meeting = rendezvous(places, bool(shared.placement.gpus))
            live.event("running", {"trial_id": trial.id, "attempt": attempt, **places[0],
                                   "backend": meeting["backend"],
                                   "hosts": [f"{p['node']} ({p['ip']}:{p['port']}, pid "
                                             f"{p['pid']})" for p in places],
                                   "pids": [p["pid"] for p in places]})
            # Only rank 0 reports to the study (it alone emits metrics); if it is pruned,
            # the others are killed with the gang.
            plan, inputs = trial.to_dict(), shared.files.for_config(trial.config)
            refs = [a.run_rank.remote(plan, meeting, i,
                                      *((shared.study, shared.metric) if i == 0 else
                                        (None, shared.metric)), inputs,
                                      shared.box if i == 0 else None)
                    for i, a in enumerate(actors)]
            summary = self._wait_all(trial, refs, attempt, first)
            if summary is None or summary.get("status") not in ("completed", "degenerate"):
                return summary
            ray.get([a.cleanup.remote() for a in actors[1:]])
            return collect(trial, actors[0], summary)
        except ray.exceptions.RayActorError as err:
            return live.lost(trial, attempt, first, "a rank died: " + str(err).splitlines()[0])
        except ray.exceptions.RayError as err:  # e.g. an argument that would not unpickle
            return outcome(trial, "failed", f"{type(err).__name__}: {err}"[:500], first,
                           attempt + 1)
        finally:
            live.release(trial.id)
            for a in actors:
                ray.kill(a)
            remove_placement_group(pg)

    def _wait_all(self, trial: TrialPlan, refs: list, attempt: int,
                  first: float) -> Summary | None:
        """Rank 0's summary once every rank finished; a lost rank → None; a failed one →
        it."""
        import ray

        limit = self.shared.time_limit_s
        deadline = time.time() + (limit or 1e12)
        results: dict[int, Summary] = {}
        pending = list(refs)
        out = Path(trial.config.out)
        relay(self.shared.box, trial.id, out, first=True)
        while pending:
            left = max(deadline - time.time(), 0.0)
            done, pending = ray.wait(pending, num_returns=1, timeout=min(left, 2.0))
            relay(self.shared.box, trial.id, out, first=False)
            if not done and time.time() < deadline:
                continue
            if not done:
                return outcome(trial, "failed", f"time_limit: over {limit:g} s (every rank "
                               "killed)", first, attempt + 1)
            try:
                summary = checked(trial, ray.get(done[0]), first, attempt + 1)
            except ray.exceptions.RayActorError as err:
                return self.shared.live.lost(trial, attempt, first,
                                             "a rank died: " + str(err).splitlines()[0])
            results[refs.index(done[0])] = summary
            if summary.get("status") == "failed" and peer_lost(summary.get("reason", "")):
                return self.shared.live.lost(trial, attempt, first, f"rank "
                                             f"{summary.get('rank')}: {summary['reason']}")
            if summary.get("status") in ("failed", "pruned"):  # the others would wait forever
                return {**summary, "reason": f"rank {summary.get('rank')}: "
                        f"{summary['reason']}", "world_size": len(refs)}
        main = results[0]
        return {**main, "world_size": len(refs),
                "hosts": [f"{r.get('node')} (pid {r.get('pid')})"
                          for _, r in sorted(results.items())]}
