"""Reading tokenized pairs (pyarrow alone) and ordering them into batches.

Reads the data contract of docs/design.md — a dataset directory of Parquet/Arrow shards with a
``manifest.json``, a single ``.parquet``/``.arrow`` file, or ``.jsonl`` with the same
columns: ``prompt_ids``, ``chosen_ids``, ``rejected_ids`` (and optional ``id``, ``split``).
Unusable rows (an empty response; a token id that is not an integer, is missing or lies
outside the model's vocabulary: engine/data/token_ids.py) are counted by reason and reported,
never silently dropped or trained on as NaN; above ``MAX_BAD_FRACTION`` of the rows (the
limit ``pomona data tokenize`` applies) loading fails, naming the file and a bad row.

Three splits: ``train``; ``valid``, which training reports and a sweep ranks and prunes on;
and ``test``, read only by the final evaluation, so the number a leaderboard reports was
never used to choose anything. Datasets written before the test split existed carry
``split`` values of train/valid only: they load with an empty ``test``.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from engine.data.batch import Pair
from engine.data.shards import check_dataset
from engine.data.splits import MAX_BAD_FRACTION, TEST_FRACTION, VALID_FRACTION, check_fractions
from engine.data.token_ids import ID_COLUMNS, BadId, bad_id_rows, check_id_types, int_lists
from engine.data.unpaired import (
    LABEL,
    as_pair_columns,
    is_unpaired,
    tokenized_max_length,
    with_partners,
)
from engine.host.outputs import reading

COLUMNS = ID_COLUMNS
SPLITS = ("train", "valid", "test")
log = logging.getLogger(__name__)


def split_notes(counts: dict[str, int], valid_fraction: float, test_fraction: float
                ) -> list[str]:
    """One note per empty valid or test split of a dataset's ``counts`` (split_counts);
    ValueError when the train split is empty (small data, large fractions)."""
    total = sum(counts.values())
    if total and not counts.get("train"):
        raise ValueError(f"--valid-fraction {valid_fraction} and --test-fraction "
                         f"{test_fraction} leave no train rows (of {total}: "
                         f"{counts.get('valid', 0)} valid, {counts.get('test', 0)} test); "
                         "lower them or add rows")
    notes = []
    if total and not counts.get("valid"):
        notes.append(f"the valid split is empty (--valid-fraction {valid_fraction} of "
                     f"{total} rows): training reports no validation metrics and a sweep "
                     "cannot rank its trials")
    if total and not counts.get("test"):
        notes.append(f"the test split is empty (--test-fraction {test_fraction} of {total} "
                     "rows): the leaderboard will report no test metrics")
    return notes


def stable_split(row_id: str, valid_fraction: float = VALID_FRACTION,
                 test_fraction: float = TEST_FRACTION) -> str:
    """train/valid/test by a hash of the id: adding rows never moves old rows across splits.

    u = hash / 2**64: valid below ``valid_fraction`` (as before the test split existed, so
    valid keeps its rows), test in the next ``test_fraction``, carved out of old train."""
    u = int.from_bytes(hashlib.blake2b(row_id.encode(), digest_size=8).digest(), "big") / 2**64
    if u < valid_fraction:
        return "valid"
    return "test" if u < valid_fraction + test_fraction else "train"


def split_counts(splits: list[str]) -> dict[str, int]:
    """Rows per split (a manifest's ``rows``)."""
    return {name: splits.count(name) for name in SPLITS}


@dataclass
class RowCounts:
    """What reading a dataset left out: the reasons rows were refused, the rows read."""

    rejected: Counter = field(default_factory=Counter)
    read: int = 0  # rows in the file, usable or not
    first_bad: str = ""  # the first unusable row: "row 3 (id 'a'): why"

    def skipped_note(self) -> str:
        """How many rows were left out and why, or "" when none was."""
        bad = sum(self.rejected.values())
        if not bad:
            return ""
        why = ", ".join(f"{reason} ({n})" for reason, n in self.rejected.most_common())
        return f"skipped {bad} of {self.read} rows: {why}; first: {self.first_bad}"


@dataclass
class PairSet(RowCounts):
    """Pairs of one dataset, by split, with the reasons rows were left out."""

    train: list[Pair] = field(default_factory=list)
    valid: list[Pair] = field(default_factory=list)
    test: list[Pair] = field(default_factory=list)
    unpaired: bool = False  # KTO's unpaired rows, each with its KL partner (unpaired.py)

    def split(self, name: str) -> list[Pair]:
        """The pairs of split ``name`` (train, valid or test)."""
        if name not in SPLITS:
            raise ValueError(f"unknown split {name!r}: expected one of {', '.join(SPLITS)}")
        return getattr(self, name)


def _read_table(path: Path):
    import pyarrow as pa
    import pyarrow.dataset as ds
    import pyarrow.json as pj

    if path.is_dir():
        try:  # only a complete dataset has its manifest (written last, atomically)
            shards = json.loads((path / "manifest.json").read_text())["shards"]
        except (FileNotFoundError, KeyError, json.JSONDecodeError) as err:
            raise FileNotFoundError(f"{path}: not a complete dataset directory (no valid "
                                    "manifest.json); run `pomona data tokenize` first") from err
        check_dataset(path)  # the bytes tokenize wrote, split by prompt
        files = [path / s for s in shards]
        fmt = "parquet" if not files or files[0].suffix == ".parquet" else "ipc"
        return _readable(path, lambda: ds.dataset([str(f) for f in files], format=fmt).to_table())
    if path.suffix == ".jsonl":
        return _readable(path, lambda: pj.read_json(path))
    if path.suffix == ".parquet":
        return _readable(path, lambda: ds.dataset(str(path), format="parquet").to_table())
    if path.suffix == ".arrow":
        def ipc() -> pa.Table:
            with pa.memory_map(str(path)) as source:
                return pa.ipc.open_file(source).read_all()
        return _readable(path, ipc)
    raise ValueError(f"{path}: unsupported data file; expected a dataset directory, "
                     ".parquet, .arrow or .jsonl")


def _readable(path: Path, read: Callable[[], Any]) -> Any:
    """``read()``, its Arrow error (a string where an id should be, a truncated shard)
    turned into one line naming ``path``."""
    import pyarrow as pa

    try:
        return read()
    except (pa.ArrowException, OSError) as err:
        first = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise ValueError(f"{path}: cannot read it as tokenized pairs ({first}); token-id "
                         "columns hold lists of integers") from None


PROMPT_COLUMN = "answer"  # what a prompts dataset holds beside prompt_ids (engine/data/prompts.py)


def read_data(path: Path) -> Any:
    """The table at ``path`` (a dataset folder, .parquet, .arrow or .jsonl), read while no
    writer replaces a folder."""
    with reading(path) if path.is_dir() else nullcontext():
        return _read_table(path)


def load_pairs(path: str | Path, valid_fraction: float = VALID_FRACTION,
               test_fraction: float = TEST_FRACTION, vocab: int | None = None,
               max_bad_fraction: float = MAX_BAD_FRACTION) -> PairSet:
    """All usable pairs of ``path`` by split: the ``split`` column where a row has one
    (train/valid/test; a dataset written before the test split has none in test), else a
    stable hash of the id. Token ids must be integers in ``[0, vocab)`` (``vocab`` None:
    what int32 holds); ValueError naming the file and the first bad row when more than
    ``max_bad_fraction`` of the rows are unusable."""
    check_fractions(valid_fraction, test_fraction)
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"data not found: {path}")
    table = read_data(path)
    missing = [c for c in COLUMNS if c not in table.column_names]
    if missing and PROMPT_COLUMN in table.column_names:  # prompts: GRPO's, not a pair loss's
        raise ValueError(f"{path}: a prompts dataset (prompts and answers, no chosen or "
                         "rejected response): a pair loss trains on pairs; train it with "
                         "--loss grpo --reward SCORER")
    unpaired = is_unpaired(table)
    if unpaired:  # KTO's rows: a completion and a label (engine/data/unpaired.py)
        table, missing = as_pair_columns(table), []
    if missing:
        raise ValueError(f"{path}: missing column(s) {', '.join(missing)}; "
                         f"found {', '.join(table.column_names)}")
    check_id_types(table, str(path))
    bad_ids = bad_id_rows(table, vocab)
    cols = {c: int_lists(table.column(c)) for c in COLUMNS}
    ids = (table.column("id").to_pylist() if "id" in table.column_names
           else [f"row-{i}" for i in range(table.num_rows)])
    splits = table.column("split").to_pylist() if "split" in table.column_names else None
    labels = table.column(LABEL).to_pylist() if unpaired else [None] * table.num_rows
    out = PairSet(read=table.num_rows, unpaired=unpaired)
    for i in range(table.num_rows):
        row_id = f"row-{i}" if ids[i] is None else str(ids[i])
        pair = Pair(row_id, cols["prompt_ids"][i] or [], cols["chosen_ids"][i] or [],
                    cols["rejected_ids"][i] or [], label=labels[i])
        bad: BadId | None = bad_ids.get(i)
        reason = bad.reason if bad else pair.problem()
        if reason is None and unpaired and not isinstance(labels[i], bool):
            reason = "label not true or false"
        if reason is not None:
            out.rejected[reason] += 1
            out.first_bad = out.first_bad or (
                f"row {i} (id {pair.id!r}): {bad.describe(vocab) if bad else reason}")
            continue
        split = (splits[i] if splits else None) or stable_split(pair.id, valid_fraction,
                                                                  test_fraction)
        if split not in SPLITS:
            raise ValueError(f"{path}: row {i} (id {pair.id!r}) has split {split!r}; expected "
                             f"one of {', '.join(SPLITS)}, or none for a hash of the id")
        out.split(split).append(pair)
    if unpaired:  # each row's second branch: its KL partner's completion
        longest = tokenized_max_length(path) if path.is_dir() else None
        out.train, out.valid, out.test = (with_partners(out.split(s), longest) for s in SPLITS)
    check_bad_rows(out, path, max_bad_fraction)
    return out


def check_bad_rows(pairs: RowCounts, path: Path, limit: float = MAX_BAD_FRACTION) -> None:
    """Raise ValueError when more than ``limit`` of ``pairs``' rows were unusable (the
    bad-row limit of ``pomona data tokenize``); otherwise log how many were left out."""
    bad = sum(pairs.rejected.values())
    if not bad:
        return
    if bad / pairs.read > limit:
        why = ", ".join(f"{reason} ({n})" for reason, n in pairs.rejected.most_common(3))
        raise ValueError(f"{path}: {bad} of {pairs.read} rows ({bad / pairs.read:.1%}) are "
                         f"unusable, above the {limit:.0%} limit: {why}; first: "
                         f"{pairs.first_bad}. Fix or drop those rows, or tokenize text with "
                         "`pomona data tokenize --model` for this model")
    log.warning("%s: %s", path, pairs.skipped_note())


def check_train_split(pairs: PairSet, source: str | Path) -> None:
    """Raise ValueError when ``pairs`` hold no train row (a run would train on nothing)."""
    if not pairs.train:
        raise ValueError(f"{source}: no train rows (valid {len(pairs.valid)}, test "
                         f"{len(pairs.test)}); re-split it with smaller --valid-fraction and "
                         "--test-fraction, or give rows split \"train\"")


def pair_length(p: Pair) -> int:
    return len(p.prompt) + max(len(p.chosen), len(p.rejected))


def epoch_batches(pairs: list[Pair], batch_size: int, seed: int, epoch: int,
                  bucket: int = 64) -> list[list[int]]:
    """Batch indices for one epoch: shuffled, then length-sorted within buckets of
    ``bucket`` batches so rows of a batch have similar length (less padding).
    A pure function of (seed, epoch): resuming needs no saved RNG state."""
    rng = np.random.default_rng([seed, epoch])
    order = rng.permutation(len(pairs))
    batches: list[list[int]] = []
    span = batch_size * bucket
    for s in range(0, len(order), span):
        chunk = sorted(order[s : s + span].tolist(), key=lambda i: pair_length(pairs[i]))
        batches += [chunk[j : j + batch_size] for j in range(0, len(chunk), batch_size)]
    return [batches[i] for i in rng.permutation(len(batches))]


def micro_batches(pairs: list[Pair], batch_size: int, seed: int,
                  start: int = 0) -> Iterator[list[Pair]]:
    """Endless micro-batches over epochs, from the ``start``-th micro-batch on."""
    if not pairs:
        raise ValueError("no training pairs: the dataset's train split is empty")
    epoch, index = 0, 0
    while True:
        batches = epoch_batches(pairs, batch_size, seed, epoch)
        for b in batches:
            if index >= start:
                yield [pairs[i] for i in b]
            index += 1
        epoch += 1


def write_pairs_jsonl(pairs: list[Pair], path: Path, split: str | None = None) -> Path:
    """Write pairs in the engine's JSONL form (tests and tools)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for p in pairs:
            row = {"id": p.id, "prompt_ids": list(p.prompt), "chosen_ids": list(p.chosen),
                   "rejected_ids": list(p.rejected)}
            if split:
                row["split"] = split
            f.write(json.dumps(row) + "\n")
    return path
