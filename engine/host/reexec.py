"""Re-running this Python process with more environment: for what is read only at start
(the dynamic loader's ``LD_PRELOAD``: engine/host/blas.py; MLX's queue limits, read at import:
engine/host/command_queue.py)."""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping


def reexec(args: list[str], env: Mapping[str, str]) -> None:
    """Replace this process by ``python ARGS`` with ``env`` added to its environment (output
    flushed first). Returns only when the exec failed; the caller goes on without it."""
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execve(sys.executable, [sys.executable, *args], {**os.environ, **env})
    except OSError:
        return
