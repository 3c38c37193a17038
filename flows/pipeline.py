"""The pipeline flow: tokenize → preprocess → sweep → evaluate → aggregate.

Each stage is a task run (tasks/prefect/pipeline_tasks.py; the sweep: one task run per trial,
tasks/prefect/trial_task.py, on Ray), so the Prefect UI shows the whole run: the dataset's size
and rejects, every trial, every evaluation, and a markdown artifact with the leaderboard.
The sweep spec's model and data are replaced by the pipeline's own. Stages are plain
functions underneath (tasks/data/tokenize.py, tasks/data/preprocess.py, tasks/sweep/run.py,
tasks/eval/evaluate.py, tasks/board/leaderboard.py), each also reachable from the CLI.

Nothing here is ever pickled, whatever PREFECT_RESULTS_PERSIST_BY_DEFAULT says: stages that
leave their results as files persist no task result, evaluations persist theirs as JSON
(their cache), and flows return JSON.
"""

from __future__ import annotations

import dataclasses
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger
from prefect.states import Failed, State

from engine.data.prompts import holds_prompts
from engine.host.outputs import RefusedOutput, claim
from engine.losses import LossSpec
from engine.model.adapters import pairs_scored_under
from engine.model.export import ExportSettings, exportable
from engine.model.gguf_export import exported_here
from engine.model.source import source_kind
from flows.sweep_flow import sweep_stage
from tasks.board.board_settings import BoardOptions, Ranking
from tasks.board.leaderboard import rank_trials
from tasks.board.results_table import MISSING, read_results
from tasks.data.preference_rows import holds_prompt_rows, raw_kind
from tasks.data.tokenize_options import TokenizeOptions
from tasks.eval.generation_eval import (
    GenerationSettings,
    check_prompts_flag,
    check_scorers_on_data,
    check_scorers_on_raw,
)
from tasks.nodes.cluster import Cluster
from tasks.nodes.placement import Placement
from tasks.prefect.pipeline_tasks import (
    ADAPTER_GGUF_NAME,
    GGUF_NAME,
    aggregate_task,
    check_warm_start,
    eval_settings,
    evaluation_for,
    export_task,
    fuse_task,
    preprocess_task,
    soup_task,
    started_from,
    tokenize_task,
    track_task,
    warm_start_task,
)
from tasks.sweep.run import is_sweep_dir
from tasks.sweep.spec_file import load_spec
from tasks.sweep.spec_rules import check_prompt_sweep
from tasks.sweep.sweep_spec import SpecError, SweepSpec
from tasks.track.report_to import with_report_to
from tasks.track.sinks import tracker_problem


def is_pipeline_dir(path: Path) -> bool:
    """Whether ``path`` holds a pipeline's (or the demo's) outputs from an earlier Pomona,
    before they carried the mark of engine/host/outputs.py: its leaderboard, its sweep, its
    tokenized data or the demo's model."""
    from tasks.data.dataset_dir import read_manifest
    from tasks.models.model_factory import MARK

    return (((path / "leaderboard.md").is_file() and (path / "leaderboard.parquet").is_file())
            or ((path / "sweep").is_dir() and is_sweep_dir(path / "sweep"))
            or read_manifest(path / "data") is not None or (path / "model" / MARK).is_file())


def claim_pipeline(out: str | Path, *inputs: str) -> AbstractContextManager[Path]:
    """``out`` held as this process's pipeline (or demo) folder while it runs
    (engine/host/outputs.py): refused when it holds files Pomona did not write, another
    pipeline is writing it, it is not writable, or it lies inside one of ``inputs``."""
    return claim(out, ("pipeline",), legacy=is_pipeline_dir, inputs=inputs)


def claim_sweep_dir(sweep_dir: str | Path, *inputs: str) -> AbstractContextManager[Path]:
    """A finished sweep's folder held while its leaderboard, soup and best adapter are
    written into it (engine/host/outputs.py): it must exist and be a Pomona sweep."""
    return claim(sweep_dir, ("sweep",), legacy=is_sweep_dir, inputs=inputs, new_ok=False,
                 flag="SWEEP_DIR")


@dataclass(frozen=True)
class PipelineInputs:
    """What the pipeline's checks produced, the flow's to run on: its sweep (the model and
    the raw data the pipeline's, the trackers ``--report-to``'s, and the ``--warm-start``
    refusals passed) and the evaluation's settings (``--generations`` applied)."""

    sweep: SweepSpec
    generations: GenerationSettings

    def on(self, data: str) -> SweepSpec:
        """The sweep on the tokenized dataset ``data`` in place of the raw file."""
        return dataclasses.replace(self.sweep, data=data)


def check_pipeline_inputs(raw: str, model: str, spec: str, out: str | None = None,
                          generations: int | None = None,
                          report_to: list[str] | None = None,
                          warm_start: int = 0) -> PipelineInputs:
    """Every input of ``pipeline`` (and its ``out``) checked once, before the flow starts,
    so a user's mistake is one line naming the file or key (SpecError, also for a tracker
    whose client is not installed; FileNotFoundError,
    RefusedOutput, ValueError for ``generations`` below 0, ScorerError for a scorer that
    fails on the raw data's first rows, or a spec's ``export`` of a family no GGUF holds),
    not a failed flow run; the flow receives what they produced."""
    check_prompts_flag(generations)
    parsed = with_report_to(load_spec(spec, {"model": model, "data": raw}), report_to)
    if problem := tracker_problem(parsed.report_to):
        raise SpecError(problem)
    check_warm_start(parsed, warm_start)
    if Path(raw).exists() and raw_kind(raw) == "unpaired":
        raise SpecError(f"{raw}: unpaired rows (a prompt, one completion and a label: KTO's "
                        "data): the pipeline's leaderboard scores preference pairs; train "
                        "them with `pomona train --loss kto`")
    if warm_start and holds_prompt_rows(raw):
        raise SpecError(f"--warm-start {warm_start}: its SFT trains on pairs' chosen "
                        f"responses, and {raw} holds prompts alone; warm-start on pair data, "
                        "or give the spec a warm_start adapter")
    settings = parsed.evaluation.with_prompts(generations)
    if not Path(raw).exists():
        raise FileNotFoundError(f"raw preference data not found: {raw}")
    source_kind(model)  # a local path that is not there; a repo id is mlx-lm's
    if parsed.export.any:
        exportable(model)  # a family no GGUF holds, before any server or trial
    check_scorers_on_raw(settings, raw)  # a ScorerError (a ValueError) before any server
    if holds_prompt_rows(raw):  # GRPO's data: a sweep over groups, judged by its answers
        check_prompt_sweep(parsed.fixed, parsed.grid, parsed.space, raw, settings.on)
    if out is not None:
        with claim_pipeline(out, raw, model, spec):
            check_export_target(Path(out), parsed.export)
            # the flow claims it again while it runs
    return PipelineInputs(parsed, settings)


def check_export_target(out: Path, export: ExportSettings) -> None:
    """RefusedOutput (one line) where the spec's ``export:`` would write a GGUF over a file
    in ``out`` that no export wrote: said before the sweep, not after it."""
    wanted = [(GGUF_NAME, f"gguf: {export.gguf}")] if export.gguf else []
    if export.gguf_adapter:
        wanted.append((ADAPTER_GGUF_NAME, "gguf_adapter: true"))
    for name, asked in wanted:
        path = out / name
        taken = path.is_symlink() or path.is_dir() or (path.is_file() and path.stat().st_size)
        if taken and not (path.is_file() and exported_here(path)):
            raise RefusedOutput(f"{path}: a file Pomona did not write, where the spec's "
                                f"export: {{{asked}}} would write the best adapter; move it, "
                                "or choose another --out")


@flow(name="pomona-pipeline", result_serializer="json")
def pipeline(raw: str, model: str, spec: str, out: str, cluster: Cluster | None = None,
             generations: int | None = None, soup_k: int = 2, fuse: bool = False,
             tokenize: TokenizeOptions | None = None, report_to: list[str] | None = None,
             warm_start: int = 0, checked: PipelineInputs | None = None) -> dict[str, Any]:
    """Raw preference data and a model → a sweep on ``cluster`` (None: a private local
    Ray) → a leaderboard and the best adapter (and, with ``soup_k`` ≥ 2 completed trials,
    their soup, evaluated like a trial; with ``fuse``, the best adapter fused into the base
    as a standalone model). Evaluations generate and score as the spec's ``evaluation``
    says; ``generations`` overrides its prompts a split (0: no generation). ``tokenize``:
    how the raw data is tokenized and split (None: the defaults); ``report_to``: the
    experiment trackers, in place of the spec's (None: the spec's); ``warm_start``: steps
    of SFT on the train split's answers that every trial then starts from, its KL taken
    against it, and the base row evaluated with it (0: none); ``checked``: what
    ``check_pipeline_inputs`` produced for these inputs and ``out`` (None: a scheduled run,
    which checks them here, before any stage)."""
    out_dir, cluster = Path(out), cluster or Cluster()
    if fresh := checked is None:
        checked = check_pipeline_inputs(raw, model, spec, None, generations, report_to,
                                        warm_start)
    with claim_pipeline(out, raw, model, spec):
        if fresh:  # a user's file where the export would write: said before any stage
            check_export_target(out_dir, checked.sweep.export)
        tokenized = tokenize_task(raw, model, str(out_dir / "data"), tokenize,
                                  return_state=True)
        if tokenized.is_failed():
            return tokenized  # the flow run fails with the data's message
        data = tokenized.result()
        prompts = holds_prompts(Path(data["path"]))
        if not prompts:  # a prompts dataset has no pair prefix to find
            preprocess_task(data["path"])
        sweep, settings = checked.on(data["path"]), checked.generations
        start = None  # a stage of its own: the UI shows the start the trials share
        if warm_start:
            start = warm_start_task(model, data["path"], str(out_dir / "warm-start"),
                                    warm_start, sweep)
            sweep = started_from(sweep, start)
        check_scorers_on_data(settings, model, data["path"])  # a broken scorer: no trial ran
        with cluster.session():  # opened once, for the sweep and the board
            results = sweep_stage(sweep, out_dir / "sweep", cluster.placement)
            if not any(r["status"] == "completed" for r in results):  # nothing to rank
                return no_trial_completed(results)
            summary = rank_stage(results, model, data["path"], sweep.ranking, out_dir,
                                 cluster.placement, settings,
                                 BoardOptions(soup_k, fuse, sweep.export, start))
            track_task(str(out_dir / "sweep"), str(out_dir))
    return {**summary, "rows": data["rows"], "tokenize_cache_hit": data["cache_hit"],
            "trials": len(results)}


def no_trial_completed(results: list[dict[str, Any]]) -> State:
    """The flow's end when no trial completed: one line with the first reason."""
    first = next((f"{r['trial_id']}: {r.get('reason')}" for r in results if r.get("reason")),
                 "no trial ran")
    return Failed(message=f"no trial completed ({len(results)} trials; {first}); nothing "
                  "to evaluate or rank")


def rank_stage(results: list[dict[str, Any]], model: str, data: str, ranking: Ranking,
               out_dir: Path, placement: Placement, generations: GenerationSettings,
               board: BoardOptions) -> dict[str, Any]:
    """Evaluate every completed trial and the base (in parallel, on Ray), soup the top
    ``board.soup_k`` by ``ranking``, write the leaderboard, copy (and with
    ``board.fuse``, fuse) the best adapter, and with ``board.export`` write it as GGUFs
    beside it (fused, and alone as llama.cpp's LoRA adapter); ``ranking.metric``: the
    training metric, which the plots show and which breaks ties."""
    done = [r for r in results if r["status"] == "completed"]
    site = EvalSite(model, data, placement, generations, eval_settings(done))
    evals, base_metrics = evaluate_stage(done, site, out_dir, board.start)
    trained = (ranking.metric, ranking.metric_mode)
    top = [r["adapter"] for r in rank_trials(results, evals, ranking.by, ranking.mode,
                                             tie=trained)
           if r.get("rank") and r["rank"] <= board.soup_k]
    soup = soup_stage(top, site, out_dir) if board.soup_k >= 2 and len(top) >= 2 else None
    summary = aggregate_task(results, evals, base_metrics, ranking, str(out_dir), soup)
    if summary["best_adapter"]:
        summary.update(best_outputs(summary["best_adapter"], model, out_dir, board))
    get_run_logger().info("leaderboard: %s; best adapter: %s", summary["markdown"],
                          summary["best_adapter"])
    return summary


@dataclass(frozen=True)
class EvalSite:
    """Where and how the board's evaluations run: the base model, the tokenized data, the
    placement, the generation settings, and ``shared`` (what fits every trial's setting,
    for the base and the soup)."""

    model: str
    data: str
    placement: Placement
    generations: GenerationSettings
    shared: Any


def evaluate_stage(done: list[dict[str, Any]], site: EvalSite, out_dir: Path,
                   start: str | None) -> tuple[dict[str, Any], dict[str, Any]]:
    """Each completed trial's evaluation and the base's, submitted together and awaited:
    the base under the first trial's loss (GRPO's: ORPO's, as its pairs are scored), so its
    loss column reads beside theirs; with the trials' warm ``start``, the base row is
    where they began."""
    jobs = {r["trial_id"]: evaluation_for(r["adapter"], site.generations).submit(
                r["trial_id"], site.model, r["adapter"], site.data, None, site.generations,
                str(Path(r["adapter"])), site.placement, eval_settings([r]))
            for r in done}
    base_loss = pairs_scored_under(done[0]["adapter"]) if done else LossSpec()
    if start:
        get_run_logger().info("base: the model with the trials' warm start %s", start)
    base = evaluation_for(str(out_dir / "base"), site.generations).submit(
        "base", site.model, start, site.data, base_loss, site.generations,
        str(out_dir / "base"), site.placement, site.shared)
    return {name: job.result() for name, job in jobs.items()}, base.result()


def soup_stage(top: list[str], site: EvalSite, out_dir: Path) -> dict[str, Any]:
    """The ``top`` adapters averaged into ``out_dir/soup`` and evaluated like a trial,
    under its best member's loss."""
    path = soup_task(top, str(out_dir / "soup"))
    evaluated = evaluation_for(path, site.generations)(
        "soup", site.model, path, site.data, pairs_scored_under(top[0]), site.generations,
        path, site.placement, site.shared)
    return {**evaluated, "adapter": path}


def best_outputs(best: str, model: str, out_dir: Path, board: BoardOptions) -> dict[str, str]:
    """What the board makes of its best adapter beyond the copy: fused into the base
    (``board.fuse``) and the spec's GGUF exports (``board.export``)."""
    made = {}
    if board.fuse:
        made["fused"] = fuse_task(model, best, str(out_dir / "best-fused"))
    if board.export:
        made.update(export_task(best, model, str(out_dir), board.export))
    return made


@flow(name="pomona-leaderboard", result_serializer="json")
def leaderboard_flow(sweep_dir: str, model: str, data: str, metric: str = "val/loss",
                     mode: str | None = None, out: str | None = None,
                     cluster: Cluster | None = None,
                     generations: GenerationSettings | None = None, soup_k: int = 2,
                     fuse: bool = False, scorers_checked: bool = False) -> dict[str, Any]:
    """Evaluate and rank a finished sweep (``sweep_dir/results.parquet``) on its own, by
    ``metric`` (a validation metric, ``mode`` its direction, min by default; or a generation
    score ``gen/valid/<label>``: higher is better, ties broken by val/loss);
    ``generations``: the generation settings (None: the defaults); ``scorers_checked``: the
    caller tried them on the data already (`pomona leaderboard` does, before the flow starts)."""
    results = read_results(Path(sweep_dir))  # its own trials' adapters, never elsewhere
    for row in results:
        if row["status"] == MISSING:
            get_run_logger().warning("%s: %s", row["trial_id"], row["reason"])
    out_dir = Path(out) if out else Path(sweep_dir)
    settings = generations or GenerationSettings()
    if not scorers_checked:
        check_scorers_on_data(settings, model, data)
    cluster = cluster or Cluster()
    ranking = Ranking.of(Path(sweep_dir).name, metric, mode)
    with cluster.session():
        summary = rank_stage(results, model, data, ranking, out_dir, cluster.placement,
                             settings, BoardOptions(soup_k, fuse))
    track_task(sweep_dir, str(out_dir))
    return summary


def pipeline_deployment(name: str, cron: str, timezone: str, parameters: dict[str, Any]):
    """The pipeline on a cron schedule (explicit timezone), one run at a time: a scheduled
    run never overlaps the previous one (deployment concurrency limit 1)."""
    from prefect.schedules import Cron

    return pipeline.to_deployment(name=name, schedules=[Cron(cron, timezone=timezone)],
                                  concurrency_limit=1, parameters=parameters)
