"""What ``score`` is asked (``python -m engine score``, ``pomona score``): one frozen value,
checked once when built, whose fields are the verb's flags (engine/host/flags.py). The
loss's own settings (``--dpo-beta``, ...) are the losses' flags, beside it."""

from __future__ import annotations

from dataclasses import dataclass

from engine.host.flags import check_choices, flag_field
from engine.losses import PAIR_LOSSES
from engine.settings.config import CHOICES, TrainConfig
from engine.settings.forward_options import ForwardOptions

SPLITS = ("all", "train", "valid", "test")
TRAIN_FIELDS = TrainConfig.__dataclass_fields__


@dataclass(frozen=True, kw_only=True)
class ScoreRequest:
    """Which pairs to score, under which model and adapter, into which file."""

    model: str = flag_field("Model directory, .gguf file or repo id.")
    adapter: str | None = flag_field("Adapter directory (mlx-lm format).", None)
    data: str = flag_field("Tokenized pairs (dataset dir/.parquet/.jsonl).")
    out: str = flag_field("Output JSONL, one object per pair.")
    loss: str | None = flag_field("The loss column's loss (default: the adapter's own, else "
                                  "orpo).", None, choices=tuple(PAIR_LOSSES))
    reference: str | None = flag_field("DPO's reference: base or an adapter directory. "
                                       "Default: the one the adapter trained against.", None)
    split: str = flag_field("Which pairs to score: train, valid (ranked on), test "
                            "(reported).", "all", choices=SPLITS)
    batch_size: int = flag_field("Pairs per forward.", 8)
    head_chunk: int = flag_field("Bounded head chunk (0 = dense).", 0)
    allow_tokenizer_mismatch: bool = flag_field(
        TRAIN_FIELDS["allow_tokenizer_mismatch"].metadata["help"], False)
    prefix_share: str = flag_field("One forward per pair over [prompt | chosen | rejected], "
                                   "as in training (auto: where it saves enough tokens).",
                                   "auto", choices=CHOICES["prefix_share"])

    def __post_init__(self) -> None:
        check_choices(self)
        if self.batch_size < 1:  # a batch of 0 pairs scores nothing, forever
            raise ValueError(f"--batch-size {self.batch_size}: must be at least 1")
        if self.head_chunk < 0:
            raise ValueError(f"--head-chunk {self.head_chunk}: must be at least 0")

    @property
    def forward(self) -> ForwardOptions:
        return ForwardOptions(self.batch_size, self.head_chunk, self.prefix_share,
                              self.allow_tokenizer_mismatch)
