"""Greedy completions of many prompts at once: batched decoding with a KV cache.

``greedy_batch`` runs mlx-lm's continuous-batching generator (``BatchGenerator``: prompts
left-padded and prefilled together, one decode step for the whole batch, each row stopped
at its own end-of-sequence token or at ``max_tokens``), with the greedy sampler, the
model in eval mode (no LoRA dropout). The prompts' shared prefix (a chat template's
system turn: most of a short prompt) is prefilled once and its KV cache handed to every
row, as training shares it (engine/forward/prefix.py); models whose caches are not plain
``KVCache`` (sliding windows) prefill each prompt whole. ``greedy_one`` is the naive path
it is checked against: one prompt at a time through ``mlx_lm.generate_step``, stopped at the same
tokens (tests/test_generation.py: the same tokens on the real SmolLM2).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn


@dataclass(frozen=True)
class Completions:
    """What ``greedy_batch`` produced: per prompt its text and token ids (the stop token
    left out), and the work it did."""

    texts: list[str]
    tokens: list[list[int]]
    generated: int  # tokens decoded, stop tokens included
    seconds: float

    @property
    def tokens_per_sec(self) -> float:
        return self.generated / self.seconds if self.seconds > 0 else 0.0


def stop_ids(tokenizer) -> set[int]:
    """The tokens a completion ends at: the tokenizer's end-of-sequence ids."""
    ids = getattr(tokenizer, "eos_token_ids", None) or {tokenizer.eos_token_id}
    return {int(i) for i in ids if i is not None}


def greedy_batch(model: nn.Module, tokenizer, prompts: Sequence[Sequence[int]],
                 max_tokens: int, batch_size: int = 32) -> Completions:
    """Greedy completions of ``prompts`` (token ids), ``batch_size`` decoded at a time."""
    rows = [list(map(int, p)) for p in prompts]
    groups = prefix_groups(rows)  # rows of one system turn share its prefill
    tokens, _, generated, seconds = decode_groups(
        model, tokenizer, [[rows[i] for i in g] for g in groups], max_tokens, batch_size,
        lambda logits: mx.argmax(logits, axis=-1))
    by_row = dict(zip([i for g in groups for i in g], tokens, strict=True))
    tokens = [by_row[i] for i in range(len(rows))]
    return Completions([tokenizer.decode(t) for t in tokens], tokens, generated, seconds)


def decode_groups(model: nn.Module, tokenizer, groups: Sequence[Sequence[list[int]]],
                  max_tokens: int, batch_size: int, sampler: Callable[[mx.array], mx.array],
                  least: int = 8) -> tuple[list[list[int]], list[int | None], int, float]:
    """Every row of ``groups`` completed by ``sampler`` (mlx-lm's ``BatchGenerator``, the
    model in eval mode), each group's shared prefix prefilled once (at least ``least``
    tokens, else each row whole): per row, group by group, its tokens (the stop token
    left out) and the stop token it ended at (None: cut at ``max_tokens``); the tokens
    decoded and the seconds."""
    from mlx_lm.generate import BatchGenerator

    rows = [r for g in groups for r in g]
    if not rows or max_tokens <= 0:
        return [[] for _ in rows], [None] * len(rows), 0, 0.0
    stops = stop_ids(tokenizer)
    was_training, started = model.training, time.perf_counter()
    model.eval()
    gen = BatchGenerator(model, stop_tokens=[[t] for t in sorted(stops)], sampler=sampler,
                         completion_batch_size=batch_size,
                         prefill_batch_size=min(batch_size, 8))
    try:
        uids: list[int] = []
        for members in groups:
            shared, caches = shared_prefix_caches(model, list(members), least)
            uids += gen.insert([r[shared:] for r in members], [max_tokens] * len(members),
                               caches=caches)
        out: dict[int, list[int]] = {u: [] for u in uids}
        stopped: dict[int, int | None] = dict.fromkeys(uids)
        generated = 0
        while responses := gen.next_generated():
            for r in responses:
                generated += 1
                if r.finish_reason == "stop":  # the stop token is not the answer's
                    stopped[r.uid] = int(r.token)
                else:
                    out[r.uid].append(int(r.token))
    finally:
        gen.close()
        model.train(was_training)
    return ([out[u] for u in uids], [stopped[u] for u in uids], generated,
            time.perf_counter() - started)


def greedy_one(model: nn.Module, tokenizer, prompt: Sequence[int], max_tokens: int
               ) -> list[int]:
    """The naive path: one prompt's greedy completion, token by token."""
    from mlx_lm.generate import generate_step

    stops, out = stop_ids(tokenizer), []
    was_training = model.training
    model.eval()
    try:
        steps = generate_step(mx.array(list(map(int, prompt))), model, max_tokens=max_tokens,
                              sampler=lambda logits: mx.argmax(logits, axis=-1))
        for token, _ in steps:
            if int(token) in stops:
                break
            out.append(int(token))
    finally:
        model.train(was_training)
    return out


def prefix_groups(rows: Sequence[Sequence[int]], key: int = 16) -> list[list[int]]:
    """Indices of ``rows`` grouped by their first ``key`` tokens (a chat template's
    system turn opens every prompt: rows with the same one share a prefix)."""
    groups: dict[tuple[int, ...], list[int]] = {}
    for i, r in enumerate(rows):
        groups.setdefault(tuple(r[:key]), []).append(i)
    return list(groups.values())


def common_prefix(rows: Sequence[Sequence[int]]) -> int:
    """Length of the prefix every row shares, leaving each row at least one token."""
    n = min(len(r) for r in rows) - 1
    first = rows[0]
    for i in range(max(n, 0)):
        if any(r[i] != first[i] for r in rows):
            return i
    return max(n, 0)


def shared_prefix_caches(model: nn.Module, rows: list[list[int]], least: int = 8
                         ) -> tuple[int, list | None]:
    """(tokens shared, a KV cache per row holding them), prefilled once; (0, None) when
    under ``least`` tokens are shared or the model's cache is not plain ``KVCache``."""
    from mlx_lm.models.cache import KVCache, make_prompt_cache

    shared = common_prefix(rows) if len(rows) > 1 else 0
    cache = make_prompt_cache(model)
    if shared < least or not all(type(c) is KVCache for c in cache):
        return 0, None
    model(mx.array(rows[0][:shared])[None], cache=cache)
    filled = [(c.keys[..., :shared, :], c.values[..., :shared, :]) for c in cache]
    mx.eval(filled)

    def copy() -> list:
        out = []
        for keys, values in filled:
            fresh = KVCache()
            fresh.state = (mx.array(keys), mx.array(values), shared)  # each row its own
            out.append(fresh)
        return out

    return shared, [copy() for _ in rows]
