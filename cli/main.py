"""The ``pomona`` command line: one entry point for every stage.

    pomona model init --out models/tiny          # a self-made model, no download
    pomona data synth --task sort --n 500 --out data/sort.jsonl
    pomona demo --out runs/demo                  # the whole pipeline on self-made fixtures
    pomona pipeline RAW MODEL SPEC --out DIR     # tokenize → … → leaderboard, as a flow
    pomona sweep SPEC --out DIR                  # a sweep alone (docs/sweep.md)
    pomona track RUN_DIR                         # what MLflow/TensorBoard missed, sent
    pomona export RUN --gguf OUT.gguf            # the best adapter fused, for llama.cpp

Heavy imports (mlx, mlx-lm, tokenizers) happen inside commands so ``--help`` stays fast.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from pathlib import Path
from typing import Annotated

import typer

from cli.data import data_app
from cli.engine_verbs import HELP, PASSTHROUGH, add_engine_verbs
from cli.model import model_app
from cli.shared_options import (
    ADDRESS,
    GENERATIONS,
    GPUS,
    MODEL,
    OUT,
    REPORT_TO,
    RESOURCE,
)
from cli.terminal import OneLineGroup, console, fail

app = typer.Typer(
    name="pomona",
    help="Preference fine-tuning (ORPO, DPO, SimPO, KTO, CPO, SFT) of mlx-lm models, swept "
         "with Ray, run by Prefect.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    cls=OneLineGroup,  # a usage mistake in any verb: one line (cli/terminal.py)
    rich_markup_mode=None,  # plain help: rich's boxes cut train's 90 options' help to "…"
    context_settings=HELP,
)
app.add_typer(model_app, name="model")
app.add_typer(data_app, name="data")
@app.callback()
def before_any_verb() -> None:
    """Before any verb (never at import: a program that imports the CLI keeps its
    environment): the cache root checked (a bad $POMONA_CACHE is one line now, not a
    traceback once Ray runs), and Prefect's defaults for a lab: what the user set wins."""
    from engine.host.cache import CacheRootError, check_cache_root

    try:
        check_cache_root()
    except CacheRootError as err:
        raise fail(str(err)) from None
    # A lab network has no route out, and the temporary server's telemetry writer raced
    # the flow for its SQLite database ("database is locked" tracebacks in the demo).
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    # On a fresh PREFECT_HOME the temporary server migrates its database before it
    # answers; on a busy 2-core CI box that outran Prefect's 20 s wait.
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")


def cluster_of(address: str | None, gpus: bool = False, resource: str | None = None):
    """The run's Ray cluster and placement, built once from the flags (tasks/nodes/
    cluster.py); an ``--address`` that is no Ray address is refused before anything
    starts."""
    from tasks.nodes.cluster import Cluster
    from tasks.nodes.ray_session import RayAddressError

    try:
        return Cluster.of(address, gpus, resource)
    except RayAddressError as err:
        raise fail(str(err)) from None


@app.command("sweep")
def sweep(
    spec: Annotated[Path, typer.Argument(help="Sweep spec YAML (see flows/configs/).")],
    out: Annotated[Path | None, OUT] = None,
    address: ADDRESS = None,
    gpus: GPUS = False,
    resource: RESOURCE = None,
    prefect: Annotated[bool | None, typer.Option(
        "--prefect/--no-prefect", help="Run as a Prefect flow (each trial a task run); "
        "default: when PREFECT_API_URL names a server.")] = None,
    report_to: REPORT_TO = None,
) -> None:
    """Run a hyperparameter sweep on Ray: one trial per GPU or slot, cached re-runs."""

    from cli.sweep_display import run_sweep_cli

    cluster = cluster_of(address, gpus, resource)
    use_prefect = bool(os.environ.get("PREFECT_API_URL")) if prefect is None else prefect
    run_sweep_cli(console, spec, out, cluster, use_prefect, report_to)




add_engine_verbs(app)  # train, score, export: flags from engine/cli.py


@app.command("bench", context_settings=PASSTHROUGH, add_help_option=False)
def bench_cmd(ctx: typer.Context) -> None:
    """Side-by-side benchmarks (`python -m benchmarks`): `pomona bench --help` lists them."""
    from benchmarks.__main__ import main as benchmarks

    raise typer.Exit(code=benchmarks(list(ctx.args), prog="pomona bench"))


@app.command("demo")
def demo(
    out: Annotated[Path | None, OUT] = None,
    address: ADDRESS = None,
    model: Annotated[str | None, MODEL] = None,
    online: Annotated[bool, typer.Option(help="GRPO from the task's verifier alone, from a "
                                              "short SFT warm start (tiny only; default "
                                              "--out runs/demo-online).")] = False,
) -> None:
    """The whole pipeline on a model and a synthetic task: leaderboard and generations."""
    from cli.demo import DEFAULT_MODEL, demo_of, run_demo
    from cli.prefect_ui import ApiGone, prefect_api
    from engine.host.outputs import RefusedOutput
    from flows.pipeline import claim_pipeline

    cluster = cluster_of(address)
    model = model or DEFAULT_MODEL
    try:
        demo_of(model, online)
    except ValueError as err:
        raise fail(str(err)) from None
    out = out or Path(f"runs/demo-{'online' if online else model}" if online or (
        model != DEFAULT_MODEL) else "runs/demo")
    try:
        with claim_pipeline(out), prefect_api(out):
            run_demo(out, console, cluster, model, online)
    except (RefusedOutput, ApiGone) as err:  # --out not Pomona's to replace; a dead server
        raise fail(str(err)) from None
    except OSError as err:  # a real model's fetch from PyPI failed
        raise fail(str(err)) from None


@app.command("pipeline")
def pipeline_cmd(
    raw: Annotated[Path, typer.Argument(help="Preference JSONL file or directory.")],
    model: Annotated[str, typer.Argument(help="Model directory or repo id (mlx_lm.load).")],
    spec: Annotated[Path, typer.Argument(help="Sweep spec YAML (its model/data are "
                                               "replaced by these).")],
    out: Annotated[Path | None, OUT] = None,
    address: ADDRESS = None,
    gpus: GPUS = False,
    resource: RESOURCE = None,
    generations: GENERATIONS = None,
    report_to: REPORT_TO = None,
    warm_start: Annotated[int, typer.Option(
        help="Steps of SFT on the train split's answers before the sweep, every trial then "
             "starting from it, its KL (GRPO's β, DPO's) taken against it and the base row "
             "evaluated with it (0: none; `pomona demo --online` runs 80).")] = 0,
) -> None:
    """The Prefect pipeline: tokenize → preprocess → sweep → evaluate → leaderboard, into
    --out (default runs/pipeline)."""
    from flows.pipeline import check_pipeline_inputs, pipeline

    out = out or Path("runs/pipeline")
    cluster = cluster_of(address, gpus, resource)
    try:
        checked = check_pipeline_inputs(str(raw), model, str(spec), str(out), generations,
                                        report_to, warm_start)
    except (ValueError, FileNotFoundError) as err:  # SpecError is a ValueError
        raise fail(str(err)) from None
    from prefect.exceptions import FailedRun

    from cli.prefect_ui import ApiGone, prefect_api
    from tasks.eval.scorers import ScorerError

    try:
        with prefect_api(out):
            summary = pipeline(str(raw), model, str(spec), str(out), cluster, generations,
                               report_to=report_to, warm_start=warm_start, checked=checked)
    except (FailedRun, ApiGone, ScorerError) as err:  # the data's or a scorer's mistake
        raise fail(str(err)) from None
    console.print(f"leaderboard: {summary['markdown']}; best adapter: "
                  f"{summary['best_adapter']}")


@app.command("leaderboard")
def leaderboard_cmd(
    sweep_dir: Annotated[Path, typer.Argument(help="A finished sweep's directory "
                                                    "(results.parquet).")],
    model: Annotated[str, MODEL],
    data: Annotated[Path, typer.Option(help="The sweep's tokenized dataset.")],
    metric: Annotated[str, typer.Option(help="Rank by this validation metric, or by a "
                                             "generation score gen/valid/LABEL (higher "
                                             "better).")] = "val/loss",
    mode: Annotated[str | None, typer.Option(
        help="min or max: the validation metric's direction (default min); a generation "
             "score ranks higher first.")] = None,
    scorer: Annotated[list[str] | None, typer.Option(
        help="How generations are scored (repeatable): exact, contains, regex:PATTERN, "
             "task, task:NAME, python:package.module:function; LABEL=SCORER names its "
             "metric gen/<split>/LABEL.")] = None,
    generations: GENERATIONS = None,
    score_timeout: Annotated[float, typer.Option(
        help="Seconds one evaluation's scoring may take, all rows and scorers; past it the "
             "run ends naming the scorer and row.")] = 300.0,
    address: ADDRESS = None,
    gpus: GPUS = False,
    resource: RESOURCE = None,
    fuse: Annotated[bool, typer.Option(help="Also fuse the best adapter (mlx_lm fuse).")]
    = False,
) -> None:
    """Evaluate and rank a finished sweep: leaderboard.md/.parquet and best-adapter/."""
    from cli.prefect_ui import ApiGone, prefect_api
    from engine.host.outputs import RefusedOutput
    from flows.pipeline import claim_sweep_dir, leaderboard_flow
    from tasks.board.leaderboard import check_leaderboard_inputs
    from tasks.eval.generation_eval import check_rank_by, check_scorers_on_data

    cluster = cluster_of(address, gpus, resource)
    try:
        settings = leaderboard_settings(scorer, generations, score_timeout)
        if metric.startswith("gen/"):
            check_rank_by(metric, settings)
        check_leaderboard_inputs(sweep_dir, model, str(data), metric, mode)
        check_scorers_on_data(settings, model, str(data))  # before anything starts or is written
        with claim_sweep_dir(sweep_dir, model, str(data)), prefect_api(sweep_dir):
            summary = leaderboard_flow(str(sweep_dir), model, str(data), metric, mode,
                                       cluster=cluster, generations=settings, fuse=fuse,
                                       scorers_checked=True)
    except (RefusedOutput, ValueError, FileNotFoundError, ApiGone) as err:
        raise fail(str(err)) from None  # ScorerError is a ValueError
    console.print(f"leaderboard: {summary['markdown']}; best adapter: "
                  f"{summary['best_adapter']}")


@app.command("track")
def track(
    run_dir: Annotated[Path, typer.Argument(help="A sweep's, a pipeline's or a `pomona "
                                                 "train --report-to` run's directory.")],
    report_to: REPORT_TO = None,
) -> None:
    """Send a run's trials, evaluations, board and best adapter to its trackers: what
    they missed (a server that was down), from the run's own files, nothing twice."""
    from engine.host.outputs import RefusedOutput, claim
    from tasks.sweep.run import is_sweep_dir
    from tasks.track.report_to import ReportTo
    from tasks.track.resend import TrackError, sweep_folder, track_run

    try:
        extra = ReportTo.parse(report_to, "--report-to") if report_to else None
        folder = sweep_folder(run_dir)
        with contextlib.ExitStack() as held:  # a pipeline's folder too: its board is read
            if folder != run_dir:
                from flows.pipeline import claim_pipeline

                held.enter_context(claim_pipeline(run_dir))
            held.enter_context(claim(folder, ("sweep", "run"), legacy=is_sweep_dir,
                                     new_ok=False, flag="RUN_DIR"))
            sent = track_run(run_dir, extra)
    except (RefusedOutput, ValueError, FileNotFoundError, TrackError) as err:
        raise fail(str(err)) from None
    for name, where in sent.items():
        console.print(f"{name}: {run_dir} sent to {where}")


def leaderboard_settings(scorers: list[str] | None, generations: int | None, timeout: float):
    """The leaderboard's GenerationSettings from its flags (ValueError naming the flag)."""
    from tasks.eval.generation_eval import GenerationSettings, check_prompts_flag
    from tasks.eval.scorers import parse_scorers

    check_prompts_flag(generations)
    if not 0 < timeout < float("inf"):
        raise ValueError(f"--score-timeout {timeout:g}: expected seconds > 0")
    return GenerationSettings(**({"scorers": parse_scorers(scorers)} if scorers else {}),
                              score_timeout_s=timeout).with_prompts(generations)


@app.command("serve")
def serve(
    raw: Annotated[Path, typer.Argument(help="Preference JSONL file or directory.")],
    model: Annotated[str, typer.Argument(help="Model directory or repo id.")],
    spec: Annotated[Path, typer.Argument(help="Sweep spec YAML.")],
    cron: Annotated[str, typer.Option(help="When to run, cron syntax.")] = "0 2 * * *",
    timezone: Annotated[str, typer.Option(help="The cron's timezone (explicit: a lab's "
                                               "night is local).")] = "UTC",
    out: Annotated[Path | None, OUT] = None,
    address: ADDRESS = None,
    gpus: GPUS = False,
    resource: RESOURCE = None,
    name: Annotated[str, typer.Option(help="Deployment name.")] = "scheduled",
) -> None:
    """Serve the pipeline on a schedule until stopped (needs PREFECT_API_URL: `pomona ui`),
    each run into --out (default runs/scheduled)."""
    from prefect import serve as prefect_serve

    from cli.prefect_ui import ApiGone, check_api
    from flows.pipeline import pipeline_deployment

    try:
        check_api()
    except ApiGone as err:
        raise fail(str(err)) from None
    cluster = cluster_of(address, gpus, resource)  # a mapping: the deployment's JSON
    out = out or Path("runs/scheduled")
    params = {"raw": str(raw.resolve()), "model": model, "spec": str(spec.resolve()),
              "out": str(out.resolve()), "cluster": dataclasses.asdict(cluster)}
    console.print(f"serving pomona-pipeline/{name}: '{cron}' ({timezone}), one run at a time")
    prefect_serve(pipeline_deployment(name, cron, timezone, params))


@app.command("ui")
def ui(
    host: Annotated[str, typer.Option(help="Bind address (localhost unless you mean the "
                                           "lab network).")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port.")] = 4200,
    public_url: Annotated[str | None, typer.Option(
        help="URL browsers and clients reach this server at, e.g. http://head-mac.lab:4200 "
             "(needed with --host 0.0.0.0; default http://HOST:PORT).")] = None,
) -> None:
    """Start a Prefect server (UI + API); then export PREFECT_API_URL=http://HOST:PORT/api."""
    import sys

    from cli.prefect_ui import browser_url, point_ui_at

    try:
        url = browser_url(host, port, public_url)
    except ValueError as e:
        raise fail(str(e)) from None
    api = point_ui_at(url)  # the UI calls this API (Prefect's default is port 4200)
    console.print(f"Prefect UI at {url}; in other shells: export PREFECT_API_URL={api}")
    prefect = str(Path(sys.executable).with_name("prefect"))  # this environment's CLI
    os.execv(prefect, [prefect, "server", "start", "--host", host, "--port", str(port)])


def main() -> None:
    """Console-script entry point (on a Linux CPU, first OpenBLAS: engine/host/blas.py)."""
    from engine.host.blas import ensure_fast_blas
    from engine.host.command_queue import entry_point
    from tasks.nodes.stop_signals import hear_stop_signals

    ensure_fast_blas()
    hear_stop_signals()  # SIGINT even when a script's `&` left it ignored; SIGTERM too
    entry_point()  # `pomona train` under a memory limit may re-run with MLX's queue capped
    app()


if __name__ == "__main__":
    main()
