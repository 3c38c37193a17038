"""Unpaired rows (KTO's own data, TRL's unpaired layout: a prompt, one completion and a
``label``, true where the completion is desirable) → token ids, beside tokenize's pairs
(tasks/data/tokenize.py). Each row is rendered and encoded as a pair's prompt and chosen
response are (the chat template, the BOS rule, the prompt/response boundary), and cut as a
pair is: the prompt keeps its end, the completion what the prompt leaves of
``max_length``; a completion cut to nothing is a counted reject (``empty_after_truncation``).

The dataset's columns: ``id``, ``group``, ``prompt_ids``, ``completion_ids``, ``label``,
``split``, and ``kind: unpaired`` in its manifest. The engine reads it as pairs of a row and
its KL partner (engine/data/unpaired.py).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pyarrow as pa

from tasks.data.pair_encoder import PairEncoder
from tasks.data.preference_rows import Conversation, Reject
from tasks.data.render import ChatTemplate, Truncation, render, truncate_prompt

UNPAIRED = "unpaired"  # an unpaired dataset's manifest ``kind``
UNPAIRED_SCHEMA = pa.schema([
    ("id", pa.string()),
    ("group", pa.string()),  # the split key, as a pair's
    ("prompt_ids", pa.list_(pa.int32())),
    ("completion_ids", pa.list_(pa.int32())),
    ("label", pa.bool_()),  # TRL's: the completion is desirable (true) or not (false)
    ("split", pa.string()),
])


def tokenize_unpaired(convs: list[Conversation], encoder: PairEncoder,
                      template: ChatTemplate | None, limits: Truncation, got: Any) -> None:
    """Unpaired rows into ``got.rows``: the completion as a pair's chosen response, no
    rejected one, the label beside it."""
    rendered, kept = [], []
    for c in convs:
        try:  # the completion in both places: the encoder's boundary rule, as a pair's
            rendered.append(render(replace(c, rejected=c.chosen), template))
            kept.append(c)
        except Exception as err:  # a template may raise on odd content: reject the row
            reason = str(err) if str(err) == "template_mismatch" else "template_error"
            got.rejects.append(Reject(c.source, c.line, reason, c.id))
    for c, pair in zip(kept, encoder.pairs(rendered), strict=True):
        prompt, reasons = truncate_prompt(pair.prompt_ids, limits, encoder.bos, room_for=1)
        completion = list(pair.chosen_ids)
        room = limits.max_length - len(prompt) if limits.max_length else len(completion)
        if len(completion) > room:
            completion, reasons = completion[: max(room, 0)], [*reasons, "truncated_completion"]
        got.trunc.update(reasons)
        if not prompt or not completion:
            got.rejects.append(Reject(c.source, c.line, "empty_after_truncation", c.id))
            continue
        if pair.boundary_merged:
            got.trunc["boundary_merged"] += 1
        got.where.append((c.source, c.line))
        for name, value in (("id", c.id), ("group", c.group), ("prompt_ids", prompt),
                            ("chosen_ids", completion), ("rejected_ids", []),
                            ("label", c.label)):
            got.rows[name].append(value)


def unpaired_columns(rows: dict[str, list]) -> dict[str, list]:
    """The columns an unpaired dataset writes, from tokenize's rows."""
    return {"id": rows["id"], "group": rows["group"], "prompt_ids": rows["prompt_ids"],
            "completion_ids": rows["chosen_ids"], "label": rows["label"],
            "split": rows["split"]}
