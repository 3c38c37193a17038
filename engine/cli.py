"""The engine's verbs (train, score, export) with no Prefect and no Ray: each verb's flags,
declared once from the dataclass it fills (engine/host/flags.py: TrainConfig, ScoreRequest,
ExportRequest, and the losses' settings), and the function that runs it from the parsed
values. ``python -m engine`` parses them with argparse (``main``); ``pomona`` with typer
(cli/engine_verbs.py), from the same flags. Precedence: CLI > YAML (--config) > defaults.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, get_type_hints

from engine.forward.score_request import ScoreRequest
from engine.host.cache import CacheRootError, check_cache_root
from engine.host.flags import (
    Flag,
    add_flags,
    choices_metavar,
    command_line,
    field_flags,
    flag_kind,
    given,
)
from engine.host.parsers import OneLineParser, command_parser
from engine.losses import LOSSES, OWNERS, READERS, LossSpec
from engine.model.export import ExportRequest
from engine.settings.config import DEFAULT_LOSS, TrainConfig
from engine.train.progress import progress_line

CONFIG = Flag("config", str, "YAML file of TrainConfig fields (CLI flags override).")


def train_flags() -> list[Flag]:
    """``train``'s flags: --config, one per TrainConfig field (the loss by name, the
    reference as base or a folder), then one per loss setting."""
    shown = {"loss": {"default": DEFAULT_LOSS.kind, "metavar": choices_metavar(tuple(LOSSES))},
             "reference": {"metavar": "base|DIR"}}
    fields = [dataclasses.replace(f, **shown.get(f.name, {})) for f in field_flags(TrainConfig)]
    return [CONFIG, *fields,
            *loss_flags(lambda f: f"(default: {f.default}; loss {readers_of(f.name)} only)")]


def readers_of(name: str) -> str:
    """The losses that read setting ``name``, as its help says them."""
    return " or ".join(cls.kind for cls in READERS[name])


def loss_flags(tail: Callable[[Any], str]) -> list[Flag]:
    """One flag per loss setting (engine/losses/), its help from the loss's field."""
    flags = []
    for name, owner in OWNERS.items():
        f = owner.field(name)
        flags.append(Flag(name, flag_kind(get_type_hints(owner)[name]),
                          f"{f.metadata['help']} {tail(f)}",
                          metavar=choices_metavar(f.metadata.get("choices"))))
    return flags


def score_flags() -> list[Flag]:
    return [*field_flags(ScoreRequest),
            *loss_flags(lambda f: f"Default: the adapter's, else {f.default}.")]


# Each verb: its flags and what it does, as `python -m engine --help` and `pomona --help` say.
VERBS: dict[str, tuple[Callable[[], list[Flag]], str]] = {
    "train": (train_flags, "Train one LoRA adapter with a preference loss (--loss: "
                           + ", ".join(LOSSES) + ")."),
    "score": (score_flags, "Score preference pairs under a model (+ adapter)."),
    "export": (lambda: field_flags(ExportRequest),
               "Fuse an adapter into its base model and write a GGUF (llama.cpp, Ollama, "
               "LM Studio)."),
}


def verb_parser(verb: str, prog: str | None = None) -> OneLineParser:
    """``verb``'s argparse parser, named as the user typed it."""
    flags, about = VERBS[verb]
    parser = OneLineParser(prog=prog or f"python -m engine {verb}", description=about)
    add_flags(parser, flags())
    return parser


def train_config(values: dict[str, Any]) -> TrainConfig:
    """The run's config from parsed ``train`` flags (None: not given): the flags over the
    ``--config`` file over TrainConfig's defaults, checked once."""
    changes = dict(given(values))
    yaml_path = changes.pop("config", None)
    if yaml_path:
        return TrainConfig.from_yaml(yaml_path, **changes)
    return TrainConfig().replace(**changes)


def config_from_args(argv: list[str]) -> TrainConfig:
    """``python -m engine train ARGV``'s config."""
    return train_config(vars(verb_parser("train").parse_args(argv)))


def replayable(config: str | None) -> bool:
    """Whether a new process given the same flags reads the same config: its ``--config``
    is a regular file by name (a pipe, ``<(...)`` or ``/dev/stdin`` is read to its end here)."""
    return config is None or (Path(config).is_file()
                              and not str(Path(config).absolute()).startswith(("/dev/", "/proc/")))


class PrintMetrics:
    """One line a record on stderr (engine/train/progress.py; the engine has no terminal
    UI): ``step 50/100 loss 5.76 acc 0.58 lr 3.6e-4 4.9k tok/s 0.03 GB``."""

    def __init__(self, steps: int | None = None):
        self.steps = steps

    def on_metrics(self, record: dict[str, Any]) -> None:
        print(progress_line(record, self.steps), file=sys.stderr)


class _Stderr(logging.StreamHandler):
    """Writes to whatever ``sys.stderr`` is at the time (a test runner swaps it)."""

    @property
    def stream(self) -> Any:
        return sys.stderr

    @stream.setter
    def stream(self, value: Any) -> None:
        pass

    def format(self, record: logging.LogRecord) -> str:
        kind = "" if record.levelno < logging.WARNING else f"{record.levelname.lower()}: "
        return kind + record.getMessage()


# Loggers whose INFO lines the CLI shows (--verify's figures); every logger's warnings show.
SHOWN_INFO = ("engine.train.trainer", "engine.train.run_parts", "engine.train.grpo_trainer",
              "engine.check.load_check", "engine.model.source", "engine.train.reference")


def log_to_stderr() -> None:
    """The engine's notes (rows skipped, an empty valid split, --verify's figures) as
    plain lines on stderr, beside the metrics."""
    logger = logging.getLogger("engine")
    if not any(isinstance(h, _Stderr) for h in logger.handlers):
        handler = _Stderr()
        handler.addFilter(lambda r: r.levelno >= logging.WARNING or r.name in SHOWN_INFO)
        logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False  # once, not again through a root handler someone configured


def run_train(values: dict[str, Any]) -> int:
    """``train`` with the parsed ``values`` (None: a flag not given); a run under a memory
    limit started by a CLI re-runs as ``python -m engine train`` with MLX's queue capped."""
    from engine.check.load_check import VerifyFailed
    from engine.host.command_queue import ensure_queue
    from engine.train.dispatch import train_any
    from engine.train.steps import NonFiniteLoss

    log_to_stderr()
    cfg = None
    try:
        cfg = train_config(values)
        if replayable(values.get("config")):  # the same flags read the same config again
            ensure_queue(cfg.memory_limit_gb,
                         ["-m", "engine", "train", *command_line(train_flags(), values)])
        result = train_any(cfg, [PrintMetrics(cfg.steps)])  # by its loss: sampled or read
    except KeyboardInterrupt:  # Ctrl-C: how to go on, not a traceback
        print(f"interrupted; {resume_hint(cfg)}", file=sys.stderr)
        return 130
    except (ValueError, OSError) as err:  # a file where --out should be a folder, too
        print(f"error: {err}", file=sys.stderr)
        return 2
    except NonFiniteLoss as err:  # the run stopped before saving the update
        print(f"error: {err}; nothing saved. Lower the learning rate, or check the data",
              file=sys.stderr)
        return 2
    except VerifyFailed as err:  # before any step: the configured path is not exact here
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(json.dumps(result.__dict__, indent=2))
    return 0


def resume_hint(cfg: Any) -> str:
    """How to continue an interrupted run: the step of its newest checkpoint, if any."""
    from engine.model.adapters import latest_checkpoint

    ckpt = latest_checkpoint(Path(cfg.out)) if cfg is not None else None
    if ckpt is None:
        return "no checkpoint to resume from (--checkpoint-every N writes them)"
    step = int(ckpt.name.removeprefix("step_"))
    return f"resume from step {step} ({ckpt}) with the same options and --resume auto"


def score_loss(kind: str | None, changes: dict[str, Any], own: LossSpec) -> LossSpec:
    """The score's loss: the adapter's own (``own``) unless ``kind`` names another, each
    loss flag given (``changes``) replacing its value, checked as a run's is (a negative β,
    a NaN or another loss's setting refused by name)."""
    kind = kind or own.kind
    kept = own.loss.fields() if kind == own.kind else {}
    cfg = TrainConfig().replace(loss=kind, nll_span=own.nll_span, **{**kept, **changes})
    return cfg.loss_spec()


def run_score(values: dict[str, Any]) -> int:
    """``score`` with the parsed ``values`` (None: a flag not given)."""
    from engine.data.data_fit import load_pairs_for
    from engine.data.unpaired import refuse_unpaired
    from engine.forward.layout_policy import scoring_layout
    from engine.forward.scoring import is_score_file, preference_accuracy, score_pairs
    from engine.host.atomic import atomic_write_text
    from engine.host.outputs import check_file
    from engine.model.adapters import pairs_scored_under, trained_loss, trained_reference
    from engine.settings.reference_kind import parse_reference
    from engine.train.prepared import prepare_scoring
    from engine.train.reference import ReferenceSpec, attach_reference, ensure_reference

    log_to_stderr()
    changes = dict(given(values))
    try:  # the output first: a refused --out costs no model load nor scoring
        a = ScoreRequest(**{k: v for k, v in changes.items() if k not in OWNERS})
        check_file(a.out, is_score_file, "a score file", inputs=[a.data, a.model, a.adapter])
        if (trained := trained_loss(a.adapter)) is not None and trained.loss.on_groups:
            print(f"note: {a.adapter} was trained with loss {trained.kind}, which scores no "
                  f"pairs: its metrics are loss {DEFAULT_LOSS.kind}'s", file=sys.stderr)
        refuse_unpaired(Path(a.data), "score reads preference pairs")
        own = pairs_scored_under(a.adapter)
        spec = score_loss(a.loss, {k: v for k, v in changes.items() if k in OWNERS}, own)
        reference = ReferenceSpec(a.model, a.data, parse_reference(a.reference) if a.reference
                                  else trained_reference(a.adapter), spec.needs_kl)
        options = a.forward
        if spec.needs_reference:  # made (or read) before the scored model loads
            ensure_reference(reference, None, options)
        prepared = prepare_scoring(a.model, a.adapter)
        model, stack = prepared.model, prepared.stack
        data = load_pairs_for(a.data, a.model, stack, options.allow_tokenizer_mismatch)
        if spec.needs_reference:
            attach_reference(data, reference, None, options)
    except (ValueError, OSError) as err:  # OSError: a cache that cannot be written
        print(f"error: {err}", file=sys.stderr)
        return 2
    pairs = data.train + data.valid + data.test if a.split == "all" else data.split(a.split)
    if not pairs:
        print(f"error: {a.data}: no {a.split} pairs to score", file=sys.stderr)
        return 2
    rows = score_pairs(model, stack, pairs, spec, options.batch_size, options.head_chunk,
                       scoring_layout(options.prefix_share, prepared.pad_id))
    out = Path(a.out)
    try:
        atomic_write_text(out, "".join(json.dumps(r) + "\n" for r in rows))
    except OSError as err:  # a disk that filled while scoring
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"scored {len(rows)} pairs → {out} (preference accuracy "
          f"{preference_accuracy(rows):.3f}; rows skipped: {dict(data.rejected)})",
          file=sys.stderr)
    return 0


def run_export(values: dict[str, Any]) -> int:
    """``export`` with the parsed ``values`` (None: a flag not given)."""
    from pathlib import Path

    from engine.model.export import check_adapter_export, export, export_adapter, writable

    try:
        a = ExportRequest(**dict(given(values)))
        jobs = [(what, out) for what, out in (("fused", a.gguf), ("adapter", a.gguf_adapter))
                if out]
        for what, out in jobs:  # both files' refusals before either is written
            writable(Path(out), lambda _: False, [a.target],
                     "--gguf-adapter" if what == "adapter" else "--gguf")
        if a.gguf_adapter and a.gguf:  # the adapter's own refusals, before the fused file
            check_adapter_export(a.target, a.model)
        for what, out in jobs:  # fused first: what can fail late fails with nothing written
            done = (export_adapter if what == "adapter" else export)(a.target, out, a.model,
                                                                     a.type)
            print(f"exported {a.target} → {done} ({what}, {a.type}, "
                  f"{done.stat().st_size / 2**20:.1f} MiB)", file=sys.stderr)
    except (ValueError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


RUNNERS: dict[str, Callable[[dict[str, Any]], int]] = {
    "train": run_train, "score": run_score, "export": run_export}


USAGE = """Train, score or export one adapter with no Prefect and no Ray.

    python -m engine train --model DIR --data PATH --out DIR [--config YAML] [--steps N ...]
    python -m engine score --model DIR [--adapter DIR] --data PATH --out FILE.jsonl
    python -m engine export RUN_OR_ADAPTER --gguf OUT.gguf [--model M] [--type q8_0]
    python -m engine export RUN_OR_ADAPTER --gguf-adapter LORA.gguf   # llama.cpp's --lora

Each command's --help lists its options. Benchmarks: python -m benchmarks --help."""


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["bench"]:  # where it lived before benchmarks/ was their one home
        print("error: the benchmarks are `python -m benchmarks KIND ...` (or `pomona bench "
              "KIND ...`) now", file=sys.stderr)
        return 2
    try:
        verbs = {verb: about for verb, (_, about) in VERBS.items()}
        args, rest = command_parser("python -m engine", verbs, USAGE).parse_known_args(argv)
        values = vars(verb_parser(args.command).parse_args(rest))
    except SystemExit as done:  # --help (0) or a usage mistake (2): a return code
        return int(done.code or 0)
    try:
        check_cache_root()  # a bad $POMONA_CACHE: one line now, not a traceback mid-run
    except CacheRootError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return RUNNERS[args.command](values)
