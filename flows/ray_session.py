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

    Token auth stays on unless the environment says otherwise (``RAY_AUTH_MODE``): a
    local Ray generates its own token; a cluster's token comes from ``RAY_AUTH_TOKEN``,
    ``RAY_AUTH_TOKEN_PATH`` or ``~/.ray/auth_token`` (docs/cluster.md)."""
    import ray

    if ray.is_initialized():
        yield
        return
    if address:
        ray.init(address=address, log_to_driver=False)
    else:
        os.environ.setdefault("RAY_AUTH_MODE", "token")
        ray.init(num_cpus=os.cpu_count(), include_dashboard=False, log_to_driver=False)
    try:
        yield
    finally:
        ray.shutdown()
