"""The pipeline flow: tokenize → preprocess → sweep → evaluate → aggregate.

Each stage is a task run (the sweep: one task run per trial, tasks/trials.py on Ray), so
the Prefect UI shows the whole run: the dataset's size and rejects, every trial, every
evaluation, and a markdown artifact with the leaderboard. The sweep spec's model and data
are replaced by the pipeline's own. Stages are plain functions underneath
(tasks/tokenize.py, tasks/preprocess.py, tasks/sweep.py, tasks/evaluate.py,
tasks/leaderboard.py), each also reachable from the CLI.

Nothing here is ever pickled, whatever PREFECT_RESULTS_PERSIST_BY_DEFAULT says: stages that
leave their results as files persist no task result, evaluations persist theirs as JSON
(their cache), and flows return JSON.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger, task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE
from prefect.states import Failed, State

from engine.adapters import ADAPTER_FILE, CONFIG_FILE, trained_loss
from engine.losses import LossSpec
from flows.ray_session import ray_session
from flows.sweep_flow import artifact_key, sweep_stage
from tasks.content_key import file_digest, model_fingerprint
from tasks.evaluate import evaluate_adapter
from tasks.leaderboard import export_best, rank_trials, swept_params, write_leaderboard
from tasks.plots import curves_png, inline_png, metric_vs_params_png
from tasks.preprocess import preprocess_dataset
from tasks.soup import make_soup
from tasks.sweep import CODE_VERSION, check_model, data_fingerprint
from tasks.sweep_spec import load_spec
from tasks.tokenize import tokenize_dataset
from tasks.trials import Placement


@task(cache_policy=NO_CACHE, persist_result=False)
def tokenize_task(raw: str, model: str, out: str) -> dict[str, Any] | State:
    """Raw preference files → an Arrow dataset directory (cached on its fingerprint).

    A data mistake (no rows, too many bad ones, an unreadable file, a refused --out) ends
    the run Failed with its one-line message: the user's error, not a traceback."""
    try:
        report = tokenize_dataset(raw, model, out)
    except (ValueError, OSError) as err:
        return Failed(message=str(err))
    get_run_logger().info("tokenized %s rows (%s tokens)%s; rejects: %s", report.rows,
                          report.tokens, " [cache hit]" if report.cache_hit else "",
                          report.rejects)
    return {"path": out, "rows": report.rows, "tokens": report.tokens,
            "cache_hit": report.cache_hit}


@task(cache_policy=NO_CACHE, persist_result=False)
def preprocess_task(path: str) -> dict[str, Any]:
    """Find each pair's shared prompt prefix (split_prefix_batch's input)."""
    report = preprocess_dataset(path)
    get_run_logger().info("prefix sharing saves %.0f%% of tokens", 100 * report.saved_fraction)
    return {"saved_fraction": report.saved_fraction}


@dataclasses.dataclass(frozen=True)
class EvalSettings:
    """How an evaluation runs: batch size, LM-head chunk (0 = dense), prefix sharing."""

    batch_size: int = 8
    head_chunk: int = 0
    prefix_share: str = "auto"


def eval_settings(rows: list[dict[str, Any]]) -> EvalSettings:
    """Settings that work where ``rows``' trials trained: their smallest batch; if any
    bounded its head, the smallest chunk (dense [2B, T, vocab] logits at batch 8 would
    outgrow a 16 GB Mac mini that trained a large-vocabulary model with head_chunk); and
    prefix sharing off if any trial turned it off (an architecture it cannot wrap)."""
    if not rows:
        return EvalSettings()
    chunks = [int(r.get("param/head_chunk") or 0) for r in rows]
    shares = {r.get("param/prefix_share") or "auto" for r in rows}
    return EvalSettings(batch_size=min(int(r.get("param/batch_size") or 8) for r in rows),
                        head_chunk=min((c for c in chunks if c > 0), default=0),
                        prefix_share="off" if "off" in shares else
                        "on" if shares == {"on"} else "auto")


def evaluation_key(context: Any, inputs: dict[str, Any]) -> str:
    """An evaluation depends on the model's and the adapter's bytes, the data's
    fingerprint, the code and its settings, never on paths alone (Prefect's INPUTS policy
    would hash the paths; a model re-made in place keeps its path)."""
    adapter, loss = inputs["adapter"], inputs["loss"]
    weights = file_digest(Path(adapter) / ADAPTER_FILE) if adapter else "base"
    trained = file_digest(Path(adapter) / CONFIG_FILE) if adapter else None  # its own loss
    body = json.dumps([model_fingerprint(inputs["model"]), weights, trained,
                       data_fingerprint(inputs["data"]),
                       dataclasses.asdict(loss) if loss else None,
                       inputs["generations"], inputs["out"], CODE_VERSION])
    return "evaluate-" + hashlib.sha256(body.encode()).hexdigest()[:24]


@task(cache_key_fn=evaluation_key, persist_result=True, result_serializer="json", retries=2,
      retry_delay_seconds=5, task_run_name="evaluate-{name}")
def evaluate_task(name: str, model: str, adapter: str | None, data: str,
                  loss: LossSpec | None, generations: int, out: str, placement: Placement,
                  settings: EvalSettings | None = None) -> dict[str, Any]:
    """Valid and test metrics of one adapter (or the base), in a Ray task on a GPU/slot,
    under ``loss`` (None: the adapter's own)."""
    import ray

    settings = settings or EvalSettings()
    remote = placement.fresh_task(evaluate_adapter)
    metrics = ray.get(remote.remote(model, adapter, data, loss, settings.batch_size,
                                    settings.head_chunk, generations, out,
                                    prefix_share=settings.prefix_share))
    logger = get_run_logger()
    logger.info("%s: %s", name, {k: round(v, 4) if isinstance(v, float) else v
                                 for k, v in metrics.items() if k != "eval/test/missing"})
    if metrics.get("eval/test/missing"):
        logger.warning("%s: %s", name, metrics["eval/test/missing"])
    return metrics


@task(cache_policy=NO_CACHE, persist_result=False)
def soup_task(adapters: list[str], out: str) -> str:
    """The top adapters averaged in ΔW and re-factored to rank r (tasks/soup.py)."""
    path = make_soup([Path(a) for a in adapters], Path(out))
    get_run_logger().info("soup of %s → %s", adapters, path)
    return str(path)


@task(cache_policy=NO_CACHE, persist_result=False)
def aggregate_task(results: list[dict[str, Any]], evals: dict[str, dict[str, Any]],
                   base: dict[str, Any], metric: str, mode: str, out: str, title: str,
                   soup: dict[str, Any] | None = None) -> dict[str, Any]:
    """Rank, write leaderboard.parquet/.md, export the best adapter, publish the board."""
    rows = rank_trials(results, evals, metric, mode, base, soup)
    parquet, md = write_leaderboard(rows, Path(out), metric, title)
    best = export_best(rows, Path(out))
    plots = Path(out) / "plots"
    trials = [r for r in rows if r["status"] not in ("baseline", "soup")]
    curves = curves_png(trials, metric, plots / "curves.png")
    by_param = metric_vs_params_png(trials, metric, swept_params(trials), plots / "params.png")
    memory = Path(out) / "memory.png"  # a memory sweep's Pareto plot, when one ran here
    create_markdown_artifact(
        md.read_text() + "\n" + inline_png(curves, "training and validation curves")
        + inline_png(by_param, f"{metric} against each swept parameter")
        + inline_png(memory if memory.exists() else None, "memory: peak vs throughput"),
        key=artifact_key(title, "leaderboard"), description=f"{md}; best adapter: {best}")
    return {"leaderboard": str(parquet), "markdown": str(md),
            "best_adapter": str(best) if best else None,
            "best_trial": next((r["trial_id"] for r in rows if r.get("rank") == 1), None)}


def check_pipeline_inputs(raw: str, model: str, spec: str) -> None:
    """Every input of ``pipeline`` checked before the flow starts, so a user's mistake is
    one line naming the file or key (SpecError, FileNotFoundError), not a failed flow run."""
    load_spec(spec)
    if not Path(raw).exists():
        raise FileNotFoundError(f"raw preference data not found: {raw}")
    check_model(model)


@flow(name="pomona-pipeline", result_serializer="json")
def pipeline(raw: str, model: str, spec: str, out: str, address: str | None = None,
             gpus: bool = False, resource: str | None = None, generations: int = 4,
             soup_k: int = 2, fuse: bool = False) -> dict[str, Any]:
    """Raw preference data and a model → a sweep → a leaderboard and the best adapter
    (and, with ``soup_k`` ≥ 2 completed trials, their soup, evaluated like a trial; with
    ``fuse``, the best adapter fused into the base as a standalone model)."""
    out_dir = Path(out)
    tokenized = tokenize_task(raw, model, str(out_dir / "data"), return_state=True)
    if tokenized.is_failed():
        return tokenized  # the flow run fails with the data's message
    data = tokenized.result()
    preprocess_task(data["path"])
    sweep = dataclasses.replace(load_spec(spec), model=model, data=data["path"])
    placement = Placement(gpus=int(gpus), resource=resource)
    with ray_session(address):
        results = sweep_stage(sweep, out_dir / "sweep", address, gpus, resource)
        summary = rank_stage(results, model, data["path"], sweep.metric, sweep.mode,
                             sweep.name, out_dir, placement, generations, soup_k, fuse)
    return {**summary, "rows": data["rows"], "tokenize_cache_hit": data["cache_hit"],
            "trials": len(results)}


def rank_stage(results: list[dict[str, Any]], model: str, data: str, metric: str, mode: str,
               title: str, out_dir: Path, placement: Placement, generations: int = 4,
               soup_k: int = 2, fuse: bool = False) -> dict[str, Any]:
    """Evaluate every completed trial and the base (in parallel, on Ray), soup the top
    ``soup_k``, write the leaderboard, export (and optionally fuse) the best adapter."""
    done = [r for r in results if r["status"] == "completed"]
    shared = eval_settings(done)  # the base and the soup: what fits every trial's setting
    jobs = {r["trial_id"]: evaluate_task.submit(
                r["trial_id"], model, r["adapter"], data, None, generations,
                str(Path(r["adapter"])), placement, eval_settings([r]))
            for r in done}
    # The base under the first trial's loss: its loss column then reads beside theirs.
    base_loss = next(filter(None, (trained_loss(r["adapter"]) for r in done)), LossSpec())
    base = evaluate_task.submit("base", model, None, data, base_loss, generations,
                                str(out_dir / "base"), placement, shared)
    evals = {name: job.result() for name, job in jobs.items()}
    base_metrics = base.result()
    top = [r["adapter"] for r in rank_trials(results, evals, metric, mode)
           if r.get("rank") and r["rank"] <= soup_k]
    soup = None
    if soup_k >= 2 and len(top) >= 2:
        path = soup_task(top, str(out_dir / "soup"))
        loss = next(filter(None, map(trained_loss, top)), base_loss)  # its best member's
        soup = {**evaluate_task("soup", model, path, data, loss, generations, path, placement,
                                shared),
                "adapter": path}
    summary = aggregate_task(results, evals, base_metrics, metric, mode, str(out_dir), title,
                             soup)
    if fuse and summary["best_adapter"]:
        summary["fused"] = fuse_task(model, summary["best_adapter"], str(out_dir / "best-fused"))
    get_run_logger().info("leaderboard: %s; best adapter: %s", summary["markdown"],
                          summary["best_adapter"])
    return summary


@task(cache_policy=NO_CACHE, persist_result=False)
def fuse_task(model: str, adapter: str, out: str) -> str:
    """The best adapter fused into the base weights (``mlx_lm fuse``), a standalone model."""
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "mlx_lm", "fuse", "--model", model, "--adapter-path",
           adapter, "--save-path", out]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"mlx_lm fuse failed ({proc.returncode}): {proc.stderr[-2000:]}")
    get_run_logger().info("fused %s into %s", adapter, out)
    return out


@flow(name="pomona-leaderboard", result_serializer="json")
def leaderboard_flow(sweep_dir: str, model: str, data: str, metric: str = "val/loss",
                     mode: str = "min", out: str | None = None, address: str | None = None,
                     gpus: bool = False, resource: str | None = None, generations: int = 4,
                     soup_k: int = 2, fuse: bool = False) -> dict[str, Any]:
    """Evaluate and rank a finished sweep (``sweep_dir/results.parquet``) on its own."""
    import pyarrow.parquet as pq

    results = pq.read_table(Path(sweep_dir) / "results.parquet").to_pylist()
    out_dir = Path(out) if out else Path(sweep_dir)
    with ray_session(address):
        return rank_stage(results, model, data, metric, mode, Path(sweep_dir).name, out_dir,
                          Placement(gpus=int(gpus), resource=resource), generations, soup_k,
                          fuse)


def pipeline_deployment(name: str, cron: str, timezone: str, parameters: dict[str, Any]):
    """The pipeline on a cron schedule (explicit timezone), one run at a time: a scheduled
    run never overlaps the previous one (deployment concurrency limit 1)."""
    from prefect.schedules import Cron

    return pipeline.to_deployment(name=name, schedules=[Cron(cron, timezone=timezone)],
                                  concurrency_limit=1, parameters=parameters)
