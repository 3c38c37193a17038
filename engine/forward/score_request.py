"""What ``score`` is asked (``python -m engine score``, ``pomona score``): one frozen value,
checked once when built, whose fields are the verb's flags (engine/host/flags.py). The
loss's own settings (``--dpo-beta``, ...) are the losses' flags, beside it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from engine.losses import LOSSES
from engine.settings.config import CHOICES, TrainConfig
from engine.settings.forward_options import ForwardOptions

SPLITS = ("all", "train", "valid", "test")


def _f(default: Any, help: str, **more: Any) -> Any:
    return field(default=default, metadata={"help": help, **more})


def _required(help: str) -> Any:
    return field(metadata={"help": help})


def _train_help(name: str) -> str:
    return TrainConfig.__dataclass_fields__[name].metadata["help"]


@dataclass(frozen=True, kw_only=True)
class ScoreRequest:
    """Which pairs to score, under which model and adapter, into which file."""

    model: str = _required("Model directory, .gguf file or repo id.")
    adapter: str | None = _f(None, "Adapter directory (mlx-lm format).")
    data: str = _required("Tokenized pairs (dataset dir/.parquet/.jsonl).")
    out: str = _required("Output JSONL, one object per pair.")
    loss: str | None = _f(None, "The loss column's loss (default: the adapter's own, else "
                                "orpo).", choices=tuple(LOSSES))
    reference: str | None = _f(None, "DPO's reference: base or an adapter directory. "
                                     "Default: the one the adapter trained against.")
    split: str = _f("all", "Which pairs to score: train, valid (ranked on), test (reported).",
                    choices=SPLITS)
    batch_size: int = _f(8, "Pairs per forward.")
    head_chunk: int = _f(0, "Bounded head chunk (0 = dense).")
    allow_tokenizer_mismatch: bool = _f(False, _train_help("allow_tokenizer_mismatch"))
    prefix_share: str = _f("auto", "One forward per pair over [prompt | chosen | rejected], "
                                   "as in training (auto: where it saves enough tokens).",
                           choices=CHOICES["prefix_share"])

    def __post_init__(self) -> None:
        for name in ("split", "prefix_share", "loss"):
            choices = type(self).__dataclass_fields__[name].metadata["choices"]
            if getattr(self, name) not in (*choices, *((None,) if name == "loss" else ())):
                raise ValueError(f"--{name.replace('_', '-')} {getattr(self, name)}: "
                                 f"expected one of {', '.join(choices)}")
        if self.batch_size < 1:  # a batch of 0 pairs scores nothing, forever
            raise ValueError(f"--batch-size {self.batch_size}: must be at least 1")
        if self.head_chunk < 0:
            raise ValueError(f"--head-chunk {self.head_chunk}: must be at least 0")

    @property
    def forward(self) -> ForwardOptions:
        return ForwardOptions(self.batch_size, self.head_chunk, self.prefix_share,
                              self.allow_tokenizer_mismatch)
