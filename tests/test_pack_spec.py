"""A sweep spec's ``pack: N`` or ``auto`` (tasks/sweep/spec_file.py): carried to the
scheduler's rules, refused in one line where packs cannot run (tasks/sweep/spec_rules.py
``check_pack``); ``auto``'s sizes from the pack probe's cached rows (tasks/sweep/pack_sizes.py)."""

from __future__ import annotations

import pytest

from tasks.sweep.spec_file import parse_spec
from tasks.sweep.sweep_spec import SpecError
from tasks.sweep.trial_plan import AUTO

pytestmark = pytest.mark.unit

BASE = {"name": "s", "model": "m", "data": "d", "grid": {"learning_rate": [1e-4, 2e-4]}}


def test_pack_reaches_the_rules_and_defaults_to_one() -> None:
    assert parse_spec({**BASE, "pack": 3}).rules.pack == 3
    assert parse_spec(BASE).rules.pack == 1
    auto = parse_spec({**BASE, "pack": "auto", "memory_budget_gb": 8})
    assert auto.pack is AUTO and auto.rules.pack == 1  # sized once probed (SweepPlan.rules)


@pytest.mark.parametrize("more, said", [
    ({"pack": 0}, "pack"),
    ({"search": "optuna", "grid": {}, "space": {"learning_rate": {"choice": [1e-4, 2e-4]}}},
     "search: optuna asks trials one at a time"),
    ({"ranks_per_trial": 2, "fixed": {"batch_size": 4}}, "a pack trains in one process"),
    ({"kind": "memory"}, "kind: memory"),
    ({"memory_budget_gb": 8, "fixed": {"segment_size": "auto"}}, "fixed.segment_size: auto"),
    ({"memory_budget_gb": 8, "search": "random", "grid": {},
      "space": {"segment_size": {"choice": ["auto", 2]}}}, "space.segment_size: auto"),
    ({"memory_budget_gb": 8}, "memory_budget_gb is a trial's.*pack: auto fits packs to it"),
    ({"pack": "auto"}, "pack: auto needs memory_budget_gb > 0"),
    ({"pack": "auto", "memory_budget_gb": 8, "fixed": {"segment_size": "auto"}},
     "pack: auto: fixed.segment_size: auto fits one adapter"),
    ({"pack": "auto", "memory_budget_gb": 8, "kind": "memory"}, "pack: auto: kind: memory"),
    ({"pack": "several"}, "pack='several': expected an integer >= 1 or auto"),
    ({"pack": "auto", "memory_budget_gb": 8, "fixed": {"memory_limit_gb": 4}},
     "fixed.memory_limit_gb: pack: auto fits each pack to memory_budget_gb"),
])
def test_pack_is_refused_where_packs_cannot_run(more: dict, said: str) -> None:
    """Would catch: a spec accepted whose packs the scheduler would refuse once Ray is up,
    or a pack of trials the memory probe sized for one adapter."""
    with pytest.raises(SpecError, match=said):
        parse_spec({**BASE, "pack": 2, **more})


def _fields(batch_size: int, rank: int, i: int) -> dict:
    return {"model": "m", "data": "d", "out": f"o/t{i}", "batch_size": batch_size,
            "lora_rank": rank, "learning_rate": 1e-4 * (i + 1)}


def _plans(batch_sizes: list[int], ranks: list[int]) -> list:
    from tasks.sweep.trial_plan import TrialPlan

    return [TrialPlan.make(f"t{i}", _fields(b, r, i))
            for i, (b, r) in enumerate(zip(batch_sizes, ranks, strict=True))]


def test_auto_sizes_each_class_of_trials_from_its_probe(tmp_path) -> None:
    """Cached probe rows (no Ray: nothing to measure) size each class that packs: a class
    up to its largest pack within the budget, one over it even alone refused, and a trial that packs
    with none left out. Rows probed under a smaller budget that stopped early do not answer
    for a larger one; the key is the class's heaviest trial's, with what a pack shares.
    Would catch: one size for every class, a pack past the budget (or past the first over
    it), a lone class sized, a short cached probe reused, or two segment sizes sharing a
    probe."""
    import json

    from engine.train.pack_probe import largest_pack
    from tasks.sweep.pack_sizes import covers, heaviest, pack_key, size_packs
    from tasks.sweep.trial_plan import TrialPlan

    plans = _plans([2, 2, 2, 4], [4, 8, 4, 4])
    probed = heaviest(plans[:3])  # rank 8: k copies of it bound any k of the class
    assert (probed.lora_rank, probed.learning_rate) == (8, plans[0].config.learning_rate)
    rows = [{"pack": k, "peak_gb": float(k)} for k in (1, 2, 3)]
    cache = tmp_path / "probes.json"
    cache.write_text(json.dumps({pack_key(probed, "fp"): rows}))
    limits, notes = size_packs(plans, 2.3, None, "fp", cache)  # 2 GiB fits, 3 does not
    assert limits == {"t0": 2, "t1": 2, "t2": 2} and "t3" not in limits
    assert json.loads(notes["t0"]) == {"1": 1.0, "2": 2.0, "3": 3.0}
    # issue 67 case 12: a budget even one trial exceeds trained every trial. Where the
    # probed trial is one of the class (all of one rank) the sweep stops; where it is the
    # class's blend (rank 8 for ranks 4 and 8), no real trial need exceed it: alone.
    assert size_packs(plans, 0.9, None, "fp", cache)[0]["t0"] == 1
    alike = _plans([2, 2], [8, 8])
    cache.write_text(json.dumps({pack_key(heaviest(alike), "fp"): rows}))
    with pytest.raises(SpecError, match=r"trials t0, t1: even alone a trial peaks at 1 GB"):
        size_packs(alike, 0.9, None, "fp", cache)
    cache.write_text(json.dumps({pack_key(probed, "fp"): rows}))
    assert size_packs(plans, 3.0, None, "fp", cache)[0]["t0"] == 3
    assert covers(rows[:2], 3, 1.5) and not covers(rows[:2], 3, 2.3) and not covers(None, 3, 9)
    noisy = [{"pack": 1, "peak_gb": 1.0}, {"pack": 2, "peak_gb": 2.5}, {"pack": 3, "peak_gb": 2.0}]
    assert largest_pack(noisy, 2.3) == 1  # past the first over: never picked
    other = plans[1].config  # another learning rate and folder
    assert pack_key(other, "fp") == pack_key(probed, "fp")  # the same memory, one probe
    segmented = TrialPlan.make("t9", {**_fields(2, 8, 0), "segment_size": 2}).config
    assert pack_key(segmented, "fp") != pack_key(probed, "fp")
    kto = TrialPlan.make("t8", {**_fields(2, 4, 8), "loss": "kto", "lora_dropout": 0.1})
    mixed = heaviest([plans[1], kto])  # the KL pass, rank 8 and dropout at once
    assert (mixed.loss.kind, mixed.lora_rank, mixed.lora_dropout) == ("kto", 8, 0.1)


def test_packs_keep_to_each_trials_own_limit() -> None:
    """Would catch: the scheduler's packs sized by ``pack`` alone, past a class's limit."""
    from tasks.sweep.packs import group_packs

    plans = _plans([2, 2, 2, 4, 4], [4, 4, 4, 4, 4])
    ids = lambda packs: [[t.id for t in p] for p in packs]  # noqa: E731
    limits = {"t0": 2, "t1": 2, "t2": 2, "t3": 3, "t4": 3}
    assert ids(group_packs(plans, 3, limits)) == [["t0", "t1"], ["t2"], ["t3", "t4"]]
    # pack: auto cuts the classes it sized, in order, never packing across two of them:
    # DPO trials of two references fit the ORPO ones, not each other
    from tasks.sweep.trial_plan import TrialPlan

    r1, n1, n2, r2 = (TrialPlan.make(tid, {**_fields(2, 4, i), **more}) for i, (tid, more) in
                      enumerate([("r1", {"loss": "dpo", "reference_logps": "a.arrow"}),
                                 ("n1", {}), ("n2", {}),
                                 ("r2", {"loss": "dpo", "reference_logps": "b.arrow"})]))
    two = {"r1": 2, "n1": 2, "n2": 2}  # r2 packs with none of its class: no limit
    assert ids(group_packs([r1, n1, n2, r2], 2)) == [["r1", "n1"], ["n2", "r2"]]
    assert ids(group_packs([r1, n1, n2, r2], 2, two)) == [["r1", "n1"], ["n2"], ["r2"]]
    assert ids(group_packs(plans, 3)) == [["t0", "t1", "t2"], ["t3", "t4"]]
