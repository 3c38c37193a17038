"""Rendered pairs → token ids, fast and canonical.

The canonical tokenization of a branch is its full text (prompt + response) encoded as
one string. Encoding each full text would encode every prompt twice (prompts are most of
the tokens), so where the tokenizer allows it the prompt is encoded once and each response
on its own, and the two are joined — exact when the pre-tokenizer splits the joined text
at the prompt's end (checked per branch on a window around it) and no normalizer rewrites
text. Other tokenizers, and any branch that fails the check, take the joint encoding and
a token-level split (tasks/data/render.py).
"""

from __future__ import annotations

import json

from tasks.data.preference_rows import common_prefix
from tasks.data.render import Rendered, Tokenized, finish_split, split_tokens

# Chars each side of the prompt end the boundary check reads: pre-tokenizer pieces start
# at character-class changes, so a few chars decide whether the end is a split; checks are
# cached by their window (chat-template prompts all end alike).
WINDOW = 8
SPLIT_SAFE_PRE_TOKENIZERS = {"ByteLevel", "Split", "Digits", "Punctuation"}


def _split_safe(fast) -> bool:
    """Regex/byte-level pre-tokenizers with no normalizer: joining at a split is exact."""
    spec = json.loads(fast.to_str())
    pre = spec.get("pre_tokenizer") or {}
    parts = pre.get("pretokenizers", [pre]) if pre.get("type") == "Sequence" else [pre]
    return spec.get("normalizer") is None and bool(parts) and all(
        p.get("type") in SPLIT_SAFE_PRE_TOKENIZERS for p in parts)


def _tokens_inside(enc, end: int) -> tuple[int, bool]:
    """(tokens that end at or before char ``end``, whether one straddles it); O(log n)."""
    if end == 0:
        return 0, False
    t = enc.char_to_token(end - 1)
    if t is None:  # a char no token covers (stripped by the normalizer): scan
        offsets = enc.offsets
        return sum(1 for _, b in offsets if b <= end), any(a < end < b for a, b in offsets)
    a, b = enc.token_to_chars(t)
    return (t + 1, False) if b <= end else (t, a < end)


class PairEncoder:
    """Batched, multi-threaded (the fast tokenizer's Rust threads) pair encoding."""

    def __init__(self, tokenizer) -> None:
        self.tok = tokenizer
        self.fast = getattr(tokenizer, "backend_tokenizer", None)
        bos = tokenizer.bos_token_id
        self.bos = bos if bos is not None and tokenizer.encode("a")[:1] == [bos] else None
        self.eos = tokenizer.eos_token_id
        self.split_safe = self.fast is not None and _split_safe(self.fast)
        self._checked: dict[tuple[str, str], bool] = {}

    def _bos(self, ids: list[int]) -> list[int]:
        return ids if self.bos is None or ids[:1] == [self.bos] else [self.bos, *ids]

    def _boundary_is_split(self, prompt: str, response: str) -> bool:
        key = (prompt[-WINDOW:], response[:WINDOW])
        if (known := self._checked.get(key)) is not None:
            return known
        pieces = self.fast.pre_tokenizer.pre_tokenize_str(key[0] + key[1])
        self._checked[key] = any(end == len(key[0]) for _, (_, end) in pieces)
        return self._checked[key]

    def prompts(self, texts: list[str]) -> list[list[int]]:
        """Prompt rows' token ids (BOS as a pair's prompt gets it)."""
        if self.fast is None:
            return [self._bos(self.tok.encode(t, add_special_tokens=False)) for t in texts]
        return [self._bos(e.ids) for e in self.fast.encode_batch(texts,
                                                                 add_special_tokens=False)]

    def pairs(self, rendered: list[Rendered]) -> list[Tokenized | None]:
        if self.fast is None:  # slow tokenizer: three plain encodes per pair
            enc = [self._bos(self.tok.encode(t, add_special_tokens=False))
                   for r in rendered for t in (r.prompt, r.chosen_full, r.rejected_full)]
            return [split_tokens(enc[3 * i], enc[3 * i + 1], enc[3 * i + 2], self.eos)
                    for i in range(len(rendered))]
        if not self.split_safe:
            return self._joint(rendered)
        n = len(rendered)
        responses = [full[len(r.prompt):] for r in rendered
                     for full in (r.chosen_full, r.rejected_full)]
        prompts = self.fast.encode_batch([r.prompt for r in rendered], add_special_tokens=False)
        resp = self.fast.encode_batch(responses, add_special_tokens=False)
        out: list[Tokenized | None] = [None] * n
        joint = []
        for i, r in enumerate(rendered):
            if all(self._boundary_is_split(r.prompt, responses[2 * i + j]) for j in (0, 1)):
                t = finish_split(resp[2 * i].ids, resp[2 * i + 1].ids, 0, self.eos, merged=False)
                out[i] = Tokenized(self._bos(prompts[i].ids), t.chosen_ids, t.rejected_ids,
                                   boundary_merged=False)
            else:
                joint.append(i)
        for i, t in zip(joint, self._joint([rendered[i] for i in joint]), strict=True):
            out[i] = t
        return out

    def _joint(self, rendered: list[Rendered]) -> list[Tokenized]:
        """Encode both full texts; the prompt is the tokens inside its text in both."""
        texts = [t for r in rendered for t in (r.chosen_full, r.rejected_full)]
        encs = self.fast.encode_batch(texts, add_special_tokens=False)
        out = []
        for i, r in enumerate(rendered):
            seqs, inside, straddles = [], [], False
            for e in encs[2 * i : 2 * i + 2]:
                n, cut = _tokens_inside(e, len(r.prompt))
                straddles |= cut
                ids = self._bos(e.ids)
                seqs.append(ids)
                inside.append(n + len(ids) - len(e.ids))
            k = min(inside)
            if seqs[0][:k] != seqs[1][:k]:  # rare: whitespace split by what follows
                k = common_prefix(seqs[0][:k], seqs[1][:k])
            out.append(finish_split(seqs[0], seqs[1], k, self.eos, straddles))
        return out
