"""Pre-tokenized id columns checked before any id reaches the model.

An id at or past the vocabulary makes the embedding gather read outside its table (NaN
losses, or SIGSEGV on the CPU), a negative one indexes from the end, a float would be
truncated to an int and 2**40 overflows the int32 batches. So every row of the three id
columns is checked at load, vectorised over Arrow's flat values: each id an integer (an
integral float passes: JSON readers widen a whole column to float when one row holds
one), present, and in ``0 <= id < vocab``. A row that fails is a counted reject with its
reason (engine/data/pairs.py applies the bad-row limit); a column that holds no numbers at all
is an error naming the file and the column.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

ID_COLUMNS = ("prompt_ids", "chosen_ids", "rejected_ids")
INT32_IDS = 2**31  # without a model's vocabulary: what an int32 batch can hold
OUT_OF_RANGE = "token id out of range"
NOT_INTEGER = "token id not an integer"
MISSING = "token id missing (null)"
CODES = ("", MISSING, NOT_INTEGER, OUT_OF_RANGE)


@dataclass(frozen=True)
class BadId:
    """The first bad id of a row: why, in which column, and the value."""

    reason: str
    column: str
    value: Any

    def describe(self, vocab: int | None) -> str:
        """``chosen_ids`` holds 1000, outside the model's vocabulary of 512 ids (0-511)."""
        if self.reason == OUT_OF_RANGE:
            limit = (f"outside the model's vocabulary of {vocab} ids (0-{vocab - 1})" if vocab
                     else "outside 0 <= id < 2**31")
            return f"{self.column} holds {self.value!r}, {limit}"
        if self.reason == NOT_INTEGER:
            return f"{self.column} holds {self.value!r}, not an integer"
        return f"{self.column} holds a null id"


def check_id_types(table: Any, source: str, columns: tuple[str, ...] = ID_COLUMNS) -> None:
    """Raise ValueError naming ``source`` and the column unless each id column holds lists
    of numbers (a string or nested list cannot be a token id)."""
    import pyarrow as pa

    for name in columns:
        kind = table.schema.field(name).type
        listed = pa.types.is_list(kind) or pa.types.is_large_list(kind)
        item = kind.value_type if listed else None
        if not listed or not (pa.types.is_integer(item) or pa.types.is_floating(item)
                              or pa.types.is_null(item)):
            raise ValueError(f"{source}: column {name} is {kind}, expected lists of integer "
                             "token ids; tokenize text with `pomona data tokenize`")


def bad_id_rows(table: Any, vocab: int | None, columns: tuple[str, ...] = ID_COLUMNS
                ) -> dict[int, BadId]:
    """Row index → its first bad id, over the id ``columns`` (a pair's three; a prompt
    row's one) (``vocab`` None: only what an int32 batch cannot hold counts as out of
    range)."""
    bound = vocab or INT32_IDS
    bad: dict[int, BadId] = {}
    for name in columns:
        for row, problem in _column_problems(table.column(name), name, bound).items():
            bad.setdefault(row, problem)
    return bad


def _column_problems(column: Any, name: str, bound: int) -> dict[int, BadId]:
    import pyarrow as pa
    import pyarrow.compute as pc

    lists = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    flat = pc.list_flatten(lists)
    if not len(flat):
        return {}
    parents = np.asarray(pc.list_parent_indices(lists))
    if not (pa.types.is_floating(flat.type) or pa.types.is_integer(flat.type)):
        return {int(r): BadId(MISSING, name, None) for r in np.unique(parents)}  # all null
    null = ~np.asarray(flat.is_valid(), dtype=bool)
    code = np.zeros(len(flat), np.int8)  # index into CODES: 0 = a good id
    if pa.types.is_floating(flat.type):
        values = np.asarray(flat.fill_null(0.0), dtype=np.float64)
        with np.errstate(invalid="ignore"):
            fraction = ~np.isfinite(values) | (values != np.floor(values))
            outside = ~fraction & ((values < 0) | (values >= bound))
        code[fraction] = 2
    else:
        values = np.asarray(flat.fill_null(0))
        outside = values >= bound if values.dtype.kind == "u" else (values < 0) | (values >= bound)
    code[outside] = 3
    code[null] = 1
    bad = np.flatnonzero(code)
    rows, first = np.unique(parents[bad], return_index=True)  # each row's first bad id
    return {int(row): BadId(CODES[code[at]], name, None if null[at] else values[at].item())
            for row, at in zip(rows, bad[first], strict=True)}


def int_lists(column: Any) -> list[list[int] | None]:
    """The column as Python lists of ints (floats cast; call after ``bad_id_rows``, whose
    rows are dropped whatever the cast made of them)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    if not pa.types.is_integer(column.type.value_type):
        column = pc.cast(column, pa.list_(pa.int64()), safe=False)
    return column.to_pylist()
