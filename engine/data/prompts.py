"""The prompts a group loss (GRPO) samples from: each row's prompt token ids and the answer a
verifier checks completions against, split as the pairs were.

From pair data a prompt's answer is its chosen response, decoded as evaluation decodes it
(special tokens skipped); a prompt with several pairs is one row, its first pair's (rows
of one prompt share a split: engine/data/shards.py ``SPLIT_BY``). What a reward reads of a
row is ``row``: its id, the prompt and the answer as ``chosen`` (the scorers' field,
tasks/eval/scorers.py), with ``rejected`` empty.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from engine.data.pairs import PairSet


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
class PromptSet:
    """A dataset's prompts by split, and the rows refused (by reason) when it was read."""

    train: list[PromptRow] = field(default_factory=list)
    valid: list[PromptRow] = field(default_factory=list)
    test: list[PromptRow] = field(default_factory=list)
    rejected: Counter = field(default_factory=Counter)


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
