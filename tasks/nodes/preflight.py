"""Before any trial: every node that will get work runs the same Pomona, MLX, Ray and Python.

One tiny task pinned to each live node that offers the placement's resource reports its
versions (Pomona's as the digest of its source files, so an edited or older checkout is
seen), its free disk and its resources. A node that differs from the driver is refused in
one line naming the node and both versions: a worker on another Pomona would otherwise
run silently, or crash the driver on a summary of another shape.
"""

from __future__ import annotations

import hashlib
import platform
import shutil
import socket
from pathlib import Path
from typing import Any

from engine.host.cache import cache_root
from tasks.nodes.placement import Placement

PACKAGES = ("engine", "tasks", "flows")  # Pomona's code: what a worker imports
COMPARED = ("pomona", "mlx", "ray", "python")


class PreflightError(RuntimeError):
    """A node that would get work differs from the driver."""


def source_digest() -> str:
    """SHA-256 over Pomona's Python files (relative path and bytes), as imported here."""
    import engine

    root = Path(engine.__file__).resolve().parent.parent
    h = hashlib.sha256()
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            h.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes())
    return h.hexdigest()


def node_report() -> dict[str, Any]:
    """This node's versions, host and free disk (where Pomona caches inputs)."""
    from importlib.metadata import version

    cache = cache_root()
    cache.mkdir(parents=True, exist_ok=True)
    return {"pomona": source_digest(), "mlx": version("mlx"), "ray": version("ray"),
            "python": platform.python_version(), "host": socket.gethostname(),
            "free_gb": round(shutil.disk_usage(cache).free / 2**30, 1)}


def offers(node: dict[str, Any], placement: Placement) -> bool:
    """Whether a node (``ray.nodes()``) can hold one trial of ``placement``."""
    have = node.get("Resources", {})
    if placement.resource:
        return have.get(placement.resource, 0) >= 1
    if placement.gpus:
        return have.get("GPU", 0) >= 1
    return have.get("CPU", 0) >= placement.cpus


def preflight(placement: Placement, timeout_s: float = 120.0) -> list[dict[str, Any]]:
    """Every live node that can get work, checked against this process; the reports.
    PreflightError (one line) on the first difference or a node that does not answer."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    ours = node_report()
    nodes = [n for n in ray.nodes() if n.get("Alive") and offers(n, placement)]
    report = ray.remote(num_cpus=0)(node_report)
    refs = [report.options(scheduling_strategy=NodeAffinitySchedulingStrategy(
        n["NodeID"], soft=False)).remote() for n in nodes]
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
    reports = []
    for node, ref in zip(nodes, refs, strict=True):
        where = f"node {node.get('NodeManagerAddress')}"
        if ref not in ready:
            raise PreflightError(f"{where}: did not answer the preflight within "
                                 f"{timeout_s:g} s; is it overloaded or cut off?")
        theirs = ray.get(ref)
        for key in COMPARED:
            if theirs[key] != ours[key]:
                shown = (lambda v: v[:12]) if key == "pomona" else str
                raise PreflightError(
                    f"{where} ({theirs['host']}): {key} {shown(theirs[key])} there, "
                    f"{shown(ours[key])} on the driver; install the same {key} on every "
                    "node (docs/cluster.md)")
        reports.append({**theirs, "ip": node.get("NodeManagerAddress"),
                        "resources": node.get("Resources", {})})
    return reports
