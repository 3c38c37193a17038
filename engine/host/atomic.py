"""Files that appear whole or not at all: one way to write them.

Every writer (adapters, checkpoints' files, reference log-probs, results, plots, rejects,
the hash cache) writes a unique temporary beside its target and renames it on: a crash or
a full disk leaves the previous file, never half of one, and the temporary never takes the
name of a file already there (made with O_EXCL). The error names the target.
"""

from __future__ import annotations

import errno
import os
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any


def temp_beside(path: str | Path, suffix: str = "") -> Path:
    """A new empty file beside ``path`` under a unique hidden name ending in ``suffix`` (made
    with O_EXCL, so no file already there is ever written over; mode per the umask, like
    any new file), to write and then ``os.replace`` onto ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    while True:
        tmp = path.with_name(f".{path.name}.{os.getpid()}-{os.urandom(4).hex()}.tmp{suffix}")
        try:
            os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
            return tmp
        except FileExistsError:
            continue


@contextmanager
def written(path: str | Path, suffix: str = "", tmp: Path | None = None) -> Iterator[Path]:
    """A temporary to write in the block (``tmp``: a fixed name, only inside a folder this
    process holds, engine/host/outputs.py's claim), renamed onto ``path`` after. On any failure
    it is removed and an OSError names ``path``: MLX reports a failed write as a
    RuntimeError ("[write] Unable to write 8 bytes"), pyarrow as an ArrowException."""
    path = Path(path)
    tmp = tmp or temp_beside(path, suffix)
    try:
        yield tmp
        os.replace(tmp, path)
    except BaseException as err:
        tmp.unlink(missing_ok=True)
        if isinstance(err, OSError):
            raise OSError(err.errno, f"cannot write {path}: {err.strerror or err}") from None
        if isinstance(err, RuntimeError) or type(err).__module__.startswith("pyarrow"):
            free = shutil.disk_usage(path.parent).free / 2**20
            raise OSError(errno.EIO, f"cannot write {path}: {err} ({free:.0f} MiB free "
                                     "on its disk)") from None
        raise


def write_atomic(path: str | Path, write: Callable[[Path], Any], suffix: str = "") -> Path:
    """``write(tmp)`` then ``tmp`` renamed onto ``path``; return ``path``."""
    with written(path, suffix) as tmp:
        write(tmp)
    return Path(path)


def atomic_write_text(path: str | Path, text: str) -> Path:
    return write_atomic(path, lambda tmp: tmp.write_text(text))


def atomic_write_bytes(path: str | Path, data: bytes) -> Path:
    return write_atomic(path, lambda tmp: tmp.write_bytes(data))
