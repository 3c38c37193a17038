"""TrainConfig: every knob of one training run, with its help text. CLI > YAML > defaults.

Names follow mlx-lm where it has one (``lora_scale`` = α/r as in its adapter_config) and
TRL otherwise; λ is ``orpo_lambda`` (TRL's ``beta``, the paper's λ, the official code's
``alpha``). A run's loss is one field holding that loss's settings (engine/losses/, one
file a loss); its options keep their flat names (``orpo_lambda``) in YAML and on the CLI.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any, get_type_hints

from engine.losses import (
    LOSSES,
    NLL_SPANS,
    OWNERS,
    LossSettings,
    LossSpec,
    Orpo,
    foreign_message,
    loss_named,
)
from engine.settings.forward_options import ForwardOptions
from engine.settings.metric_order import MODES
from engine.settings.reference_kind import BASE, AdapterRef, Base, Reference, parse_reference
from engine.settings.yaml_file import read_yaml


def _f(default: Any, help: str) -> Any:
    return field(default=default, metadata={"help": help})


CHOICES = {"nll_span": NLL_SPANS, "lr_schedule": ("cosine", "constant"),
           "prefix_share": ("auto", "on", "off"),
           "prefix_attention": ("auto", "mask", "split"), "best_mode": MODES}


def check_choice(name: str, value: str) -> None:
    """Raise ValueError unless ``value`` is one of field ``name``'s CHOICES."""
    if value not in CHOICES[name]:
        raise ValueError(f"{name}={value!r}: expected one of {CHOICES[name]}")


DEFAULT_LOSS = Orpo()
FLOAT32_TINY = 1.1754944e-38  # numpy.finfo(float32).tiny: a smaller rate updates nothing
REFERENCE_HELP = ("DPO's, KTO's and GRPO's (β > 0) reference model: base (the base model, "
                  "no LoRA) or an adapter directory for it (SFT, then DPO or GRPO).")
LOSS_HELP = ("The loss and its settings: " + "; ".join(cls.summary for cls in LOSSES.values())
             + " (engine/losses/). On the command line and in YAML: --loss NAME and that "
             "loss's own options (--orpo-lambda, ...).")


@dataclass(frozen=True)
class TrainConfig:
    """One training run (one adapter)."""

    model: str = _f("", "Base model: a local directory or a Hugging Face repo id (mlx_lm.load).")
    data: str = _f("", "Tokenized pairs: a dataset directory, .parquet or .jsonl with "
                       "prompt_ids/chosen_ids/rejected_ids (and optional id, split).")
    out: str = _f("runs/train", "Output directory: adapters, metrics.jsonl, checkpoints.")
    loss: LossSettings = _f(DEFAULT_LOSS, LOSS_HELP)  # noqa: RUF009 (frozen: immutable)
    reference: Reference = _f(BASE, REFERENCE_HELP)  # noqa: RUF009 (frozen: immutable)
    reference_logps: str | None = _f(None, "DPO: a reference log-prob file to read "
                                           "(engine/train/reference.py); default: Pomona's cache, "
                                           "computed once when missing.")
    nll_span: str = _f("full", "NLL over prompt+response (full) or the response only.")
    lora_rank: int = _f(8, "LoRA rank r.")
    lora_scale: float = _f(20.0, "LoRA scale (α/r), as in mlx-lm's adapter_config.")
    lora_dropout: float = _f(0.0, "Dropout on the LoRA input.")
    lora_keys: tuple[str, ...] | None = _f(None, "Module paths inside a block to adapt "
                                                 "(e.g. self_attn.q_proj); default: all linears.")
    lora_layers: int = _f(-1, "Adapt the last N blocks; -1 = all.")
    segment_size: int = _f(0, "Layers per backward segment; 0 = plain value_and_grad.")
    head_chunk: int = _f(0, "Tokens per LM-head chunk; 0 = dense logits.")
    shared_lora_inputs: bool = _f(True, "LoRA layers that read one input (q/k/v; gate/up) "
                                        "compute x @ [A_1|...|A_k] once, each its slice "
                                        "(engine/model/shared_lora.py); off: each its own.")
    compile: bool = _f(True, "Each backward segment's forward and vjp run under mx.compile, "
                             "traced the second time a segment's shapes come and replayed "
                             "after (engine/backward/compiled.py); off, or with "
                             "lora_dropout, uncompiled.")
    mlp_chunk: int = _f(0, "Tokens per MLP chunk, recomputed in the backward: bounds a wide "
                           "MLP's activations at long sequences for one more MLP forward a "
                           "step; 0 = off (docs/performance.md, Gemma 4).")
    inflight: int = _f(2, "Segments evaluated at once in the segmented backward: 1 = least "
                          "memory; 2 = the device runs one while Python builds the next "
                          "(faster, more activations: docs/performance.md).")
    prefix_share: str = _f("auto", "One forward over [prompt | chosen | rejected] (GRPO: "
                                   "[prompt | c1 | … | cG]): on, off, or auto (where it "
                                   "was measured faster: engine/forward/layout_policy.py, "
                                   "group_layout.py, docs/performance.md).")
    prefix_attention: str = _f("auto", "Shared forward's attention: split (two fused causal "
                                       "calls; on CUDA pad_multiple a multiple of 128), mask "
                                       "(block-sparse array) or auto (split, else mask where "
                                       "prompts are too ragged; CUDA: split only).")
    pad_multiple: int = _f(-1, "Pad sequence length to a multiple of this; -1 = auto "
                               "(128 on CUDA, where fused attention needs it; else 1).")
    steps: int = _f(100, "Optimizer steps.")
    batch_size: int = _f(4, "Pairs per micro-batch.")
    grad_accum: int = _f(1, "Micro-batches per optimizer step.")
    learning_rate: float = _f(1e-5, "Peak learning rate.")
    warmup_steps: int = _f(0, "Linear warmup steps from 0.")
    lr_schedule: str = _f("cosine", "cosine (to min_lr_ratio·lr) or constant after warmup.")
    min_lr_ratio: float = _f(0.0, "Final learning rate as a fraction of the peak (cosine).")
    weight_decay: float = _f(0.0, "AdamW decoupled weight decay.")
    adam_beta1: float = _f(0.9, "AdamW β1.")
    adam_beta2: float = _f(0.999, "AdamW β2.")
    adam_eps: float = _f(1e-8, "AdamW ε.")
    bias_correction: bool = _f(True, "Adam bias correction (torch/TRL: on; MLX's default: off).")
    grad_clip: float = _f(1.0, "Clip the global gradient norm to this; 0 = off.")
    seed: int = _f(0, "Seed for LoRA init, batch order and dropout (0 is a seed).")
    report_every: int = _f(10, "Steps per training-metrics window.")
    val_every: int = _f(50, "Validate before training, every N steps and at the end; "
                            "0 = only at the end.")
    val_batches: int = _f(0, "Validation micro-batches per evaluation; 0 = the whole split.")
    best_metric: str = _f("val/loss", "The validation metric that picks the run's best "
                                      "evaluation (summary.json's best_val); a sweep sets its "
                                      "own ranking metric here.")
    best_mode: str = _f("min", "min or max: which end of best_metric is best.")
    checkpoint_every: int = _f(0, "Checkpoint every N steps (adapters + optimizer); 0 = off.")
    keep_checkpoints: int = _f(2, "Newest checkpoints to keep.")
    resume: str | None = _f(None, "Checkpoint directory to resume from, or 'auto' (latest).")
    warm_start: str | None = _f(None, "Adapter directory to start the LoRA weights from.")
    allow_tokenizer_mismatch: bool = _f(False, "Train on a dataset whose manifest names "
                                               "another tokenizer than the model's (refused "
                                               "by default: engine/data/data_fit.py).")
    verify: bool = _f(False, "Before training, check this path's loss and gradients "
                             "against the plain dense path on the first batch.")
    memory_limit_gb: float = _f(0.0, "MLX's memory limit in GiB; past it, evaluation waits for "
                                     "queued GPU work to free its buffers, so peak stays near "
                                     "what a step needs (a 16 GB Mac mini: ~9; "
                                     "docs/performance.md). The run's process also caps MLX's "
                                     "queue (MLX_MAX_MB_PER_BUFFER: 40 on a Mac, 100 on "
                                     "CUDA; the CLIs re-run "
                                     "themselves with it). 0 = MLX's default.")

    def validate(self) -> None:
        """Raise ValueError unless the run names its model and data (every other field was
        checked when the config was built: ``check_values``)."""
        if not self.model:
            raise ValueError("model is required (a model directory or repo id)")
        if not self.data:
            raise ValueError("data is required (a tokenized dataset)")

    def check_values(self) -> None:
        """Every field's type and range, and the rules across fields (ValueError naming the
        first bad one): run once, by ``__post_init__``, whenever a config is built, so a
        TrainConfig is valid by construction; model and data may still be empty."""
        for f in dataclasses.fields(self):
            value, kind = getattr(self, f.name), _kind(f.name)
            if not _is_kind(value, kind):
                raise ValueError(f"{f.name}={value!r}: expected {_KINDS[kind]}")
            if kind == "float" and not math.isfinite(value):
                raise ValueError(f"{f.name}={value!r}: must be a finite number")
        for name in CHOICES:
            check_choice(name, getattr(self, name))
        for name in ("steps", "batch_size", "grad_accum", "lora_rank", "report_every",
                     "inflight"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)}: must be at least 1")
        for name in ("segment_size", "head_chunk", "mlp_chunk", "warmup_steps", "val_every",
                     "checkpoint_every", "val_batches"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}={getattr(self, name)}: must be >= 0")
        if not 0.0 <= self.lora_dropout < 1.0:
            raise ValueError(f"lora_dropout={self.lora_dropout}: must be in [0, 1)")
        if self.mlp_chunk and self.lora_dropout:  # a chunk's dropout mask is not the whole's
            raise ValueError("mlp_chunk with lora_dropout > 0: masks would differ from the "
                             "unchunked path; set one of them to 0")
        for name in ("learning_rate", "grad_clip", "weight_decay", "min_lr_ratio",
                     "memory_limit_gb"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}={getattr(self, name)}: must be >= 0")
        self._check_trains_something()
        for name in ("adam_beta1", "adam_beta2"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"{name}={getattr(self, name)}: must be in [0, 1)")
        if self.adam_eps <= 0:
            raise ValueError(f"adam_eps={self.adam_eps}: must be > 0")
        if not self.best_metric.startswith("val/"):
            raise ValueError(f"best_metric={self.best_metric!r}: expected a validation metric "
                             "such as val/loss or val/rewards/accuracies")

    def _check_trains_something(self) -> None:
        """Values the types and signs allow that would still train nothing (a zero
        learning rate or LoRA scale: every update or gradient is 0; a loss's own, such as
        SimPO's β, its settings refuse) or not what
        was asked (``lora_layers`` 0 adapts every block in mlx-lm; a final rate above the
        peak climbs instead of decaying)."""
        for name in ("learning_rate", "lora_scale"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}={getattr(self, name)}: must be > 0 (0 trains "
                                 "nothing: every update is zero)")
            if getattr(self, name) < FLOAT32_TINY:  # 1e-300 is 0 in the float32 update
                raise ValueError(f"{name}={getattr(self, name)}: below float32's smallest "
                                 f"normal number ({FLOAT32_TINY:.3g}): every update rounds "
                                 "to zero and trains nothing")
        if self.lora_layers == 0 or self.lora_layers < -1:
            raise ValueError(f"lora_layers={self.lora_layers}: adapt the last N >= 1 blocks, "
                             "or -1 for all of them")
        if self.pad_multiple < -1:
            raise ValueError(f"pad_multiple={self.pad_multiple}: must be -1 (auto) or >= 0")
        for f in dataclasses.fields(self):  # MLX and the loop count in int32
            value = getattr(self, f.name)
            if _kind(f.name) == "int" and abs(value) > 2**31 - 1:
                raise ValueError(f"{f.name}={value}: too large (at most {2**31 - 1})")
        if self.min_lr_ratio > 1:
            raise ValueError(f"min_lr_ratio={self.min_lr_ratio}: must be in [0, 1] (the final "
                             "learning rate is this fraction of the peak)")

    def __post_init__(self) -> None:
        if isinstance(self.loss, str):  # TrainConfig(loss="dpo"): that loss's defaults
            object.__setattr__(self, "loss", loss_named(self.loss))
        if isinstance(self.reference, str):  # TrainConfig(reference=DIR), as written
            object.__setattr__(self, "reference", parse_reference(self.reference))
        self.check_values()

    def forward(self, ranks: int = 1) -> ForwardOptions:
        """How this run's forward-only passes run (its reference pass, its evaluation): its
        batch (a rank's share of it: one device runs the pass), head chunk, sharing."""
        return ForwardOptions(max(1, self.batch_size // ranks), self.head_chunk,
                              self.prefix_share, self.allow_tokenizer_mismatch)

    def loss_spec(self) -> LossSpec:
        """The loss this run trains, validates and scores with."""
        return LossSpec(self.loss, self.nll_span)

    def replace(self, **changes: Any) -> TrainConfig:
        """A copy with ``changes``, each coerced to its field's type (``coerce``): a loss by
        name (its defaults, unless it is this run's loss already) and that loss's own
        settings by their flat names. Unknown names, values of the wrong type and another
        loss's settings raise, naming the field."""
        loss, rest = _routed(changes, self.loss)
        return dataclasses.replace(self, loss=loss, **rest)

    @classmethod
    def from_yaml(cls, path: str | Path, **overrides: Any) -> TrainConfig:
        """Defaults ← YAML file ← ``overrides`` (CLI). Every problem with the file (unreadable,
        not YAML, a Python tag, a bad key or value) is a ValueError naming it."""
        data = read_yaml(path, "config file") or {}
        if not isinstance(data, dict):
            raise ValueError(f"{path}: expected a mapping of config fields, got "
                             f"{type(data).__name__}")
        data = {str(k): v for k, v in data.items()}
        # Merged first, then checked: the file's keys under the loss the run ends up with
        # (kto_beta in the file and --loss kto on the command line is a KTO run).
        loss = {"loss": overrides["loss"]} if "loss" in overrides else {}
        try:
            cls().replace(**{**data, **loss})
        except ValueError as err:
            raise ValueError(f"{path}: {err}") from None
        return cls().replace(**{**data, **overrides})  # one replace: the loss, then its own

    def to_dict(self) -> dict[str, Any]:
        """Plain values, the loss flat (its name and its own settings): ``from_dict``
        rebuilds the config."""
        plain = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return {**plain, "loss": self.loss.kind, **self.loss.fields(),
                "reference": str(self.reference)}

    @staticmethod
    def defaults() -> dict[str, Any]:
        """The defaults as ``to_dict`` writes them, read off the fields (no config built)."""
        plain = {f.name: f.default for f in dataclasses.fields(TrainConfig)}
        return {**plain, "loss": DEFAULT_LOSS.kind, **DEFAULT_LOSS.fields(),
                "reference": str(BASE)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TrainConfig:
        """The config ``to_dict`` gave (or any flat mapping of fields): built once."""
        loss, rest = _routed(data, DEFAULT_LOSS)
        return cls(loss=loss, **rest)


def _routed(changes: dict[str, Any], loss: LossSettings) -> tuple[LossSettings, dict[str, Any]]:
    """``changes`` coerced and split into the run's loss (``loss`` changed by them) and the
    other fields; unknown names and another loss's settings raise, naming the field."""
    names = {f.name for f in dataclasses.fields(TrainConfig)}
    unknown = sorted(str(k) for k in set(changes) - names - set(OWNERS))
    if unknown:
        raise ValueError(f"unknown config field(s): {', '.join(unknown)}")
    if "loss" in changes and not (changes["loss"] == loss.kind or changes["loss"] is loss):
        loss = coerce("loss", changes["loss"])
    own = {k: coerce(k, v) for k, v in changes.items() if k in OWNERS}
    foreign = sorted(k for k in own if k not in loss.names())
    if foreign:
        raise ValueError(foreign_message(foreign[0], loss.kind))
    loss = dataclasses.replace(loss, **own) if own else loss
    return loss, {k: coerce(k, v) for k, v in changes.items() if k in names and k != "loss"}


_KINDS = {"loss": f"one of {tuple(LOSSES)}", "reference": "base or an adapter directory",
          "bool": "true or false", "int": "an integer", "float": "a number",
          "str": "a string", "str?": "a string or null",
          "keys?": "a list of module paths or null", "names": "a name or a list of names",
          "floats": "a number or a list of numbers"}


def field_type(name: str) -> Any:
    """The type of config field ``name``, a loss's own settings included."""
    owner = OWNERS.get(name)
    return get_type_hints(owner or TrainConfig)[name]


@cache
def _kind(name: str) -> str:
    hint = str(field_type(name))
    return {"<class 'bool'>": "bool", "<class 'int'>": "int", "<class 'float'>": "float",
            "<class 'str'>": "str", "str | None": "str?",
            "tuple[str, ...] | None": "keys?", "tuple[str, ...]": "names",
            "tuple[float, ...]": "floats",
            "<class 'engine.losses.base.LossSettings'>": "loss",
            "engine.settings.reference_kind.Base"
            " | engine.settings.reference_kind.AdapterRef": "reference"}[hint]


def _is_kind(value: Any, kind: str) -> bool:
    if kind == "loss":
        return isinstance(value, LossSettings)
    if kind == "reference":
        return isinstance(value, Base | AdapterRef)
    if kind == "bool":
        return isinstance(value, bool)
    if kind in ("int", "float"):
        types = int if kind == "int" else (int, float)
        return isinstance(value, types) and not isinstance(value, bool)
    if kind in ("keys?", "names") and isinstance(value, (list, tuple)):
        return all(isinstance(k, str) for k in value)
    if kind == "floats":
        return isinstance(value, tuple) and all(_number(v) is not None for v in value)
    return isinstance(value, str) or (value is None and kind.endswith("?"))


def coerce(name: str, value: Any) -> Any:
    """``value`` as field ``name``'s type, the way a user means it, or ValueError naming it.

    YAML 1.1 (PyYAML) reads ``1e-4`` as a string: numeric strings become numbers; an
    integral float (``1e3``, ``100.0``) is an integer where one is expected; a single
    string is a one-item ``lora_keys``. Booleans are never numbers, nor numbers booleans.
    """
    kind = _kind(name)
    number = _number(value)
    if kind == "loss":
        if isinstance(value, LossSettings):
            return value
        if isinstance(value, str) and value in LOSSES:
            return loss_named(value)
        raise ValueError(f"loss={value!r}: expected one of {tuple(LOSSES)}")
    if kind == "reference":
        return parse_reference(value)
    if kind == "bool" and isinstance(value, bool):
        return value
    if kind == "int" and number is not None and math.isfinite(number) and number.is_integer():
        return int(value) if isinstance(value, int) else int(number)
    if kind == "float" and number is not None:
        return number
    if kind == "str" and isinstance(value, str):
        return value
    if kind == "str?" and (value is None or isinstance(value, str)):
        return value
    if kind in ("names", "floats"):  # GRPO's reward and reward_weights: one, or a list
        items = tuple(value) if isinstance(value, list | tuple) else (value,)
        numbers = tuple(_number(v) for v in items)
        if kind == "names" and all(isinstance(v, str) for v in items):
            return items
        if kind == "floats" and None not in numbers:
            return numbers
    if kind == "keys?":
        if value is None:
            return None
        keys = (value,) if isinstance(value, str) else value
        if isinstance(keys, (list, tuple)) and keys and all(isinstance(k, str) for k in keys):
            return tuple(keys)
    raise ValueError(f"{name}={value!r}: expected {_KINDS[kind]}")


def _number(value: Any) -> float | None:
    """A real number from an int, a float or a numeric string (not from a bool)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str):
        try:
            return float(value.strip())
        except ValueError:
            return None
    return None
