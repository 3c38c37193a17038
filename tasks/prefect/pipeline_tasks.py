"""The pipeline's Prefect tasks: each stage of flows/pipeline.py as a task run, a thin
typed wrapper over a plain function of this package (tokenize, preprocess, evaluate in a
Ray task, soup, aggregate, fuse), so the Prefect UI shows every stage, and the flows hold
only the order of stages. Tests call each one's ``.fn``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from pathlib import Path
from typing import Any

from prefect import get_run_logger, task
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.cache_policies import NO_CACHE
from prefect.states import Failed, State

from engine.host.atomic import atomic_write_text
from engine.host.digests import file_digest
from engine.losses import LossSpec
from engine.model.adapters import ADAPTER_FILE, CONFIG_FILE, trained_reference
from engine.model.content_key import model_fingerprint, reference_key
from engine.model.export import ExportSettings, export, export_adapter
from engine.model.gguf_export import exported_here
from engine.settings.config import TrainConfig
from engine.settings.forward_options import ForwardOptions
from engine.settings.reference_kind import adapter_path
from tasks.board.board_settings import Ranking
from tasks.board.eval_lines import evaluation_lines
from tasks.board.leaderboard import (
    answer_samples,
    compact_markdown,
    copy_best,
    markdown,
    rank_trials,
    swept_params,
    write_leaderboard,
)
from tasks.board.plots import curves_png, inline_png, metric_vs_params_png, rewards_png
from tasks.board.soup import make_soup
from tasks.data.data_check import check_dataset
from tasks.data.preprocess import preprocess_dataset
from tasks.data.tokenize import tokenize_dataset
from tasks.data.tokenize_options import TokenizeOptions
from tasks.eval.evaluate import evaluate_on_node
from tasks.eval.generation_eval import GenerationSettings
from tasks.eval.scorers import ScorerError, scorer_code
from tasks.nodes.placement import Placement
from tasks.nodes.trial_inputs import InputServer
from tasks.prefect.run_log import in_run_log
from tasks.sweep.sweep_plan import CODE_VERSION, data_fingerprint
from tasks.sweep.sweep_spec import SpecError, SweepSpec
from tasks.sweep.warm_start import LORA_SHAPE, sft_warm_start, start_key
from tasks.track.tracker import track_board


def artifact_key(*parts: str) -> str:
    """A Prefect artifact key: lowercase letters, digits and dashes only."""
    return re.sub(r"[^a-z0-9]+", "-", "-".join(parts).lower()).strip("-")


@task(cache_policy=NO_CACHE, persist_result=False)
def tokenize_task(raw: str, model: str, out: str, options: TokenizeOptions | None = None
                  ) -> dict[str, Any] | State:
    """Raw preference files → an Arrow dataset directory (cached on its fingerprint), with
    ``options`` (None: the defaults; the demo holds out more rows for test).

    A data mistake (no rows, too many bad ones, an unreadable file, a refused --out) ends
    the run Failed with its one-line message: the user's error, not a traceback."""
    try:
        report = tokenize_dataset(raw, model, out, options)
    except (ValueError, OSError) as err:
        return Failed(message=str(err))
    rejects = ", ".join(f"{n} {why}" for why, n in sorted(report.rejects.items())) or "none"
    get_run_logger().info("tokenized %s rows (%s tokens)%s; rejects: %s", report.rows,
                          report.tokens, " [cache hit]" if report.cache_hit else "", rejects)
    data_check_artifact(out, raw)
    return {"path": out, "rows": report.rows, "tokens": report.tokens,
            "cache_hit": report.cache_hit}


def data_check_artifact(data: str, raw: str) -> None:
    """``pomona data check``'s report of a pair dataset (tasks/data/data_check.py) as the
    tokenize task's artifact, each finding over its limit a warning in the run's log."""
    from engine.data.prompts import holds_prompts

    if holds_prompts(Path(data)):  # prompts and answers: no pair to check
        return
    report = check_dataset(Path(data), Path(raw))
    create_markdown_artifact(key="data-check", markdown=report.markdown(),
                             description="pomona data check: the tokenized pairs")
    for finding in report.over:
        get_run_logger().warning("data check: %s", finding.line())


@task(cache_policy=NO_CACHE, persist_result=False)
def warm_start_task(model: str, data: str, out: str, steps: int, spec: SweepSpec) -> str:
    """``steps`` of SFT on ``data``'s train answers at the spec's LoRA shape
    (tasks/sweep/warm_start.py), kept under ``out`` by what it was trained from (the same
    inputs reuse it): the adapter a sweep's trials start from."""
    shape = {k: spec.fixed[k] for k in LORA_SHAPE if k in spec.fixed}
    folder = Path(out) / start_key(model, Path(data), steps, shape)
    path = sft_warm_start(Path(model), Path(data), folder, steps, shape)
    get_run_logger().info("warm start: %d steps of SFT in %s", steps, path)
    return str(path.resolve())


def started_from(spec: SweepSpec, start: str) -> SweepSpec:
    """``spec`` with every trial starting from the adapter ``start`` and taking its KL
    (GRPO's β, DPO's) against it."""
    check_warm_start(spec, 1)
    return dataclasses.replace(spec, fixed={**spec.fixed, "warm_start": start,
                                            "reference": start})


def check_warm_start(spec: SweepSpec, steps: int) -> None:
    """A pipeline's warm-start stage of ``steps`` (0: none) refused, in one line, where
    the spec gives the start or the reference it would set (never silently replaced)."""
    if steps < 0:
        raise SpecError(f"--warm-start {steps}: expected steps of SFT >= 0 (0: none)")
    given = [k for k in ("warm_start", "reference")
             if k in spec.fixed or k in spec.grid or k in spec.space]
    if steps and given:
        raise SpecError(f"--warm-start {steps} with the spec's {given[0]}: the warm-start "
                        f"stage sets both warm_start and reference; drop one of them")
    swept = [k for k in LORA_SHAPE if k in spec.grid or k in spec.space]
    if steps and swept:  # one start, one shape: each trial must load its tensors
        raise SpecError(f"--warm-start {steps} with {swept[0]} searched: every trial starts "
                        "from one warm start, of one LoRA shape; give it in fixed")


@task(cache_policy=NO_CACHE, persist_result=False)
def preprocess_task(path: str) -> dict[str, Any]:
    """Find each pair's shared prompt prefix (split_prefix_batch's input)."""
    report = preprocess_dataset(path)
    get_run_logger().info("prefix sharing saves %.0f%% of tokens", 100 * report.saved_fraction)
    return {"saved_fraction": report.saved_fraction}


_TRAINED = TrainConfig.defaults()  # a results table of before 0.5.0 held only what was set


def trained_setting(row: dict[str, Any], name: str) -> Any:
    """The ``name`` a trial trained at: its ``param/`` column (a sweep writes every
    effective setting: tasks/sweep/run.py), else, in a table of before then, the default."""
    value = row.get(f"param/{name}")
    return _TRAINED[name] if value is None else value


def eval_settings(rows: list[dict[str, Any]]) -> ForwardOptions:
    """Settings that work where ``rows``' trials trained: their smallest batch; if any
    bounded its head, the smallest chunk (dense [2B, T, vocab] logits at batch 8 would
    outgrow a 16 GB Mac mini that trained a large-vocabulary model with head_chunk); and
    prefix sharing off if any trial turned it off (an architecture it cannot wrap); a
    tokenizer mismatch allowed if any trial was allowed one."""
    if not rows:
        return ForwardOptions()  # TrainConfig's
    chunks = [int(trained_setting(r, "head_chunk")) for r in rows]
    shares = {trained_setting(r, "prefix_share") for r in rows}
    return ForwardOptions(batch_size=min(int(trained_setting(r, "batch_size")) for r in rows),
                          head_chunk=min((c for c in chunks if c > 0), default=0),
                          prefix_share="off" if "off" in shares else
                          "on" if shares == {"on"} else "auto",
                          allow_tokenizer_mismatch=any(
                              trained_setting(r, "allow_tokenizer_mismatch") for r in rows))


def generation_key(settings: GenerationSettings) -> Any:
    """The generation settings as the cache key reads them, scorers as a spec names them,
    with each ``python:`` scorer's module bytes (an edited scorer scores again; the spec
    string alone kept old scores)."""
    return {**dataclasses.asdict(settings), "scorers": [s.name for s in settings.scorers],
            "scorer_code": scorer_code(settings.scorers)}


def evaluation_key(context: Any, inputs: dict[str, Any]) -> str:
    """An evaluation depends on the model's and the adapter's bytes, the data's
    fingerprint, the code and its settings, never on paths alone (Prefect's INPUTS policy
    would hash the paths; a model re-made in place keeps its path)."""
    adapter, loss = inputs["adapter"], inputs["loss"]
    weights = file_digest(Path(adapter) / ADAPTER_FILE) if adapter else "base"
    trained = file_digest(Path(adapter) / CONFIG_FILE) if adapter else None  # its own loss
    reference = reference_key(trained_reference(adapter))  # its bytes, not its path
    body = json.dumps([model_fingerprint(inputs["model"]), weights, trained, reference,
                       data_fingerprint(inputs["data"]),
                       loss.to_dict() if loss else None,
                       generation_key(inputs["generations"]), inputs["out"], CODE_VERSION])
    return "evaluate-" + hashlib.sha256(body.encode()).hexdigest()[:24]


def retry_evaluation(task: Any, task_run: Any, state: State) -> bool:
    """Retry an evaluation that a node lost, never a scorer's mistake nor a refused input
    (it would fail the same way again, three tracebacks later)."""
    try:
        state.result()
    except ScorerError:
        return False
    except BaseException as err:  # a node or a worker lost: worth a retry
        # an input the evaluation refuses (an adapter not whole, a dataset edited): the
        # same again, three loads later
        return not isinstance(getattr(err, "cause", None) or err, ValueError)
    return True


def scorers_error(err: BaseException) -> ScorerError | None:
    """The ScorerError a Ray task raised, unwrapped (its text alone: no traceback, no ANSI
    colour), or None when the task failed otherwise."""
    cause = getattr(err, "cause", None)
    return ScorerError(str(cause)) if isinstance(cause, ScorerError) else None


@task(cache_key_fn=evaluation_key, persist_result=True, result_serializer="json", retries=2,
      retry_delay_seconds=5, task_run_name="evaluate-{name}",
      retry_condition_fn=retry_evaluation)
def evaluate_task(name: str, model: str, adapter: str | None, data: str,
                  loss: LossSpec | None, generations: GenerationSettings,
                  out: str, placement: Placement,
                  options: ForwardOptions | None = None) -> dict[str, Any]:
    """Valid and test metrics of one adapter (or the base), in a Ray task on a GPU/slot,
    under ``loss`` (None: the adapter's own), with scored generations as ``generations``
    says, written here, once, to ``out/generations.jsonl``."""
    import ray

    options = options or ForwardOptions()
    paths = {"model": model, "data": data, "adapter": adapter,
             "reference": adapter_path(trained_reference(adapter))}
    inputs = InputServer().for_paths({k: v for k, v in paths.items()
                                     if v and Path(v).exists()})
    remote = placement.fresh_task(evaluate_on_node)
    try:
        result = ray.get(remote.remote(inputs, model, adapter, data, loss, generations,
                                       options))
    except ray.exceptions.RayTaskError as err:
        if (mistake := scorers_error(err)) is not None:
            raise mistake from None
        raise
    metrics = result.metrics
    if generations.on:  # the driver alone writes its outputs (none generated: empty)
        path = Path(out) / "generations.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path, "".join(json.dumps(r) + "\n" for r in result.generations))
        metrics["generations"] = str(path)
    logger = get_run_logger()
    for line in evaluation_lines(name, metrics):  # the whole record: the task's result
        logger.info("%s", line)
    for split in ("valid", "test"):
        if metrics.get(f"eval/{split}/missing"):
            logger.warning("%s: %s", name, metrics[f"eval/{split}/missing"])
    return metrics


def evaluation_for(out: str, generations: GenerationSettings) -> Any:
    """``evaluate_task``, told to evaluate again where the generations it would write to
    ``out`` are gone (an out folder deleted since): its cached result names that file."""
    if generations.on and not (Path(out) / "generations.jsonl").is_file():
        return evaluate_task.with_options(refresh_cache=True)
    return evaluate_task


@task(cache_policy=NO_CACHE, persist_result=False)
def soup_task(adapters: list[str], out: str) -> str:
    """The top adapters averaged in ΔW and re-factored to rank r (tasks/board/soup.py)."""
    path = make_soup([Path(a) for a in adapters], Path(out))
    get_run_logger().info("soup of %s → %s", ", ".join(Path(a).name for a in adapters), path)
    return str(path)


def board_artifacts(rows: list[dict[str, Any]], metric: str, title: str, figures: str,
                    description: str) -> list[dict[str, str]]:
    """The UI's leaderboard artifacts (key, markdown, description): first the board in the
    CLI's few columns with the ``figures`` (every column overflowed a 1400 px browser after
    the third metric), then every column in an artifact of its own."""
    return [{"key": artifact_key(title, "leaderboard"), "description": description,
             "markdown": compact_markdown(rows, metric, title) + "\n" + figures},
            {"key": artifact_key(title, "leaderboard", "full"),
             "description": f"{description}; every column",
             "markdown": markdown(rows, metric, title)}]


@task(cache_policy=NO_CACHE, persist_result=False)
def aggregate_task(results: list[dict[str, Any]], evals: dict[str, dict[str, Any]],
                   base: dict[str, Any], ranking: Ranking, out: str,
                   soup: dict[str, Any] | None = None) -> dict[str, Any]:
    """Rank by ``ranking`` (by, mode; ties by its training metric), write
    leaderboard.parquet/.md (naming what it ranked on), export the best adapter, publish
    the board (its compact columns and plots, then every column in a second artifact) and
    a table of held-out answers, base beside best; the plots show the training metric."""
    rank_by, metric, title = ranking.by, ranking.metric, ranking.title
    rows = rank_trials(results, evals, rank_by, ranking.mode, base, soup,
                       tie=(metric, ranking.metric_mode))
    parquet, md = write_leaderboard(rows, Path(out), rank_by, title)
    best = copy_best(rows, Path(out))
    plots = Path(out) / "plots"
    trials = [r for r in rows if r["status"] not in ("baseline", "soup")]
    curves = curves_png(trials, metric, plots / "curves.png")
    rewards = rewards_png(trials, plots / "rewards.png")  # GRPO's trials: their rewards
    by_param = metric_vs_params_png(trials, metric, swept_params(trials), plots / "params.png")
    memory = Path(out) / "memory.png"  # a memory sweep's Pareto plot, when one ran here
    figures = (inline_png(curves, "training and validation curves")
               + inline_png(rewards, "training reward and zero-spread groups")
               + inline_png(by_param, f"{metric} against each swept parameter")
               + inline_png(memory if memory.exists() else None, "memory: peak vs throughput"))
    for art in board_artifacts(rows, rank_by, title, figures, f"{md}; best adapter: {best}"):
        create_markdown_artifact(art["markdown"], key=art["key"],
                                 description=art["description"])
    if samples := answer_samples(rows):
        create_table_artifact(samples, key=artifact_key(title, "answers"),
                              description="held-out prompts: the chosen response, the base "
                              "model's and the best adapter's greedy answers, their scores")
    return {"leaderboard": str(parquet), "markdown": str(md),
            "best_adapter": str(best) if best else None,
            "best_trial": next((r["trial_id"] for r in rows if r.get("rank") == 1), None)}


@task(cache_policy=NO_CACHE, persist_result=False)
def track_task(sweep_dir: str, board_dir: str) -> None:
    """The evaluations, the leaderboard and the best adapter sent to the sweep's trackers
    (its ``report_to``; tasks/track/tracker.py): a tracker that is down costs one warning."""
    with in_run_log():
        track_board(Path(sweep_dir), Path(board_dir))


GGUF_NAME = "best-adapter.gguf"  # beside best-adapter/: the pipeline's export
ADAPTER_GGUF_NAME = "best-adapter-lora.gguf"  # the same adapter alone, for llama.cpp's --lora


@task(cache_policy=NO_CACHE, persist_result=False)
def export_task(adapter: str, model: str, out_dir: str,
                settings: ExportSettings) -> dict[str, str]:
    """The best adapter as the spec's ``export:`` asks (engine/model/export.py): fused into
    ``model`` as a GGUF of type ``settings.gguf``, and alone as llama.cpp's LoRA GGUF, each
    beside it; replacing only a file an export wrote (an earlier run's), never a user's
    file of that name. Returns the summary's ``gguf`` / ``gguf_adapter`` paths."""
    done, lines = {}, []
    if settings.gguf_adapter:
        path = export_adapter(adapter, Path(out_dir) / ADAPTER_GGUF_NAME, model, "f32",
                              ours=exported_here)
        done["gguf_adapter"] = str(path)
        lines.append(f"LoRA GGUF (f32, {path.stat().st_size / 2**20:.1f} MiB) of the best "
                     f"adapter alone, for its base's GGUF (llama.cpp --lora, Ollama ADAPTER): "
                     f"{path}")
    if settings.gguf:
        path = export(adapter, Path(out_dir) / GGUF_NAME, model, settings.gguf,
                      ours=exported_here)
        done["gguf"] = str(path)
        lines.append(f"GGUF ({settings.gguf}, {path.stat().st_size / 2**20:.1f} MiB) of the "
                     f"best adapter fused into its base: {path}")
    for line in lines:
        get_run_logger().info("%s", line)
    create_markdown_artifact("\n\n".join(lines), key="best-gguf", description="the best "
                             "adapter as GGUF for llama.cpp, Ollama and LM Studio")
    return done


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
