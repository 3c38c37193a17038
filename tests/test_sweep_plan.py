"""The sweep planned into one frozen value before it runs (tasks/sweep/sweep_plan.py), and
``SweepRun`` holding only the running state (issue 71, step 1)."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest

from tasks.nodes.placement import Placement
from tasks.sweep.spec_file import parse_spec
from tasks.sweep.sweep_plan import SweepInputs, plan_sweep
from tasks.sweep.sweep_spec import trial_id

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.unit
def test_the_plan_holds_cached_refused_and_to_run_trials_before_any_runs(
        tiny_model: Path, tiny_data: Path, tmp_path: Path) -> None:
    """A grid of four points: one finished in an earlier run (its row and adapter on
    disk, the same key), two no TrainConfig takes (mlp_chunk with lora_dropout), one to
    run. The plan says so in its counts, keys every listed trial, and its table puts rows
    in the spec's order with each trial's params; it cannot be changed. Would catch: a
    cached trial run again, a refused point dropped, a plan mutated while trials run."""
    from tasks.board.results_table import RESULTS, write_results

    out = tmp_path / "out"
    spec = parse_spec({"name": "s", "model": str(tiny_model), "data": str(tiny_data),
                       "fixed": {"steps": 1, "mlp_chunk": 64},
                       "grid": {"learning_rate": [1e-5, 2e-5], "lora_dropout": [0.0, 0.1]}})
    first = plan_sweep(spec, out, Placement())
    assert dict(first.counts) == {"trials": 4, "cached": 0, "to_run": 2}
    assert [r["status"] for r in first.done] == ["failed", "failed"]
    old = first.keyed[first.todo[0].id]
    (out / old.plan.id).mkdir(parents=True)
    (out / old.plan.id / "adapters.safetensors").write_bytes(b"weights")
    write_results([{"trial_id": old.plan.id, "status": "completed", "cache_key": old.key}],
                  out / RESULTS, sweep=True)

    plan = plan_sweep(spec, out, Placement())
    assert dict(plan.counts) == {"trials": 4, "cached": 1, "to_run": 1}
    assert [p.id for p in plan.todo] == [first.todo[1].id]
    assert set(plan.keyed) == {p.id for p in first.todo}  # the cached one keyed too
    run_now = {"trial_id": plan.todo[0].id, "status": "completed"}
    rows = plan.table([run_now], {}, [])
    assert [r["trial_id"] for r in rows] == [trial_id(p) for p in spec.points()]
    by_id = {r["trial_id"]: r for r in rows}
    assert by_id[old.plan.id]["skipped"] and by_id[old.plan.id]["cache_key"] == old.key
    assert by_id[run_now["trial_id"]]["param/learning_rate"] == 2e-5
    assert by_id[run_now["trial_id"]]["cache_key"] == plan.keyed[run_now["trial_id"]].key
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.todo = ()  # type: ignore[misc]
    with pytest.raises(TypeError):
        plan.keyed["x"] = old  # type: ignore[index]
    assert SweepInputs.read(spec, out, Placement()).cached(old) is not None


def assigned_attributes(path: Path, cls: str) -> tuple[dict[str, set[str]], list[str]]:
    """``cls``'s attributes by the methods of ``path`` that assign them (``self.x = ``),
    and each ``obj.x = `` of one of them elsewhere in ``path`` (set from outside)."""
    tree = ast.parse(path.read_text())
    where: dict[str, set[str]] = {}
    outside: list[str] = []
    [body] = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls]
    for method in (n for n in body.body if isinstance(n, ast.FunctionDef)):
        for node in ast.walk(method):
            for t in getattr(node, "targets", [getattr(node, "target", None)]):
                if isinstance(t, ast.Attribute) and ast.unparse(t.value) == "self":
                    where.setdefault(t.attr, set()).add(method.name)
    for node in ast.walk(tree):
        for t in getattr(node, "targets", [getattr(node, "target", None)]):
            if (isinstance(t, ast.Attribute) and t.attr in where
                    and ast.unparse(t.value) != "self"):
                outside.append(f"line {t.lineno}: {ast.unparse(t)}")
    return where, outside


@pytest.mark.unit
def test_sweep_run_holds_only_the_running_state(tmp_path: Path) -> None:
    """Issue 71's line: ``SweepRun`` has at most 6 attributes, each set in its constructor
    and none from outside (the plan is the frozen value). Would catch: the old 16, the
    source set from outside (``sweep.source = source``), a dict filled as trials resolve."""
    where, outside = assigned_attributes(ROOT / "tasks/sweep/run.py", "SweepRun")
    assert len(where) <= 6, sorted(where)
    assert all(methods == {"__init__"} for methods in where.values()), where
    assert not outside, outside
    old = ("class SweepRun:\n    def __init__(self):\n        self.a = 1\n"
           "    def later(self):\n        self.b = 2\n"
           "def run(sweep):\n    sweep.a = 3\n")
    (probe := tmp_path / "old.py").write_text(old)
    where, outside = assigned_attributes(probe, "SweepRun")
    assert where == {"a": {"__init__"}, "b": {"later"}} and outside == ["line 7: sweep.a"]


@pytest.mark.unit
def test_references_are_read_from_the_planned_trials(tiny_model: Path, tiny_data: Path,
                                                    tmp_path: Path) -> None:
    """``reference_needs(plan)``: each trial to run's own reference, as the trial reads it
    (``reference_of``), once per distinct one; none for a trial naming its own file; for
    Optuna, each loss its space may draw. Would catch: the spec's dicts read a second way
    (an ``"orpo"`` default, ``grid[name][0]``), or a need the trials never read."""
    from tasks.sweep.references import reference_needs
    from tasks.sweep.spec_file import load_spec

    base = {"name": "s", "model": str(tiny_model), "data": str(tiny_data)}
    dpo = parse_spec({**base, "fixed": {"loss": "dpo", "batch_size": 2},
                      "grid": {"learning_rate": [1e-5, 2e-5]}})
    [(reference, options)] = reference_needs(plan_sweep(dpo, tmp_path / "a", Placement()))
    assert (reference.model, reference.kl, options.batch_size) == (str(tiny_model), False, 2)
    named = parse_spec({**base, "fixed": {"loss": "dpo", "reference_logps": str(tiny_data)}})
    assert reference_needs(plan_sweep(named, tmp_path / "b", Placement())) == []
    spec = tmp_path / "optuna.yaml"
    spec.write_text(f"name: o\nmodel: {tiny_model}\ndata: {tiny_data}\nsearch: optuna\n"
                    "num_samples: 2\nmetric: val/logps/accuracies\nmode: max\n"
                    "space: {loss: {choice: [orpo, dpo, kto]}}\n")
    drawn = reference_needs(plan_sweep(load_spec(spec), tmp_path / "c", Placement()))
    assert sorted(r.kl for r, _ in drawn) == [False, True]  # DPO's, KTO's with partners
