"""Prompt rows (GRPO's: a prompt and the answer its verifier reads) → token ids, beside
tokenize's pairs (tasks/data/tokenize.py): each prompt rendered as a pair's prompt is (the
chat template with its generation prompt, or raw), encoded with the same BOS rule and cut
from its start as a pair's prompt is. A dataset holds pairs or prompts, never both
(``kind`` in its manifest): a row of the other kind is a counted reject
(``kind_mismatch:pairs``), as a row of another layout is within a file."""

from __future__ import annotations

from typing import Any

import pyarrow as pa

from tasks.data.dataset_dir import SCHEMA
from tasks.data.pair_encoder import PairEncoder
from tasks.data.preference_rows import Conversation, Reject
from tasks.data.render import ChatTemplate, Truncation, render_prompt, truncate_prompt
from tasks.data.unpaired_tokens import (
    UNPAIRED,
    UNPAIRED_SCHEMA,
    tokenize_unpaired,
    unpaired_columns,
)

PROMPTS = "prompts"  # a prompts dataset's manifest ``kind``
PROMPT_SCHEMA = pa.schema([
    ("id", pa.string()),
    ("group", pa.string()),  # the split key, as a pair's
    ("prompt_ids", pa.list_(pa.int32())),
    ("answer", pa.string()),  # the verifier's answer ("" where the row gave none)
    ("split", pa.string()),
])


def kind_of(conv: Conversation) -> str:
    return conv.kind


def keep_one_kind(convs: list[Conversation], got: Any) -> list[Conversation]:
    """``convs`` of the dataset's kind (its first row's); the others counted as rejects."""
    kept = []
    for c in convs:
        got.kind = got.kind or kind_of(c)
        if kind_of(c) == got.kind:
            kept.append(c)
        else:
            got.rejects.append(Reject(c.source, c.line, f"kind_mismatch:{kind_of(c)}", c.id))
    return kept


def tokenize_kind(convs: list[Conversation], encoder: PairEncoder,
                  template: ChatTemplate | None, limits: Truncation, got: Any) -> bool:
    """Prompt or unpaired rows into ``got.rows``; False for pairs (tokenize's own)."""
    if got.kind == PROMPTS:
        tokenize_prompts(convs, encoder, template, limits, got)
    elif got.kind == UNPAIRED:
        tokenize_unpaired(convs, encoder, template, limits, got)
    return got.kind in (PROMPTS, UNPAIRED)


def tokenize_prompts(convs: list[Conversation], encoder: PairEncoder,
                     template: ChatTemplate | None, limits: Truncation, got: Any) -> None:
    """Prompt rows into ``got.rows`` (responses empty, the answer beside them)."""
    texts, kept = [], []
    for c in convs:
        try:
            texts.append(render_prompt(c, template))
            kept.append(c)
        except Exception:  # a template may raise on odd content: reject the row
            got.rejects.append(Reject(c.source, c.line, "template_error", c.id))
    for c, ids in zip(kept, encoder.prompts(texts), strict=True):
        ids, reasons = truncate_prompt(ids, limits, encoder.bos, room_for=1)
        got.trunc.update(reasons)
        got.where.append((c.source, c.line))
        for name, value in (("id", c.id), ("group", c.group), ("prompt_ids", ids),
                            ("chosen_ids", []), ("rejected_ids", []), ("answer", c.chosen)):
            got.rows[name].append(value)


def columns(kind: str | None, rows: dict[str, list]) -> tuple[dict[str, list], pa.Schema]:
    """The columns a dataset of ``kind`` writes, and its schema."""
    if kind == UNPAIRED:
        return unpaired_columns(rows), UNPAIRED_SCHEMA
    if kind != PROMPTS:
        return rows, SCHEMA
    return {f.name: rows[f.name] for f in PROMPT_SCHEMA}, PROMPT_SCHEMA


def id_columns(kind: str | None) -> tuple[str, ...]:
    """The token-id columns a dataset of ``kind`` holds (by their prefix in tokenize's
    rows; an unpaired row's completion is held as its chosen)."""
    return {PROMPTS: ("prompt",), UNPAIRED: ("prompt", "chosen")}.get(
        kind or "", ("prompt", "chosen", "rejected"))


def manifest_kind(kind: str | None) -> dict[str, str]:
    """The manifest's ``kind`` (a pair dataset's manifest names none, as before it)."""
    return {"kind": kind} if kind in (PROMPTS, UNPAIRED) else {}
