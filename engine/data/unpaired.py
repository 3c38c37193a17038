"""Unpaired rows (KTO's own data: a prompt, one completion and a ``label``, as
tasks/data/unpaired_tokens.py writes them) read as the engine's pairs.

Each row becomes one ``Pair``: its prompt; its completion as the first branch; as the
second, its KL partner's completion, the previous row's of its split in the split's order
(TRL's KTO ``_get_kl_dataset``: completions offset by one, the first row taking the last's;
a split of one row is its own partner). So one prefix-shared forward gives both the row's
log-prob and the mismatched prompt/completion log-prob that KTO's reference point z0
averages (engine/losses/kto.py), with no second forward. ``label``: the completion is
desirable (True) or not (False).
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

from engine.data.batch import Pair
from engine.data.data_schema import holds_column
from engine.losses.spec import LossSpec

LABEL = "label"
PARTNER_RULE = "previous-row-cut-to-max-length"  # a reference cache's key names it
COMPLETION = "completion_ids"


def is_unpaired(table: Any) -> bool:
    """Whether an Arrow table holds unpaired rows (a completion and a label, no pair)."""
    return {COMPLETION, LABEL} <= set(table.column_names)


def as_pair_columns(table: Any) -> Any:
    """``table`` with the completion under both response columns, so the id checks and the
    reader that pairs go through read it; the second becomes the KL partner's
    (``with_partners``)."""
    column = table.column(COMPLETION)
    return table.append_column("chosen_ids", column).append_column("rejected_ids", column)


def with_partners(pairs: list[Pair], max_length: int | None = None) -> list[Pair]:
    """Each unpaired row with its KL partner's completion as its second branch, cut to
    what the row's prompt leaves of ``max_length`` (tokenize's, as TRL cuts its KL
    completions). Its id names both rows (``ROW~after~PARTNER``): identical rows, which
    tokenize keeps, have other partners, so other reference log-probs."""
    out = []
    for p, q in zip(pairs, [*pairs[-1:], *pairs[:-1]], strict=True):
        partner = list(q.chosen)
        if max_length:
            partner = partner[: max(max_length - len(p.prompt), 1)]
        out.append(replace(p, id=f"{p.id}~after~{q.id}", rejected=partner))
    return out


def tokenized_max_length(path: Path) -> int | None:
    """The ``max_length`` a dataset folder was tokenized with (None: none, or a file)."""
    try:
        options = json.loads((path / "manifest.json").read_text()).get("options") or {}
    except (OSError, ValueError):
        return None
    return options.get("max_length") or None


def holds_unpaired(path: Path) -> bool:
    """Whether ``path`` holds unpaired rows, read from its manifest or its schema alone."""
    if path.is_dir():
        try:
            return json.loads((path / "manifest.json").read_text()).get("kind") == "unpaired"
        except (OSError, ValueError):
            return False
    return holds_column(path, LABEL) and holds_column(path, COMPLETION)  # as is_unpaired


def refuse_unpaired(data: Path, reader: str) -> None:
    """ValueError where ``data`` holds unpaired rows, which ``reader`` (why) cannot read."""
    if holds_unpaired(data):
        raise ValueError(f"{data}: unpaired rows (a prompt, one completion and a label: "
                         f"KTO's data): {reader}; train them with `pomona train --loss kto`")


def loss_for_data(spec: LossSpec, data: str | Path, ranks: int = 1) -> LossSpec:
    """``spec`` for the rows ``data`` holds: on unpaired rows, its unpaired form; a
    ValueError naming the data where its loss reads pairs, or a gang would need its KL point
    gathered over ranks."""
    if not holds_unpaired(Path(data)):
        return spec
    if spec.kind != "kto":
        raise ValueError(f"{data}: unpaired rows (a prompt, one completion and a label: "
                         f"KTO's data), and loss {spec.kind} trains on pairs; train them "
                         "with --loss kto")
    if ranks > 1:
        raise ValueError(f"{data}: unpaired rows over {ranks} ranks: KTO's KL point is each "
                         "forward batch's, not yet gathered over ranks; train them on one")
    return replace(spec, unpaired=True)
