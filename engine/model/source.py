"""Where a model comes from: a local directory, a GGUF file, or a Hugging Face repo id.

One rule for every verb that takes ``--model`` (``source_kind``): a directory is read as it
is; a ``.gguf`` file is imported once into the cache (engine/model/gguf_import.py), in a folder
named by the file's SHA-256, the importer's version and the dtype, and read from there; any
other string is a repo id for mlx-lm (its local snapshot, or a download). A path that looks
local but is not there is an error naming it, never a hub lookup. ``read_config`` is the one
reader of a model directory's ``config.json``.

    ~/.cache/pomona/models/gguf-<sha256[:20]>-bfloat16-v<importer version>/
    (the cache root's ``models/``: engine/host/cache.py; an import superseded by a newer
    importer is removed)
"""

from __future__ import annotations

import fcntl
import json
import logging
import shutil
from pathlib import Path
from typing import Any, Literal

from engine.host.cache import cache_root
from engine.host.digests import file_digest
from engine.model.gguf_import import IMPORTER_VERSION, MARK, gguf_layer_count, import_gguf

GGUF_DTYPE = "bfloat16"  # what a checkpoint ships as; `pomona model import` chooses others
Kind = Literal["dir", "gguf", "repo"]
log = logging.getLogger(__name__)


def source_kind(model: str) -> Kind:
    """Which of the three ``model`` names, cheaply (nothing is imported or downloaded).

    FileNotFoundError, naming it, for a file that is not a .gguf, or for a path that looks
    local (``/``, ``.`` or ``~`` first, two slashes, a .gguf suffix) but is not there: a repo
    id is ``org/name``."""
    path = Path(model).expanduser()
    if path.is_dir():
        return "dir"
    if path.is_file() and path.suffix == ".gguf":
        return "gguf"
    if path.is_file():
        raise FileNotFoundError(f"model {model}: a file, but not a .gguf; give a model "
                                "directory, a .gguf file or a Hugging Face repo id")
    if (model.startswith(("/", ".", "~")) or model.count("/") > 1 or model.endswith(".gguf")
            or path.exists()):
        raise FileNotFoundError(f"model not found: {model} (no such directory or .gguf file)")
    return "repo"


def models_cache() -> Path:
    """Imported and fetched checkpoints: ``models/`` of the one cache root
    (engine/host/cache.py)."""
    return cache_root() / "models"




def imported_gguf(path: Path, dtype: str = GGUF_DTYPE) -> Path:
    """The cached import of GGUF ``path`` (made now when missing: a few seconds per
    hundred MB, with a line saying so; imports of it by older importers are removed)."""
    digest = file_digest(path)
    stem = f"gguf-{digest[:20]}-{dtype}-v"
    target = models_cache() / f"{stem}{IMPORTER_VERSION}"
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.with_name(target.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one importer; the others wait, then read it
        if (target / "config.json").is_file():
            return target
        for old in models_cache().glob(f"{stem}*"):  # Pomona's own cache: superseded imports
            if old.name != target.name and (old / MARK).is_file():
                shutil.rmtree(old, ignore_errors=True)

        def said(done: int, total: int) -> None:  # once the file passed every check
            if done == 1:
                log.warning("importing %s (%.0f MB) into %s, once", path,
                            path.stat().st_size / 1e6, target)

        return import_gguf(path, target, dtype=dtype, progress=said)


def local_model(model: str) -> str:
    """What mlx-lm loads for ``model``: a directory (a GGUF's cached import) or a repo id."""
    kind = source_kind(model)
    if kind == "gguf":
        return str(imported_gguf(Path(model).expanduser()))
    return str(Path(model).expanduser()) if kind == "dir" else model


def hub_error(model: str, err: Exception) -> FileNotFoundError:
    """Repo id ``model`` failed in the hub client (its many error types): one line naming it
    (offline, a mistyped local path otherwise reads as a connection error)."""
    first = (str(err).strip().splitlines() or [type(err).__name__])[0]
    return FileNotFoundError(f"model {model!r}: no such directory here ({Path.cwd()}), and "
                             f"as a Hugging Face repo id: {first}")


def model_dir(model: str) -> Path:
    """The local directory of ``model``'s files: the directory itself, a GGUF's cached import,
    or a repo id's snapshot as mlx-lm keeps it (never a download); FileNotFoundError naming
    the model otherwise."""
    if source_kind(model) != "repo":
        return Path(local_model(model))
    from mlx_lm.utils import hf_repo_to_path  # the snapshot, restricted to what mlx-lm loads

    try:
        return Path(hf_repo_to_path(model))
    except Exception as err:  # not a repo id the hub client knows, or not downloaded
        raise hub_error(model, err) from err


def read_config(folder: str | Path) -> dict[str, Any]:
    """The ``config.json`` of model directory ``folder``, or an error in one line naming the
    file (FileNotFoundError when it is missing, ValueError when it is not a JSON object)."""
    path = Path(folder) / "config.json"
    try:
        config = json.loads(path.read_text())
    except FileNotFoundError as err:
        raise FileNotFoundError(f"{path}: no such file; a model directory holds its "
                                "config.json") from err
    except OSError as err:
        raise OSError(f"{path}: cannot read it ({err.strerror or err})") from err
    except ValueError as err:  # bad JSON, or bytes that are not UTF-8
        raise ValueError(f"{path}: not valid JSON ({err})") from err
    if not isinstance(config, dict):
        raise ValueError(f"{path}: a JSON {type(config).__name__}, not the object of model "
                         "settings config.json holds")
    return config


def layer_count(model: str) -> int | None:
    """Decoder layers as the model's files state them, no weights read: the config.json of
    a directory or of a repo id's local snapshot (a multimodal one's ``text_config``), a
    GGUF's ``block_count``; None where they do not say (a repo id not downloaded here)."""
    if source_kind(model) == "gguf":
        return gguf_layer_count(model)
    try:
        config = read_config(model_dir(model))
    except (OSError, ValueError):  # the probe's own load names what is wrong
        return None
    layers = config.get("num_hidden_layers") or (config.get("text_config") or {}).get(
        "num_hidden_layers")
    return int(layers) if layers else None
