"""Which layout and padding each batch takes on this device: the engine's policy.

Training, validation, scoring, probes and benchmarks all ask here; the numbers behind each
choice are in docs/performance.md (measured on an H200 and on 2-core CPUs).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import mlx.core as mx

from engine.data.batch import PairBatch, make_batch
from engine.forward.prefix import PrefixBatch, split_prefix_batch
from engine.settings.config import TrainConfig, check_choice


def resolve_pad_multiple(pad_multiple: int) -> int:
    """-1 = auto: 128 on CUDA (fused attention needs it: docs/design.md), else none."""
    if pad_multiple >= 0:
        return pad_multiple
    return 128 if is_cuda() else 1


def resolve_prefix_attention(attention: str, pad_multiple: int) -> str:
    """The shared forward's attention on this device (``prefix_attention``).

    On CUDA (MLX 0.32.4, H200) split attention needs ``pad_multiple`` a multiple of 128:
    its layout then gives every attention call 128-aligned lengths, and MLX's fused
    attention backward aborted the process (heap corruption) on a query length that was a
    multiple of 128 over a longer key length that was not. Otherwise auto means mask there.
    """
    if not is_cuda() or pad_multiple % 128 == 0:
        return attention
    if attention == "split":
        raise ValueError(f"prefix_attention=split needs pad_multiple a multiple of 128 on "
                         f"CUDA (got {pad_multiple}): MLX's fused attention backward "
                         "crashes on unaligned split shapes; use auto or mask")
    return "mask"


# H200, bf16, 4:1 pairs (docs/performance.md): split was 0.70-0.79x two forwards' step
# time from one 2k pair (2560 tokens) to 8 pairs of 1k; smaller micro-batches unmeasured.
CUDA_SPLIT_MIN_TOKENS = 2048


def choose_layout(pairs: list, cfg: TrainConfig, pad_multiple: int, pad_id: int
                  ) -> PairBatch | PrefixBatch:
    """The shared layout where ``cfg.prefix_share`` asks for it and it applies.

    auto takes it where it saves enough of the padded tokens: split attention from 25%
    (CPU: gains from 1:1 prompt:response), else the array mask from 1/3 (its attention
    computes masked blocks too; it wins where prompts are too ragged for one split
    geometry). On CUDA auto never takes the mask (it leaves MLX's fused attention), and
    split only from CUDA_SPLIT_MIN_TOKENS tokens a micro-batch.
    """
    two = make_batch(pairs, cfg.nll_span, pad_multiple, pad_id)
    if cfg.prefix_share == "off":
        return two
    attention = resolve_prefix_attention(cfg.prefix_attention, pad_multiple)
    if cfg.prefix_share == "on":
        kind = "split" if attention == "auto" else attention
        return split_prefix_batch(pairs, cfg.nll_span, pad_multiple, pad_id,
                                  attention=kind, two=two) or two  # None: counted
    kinds = [k for k in ("split", "mask") if attention in (k, "auto")]
    if is_cuda():
        kinds = [k for k in kinds if k == "split"]  # the [B, 1, L, L] mask is not even built
    for kind in kinds:
        shared = split_prefix_batch(pairs, cfg.nll_span, pad_multiple, pad_id,
                                    attention=kind, two=two)
        if shared is None:
            return two  # counted: prefix_share_rate falls
        if is_cuda() and shared.inputs.size < CUDA_SPLIT_MIN_TOKENS:
            return two
        needed = 0.25 if kind == "split" else 1 / 3
        if shared.inputs.size <= (1 - needed) * two.inputs.size:
            return shared
    return two


def scoring_layout(prefix_share: str, pad_id: int, nll_span: str = "full"
                   ) -> Callable[[list], PairBatch | PrefixBatch]:
    """``choose_layout`` for forward-only scoring (this device's padding; ``nll_span``
    full for per-pair scores, the trained one for evaluation metrics)."""
    check_choice("prefix_share", prefix_share)
    cfg = TrainConfig(nll_span=nll_span, prefix_share=prefix_share)
    pad = resolve_pad_multiple(-1)
    return lambda pairs: choose_layout(pairs, cfg, pad, pad_id)


@functools.cache  # asked first on the main thread: the batch thread reads the answer
def is_cuda() -> bool:
    return mx.cuda.is_available() and mx.default_device() == mx.gpu


