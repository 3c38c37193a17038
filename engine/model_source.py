"""Where a model comes from: a local directory, a GGUF file, or a Hugging Face repo id.

One rule for every verb that takes ``--model``: a directory is read as it is; a ``.gguf``
file is imported once into the cache (engine/gguf_import.py), in a folder named by the
file's SHA-256, the importer's version and the dtype, and read from there; any other
string is a repo id for mlx-lm (its local snapshot, or a download). A path that looks
local but is not there is an error naming it, never a hub lookup.

    ~/.cache/pomona/models/gguf-<sha256[:20]>-bfloat16-v1/   ($XDG_CACHE_HOME honoured)
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from engine.digests import sha256_file
from engine.gguf_import import IMPORTER_VERSION, import_gguf

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


def imported_gguf(path: Path, dtype: str = GGUF_DTYPE) -> Path:
    """The cached import of GGUF ``path`` (made now when missing: a few seconds per
    hundred MB, with a line saying so)."""
    digest = sha256_file(path)
    target = cache_root() / f"gguf-{digest[:20]}-{dtype}-v{IMPORTER_VERSION}"
    if (target / "config.json").is_file():
        return target
    log.warning("importing %s (%.0f MB) into %s, once", path, path.stat().st_size / 1e6,
                target)
    try:
        return import_gguf(path, target, dtype=dtype)
    except FileExistsError:  # another process imported it meanwhile
        if (target / "config.json").is_file():
            return target
        raise


def local_model(model: str) -> str:
    """What mlx-lm loads for ``model``: a directory (a GGUF's cached import) or a repo id."""
    check_source(model)
    path = Path(model).expanduser()
    if path.is_file():
        return str(imported_gguf(path))
    return str(path) if path.is_dir() else model
