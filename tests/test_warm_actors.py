"""``reuse_actors: true`` (issue 72, step 1): a slot's process trains trial after trial, each
from the state a fresh process gives it, on a real local Ray."""

from __future__ import annotations

import itertools
import threading
from pathlib import Path

import pytest
from safetensors.numpy import load_file

from tasks.nodes.placement import Placement
from tasks.sweep.scheduler import run_trials
from tasks.sweep.trial_rules import TrialRules

pytestmark = [pytest.mark.slow]

SETTINGS = [("orpo", {}), ("bad", {}), ("simpo", {"lora_dropout": 0.1}),
            ("sft", {"learning_rate": 3e-3}), ("dpo", {"seed": 3})]


def trials(model: Path, data: Path, out: Path) -> list[tuple[str, dict]]:
    """Mixed losses and settings, one trial whose data is missing between them."""
    base = {"model": str(model), "data": str(data), "steps": 3, "batch_size": 2,
            "lora_rank": 4, "val_every": 0, "report_every": 1}
    return [(name, {**base, "loss": "orpo" if name == "bad" else name, **extra,
                    "out": str(out / name),
                    **({"data": str(out / "missing")} if name == "bad" else {})})
            for name, extra in SETTINGS]


def test_a_reused_actor_trains_as_a_fresh_one(ray_cluster, tiny_model, tiny_data,
                                              tmp_path) -> None:
    """One slot: with reuse, one process trains the trials until one fails, then a fresh
    one goes on; every adapter equals the fresh-process sweep's bit for bit (LoRA init,
    batches, dropout and the optimizer from each trial's own seed, nothing carried over).
    Would catch: a model, adapter or optimizer state kept from the last trial, or a failed
    trial's process reused. (A kept actor outliving the sweep is not checked: Ray ends it
    anyway once its last handle goes, when run_trials returns.)"""
    rows = {}
    for reuse in (False, True):
        out = tmp_path / ("warm" if reuse else "fresh")
        rows[reuse] = {r["trial_id"]: r for r in run_trials(
            trials(tiny_model, tiny_data, out), Placement(),
            TrialRules(max_concurrent=1, reuse_actors=reuse))}
    for by_id in rows.values():
        assert [r["status"] for r in by_id.values()] == [
            "completed", "failed", "completed", "completed", "completed"], by_id
    warm = rows[True]
    assert [warm[n]["reused_actor"] for n, _ in SETTINGS] == [False, True, False, True, True]
    assert warm["orpo"]["pid"] == warm["bad"]["pid"] != warm["simpo"]["pid"]
    assert warm["simpo"]["pid"] == warm["sft"]["pid"] == warm["dpo"]["pid"]
    assert len({r["pid"] for r in rows[False].values()}) == 5  # each trial its own process
    assert warm["dpo"]["phase/imports"] < warm["simpo"]["phase/imports"]  # loaded once
    for name, _ in SETTINGS:
        if name == "bad":
            continue
        fresh = load_file(str(tmp_path / "fresh" / name / "adapters.safetensors"))
        reused = load_file(str(tmp_path / "warm" / name / "adapters.safetensors"))
        assert fresh.keys() == reused.keys()
        assert all((fresh[k] == reused[k]).all() for k in fresh), name


def test_two_slots_keep_a_process_each(ray_cluster, tiny_model, tiny_data, tmp_path) -> None:
    """Two worker threads share the strategy and each keeps its own actor: 6 trials on 2
    slots run in exactly 2 processes, never two trials in one process at once. (The race
    of one kept actor shared by both threads needs two trials ending together; the test
    below pins the per-thread slot itself.)"""
    base = {"model": str(tiny_model), "data": str(tiny_data), "steps": 2, "batch_size": 2,
            "lora_rank": 4, "val_every": 0, "report_every": 1}
    listed = [(f"t{i}", {**base, "seed": i, "out": str(tmp_path / f"t{i}")}) for i in range(6)]
    rows = run_trials(listed, Placement(), TrialRules(max_concurrent=2, reuse_actors=True))
    assert [r["status"] for r in rows] == ["completed"] * 6, rows
    assert len({r["pid"] for r in rows}) == 2 and sum(r["reused_actor"] for r in rows) == 4
    for pid in {r["pid"] for r in rows}:
        spans = sorted((r["started"], r["ended"]) for r in rows if r["pid"] == pid)
        assert all(a[1] <= b[0] for a, b in itertools.pairwise(spans)), spans


@pytest.mark.unit
def test_each_worker_thread_keeps_its_own_actor() -> None:
    """The sweep's worker threads share one strategy (scheduler.run_workers): each thread
    gets a kept-actor slot of its own, the same one every time; none without reuse. Would
    catch: one slot shared by the threads (found by bench sweep at T = 512: 10 processes on
    2 slots, where two trials ending together overwrote each other's kept actor)."""
    from tasks.sweep.attempts import OneActor

    strategy, seen = OneActor(None, reuse=True), {}  # type: ignore[arg-type]

    def look(name: str) -> None:
        seen[name] = (strategy.slot, strategy.slot)

    threads = [threading.Thread(target=look, args=(name,)) for name in "ab"]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert seen["a"][0] is seen["a"][1] and seen["b"][0] is seen["b"][1]
    assert seen["a"][0] is not seen["b"][0]
    assert OneActor(None, reuse=False).slot is None  # type: ignore[arg-type]
