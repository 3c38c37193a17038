"""Issue 14, sweep / config / trainer-output items: each test reproduces the reported case.

Items 3 (results lost to a mixed-type column), 5 (caches keyed on the model's path), 6
(YAML 1.1 strings, NaN and negative settings), 7 (a collapsed trial ranked first), 9 (a
reused --out mixing two runs; resume duplicating metrics) and 12 (Prefect results pickled);
issue 28's items 8 (a warm start keyed on its path) and 12 (a sweep that ranks no trial
exiting 0, a cancelled trial counted failed).
No Ray or Prefect server here: the heavy twins are in test_reliability_ray.py.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import replace
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from engine.settings.config import TrainConfig
from tasks.sweep.spec_file import load_spec, parse_spec
from tasks.sweep.sweep_spec import SpecError

pytestmark = [pytest.mark.integration, pytest.mark.long]  # conftest.py: scheduled first

SPEC = {"name": "s", "model": "m", "data": "d"}


# Item 3 -----------------------------------------------------------------------------------

def test_results_keep_every_trial_whatever_a_parameter_column_mixes(tmp_path: Path) -> None:
    """The issue's grid [3.0e-4, .nan, "1e-4"] made results.parquet fail with ArrowInvalid
    after every trial had run: nothing was written. Would catch: a column that Arrow cannot
    type as given costing the whole table."""
    from tasks.board.results_table import write_results

    rows = [{"trial_id": "a", "status": "completed", "param/learning_rate": 3.0e-4,
             "param/lora_rank": 8, "flag": True},
            {"trial_id": "b", "status": "failed", "param/learning_rate": math.nan,
             "param/lora_rank": "auto", "flag": 1},
            {"trial_id": "c", "status": "completed", "param/learning_rate": "1e-4",
             "param/lora_rank": 2**70, "extra": [1, 2]}]
    path = write_results(rows, tmp_path / "results.parquet")
    table = pq.read_table(path).to_pylist()
    assert [r["trial_id"] for r in table] == ["a", "b", "c"]
    assert [r["param/learning_rate"] for r in table][::2] == ["0.0003", "1e-4"]
    assert table[1]["param/learning_rate"] == "NaN"  # mixed with text: JSON text
    assert [r["param/lora_rank"] for r in table] == ["8", "auto", str(2**70)]
    numbers = write_results([{"x": 1}, {"x": math.nan}, {"x": 2**70}], tmp_path / "n.parquet")
    assert pq.read_table(numbers).schema.field("x").type == "double"  # numbers stay numbers


# Item 5 -----------------------------------------------------------------------------------

def _keys(model: Path, data: Path, out: Path) -> list[str]:
    from tasks.nodes.placement import Placement
    from tasks.sweep.sweep_plan import SweepInputs

    spec = parse_spec({**SPEC, "model": str(model), "data": str(data),
                       "grid": {"seed": [0, 1]}})
    inputs = SweepInputs.read(spec, out, Placement())
    return sorted(inputs.keyed(trial).key for trial in spec.trials(out))


def test_caches_key_on_the_model_bytes_not_its_path(tmp_path: Path, monkeypatch) -> None:
    """The issue: re-initialising the model in place with another seed gave "2 trials: 2
    cached" and the old adapters were reused; the pipeline's evaluation cache did the same.
    Would catch: a cache key built from the model path string."""
    from engine.host.digests import file_digest
    from tasks.eval.generation_eval import NO_GENERATION
    from tasks.models.model_factory import init_model
    from tasks.prefect.pipeline_tasks import evaluation_key
    from tests.conftest import TINY

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    model = init_model(TINY, tmp_path / "model")
    data = tmp_path / "pairs.jsonl"
    data.write_text('{"prompt_ids": [1], "chosen_ids": [2], "rejected_ids": [3]}\n')
    inputs = {"model": str(model), "adapter": None, "data": str(data), "loss": None,
              "generations": NO_GENERATION, "out": "o"}
    before, eval_before = _keys(model, data, tmp_path), evaluation_key(None, inputs)
    init_model(replace(TINY, seed=1), model, overwrite=True)  # same path, new weights
    assert _keys(model, data, tmp_path) != before
    assert evaluation_key(None, inputs) != eval_before
    init_model(TINY, model, overwrite=True)  # the same bytes again: the same keys
    assert _keys(model, data, tmp_path) == before
    assert evaluation_key(None, inputs) == eval_before
    # Each file is hashed once and then served by (size, mtime, inode) from the cache.
    weights = model / "model.safetensors"
    cache = tmp_path / "cache" / "pomona" / "file-hashes.json"
    entries = json.loads(cache.read_text())
    assert str(weights.resolve()) in entries
    import engine.host.digests as digests

    digests._memory[str(weights.resolve())]["sha256"] = "planted"
    assert file_digest(weights) == "planted"  # not read again while its stat holds
    os.utime(weights, ns=(0, 0))
    assert file_digest(weights) != "planted"  # a changed mtime: hashed again


# Item 6 -----------------------------------------------------------------------------------

def test_yaml_numbers_are_numbers_and_bad_settings_name_their_key(tmp_path: Path) -> None:
    """PyYAML (YAML 1.1) reads 1e-4 as a string: it passed the spec checks and failed
    inside the trial; NaN and inf started training and crashed at step 2; a Python tag or
    malformed YAML in --config was a traceback. Would catch: any of them getting through."""
    run = tmp_path / "run.yaml"
    run.write_text("learning_rate: 1e-4\nsteps: 1e3\nweight_decay: 1e-2\nlora_keys: q_proj\n")
    config = TrainConfig.from_yaml(run, model="m", data="d")
    assert (config.learning_rate, config.steps, config.weight_decay, config.lora_keys) == \
        (1e-4, 1000, 0.01, ("q_proj",))
    assert isinstance(config.learning_rate, float) and isinstance(config.steps, int)
    for text, message in [("learning_rate: .nan\n", "learning_rate=nan: must be a finite"),
                          ("learning_rate: .inf\n", "learning_rate=inf: must be a finite"),
                          ("learning_rate: -1.0e-4\n", "learning_rate=-0.0001: must be >= 0"),
                          ("grad_clip: -1\n", "grad_clip=-1.0: must be >= 0"),
                          ("weight_decay: -0.1\n", "weight_decay=-0.1: must be >= 0"),
                          ("steps: 1.5\n", "steps=1.5: expected an integer"),
                          ("batch_size: eight\n", "batch_size='eight': expected an integer"),
                          ("verify: 1\n", "verify=1: expected true or false"),
                          ("x: !!python/object/apply:os.system [echo]\n", "not valid YAML"),
                          ("steps: [1\n", r"not valid YAML \(line 2\)"),
                          ("- steps\n", "expected a mapping")]:
        run.write_text(text)
        with pytest.raises(ValueError, match=rf"^{run}: {message}"):
            TrainConfig.from_yaml(run)
    with pytest.raises(ValueError, match="learning_rate=nan"):
        TrainConfig(model="m", data="d").replace(learning_rate=math.nan).validate()

    spec = tmp_path / "sweep.yaml"
    spec.write_text("name: s\nmodel: m\ndata: d\nfixed: {steps: 1e3}\n"
                    "grid: {learning_rate: [3.0e-4, 1e-4]}\n")
    trials = load_spec(spec).trials()
    assert [t.params()["learning_rate"] for t in trials] == [3.0e-4, 1e-4]
    assert all(t.params()["steps"] == 1000 for t in trials)
    spec.write_text("name: s\nmodel: m\ndata: d\nsearch: random\n"
                    "space: {learning_rate: {loguniform: [1e-5, 1e-3]}}\n")
    assert 1e-5 <= load_spec(spec).trials()[0].params()["learning_rate"] <= 1e-3
    for text, message in [("grid: {learning_rate: [3.0e-4, .nan, 1e-4]}",
                           "grid.learning_rate=nan: must be a finite number"),
                          ("fixed: {grad_clip: -1}", "fixed.grad_clip=-1.0: must be >= 0"),
                          ("search: random\nspace: {lora_rank: {uniform: [1, 8]}}",
                           "space.lora_rank.uniform: lora_rank takes integers"),
                          ("search: random\nspace: {learning_rate: {choice: [1e-4, .inf]}}",
                           "space.learning_rate.choice.learning_rate=inf"),
                          ("time_limit_s: .nan", "time_limit_s=nan"),
                          ("x: !!python/name:os.system", r"not valid YAML \(line 4\)")]:
        spec.write_text(f"name: s\nmodel: m\ndata: d\n{text}\n")
        with pytest.raises(SpecError, match=rf"^{spec}: {message}"):
            load_spec(spec)


# Item 7 -----------------------------------------------------------------------------------

def test_a_collapsed_trial_is_degenerate_and_kept_off_the_board(tiny_model, tiny_data,
                                                                tmp_path) -> None:
    """lr 1e8 (the issue): grad_norm 0.0 from step 2, val accuracy 0 and the lowest
    val/loss, reported "completed" and ranked first. Would catch: a collapsed run ranked."""
    from engine.settings.config import TrainConfig
    from tasks.board.leaderboard import markdown, rank_trials
    from tasks.sweep.trial import run_trial

    config = {"model": str(tiny_model), "data": str(tiny_data), "out": str(tmp_path / "x"),
              "steps": 8, "batch_size": 4, "lora_rank": 4, "val_every": 4,
              "report_every": 1, "learning_rate": 1e8}
    collapsed = run_trial("collapsed", TrainConfig(**config))
    assert collapsed["status"] == "degenerate", collapsed
    assert collapsed["reason"].startswith("degenerate: zero gradients for ")
    assert Path(collapsed["adapter"], "adapters.safetensors").exists()  # kept, not ranked
    healthy = {"trial_id": "healthy", "status": "completed", "reason": "",
               "best/val/loss": collapsed["best/val/loss"] + 0.5}
    board = rank_trials([collapsed, healthy], {}, "val/loss", "min")
    assert [(r["trial_id"], r["rank"]) for r in board] == [("healthy", 1), ("collapsed", None)]
    text = markdown(board, "val/loss", "t")
    assert "- collapsed: degenerate: zero gradients" in text
    # Test or validation accuracy far below chance on enough pairs also unranks a completed
    # trial; on a handful of pairs it is noise and does not.
    far = {**healthy, "trial_id": "far", "best/val/loss": 0.1}
    for split in ("test", "valid"):
        board = rank_trials([healthy, far], {"far": {f"eval/{split}/logps/accuracies": 0.05,
                                                     f"eval/{split}/rows": 40}},
                            "val/loss", "min")
        assert [(r["trial_id"], r["status"], r["rank"]) for r in board] == \
            [("healthy", "completed", 1), ("far", "degenerate", None)]
        assert board[1]["reason"].startswith(f"degenerate: {split} accuracy 0.050 on 40")
        few = rank_trials([far], {"far": {f"eval/{split}/logps/accuracies": 0.0,
                                          f"eval/{split}/rows": 4}}, "val/loss", "min")
        assert few[0]["rank"] == 1


# Item 9 -----------------------------------------------------------------------------------

class _Kill:
    """Stops training at a training report of ``step`` (after it is written), as a kill."""

    def __init__(self, step: int):
        self.step = step

    def on_metrics(self, record: dict) -> None:
        if record["split"] == "train" and record["step"] == self.step:
            raise KeyboardInterrupt(f"killed at step {self.step}")


def _rows(out: Path) -> list[tuple[int, str]]:
    return [(r["step"], r["split"]) for r in map(json.loads, (out / "metrics.jsonl")
                                                  .read_text().splitlines())]


def test_a_reused_out_holds_one_run_and_resume_never_repeats_metrics(tiny_model, tiny_data,
                                                                      tmp_path) -> None:
    """A run killed in a reused --out left the previous run's adapter and summary beside
    its new metrics; resume appended the steps after the checkpoint a second time. Would
    catch: stale outputs that look valid, duplicated metric rows."""
    from engine.train.trainer import train

    out = tmp_path / "run"
    base = TrainConfig().replace(model=str(tiny_model), data=str(tiny_data), out=str(out),
                                 steps=6, batch_size=2, lora_rank=4, report_every=1,
                                 val_every=0, checkpoint_every=2)
    train(base)  # a finished run: adapter, summary, checkpoints
    assert (out / "summary.json").exists()
    with pytest.raises(KeyboardInterrupt):
        train(base.replace(seed=1), [_Kill(3)])  # a fresh run over it, killed at step 3
    assert not (out / "adapters.safetensors").exists()
    assert not (out / "summary.json").exists()
    assert _rows(out) == [(1, "train"), (2, "train"), (3, "train")]  # this run's only
    assert sorted(p.name for p in (out / "checkpoints").glob("step_*")) == ["step_0000002"]

    with pytest.raises(KeyboardInterrupt):
        train(base.replace(seed=1, resume="auto"), [_Kill(5)])  # resumes at 2, dies at 5
    train(base.replace(seed=1, resume="auto"))  # resumes at 4 (the newest checkpoint)
    assert _rows(out) == [*((s, "train") for s in range(1, 7)), (6, "valid")]  # each once
    assert json.loads((out / "summary.json").read_text())["steps"] == 6


# Item 12 ----------------------------------------------------------------------------------

@pytest.mark.unit  # a pure function: the fast tier runs it
def test_no_prefect_task_or_flow_would_pickle_its_result() -> None:
    """With PREFECT_RESULTS_PERSIST_BY_DEFAULT on, every task and flow without its own
    serializer persisted its result with pickle. Would catch: a task or flow added without
    a JSON serializer or persist_result=False."""
    import importlib
    import pkgutil

    from prefect import Flow, Task

    import flows
    import tasks

    found = []
    for package in (flows, tasks):  # flows in flows/, their tasks in tasks/ (in its wings)
        for info in pkgutil.walk_packages(package.__path__, f"{package.__name__}."):
            module = importlib.import_module(info.name)
            found += [(f"{module.__name__}.{name}", obj) for name, obj in vars(module).items()
                      if isinstance(obj, (Task, Flow)) and obj.__module__ == module.__name__]
    assert len(found) >= 10, found
    pickled = [name for name, obj in found if obj.persist_result is not False and
               getattr(obj.result_serializer, "type", obj.result_serializer) != "json"]
    assert pickled == []


# Issue 28 ---------------------------------------------------------------------------------

def test_a_warm_start_is_keyed_on_its_bytes_not_its_path(tmp_path: Path, monkeypatch) -> None:
    """Item 8: re-training a warm_start adapter in place gave "1 cached" (the key held its
    path). Would catch: a cache key that does not change with the adapter's bytes."""
    from tasks.sweep.sweep_plan import cache_key

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    warm = tmp_path / "warm"
    warm.mkdir()
    (warm / "adapter_config.json").write_text("{}")

    def retrain(weights: bytes) -> str:
        tmp = warm / ".new"
        tmp.write_bytes(weights)
        os.replace(tmp, warm / "adapters.safetensors")  # as the trainer writes it
        return cache_key(TrainConfig(learning_rate=1e-4, warm_start=str(warm)), "data", "model")

    first = retrain(b"first weights")
    assert retrain(b"other weights") != first
    assert retrain(b"first weights") == first  # the same bytes: the same trial


def _sweep_cli(tmp_path: Path, monkeypatch, rows: list[dict]) -> tuple[int, str]:
    """`pomona sweep` in this process, its trials' rows given (no Ray)."""
    import contextlib

    from typer.testing import CliRunner

    import cli.sweep_display as sweep_cli
    from cli.main import app
    from tasks.nodes.cluster import Cluster

    (tmp_path / "model").mkdir(exist_ok=True)
    data = tmp_path / "pairs.jsonl"
    data.write_text('{"prompt_ids": [1], "chosen_ids": [2], "rejected_ids": [3]}\n')
    spec = tmp_path / "s.yaml"
    spec.write_text(f"name: s\nmodel: {tmp_path / 'model'}\ndata: {data}\n")
    monkeypatch.setattr(Cluster, "session", lambda self: contextlib.nullcontext())
    monkeypatch.setattr(sweep_cli, "run_sweep", lambda *args, **kwargs: rows)
    result = CliRunner().invoke(app, ["sweep", str(spec), "--out", str(tmp_path / "out"),
                                      "--no-prefect"])
    assert result.exception is None or isinstance(result.exception, SystemExit), result.output
    return result.exit_code, result.output


def test_a_sweep_that_ranks_no_trial_exits_non_zero(tmp_path: Path, monkeypatch) -> None:
    """Item 12: every trial failed, or none reported the ranking metric, and the sweep
    exited 0. Would catch: that exit 0, or no word on why."""
    failed = [{"trial_id": t, "status": "failed", "reason": "boom"} for t in ("a", "b")]
    code, out = _sweep_cli(tmp_path, monkeypatch, failed)
    assert code == 1 and "error: sweep s: no trial completed (2 failed)" in out, out
    unranked = [{"trial_id": "a", "status": "completed", "best/val/loss": None}]
    code, out = _sweep_cli(tmp_path, monkeypatch, unranked)
    assert code == 1 and "no trial can be ranked: none of the 1 completed" in out, out
    ranked = [*failed, {"trial_id": "c", "status": "completed", "best/val/loss": 1.5}]
    code, out = _sweep_cli(tmp_path, monkeypatch, ranked)
    assert code == 0, out


def test_a_cancelled_trial_is_not_counted_failed(tmp_path: Path) -> None:
    """Item 12: the progress bar counted a trial cancelled by Ctrl-C as "failed"."""
    import io

    from rich.console import Console

    from cli.sweep_display import SweepProgress

    display = SweepProgress(Console(file=io.StringIO()), parse_spec(SPEC))
    display("plan", {"trials": 2, "cached": 0, "slots": 2})
    for trial, status in (("a", "cancelled"), ("b", "failed")):
        display("started", {"trial_id": trial})
        display("finished", {"trial_id": trial, "status": status, "reason": "r"})
    status = display.progress.tasks[0].fields["status"]
    assert "failed 1" in status and "cancelled 1" in status, status
