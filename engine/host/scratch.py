"""Hidden work folders beside an output, that the next run removes if their writer died.

A model import writes a whole model into a hidden folder beside ``--out`` (or in the model
cache) and renames it into place, so ``--out`` never holds half a model. A killed import
used to leave that folder for good (343 MB beside ``--out``, 222 MB in the cache; a 7B
float32 import ~28 GB). Each work folder now holds an ``owner`` file that its writer keeps
locked (``fcntl.flock``: the kernel releases it when the writer exits or dies, whatever
its pid became); ``remove_stale`` deletes only folders of this form whose lock nobody
holds, and says which. A folder made without the lock (an older version, a user's) is
never touched. Standard library only.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

TAG = ".pomona-work-"  # in every work folder's name: what remove_stale looks at
OWNER = "owner"
log = logging.getLogger(__name__)


def remove_stale(parent: Path) -> list[Path]:
    """Delete the work folders in ``parent`` whose writer is dead (their owner lock is
    free); log and return them. A folder whose lock is held is in use: left alone."""
    removed = []
    for folder in sorted(Path(parent).glob(f".*{TAG}*")):
        owner = folder / OWNER
        try:
            fd = os.open(owner, os.O_RDONLY)
        except OSError:  # no owner file: not a folder this module made whole; leave it
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # its writer lives
            os.close(fd)
            continue
        try:
            pid = json.loads(owner.read_text()).get("pid", "unknown")
        except (OSError, ValueError, AttributeError):
            pid = "unknown"
        size = sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())
        shutil.rmtree(folder, ignore_errors=True)
        os.close(fd)
        log.warning("removed %s (%.0f MB), left by a killed import (pid %s, no longer "
                    "running)", folder, size / 1e6, pid)
        removed.append(folder)
    return removed


def process_alive(pid: int) -> bool:
    """Whether process ``pid`` exists on this host (another user's, that we may not
    signal, does): for temporaries named by host and pid, where no lock was kept."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@contextmanager
def work_folder(parent: Path, name: str) -> Iterator[Path]:
    """A new hidden folder in ``parent`` for building ``name``, locked as this process's
    while the block runs and removed after it; stale ones of earlier writers go first."""
    parent.mkdir(parents=True, exist_ok=True)
    remove_stale(parent)
    # Made under a name remove_stale skips and renamed once locked: no scan can see it
    # unlocked.
    fresh = Path(tempfile.mkdtemp(dir=parent, prefix=f".{name}.pomona-new-"))
    fd = os.open(fresh / OWNER, os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX)
    os.write(fd, (json.dumps({"pid": os.getpid()}) + "\n").encode())
    folder = fresh.with_name(fresh.name.replace(".pomona-new-", TAG))
    try:
        fresh.rename(folder)
        yield folder
    finally:
        shutil.rmtree(folder if folder.exists() else fresh, ignore_errors=True)
        os.close(fd)
