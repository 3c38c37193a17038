"""What a data file's schema says, read without its rows: which columns a tokenized file
(.parquet, .arrow, or .jsonl by its first row) holds, so a reader can tell prompts,
unpaired rows and pairs apart before it reads them."""

from __future__ import annotations

import json
from pathlib import Path


def holds_column(path: Path, column: str) -> bool:
    """Whether the data file ``path`` (.parquet, .arrow, .jsonl) has ``column``, read from
    its schema (or its first JSON row) alone; False where it cannot be read."""
    import pyarrow.parquet as pq

    try:
        if path.suffix == ".parquet":
            return column in pq.read_schema(path).names
        if path.suffix == ".arrow":
            import pyarrow as pa

            with pa.memory_map(str(path)) as source:
                return column in pa.ipc.open_file(source).schema.names
        if path.suffix == ".jsonl":
            with path.open(encoding="utf-8") as f:
                first = next((line for line in f if line.strip()), "{}")
            return column in json.loads(first)
    except (OSError, ValueError, TypeError, AttributeError):
        return False  # the pair reader says what is wrong with it, in one line
    return False
