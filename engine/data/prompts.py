"""The prompts a group loss (GRPO) samples from: each row's prompt token ids and the answer a
verifier checks completions against, split as the pairs were.

Two sources: a prompts dataset (``pomona data tokenize`` of prompt rows: ``prompt_ids``, an
``answer`` text, empty where the row gave none, and ``split``), or pair data, whose
prompt's answer is its chosen response, decoded as evaluation decodes it (special tokens
skipped); a prompt with several pairs is one row, its first pair's (rows of one prompt
share a split: engine/data/shards.py ``SPLIT_BY``). What a reward reads of a row is
``row``: its id, the prompt and the answer as ``chosen`` (the scorers' field,
tasks/eval/scorers.py), with ``rejected`` empty.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.data.data_fit import model_vocab, tokenizer_problem
from engine.data.data_schema import holds_column
from engine.data.pairs import (
    PROMPT_COLUMN,
    SPLITS,
    PairSet,
    RowCounts,
    check_bad_rows,
    load_pairs,
    read_data,
    stable_split,
)
from engine.data.splits import MAX_BAD_FRACTION
from engine.data.token_ids import bad_id_rows, check_id_types, int_lists
from engine.data.unpaired import refuse_unpaired

PROMPT_IDS = ("prompt_ids",)


@dataclass(frozen=True)
class PromptRow:
    """One prompt: its id, token ids and the verifier's answer (text)."""

    id: str
    prompt: tuple[int, ...]
    answer: str
    prompt_text: str

    def row(self) -> dict[str, Any]:
        """The row a reward's scorers read (id, prompt, chosen = the answer)."""
        return {"id": self.id, "prompt": self.prompt_text, "chosen": self.answer,
                "rejected": ""}


@dataclass
class PromptSet(RowCounts):
    """A dataset's prompts by split, and the rows refused (by reason) when it was read."""

    train: list[PromptRow] = field(default_factory=list)
    valid: list[PromptRow] = field(default_factory=list)
    test: list[PromptRow] = field(default_factory=list)


def prompts_of_pairs(pairs: PairSet, tokenizer: Any) -> PromptSet:
    """Each split's distinct prompts of ``pairs``, the first pair's chosen response as the
    answer."""
    def text(ids) -> str:
        return tokenizer.decode(list(ids), skip_special_tokens=True)

    out = PromptSet(rejected=Counter(pairs.rejected))
    for split in ("train", "valid", "test"):
        seen: set[tuple[int, ...]] = set()
        for p in getattr(pairs, split):
            key = tuple(int(t) for t in p.prompt)
            if key in seen:
                continue
            seen.add(key)
            getattr(out, split).append(PromptRow(p.id, key, text(p.chosen), text(p.prompt)))
    return out


def prompts_for(data: str | Path, model: str, stack: Any, tokenizer: Any,
                allow_tokenizer_mismatch: bool = False) -> PromptSet:
    """``data``'s prompts for ``model``: a prompts dataset's rows, or a pair dataset's
    prompts with their chosen responses as answers; ValueError when the dataset's
    tokenizer is not the model's (unless allowed), ids outside the vocabulary counted."""
    problem = tokenizer_problem(data, model)
    if problem and not allow_tokenizer_mismatch:
        raise ValueError(problem)
    path = Path(data)
    if not path.exists():
        raise FileNotFoundError(f"data not found: {path}")
    refuse_unpaired(path, "a sampling loss samples from prompts, or from pairs' prompts")
    if not holds_prompts(path):
        return prompts_of_pairs(load_pairs(path, vocab=model_vocab(stack)), tokenizer)
    return prompts_of_table(read_data(path), path, tokenizer, model_vocab(stack))


def holds_prompts(path: Path) -> bool:
    """Whether ``path`` holds prompt rows (an ``answer`` column), read from its manifest or
    its schema alone (its rows are read once, by the reader it calls for)."""
    if path.is_dir():
        try:
            return json.loads((path / "manifest.json").read_text()).get("kind") == "prompts"
        except (OSError, ValueError, TypeError, AttributeError):
            return False  # the pair reader says what is wrong with it, in one line
    return holds_column(path, PROMPT_COLUMN)


def prompts_of_table(table: Any, path: Path, tokenizer: Any, vocab: int | None,
                     max_bad_fraction: float = MAX_BAD_FRACTION) -> PromptSet:
    """A prompts dataset's rows by split (its ``split`` column, else a hash of the id);
    a row with a bad id or an empty prompt counted, and too many of them refused."""
    import pyarrow as pa

    if "prompt_ids" not in table.column_names:
        raise ValueError(f"{path}: missing column prompt_ids (found "
                         f"{', '.join(table.column_names)}); tokenize text with `pomona data "
                         "tokenize`")
    kind = table.schema.field(PROMPT_COLUMN).type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_null(kind)):
        raise ValueError(f"{path}: column {PROMPT_COLUMN} is {kind}, expected text (the "
                         "answer a verifier reads) or null")
    check_id_types(table, str(path), PROMPT_IDS)
    bad = bad_id_rows(table, vocab, PROMPT_IDS)
    prompts = int_lists(table.column("prompt_ids"))
    answers = table.column(PROMPT_COLUMN).to_pylist()
    ids = (table.column("id").to_pylist() if "id" in table.column_names
           else [None] * table.num_rows)
    splits = table.column("split").to_pylist() if "split" in table.column_names else None
    out = PromptSet(read=table.num_rows)
    for i in range(table.num_rows):
        row_id = f"row-{i}" if ids[i] is None else str(ids[i])
        reason = bad[i].reason if i in bad else (None if prompts[i] else "empty prompt")
        if reason is not None:
            out.rejected[reason] += 1
            out.first_bad = out.first_bad or (
                f"row {i} (id {row_id!r}): {bad[i].describe(vocab) if i in bad else reason}")
            continue
        split = (splits[i] if splits else None) or stable_split(row_id)
        if split not in SPLITS:
            raise ValueError(f"{path}: row {i} (id {row_id!r}) has split {split!r}; expected "
                             f"one of {', '.join(SPLITS)}")
        ids_ = tuple(prompts[i])
        answer = "" if answers[i] is None else answers[i]
        getattr(out, split).append(PromptRow(row_id, ids_, answer, tokenizer.decode(
            list(ids_), skip_special_tokens=True)))
    check_bad_rows(out, path, max_bad_fraction)
    return out
