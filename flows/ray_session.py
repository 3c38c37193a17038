"""Connecting to Ray for a sweep: a given cluster, or a private local one."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def ray_session(address: str | None) -> Iterator[None]:
    """Inside: connected to ``address`` (``auto`` or HOST:PORT), or, with none, to a private
    local Ray that never joins whatever else runs on this machine. Shut down after. A
    process already connected keeps its connection (and it is not shut down).

    Auth is Ray's own default, token auth on (Ray ≥ 2.59 for local clusters: it writes a
    token to ``~/.ray/auth_token``), unless the shell sets ``RAY_AUTH_MODE``. It is never
    changed from inside the process: Ray reads it once, at import, and a GCS started
    with another mode than the driver's aborts. A cluster's token comes from
    ``RAY_AUTH_TOKEN``, ``RAY_AUTH_TOKEN_PATH`` or ``~/.ray/auth_token`` (docs/cluster.md)."""
    import ray

    if ray.is_initialized():
        yield
        return
    if address:
        ray.init(address=address, log_to_driver=False)
    else:
        ray.init(num_cpus=os.cpu_count(), include_dashboard=False, log_to_driver=False)
    try:
        yield
    finally:
        ray.shutdown()
