"""Files that appear whole or not at all: one way to write them.

Every writer (adapters, checkpoints' files, reference log-probs, results, plots, rejects,
the hash cache) writes a unique temporary beside its target and renames it on: a crash or
a full disk leaves the previous file, never half of one, and the temporary never takes the
name of a file already there (made with O_EXCL). The error names the target. A file that
must never replace one (an export) is published with ``no_replace``: a hard link fails
where a file appeared at the name meanwhile, where ``os.replace`` would swap it out.
"""

from __future__ import annotations

import errno
import glob
import hashlib
import os
import shutil
import socket
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from engine.host.scratch import process_alive

# This host, in every temporary's name: a stale one is told from another host's, live, on a
# shared folder (a pid names a process on one host only).
HOST = hashlib.sha256(socket.gethostname().encode()).hexdigest()[:6]
Publish = Callable[[Path, Path], None]  # (tmp, path): put the written temporary at path
FULL = (errno.ENOSPC, errno.EDQUOT)


def temp_beside(path: str | Path, suffix: str = "") -> Path:
    """A new empty file beside ``path`` under a unique hidden name ending in ``suffix`` (made
    with O_EXCL, so no file already there is ever written over; mode per the umask, like
    any new file), to write and then ``os.replace`` onto ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    while True:
        tmp = path.with_name(f".{path.name}.{os.getpid()}-{os.urandom(4).hex()}{HOST}"
                             f".tmp{suffix}")
        try:
            os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
            return tmp
        except FileExistsError:
            continue


def no_replace(ours: Callable[[Path], bool] = lambda _: False) -> Publish:
    """Publish a temporary at a name only while no file is there, atomically: a file that
    appeared meanwhile (another export, a user's) is kept and OSError(EEXIST) raised,
    unless ``ours`` recognises it (the caller's own earlier output, the one replace)."""
    def publish(tmp: Path, path: Path) -> None:
        try:
            os.link(tmp, path)  # EEXIST where a file is there: never swapped out
        except FileExistsError:
            if not ours(path):
                raise _appeared() from None
            os.replace(tmp, path)
            return
        except OSError as err:
            if err.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV):
                raise
            _claim_then_replace(tmp, path)  # a disk without hard links (exFAT, some shares)
            return
        tmp.unlink()
    return publish


def _claim_then_replace(tmp: Path, path: Path) -> None:
    """Reserve ``path`` with O_EXCL (EEXIST where a file is there), then rename onto the
    empty placeholder this process made."""
    try:
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
    except FileExistsError:
        raise _appeared() from None
    os.replace(tmp, path)


def _appeared() -> FileExistsError:
    return FileExistsError(errno.EEXIST, "a file appeared there while this was written; it "
                           "is kept as it is")


def clean_stale(path: str | Path, suffix: str = "", older_s: float = 60.0) -> list[Path]:
    """Remove the temporaries ``temp_beside(path, suffix)`` made for a process that is dead
    now (killed mid-write: a whole model's bytes, never renamed on) and untouched for
    ``older_s``; return them. A live writer's, and any other host's, stays."""
    path = Path(path)
    gone = []
    for tmp in path.parent.glob(f".{glob.escape(path.name)}.*-*{HOST}.tmp{suffix}"):
        pid = tmp.name[len(path.name) + 2:].split("-", 1)[0]
        try:
            if (not pid.isdigit() or process_alive(int(pid))
                    or time.time() - tmp.lstat().st_mtime < older_s):
                continue
            tmp.unlink(missing_ok=True)
            gone.append(tmp)
        except OSError:  # the file went meanwhile
            continue
    return gone


def write_error(path: Path, err: BaseException) -> OSError | None:
    """One line naming ``path`` for a failed write, saying so where its disk is full:
    numpy's ``tofile`` reports it with no errno ("16384 requested and 11976 written"), MLX
    as a RuntimeError ("[write] Unable to write 8 bytes"), pyarrow as an ArrowException."""
    if not isinstance(err, OSError | RuntimeError) and not type(err).__module__.startswith(
            "pyarrow"):
        return None
    try:
        free = shutil.disk_usage(path.parent).free / 2**20
    except OSError:
        free = float("nan")
    code = getattr(err, "errno", None)
    if code in FULL or (code is None and free < 1):
        return OSError(errno.ENOSPC, f"cannot write {path}: no space left on its disk "
                                     f"({free:.0f} MiB free); free some and run again")
    if isinstance(err, OSError):
        return OSError(code, f"cannot write {path}: {err.strerror or err}")
    return OSError(errno.EIO, f"cannot write {path}: {err} ({free:.0f} MiB free on its disk)")


@contextmanager
def written(path: str | Path, suffix: str = "", tmp: Path | None = None,
            publish: Publish = os.replace) -> Iterator[Path]:
    """A temporary to write in the block (``tmp``: a fixed name, only inside a folder this
    process holds, engine/host/outputs.py's claim), put at ``path`` after by ``publish``
    (renamed onto it; ``no_replace()``: only where none is there). On any failure it is
    removed and an OSError names ``path`` (``write_error``)."""
    path = Path(path)
    tmp = tmp or temp_beside(path, suffix)
    try:
        yield tmp
        publish(tmp, path)
    except BaseException as err:
        tmp.unlink(missing_ok=True)
        mapped = write_error(path, err)
        if mapped is None:
            raise
        raise mapped from None


def write_atomic(path: str | Path, write: Callable[[Path], Any], suffix: str = "",
                 publish: Publish = os.replace) -> Path:
    """``write(tmp)`` then ``tmp`` put at ``path`` by ``publish``; return ``path``."""
    with written(path, suffix, publish=publish) as tmp:
        write(tmp)
    return Path(path)


def atomic_write_text(path: str | Path, text: str) -> Path:
    return write_atomic(path, lambda tmp: tmp.write_text(text))


def atomic_write_bytes(path: str | Path, data: bytes) -> Path:
    return write_atomic(path, lambda tmp: tmp.write_bytes(data))
