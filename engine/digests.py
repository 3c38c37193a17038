"""Content digests the engine and the data tasks share: a file's SHA-256 and a tokenizer's
fingerprint.

``pomona data tokenize`` writes ``tokenizer_hash(model_dir)`` into a dataset's manifest
(DESIGN.md, the data contract); the trainer, scoring and evaluation compute it again for
the model they load and refuse data tokenized for another vocabulary (engine/data_fit.py).
Both sides must hash alike, so the one definition lives here, below both. Standard
library only.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

# What decides how text becomes ids: the tokenizer itself and the settings of its config
# that change an encoding. A copy written by another tool (mlx_lm.convert re-saves the
# tokenizer with its own class name and load flags) is the same tokenizer.
TOKENIZER_FILES = ("tokenizer.json", "special_tokens_map.json", "chat_template.jinja",
                   "tokenizer.model")
ENCODING_KEYS = ("add_bos_token", "add_eos_token", "add_prefix_space", "bos_token",
                 "eos_token", "unk_token", "pad_token", "added_tokens_decoder",
                 "chat_template", "legacy")


def sha256_file(path: str | Path) -> str:
    """Hex SHA-256 of ``path``'s bytes, read in 1 MiB blocks."""
    h = hashlib.sha256()
    with Path(path).open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _canonical(path: Path) -> bytes:
    """A JSON file's content whatever its layout (a file that is not JSON: its bytes)."""
    try:
        return json.dumps(json.loads(path.read_text()), sort_keys=True).encode()
    except (ValueError, UnicodeDecodeError):
        return path.read_bytes()


def tokenizer_hash(model_dir: str | Path) -> str:
    """The fingerprint of ``model_dir``'s tokenizer: its TOKENIZER_FILES' names and content
    (JSON read, not its bytes) and the ENCODING_KEYS of ``tokenizer_config.json``."""
    h = hashlib.sha256()
    for name in TOKENIZER_FILES:
        if (Path(model_dir) / name).exists():
            h.update(name.encode() + hashlib.sha256(_canonical(Path(model_dir) / name))
                     .hexdigest().encode())
    config_path = Path(model_dir) / "tokenizer_config.json"
    if config_path.exists():
        try:
            config = json.loads(config_path.read_text())
        except ValueError:
            config = {"unreadable": config_path.read_text(errors="replace")}
        kept = {k: config.get(k) for k in ENCODING_KEYS} if isinstance(config, dict) else config
        h.update(b"tokenizer_config.json" + json.dumps(kept, sort_keys=True).encode())
    return h.hexdigest()
