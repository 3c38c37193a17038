"""``pomona data …``: synthetic preference rows, tokenize, preprocess, stats (the work in
cli/data_display.py)."""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path
from typing import Annotated

import typer

from cli.options import fills
from cli.shared_options import (
    LAYOUT,
    MODEL,
    OUT,
    SEED,
    TEST_FRACTION,
    VALID_FRACTION,
    synth_default,
)
from cli.terminal import OneLineGroup, console, fail
from tasks.data.data_check import CheckLimits
from tasks.data.tokenize_options import TokenizeOptions

LIMITS = {f.name: f.metadata["help"] for f in fields(CheckLimits)}  # each limit's help
AT = CheckLimits()  # and its default

data_app = typer.Typer(help="Make and prepare preference data.", no_args_is_help=True,
                       cls=OneLineGroup)


@data_app.command("synth")
def data_synth(
    out: Annotated[Path, OUT],
    task: Annotated[str, typer.Option(
        help="sort | reverse | add | add-small | max | parity (what a tiny model learns to "
             "answer: the demo) | mixed.")]
    = "sort",
    n: Annotated[int, typer.Option(help="Number of preference pairs.")] = 500,
    seed: Annotated[int | None, SEED] = None,
    layout: Annotated[str | None, LAYOUT] = None,
    max_shots: Annotated[int, typer.Option(help="Most worked examples in a prompt.")] = 8,
    ids: Annotated[bool, typer.Option(help="Write the optional `id` field.")] = True,
) -> None:
    """Write a learnable synthetic preference task (chosen correct, rejected a near-miss)."""
    from tasks.data.synthetic import synth_rows, write_rows

    seed = synth_default("seed") if seed is None else seed
    layout = synth_default("layout") if layout is None else layout
    try:
        rows = list(synth_rows(task, n, seed, layout, max_shots=max_shots, ids=ids))
        write_rows(rows, out)
    except (ValueError, OSError) as err:  # OSError: an --out that cannot be written
        raise fail(str(err)) from err
    console.print(f"wrote {len(rows)} {task} pairs ({layout} layout, seed {seed}) to {out}")


@data_app.command("tokenize")
@fills(TokenizeOptions, "options")
def data_tokenize(
    input: Annotated[Path, typer.Option("--input", help="A preference file or a directory.")],
    model: Annotated[str, MODEL],
    out: Annotated[Path, OUT],
    options: TokenizeOptions,
    preprocess: Annotated[bool, typer.Option(help="Run preprocess after.")] = True,
) -> None:
    """Tokenize preference files into an Arrow dataset (cached by content fingerprint)."""
    from cli.data_display import run_tokenize

    run_tokenize(console, input, model, out, options, preprocess)


@data_app.command("check")
@fills(TokenizeOptions, "options")
def data_check(
    input: Annotated[Path, typer.Option("--input", help="A preference file or a directory.")],
    model: Annotated[str, MODEL],
    options: TokenizeOptions,
    strict: Annotated[bool, typer.Option(help="Exit 1 when a finding is over its limit "
                                              "(default: warn).")] = False,
    max_length_bias_d: Annotated[float, typer.Option(help=LIMITS["length_bias_d"])]
    = AT.length_bias_d,
    max_chosen_longer: Annotated[float, typer.Option(help=LIMITS["chosen_longer"])]
    = AT.chosen_longer,
    max_repeats_prompt: Annotated[float, typer.Option(help=LIMITS["repeats_prompt"])]
    = AT.repeats_prompt,
    max_duplicate_prompts: Annotated[float, typer.Option(help=LIMITS["duplicate_prompts"])]
    = AT.duplicate_prompts,
    max_cross_split: Annotated[int, typer.Option(help=LIMITS["cross_split"])]
    = AT.cross_split,
) -> None:
    """Tokenize as `data tokenize` would (into a scratch folder) and report what training
    would not warn about: pairs identical once truncated, length bias, responses repeating
    the prompt, duplicate prompts, prompts in more than one split; each finding names rows."""
    from cli.data_display import run_check

    try:
        limits = CheckLimits(max_length_bias_d, max_chosen_longer, max_repeats_prompt,
                             max_duplicate_prompts, max_cross_split)
    except ValueError as err:
        raise fail(str(err)) from None
    raise typer.Exit(run_check(console, input, model, options, limits, strict))


@data_app.command("preprocess")
def data_preprocess(
    path: Annotated[Path, typer.Argument(help="A tokenized dataset directory.")],
    out: Annotated[Path | None, OUT] = None,
    valid_fraction: VALID_FRACTION = None,
    test_fraction: TEST_FRACTION = None,
) -> None:
    """split_prefix, de-duplication and the stable train/valid/test split."""
    from cli.data_display import run_preprocess

    run_preprocess(console, path, out, valid_fraction, test_fraction)


@data_app.command("stats")
def data_stats(path: Annotated[Path, typer.Argument(help="A tokenized dataset directory.")]
               ) -> None:
    """A table: rows, rejects by reason, length percentiles, prefix share rate."""
    from cli.data_display import run_stats

    run_stats(console, path)
