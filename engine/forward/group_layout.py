"""The group-shared layout: one forward over ``[prompt | c1 | … | cG]`` for a prompt's G
sampled completions, the shared-prefix shape (engine/forward/prefix.py) with G branches
instead of two. The prompt is computed once for the whole group.

Row r holds its prompt (P tokens), then each completion's fed tokens: all but its last,
which is only ever a target (its first token is predicted from the prompt's last
position). Under the block-sparse mask the prompt attends causally, a completion's tokens
attend to the prompt and to their own earlier tokens (never another completion's), a pad
only to itself. Rotary positions: completion g's tokens take P … as if it followed the
prompt alone, its rope offset minus the tokens of the completions before it (each rope
runs once per branch and a select keeps its own: engine/forward/prefix_patch.py).
``gather`` maps the hidden states back to the plain layout, one row a completion,
``[prompt | completion][:-1]`` (engine/train/group_steps.py ``group_rows``), so the head
and the loss read what the plain forward gives them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from engine.data.batch import round_up

# ``prefix_share: auto`` shares a micro-batch's prompts where the shared rows feed at most
# this share of the separate rows' tokens: its block mask's attention grows with the whole
# row, so a short prompt does not pay (CPU, 8 layers × 512, G = 8, completions of 128: fed
# 0.30 → 0.52× the update time, 0.56 → 1.09×, 0.82 → 1.43×; docs/performance.md). CUDA too,
# though the array mask forgoes fused attention there: on an H100 (bf16, 16 layers × 2048)
# fed 0.30 gave 0.57× and 0.56 gave 1.2×, the same side of the line as on CPU.
AUTO_MAX_FED = 0.45


def shares_group(prompts: Sequence[int], completions: Sequence[int], prefix_share: str
                 ) -> bool:
    """Whether a micro-batch of groups (each prompt's length; each completion's, with its
    stop token, group after group) takes the shared layout under ``prefix_share``."""
    if prefix_share != "auto":
        return prefix_share == "on"
    g = len(completions) // max(len(prompts), 1)
    fed = sum(prompts) + sum(c - 1 for c in completions)
    separate = sum(prompts[n // g] + c - 1 for n, c in enumerate(completions))
    return fed <= AUTO_MAX_FED * separate


@dataclass(frozen=True)
class GroupLayout:
    """One micro-batch of groups in the shared layout.

    inputs: [R, L] int32, a row a group; mask: [R, 1, L, L] bool (True: may attend);
    branch: [R, L] int32, 0 on the prompt and pads, g on completion g's tokens (1 … G);
    shifts: [R, G] int32, completion g's rope offset in column g − 1; gather: [N, T] int32
    indices into the flattened [R·L] hidden states giving each completion's plain row
    (N = R·G, T its longest row's inputs); fed: real tokens through the model.
    """

    inputs: np.ndarray
    mask: np.ndarray
    branch: np.ndarray
    shifts: np.ndarray
    gather: np.ndarray
    fed: int

    @property
    def generations(self) -> int:
        return self.shifts.shape[1]

    def positions(self) -> np.ndarray:
        """[R, L] int32: each token's position as its own plain row sees it."""
        rows, width = self.inputs.shape
        pos = np.broadcast_to(np.arange(width, dtype=np.int32), (rows, width)).copy()
        for g in range(1, self.generations + 1):
            pos += (self.branch == g) * self.shifts[:, g - 1 : g]
        return pos


def group_layout(prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]],
                 pad_id: int = 0, pad_multiple: int = 0) -> GroupLayout:
    """The shared layout of ``prompts`` (one a group) and their completions, group after
    group (G = len(completions) / len(prompts)), each completion with the stop token it
    ended at, as the plain rows hold it."""
    r = len(prompts)
    g = len(completions) // r
    if r == 0 or g * r != len(completions) or any(len(p) == 0 for p in prompts):
        raise ValueError(f"{len(completions)} completions are not whole groups of "
                         f"{len(prompts)} non-empty prompts")
    fed = [[list(c[:-1]) for c in completions[i * g:(i + 1) * g]] for i in range(r)]
    lengths = [len(p) + sum(map(len, f)) for p, f in zip(prompts, fed, strict=True)]
    width = round_up(max(lengths), pad_multiple)
    plain = max(len(prompts[n // g]) + len(c) - 1 for n, c in enumerate(completions))
    inputs = np.full((r, width), pad_id, np.int32)
    mask = np.zeros((r, 1, width, width), bool)
    branch = np.zeros((r, width), np.int32)
    shifts = np.zeros((r, g), np.int32)
    gather = np.zeros((r * g, plain), np.int32)
    for i, (prompt, own) in enumerate(zip(prompts, fed, strict=True)):
        p, base, at = len(prompt), i * width, len(prompt)
        inputs[i, :p] = prompt
        mask[i, 0, :p, :p] = np.tril(np.ones((p, p), bool))
        for j, tokens in enumerate(own):
            n, k = i * g + j, len(tokens)
            inputs[i, at : at + k] = tokens
            branch[i, at : at + k] = j + 1
            mask[i, 0, at : at + k, :p] = True
            mask[i, 0, at : at + k, at : at + k] = np.tril(np.ones((k, k), bool))
            shifts[i, j] = p - at
            gather[n, :p] = base + np.arange(p)
            gather[n, p : p + k] = base + at + np.arange(k)
            gather[n, p + k :] = base  # past the row: never a target (its mask is 0)
            at += k
        idle = np.arange(at, width)
        mask[i, 0, idle, idle] = True  # a pad sees itself only: no fully masked row
    return GroupLayout(inputs, mask, branch, shifts, gather, sum(lengths))
