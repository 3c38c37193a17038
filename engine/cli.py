"""Argument parsing for ``python -m engine`` (and ``pomona train``/``pomona score``): argparse
subparsers pick the command, and each command parses its own arguments.

Options are generated from TrainConfig's fields, so the CLI, YAML and the dataclass can
never disagree. Precedence: CLI > YAML (--config) > defaults.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any, Union, get_args, get_origin, get_type_hints

from engine.host.cache import CacheRootError, check_cache_root
from engine.host.parsers import OneLineParser, command_parser
from engine.losses import LOSSES, OWNERS, LossSpec
from engine.settings.config import CHOICES, TrainConfig
from engine.train.progress import progress_line


def _arg_type(hint: Any) -> tuple[Any, dict[str, Any]]:
    if get_origin(hint) in (Union, types.UnionType):
        hint = next(a for a in get_args(hint) if a is not type(None))
    if hint is bool:
        return None, {"action": argparse.BooleanOptionalAction}
    if get_origin(hint) is tuple:
        return None, {"nargs": "+"}
    return None, {"type": hint}


def train_parser(prog: str = "python -m engine train") -> argparse.ArgumentParser:
    """``prog``'s options: one per TrainConfig field (and loss setting), from the dataclass;
    ``prog`` is the command as the user typed it (``pomona train``)."""
    p = OneLineParser(prog=prog,
                      description="Train one LoRA adapter with a preference loss (--loss: "
                                  + ", ".join(LOSSES) + ").")
    p.add_argument("--config", help="YAML file of TrainConfig fields (CLI flags override).")
    hints = get_type_hints(TrainConfig)
    for f in dataclasses.fields(TrainConfig):
        if f.name == "loss":
            p.add_argument("--loss", choices=tuple(LOSSES), default=None,
                           help=f"{f.metadata['help']} (default: {f.default.kind})")
            continue
        if f.name == "reference":  # a word or a path, read by TrainConfig (parse_reference)
            p.add_argument("--reference", default=None, metavar="base|DIR",
                           help=f"{f.metadata['help']} (default: {f.default})")
            continue
        _, kwargs = _arg_type(hints[f.name])
        p.add_argument(f"--{f.name.replace('_', '-')}", dest=f.name, default=None,
                       help=f"{f.metadata['help']} (default: {f.default})".replace("%", "%%"),
                       **kwargs)  # argparse %-formats help: "25%" crashed --help
    add_loss_options(p, lambda f: f"(default: {f.default}; loss {OWNERS[f.name].kind} only)")
    return p


def add_loss_options(p: argparse.ArgumentParser, tail: Callable[[Any], str]) -> None:
    """One option per loss setting (engine/losses/), its help from the loss's field."""
    for name, owner in OWNERS.items():
        f = owner.field(name)
        hint = get_type_hints(owner)[name]
        kwargs = ({"choices": f.metadata["choices"]} if "choices" in f.metadata else
                  {"type": hint})
        p.add_argument(f"--{name.replace('_', '-')}", dest=name, default=None,
                       help=f"{f.metadata['help']} {tail(f)}".replace("%", "%%"), **kwargs)


def config_from_args(argv: list[str], prog: str = "python -m engine train") -> TrainConfig:
    args = vars(train_parser(prog).parse_args(argv))
    yaml_path = args.pop("config")
    overrides = {k: v for k, v in args.items() if v is not None}
    if yaml_path:
        return TrainConfig.from_yaml(yaml_path, **overrides)
    return TrainConfig().replace(**overrides)


def replayable(argv: list[str]) -> bool:
    """Whether a new process given ``argv`` reads the same config: its ``--config`` is a
    regular file by name (a pipe, ``<(...)`` or ``/dev/stdin`` is read to its end here)."""
    path = train_parser().parse_args(argv).config
    return path is None or (Path(path).is_file()
                            and not str(Path(path).absolute()).startswith(("/dev/", "/proc/")))


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
SHOWN_INFO = ("engine.train.trainer", "engine.check.load_check", "engine.model.source",
              "engine.train.reference")


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


def run_train(argv: list[str], prog: str = "python -m engine train") -> int:
    from engine.check.load_check import VerifyFailed
    from engine.host.command_queue import ensure_queue
    from engine.train.steps import NonFiniteLoss
    from engine.train.trainer import train

    log_to_stderr()
    cfg = None
    try:
        cfg = config_from_args(argv, prog)
        if replayable(argv):  # a CLI under a limit: re-run with MLX's queue capped
            ensure_queue(cfg.memory_limit_gb, ["-m", "engine", "train", *argv])
        result = train(cfg, [PrintMetrics(cfg.steps)])
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


def score_parser(prog: str = "python -m engine score") -> argparse.ArgumentParser:
    p = OneLineParser(prog=prog,
                      description="Score preference pairs under a model (+ adapter).")
    p.add_argument("--model", required=True, help="Model directory, .gguf file or repo id.")
    p.add_argument("--adapter", help="Adapter directory (mlx-lm format).")
    p.add_argument("--data", required=True, help="Tokenized pairs (dataset dir/.parquet/.jsonl).")
    p.add_argument("--out", required=True, help="Output JSONL, one object per pair.")
    p.add_argument("--loss", choices=tuple(LOSSES),
                   help="The loss column's loss (default: the adapter's own, else orpo).")
    add_loss_options(p, lambda f: f"Default: the adapter's, else {f.default}.")
    p.add_argument("--reference", help="DPO's reference: base or an adapter directory. "
                                       "Default: the one the adapter trained against.")
    p.add_argument("--split", default="all", choices=["all", "train", "valid", "test"],
                   help="Which pairs to score: train, valid (ranked on), test (reported).")
    p.add_argument("--batch-size", type=at_least(1), default=8, help="Pairs per forward.")
    p.add_argument("--head-chunk", type=at_least(0), default=0,
                   help="Bounded head chunk (0 = dense).")
    p.add_argument("--allow-tokenizer-mismatch", action="store_true",
                   help=_field_help("allow_tokenizer_mismatch"))
    p.add_argument("--prefix-share", default="auto", choices=CHOICES["prefix_share"],
                   help="One forward per pair over [prompt | chosen | rejected], as in "
                        "training (auto: where it saves enough tokens).")
    return p


def at_least(minimum: int) -> Callable[[str], int]:
    """An argparse type: an integer of at least ``minimum`` (a batch of 0 pairs scores
    nothing, forever)."""
    def integer(text: str) -> int:
        value = int(text)  # argparse reports a ValueError as "invalid integer value"
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{value}: must be at least {minimum}")
        return value

    return integer


def _field_help(name: str) -> str:
    return next(f.metadata["help"] for f in dataclasses.fields(TrainConfig) if f.name == name)


def score_loss(a: argparse.Namespace, own: LossSpec) -> LossSpec:
    """The score's loss: the adapter's own (``own``), each flag given replacing its value,
    checked as a run's is (a negative β, a NaN or another loss's setting refused by name)."""
    kind = a.loss or own.kind
    given = {k: getattr(a, k) for k in OWNERS if getattr(a, k) is not None}
    kept = own.loss.fields() if kind == own.kind else {}
    cfg = TrainConfig().replace(loss=kind, nll_span=own.nll_span, **{**kept, **given})
    return cfg.loss_spec()


def run_score(argv: list[str], prog: str = "python -m engine score") -> int:
    from engine.data.data_fit import load_pairs_for
    from engine.forward.layout_policy import scoring_layout
    from engine.forward.scoring import is_score_file, preference_accuracy, score_pairs
    from engine.host.atomic import atomic_write_text
    from engine.host.outputs import check_file
    from engine.model.adapters import trained_loss, trained_reference
    from engine.settings.forward_options import ForwardOptions
    from engine.settings.reference_kind import parse_reference
    from engine.train.prepared import prepare_scoring
    from engine.train.reference import ReferenceSpec, attach_reference, ensure_reference

    log_to_stderr()
    a = score_parser(prog).parse_args(argv)
    try:  # the output first: a refused --out costs no model load nor scoring
        check_file(a.out, is_score_file, "a score file", inputs=[a.data, a.model, a.adapter])
        spec = score_loss(a, trained_loss(a.adapter) or LossSpec())
        reference = ReferenceSpec(a.model, a.data, parse_reference(a.reference) if a.reference
                                  else trained_reference(a.adapter), spec.needs_kl)
        options = ForwardOptions(a.batch_size, a.head_chunk, a.prefix_share,
                                 a.allow_tokenizer_mismatch)
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


def export_parser(prog: str = "python -m engine export") -> argparse.ArgumentParser:
    from engine.model.gguf_export import TYPES

    p = OneLineParser(prog=prog,
                      description="Fuse an adapter into its base model and write a GGUF "
                                  "(llama.cpp, Ollama, LM Studio).")
    p.add_argument("target", help="A training run, an adapter, or a sweep's folder "
                                  "(its best-adapter/).")
    p.add_argument("--gguf", required=True, help="The GGUF file to write (never over one).")
    p.add_argument("--model", default=None, help="The base model (default: the one the "
                                                 "adapter names); a folder or a .gguf file.")
    p.add_argument("--type", default="f32", choices=TYPES, help="Tensor type (default f32).")
    return p


def run_export(argv: list[str], prog: str = "python -m engine export") -> int:
    from engine.model.export import export

    a = export_parser(prog).parse_args(argv)
    try:
        out = export(a.target, a.gguf, a.model, a.type)
    except (ValueError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"exported {a.target} → {out} ({a.type}, {out.stat().st_size / 2**20:.1f} MiB)",
          file=sys.stderr)
    return 0


USAGE = """Train, score or export one adapter with no Prefect and no Ray.

    python -m engine train --model DIR --data PATH --out DIR [--config YAML] [--steps N ...]
    python -m engine score --model DIR [--adapter DIR] --data PATH --out FILE.jsonl
    python -m engine export RUN_OR_ADAPTER --gguf OUT.gguf [--model M] [--type q8_0]

Each command's --help lists its options. Benchmarks: python -m benchmarks --help."""
COMMANDS = {"train": "Train one LoRA adapter (ORPO, DPO, SimPO, KTO, CPO or SFT).",
            "score": "Score preference pairs under a model (+ adapter).",
            "export": "Fuse an adapter into its base and write a GGUF."}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["bench"]:  # where it lived before benchmarks/ was their one home
        print("error: the benchmarks are `python -m benchmarks KIND ...` (or `pomona bench "
              "KIND ...`) now", file=sys.stderr)
        return 2
    try:
        args, rest = command_parser("python -m engine", COMMANDS, USAGE).parse_known_args(argv)
    except SystemExit as done:  # --help (0) or a missing/unknown command (2): a return code
        return int(done.code or 0)
    try:
        check_cache_root()  # a bad $POMONA_CACHE: one line now, not a traceback mid-run
    except CacheRootError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return {"train": run_train, "score": run_score, "export": run_export}[args.command](rest)
