"""``bench group``: GRPO's update on G separate rows (the plain forward) against the
group-shared forward (one row ``[prompt | c1 | … | cG]`` a group), in one run.

    python -m benchmarks group --seq 512 --completion 128 --generations 8 [--pairs 1] [--json]

Rows: one GRPO update (loss and LoRA gradients, ``nn.value_and_grad``) on ``--pairs``
groups of ``--generations`` completions of ``--completion`` tokens after a ``--seq``-token
prompt, each in a fresh process (benchmarks/row_runner.py): ``plain`` (G separate rows
through the model's own call, every position's logits), ``rows_head`` (G separate rows,
the head on completion tokens alone) and ``shared`` (one row a group, the head on
completion tokens alone).
"""

from __future__ import annotations

import argparse
from typing import Any

import mlx.core as mx
import numpy as np

from benchmarks.row_runner import table


def group_step(path: str, model, stack, a: argparse.Namespace):
    """One GRPO update on the plain rows or the group-shared layout."""
    from engine.forward.group_layout import group_layout
    from engine.forward.rollouts import Rollouts
    from engine.losses.grpo import Grpo
    from engine.train.group_steps import GroupBatch, group_objective, group_rows

    rng = np.random.default_rng(0)
    ids = lambda n: rng.integers(10, a.vocab, n).tolist()  # noqa: E731
    g = a.generations

    class Row:
        def __init__(self) -> None:
            self.prompt = tuple(ids(a.seq))

    prompts = [Row() for _ in range(a.pairs)]
    tokens = [ids(a.completion - 1) for _ in range(a.pairs * g)]
    rollouts = Rollouts(tokens, [2] * len(tokens), 0, 0.0)
    rows, at, mask = group_rows(prompts, rollouts, g, pad_id=0)
    batch = GroupBatch(mx.array(rows), mx.array(at), mx.array(mask),
                       mx.array(rng.normal(0, 1, len(tokens)).astype(np.float32)))
    if path == "shared":
        layout = group_layout([p.prompt for p in prompts], [t + [2] for t in tokens])
        batch = GroupBatch(batch.ids, batch.at, batch.mask, batch.advantages, layout=layout)
    elif path == "rows_head":  # G separate rows, the head on completion tokens alone
        layout = group_layout([p.prompt for p in prompts for _ in range(g)],
                              [t + [2] for t in tokens])
        batch = GroupBatch(batch.ids, batch.at, batch.mask, batch.advantages, layout=layout)
    objective = group_objective(model, stack, Grpo(num_generations=g))
    fn = lambda: objective(batch, float(mask.sum()), 1.0)  # noqa: E731
    fed = batch.layout.fed if batch.layout else int(rows.shape[0] * (rows.shape[1] - 1))
    # plain: the model's own call (every position's logits); shared: completions' alone
    return fn, {"path": path, "groups": a.pairs, "generations": g, "prompt_tokens": a.seq,
                "completion_tokens": a.completion, "fed_tokens": fed}


def _ratios(rows: list[dict[str, Any]]) -> dict[str, float]:
    by = {r["path"]: r for r in rows}
    if "plain" not in by or "shared" not in by:
        return {}
    plain, shared = by["plain"], by["shared"]
    out = {}
    if "rows_head" in by:  # what sharing the prompt saves beyond a bounded head
        out["shared_time_vs_rows_head"] = shared["step_s"] / by["rows_head"]["step_s"]
    return {**out, "shared_time_vs_plain": shared["step_s"] / plain["step_s"],
            "shared_tokens_vs_plain": shared["fed_tokens"] / plain["fed_tokens"],
            "shared_peak_vs_plain": shared["peak_mb"] / plain["peak_mb"], "target": 0.6}


def main(argv: list[str]) -> int:
    return table("group", argv, __doc__, lambda name, m, s, a: group_step(name, m, s, a),
                 lambda a: ["plain", "rows_head", "shared"], _ratios)
