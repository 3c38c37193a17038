"""Where a model comes from: a local directory, a GGUF file, or a Hugging Face repo id.

One rule for every verb that takes ``--model``: a directory is read as it is; a ``.gguf``
file is imported once into the cache (engine/gguf_import.py), in a folder named by the
file's SHA-256, the importer's version and the dtype, and read from there; any other
string is a repo id for mlx-lm (its local snapshot, or a download). A path that looks
local but is not there is an error naming it, never a hub lookup.

    ~/.cache/pomona/models/gguf-<sha256[:20]>-bfloat16-v<importer version>/
    ($XDG_CACHE_HOME honoured; an import superseded by a newer importer is removed)
"""

from __future__ import annotations

import fcntl
import logging
import os
import shutil
from pathlib import Path

from engine.digests import sha256_file
from engine.gguf_import import IMPORTER_VERSION, MARK, import_gguf

GGUF_DTYPE = "bfloat16"  # what a checkpoint ships as; `pomona model import` chooses others
log = logging.getLogger(__name__)


def looks_local(model: str) -> bool:
    """A filesystem path rather than a repo id (``org/name``)."""
    return (model.startswith(("/", ".", "~")) or model.count("/") > 1
            or model.endswith(".gguf") or Path(model).expanduser().exists())


def check_source(model: str) -> None:
    """FileNotFoundError unless ``model`` is a directory, a GGUF file or a repo id (cheap:
    nothing is imported or downloaded)."""
    path = Path(model).expanduser()
    if path.is_dir() or (path.is_file() and path.suffix == ".gguf"):
        return
    if path.is_file():
        raise FileNotFoundError(f"model {model}: a file, but not a .gguf; give a model "
                                "directory, a .gguf file or a Hugging Face repo id")
    if looks_local(model):
        raise FileNotFoundError(f"model not found: {model} (no such directory or .gguf file)")


def cache_root() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(root) / "pomona" / "models"


_digests: dict[tuple, str] = {}  # (path, size, mtime, inode) -> SHA-256, this process


def gguf_digest(path: Path) -> str:
    """SHA-256 of ``path``, hashed once per process while its size, mtime and inode hold
    (a model is looked up by every loader: 8 s a time for a 5 GB file)."""
    st = path.stat()
    key = (str(path.resolve()), st.st_size, st.st_mtime_ns, st.st_ino)
    if key not in _digests:
        _digests[key] = sha256_file(path)
    return _digests[key]


def imported_gguf(path: Path, dtype: str = GGUF_DTYPE) -> Path:
    """The cached import of GGUF ``path`` (made now when missing: a few seconds per
    hundred MB, with a line saying so; imports of it by older importers are removed)."""
    digest = gguf_digest(path)
    stem = f"gguf-{digest[:20]}-{dtype}-v"
    target = cache_root() / f"{stem}{IMPORTER_VERSION}"
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.with_name(target.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one importer; the others wait, then read it
        if (target / "config.json").is_file():
            return target
        for old in cache_root().glob(f"{stem}*"):  # Pomona's own cache: superseded imports
            if old.name != target.name and (old / MARK).is_file():
                shutil.rmtree(old, ignore_errors=True)
        log.warning("importing %s (%.0f MB) into %s, once", path, path.stat().st_size / 1e6,
                    target)
        return import_gguf(path, target, dtype=dtype)


def local_model(model: str) -> str:
    """What mlx-lm loads for ``model``: a directory (a GGUF's cached import) or a repo id."""
    check_source(model)
    path = Path(model).expanduser()
    if path.is_file():
        return str(imported_gguf(path))
    return str(path) if path.is_dir() else model
