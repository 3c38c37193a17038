"""A lab's cluster for real: three simulated nodes with private disks (tests/lab_nodes.py).

The head has no GPU and holds the model and the data; two workers hold one ``mlx_gpu``
each and nothing else. The pipeline must send its inputs by content, train on both
workers, pull the results back and rank them as a one-node run does; a worker whose copy
of the data is stale must never be trained on; a worker on another Pomona is refused in
one line; an address nobody answers is a one-line error within seconds.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest

from tests.lab_nodes import SPEC, Lab, pomona, stocked_lab

pytestmark = [pytest.mark.slow, pytest.mark.long]

COMPARED = ("eval/valid/loss", "eval/valid/logps/accuracies", "eval/test/loss",
            "eval/test/logps/margin", "gen/valid/exact", "gen/test/exact")


@pytest.fixture(scope="module")
def lab(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path, tiny_data: Path):
    yield from stocked_lab(tmp_path_factory.mktemp("lab"), tiny_model, tiny_data)


@pytest.fixture(scope="module")
def lab_dataset(lab: Lab) -> str:
    """A tokenized dataset on the head's disk only, and a sweep spec over it."""
    pomona(lab, "head", "data", "tokenize", "--input", "/tmp/lab/sort.jsonl", "--model",
           "/tmp/lab/model", "--out", "/tmp/lab/ds")
    lab.run("head", ["sh", "-c", "sed -e 's#model: unused#model: /tmp/lab/model#' -e "
                     "'s#data: unused#data: /tmp/lab/ds#' spec.yaml > ds.yaml"])
    return "/tmp/lab/ds.yaml"


def test_unreachable_address_is_one_line_within_15_s(lab: Lab, lab_dataset: str) -> None:
    started = time.time()
    proc = pomona(lab, "head", "sweep", lab_dataset, "--address",
                  lab.address.replace(".1:", ".99:"), "--out", "/tmp/lab/none",
                  timeout=60, check=False)
    text = proc.stdout + proc.stderr
    assert time.time() - started < 15, text
    assert proc.returncode == 2 and "nothing answers" in text, text
    assert "Traceback" not in text and len(text.strip().splitlines()) == 1, text


def test_a_stale_dataset_on_a_worker_is_never_used(lab: Lab, lab_dataset: str,
                                                   tmp_path: Path) -> None:
    """w1 holds another dataset at the sweep's data path: its trials train on the head's
    bytes, fetched into w1's cache by digest, and w1's own folder is left as it was."""
    from tasks.data.synthetic import synth_rows, write_rows

    other = write_rows(list(synth_rows("reverse", 80, seed=1)), tmp_path / "rev.jsonl")
    lab.put("w1", other, "/tmp/lab/rev.jsonl")
    lab.put("w1", Path(lab.get("head", "/tmp/lab/model", tmp_path / "m")), "/tmp/lab/model")
    pomona(lab, "w1", "data", "tokenize", "--input", "/tmp/lab/rev.jsonl", "--model",
           "/tmp/lab/model", "--out", "/tmp/lab/ds")
    before = lab.run("w1", ["sh", "-c", "cd /tmp/lab/ds && sha256sum * | sort"]).stdout
    pomona(lab, "head", "sweep", lab_dataset, "--address", lab.address, "--resource",
           "mlx_gpu", "--out", "/tmp/lab/stale")
    out = lab.get("head", "/tmp/lab/stale", tmp_path / "got")
    rows = pq.read_table(out / "results.parquet").to_pylist()
    assert [r["status"] for r in rows] == ["completed"] * 2, [r.get("reason") for r in rows]
    assert "w1" in {r["node"] for r in rows}
    cached = lab.run("w1", ["sh", "-c", "ls /tmp/home/.cache/pomona/inputs/*/"]).stdout
    assert "ds" in cached.split(), cached  # the head's bytes, fetched by content
    assert lab.run("w1", ["sh", "-c", "cd /tmp/lab/ds && sha256sum * | sort"]).stdout == before
    accuracies = {r["node"]: r["best_val_accuracy"] for r in rows}
    assert len(rows) == 2 and all(a is not None for a in accuracies.values())


def test_a_gang_across_two_nodes_equals_one_process(lab: Lab, lab_dataset: str,
                                                    tmp_path: Path) -> None:
    """One rank on each worker (ring over the lab's links), on a train split whose last
    micro-batch holds one pair for two ranks (the idle rank joins at weight zero): the
    adapter equals a one-process trial of the same spec within 1e-5."""
    import mlx.core as mx
    import numpy as np

    manifest = json.loads(lab.run("head", ["cat", "/tmp/lab/ds/manifest.json"]).stdout)
    batch = manifest["rows"]["train"] - 1  # an epoch: one batch of N-1 pairs, one of 1
    assert batch % 2 == 0, f"{manifest['rows']}: the lab's data needs an odd train split"
    for name, ranks in (("gang", 2), ("one", 1)):
        lab.run("head", ["sh", "-c", f"sed -e 's#name: lab#name: {name}#' -e "
                         f"'s#max_concurrent: 2#max_concurrent: 1\\nranks_per_trial: {ranks}#' "
                         f"-e 's#batch_size: 4#batch_size: {batch}#' -e 's#steps: 6#steps: 2#' "
                         f"-e "
                         f"'s#learning_rate: \\[1.0e-3, 3.0e-4\\]#learning_rate: [1.0e-3]#' "
                         f"ds.yaml > {name}.yaml"])
        pomona(lab, "head", "sweep", f"/tmp/lab/{name}.yaml", "--address", lab.address,
               "--resource", "mlx_gpu", "--out", f"/tmp/lab/{name}")
    got = {name: lab.get("head", f"/tmp/lab/{name}", tmp_path) for name in ("gang", "one")}
    rows = {n: pq.read_table(got[n] / "results.parquet").to_pylist()[0] for n in got}
    assert rows["gang"]["world_size"] == 2 and len(rows["gang"]["hosts"]) == 2, rows["gang"]
    assert {h.split()[0] for h in rows["gang"]["hosts"]} == {"w1", "w2"}
    summary = json.loads((got["gang"] / rows["gang"]["trial_id"] / "summary.json").read_text())
    assert sum(summary["rank_pairs"]) == batch + 1  # the epoch's one-pair batch was trained
    a = mx.load(str(got["gang"] / rows["gang"]["trial_id"] / "adapters.safetensors"))
    b = mx.load(str(got["one"] / rows["one"]["trial_id"] / "adapters.safetensors"))
    for k in b:
        err = np.linalg.norm(np.array(a[k]) - np.array(b[k])) / np.linalg.norm(np.array(b[k]))
        assert err <= 1e-5, (k, err)


def test_packed_trials_on_private_disks_equal_lone_ones(lab: Lab, lab_dataset: str,
                                                       tmp_path: Path) -> None:
    """Issue 56: six trials with ``pack: 4``, a pack of four on one worker and of two on
    the other (inputs sent by content, each trial's files pulled back apart), train as
    the same six trials do with ``pack: 1``: every trial's best validation and final loss
    within the pack parity 1e-5. Two of them with ``pack: auto``: probed on a worker from
    the inputs sent by content, packed as the probe allows, the same results."""
    rates = "[1.0e-3, 6.0e-4, 3.0e-4, 1.0e-4, 6.0e-5, 3.0e-5]"
    for name, pack, grid in (("packed", "4", rates), ("lone", "1", rates),
                             ("auto", "auto\\nmemory_budget_gb: 100", "[1.0e-3, 6.0e-4]")):
        lab.run("head", ["sh", "-c", f"sed -e 's#name: lab#name: {name}#' -e "
                         f"'s#max_concurrent: 2#max_concurrent: 2\\npack: {pack}#' -e "
                         f"'s#learning_rate: \\[1.0e-3, 3.0e-4\\]#learning_rate: {grid}#' "
                         f"ds.yaml > {name}.yaml"])
        pomona(lab, "head", "sweep", f"/tmp/lab/{name}.yaml", "--address", lab.address,
               "--resource", "mlx_gpu", "--out", f"/tmp/lab/{name}")
    got = {n: board(lab.get("head", f"/tmp/lab/{n}", tmp_path / n) / "results.parquet")
           for n in ("packed", "lone", "auto")}
    packed, lone, auto = got["packed"], got["lone"], got["auto"]
    assert [r["pack_size"] for r in auto.values()] == [2, 2], auto  # 100 GiB fits both
    assert all(len(json.loads(r["pack_probe_gb"])) == 2 for r in auto.values())
    for tid, row in auto.items():
        assert row["status"] == "completed"
        assert row["final_loss"] == pytest.approx(lone[tid]["final_loss"], rel=1e-5), tid
    assert set(packed) == set(lone) and len(lone) == 6
    assert all(r["status"] == "completed" for r in [*packed.values(), *lone.values()])
    assert sorted(r["pack_size"] for r in packed.values()) == [2, 2, 4, 4, 4, 4], packed
    assert {r["node"] for r in packed.values()} == {"w1", "w2"}
    for tid, row in lone.items():
        for key in ("best/val/loss", "final_loss"):
            assert packed[tid][key] == pytest.approx(row[key], rel=1e-5), (tid, key)


GRPO_SPEC = ("name: grpo\nmodel: /tmp/lab/model\ndata: /tmp/lab/ds\nmax_concurrent: 2\n"
             "fixed: {loss: grpo, reward: python:lab_reward:score, steps: 2, batch_size: 2, "
             "num_generations: 2, max_completion_length: 4, lora_rank: 4, val_every: 0}\n"
             "grid: {temperature: [0.7, 1.0]}\n")
LAB_REWARD = ("def score(prompt, completion, row):\n"
              "    text = completion.replace(' ', '')\n"
              "    return sum(c.isalpha() for c in text) / len(text) if text else 0.0\n")


def test_a_grpo_sweep_rewarded_by_the_heads_module_trains_on_both_workers(
        lab: Lab, lab_dataset: str, tmp_path: Path) -> None:
    """Issue 73: two GRPO trials whose ``python:`` reward only the head's disk holds: its
    module goes to each worker by content (into its cache, by digest), both workers train,
    and the head ranks them on ``val/reward``."""
    (tmp_path / "lab_reward.py").write_text(LAB_REWARD)
    (tmp_path / "grpo.yaml").write_text(GRPO_SPEC)
    for name in ("lab_reward.py", "grpo.yaml"):
        lab.put("head", tmp_path / name, f"/tmp/lab/{name}")
    for worker in ("w1", "w2"):  # the module is the head's alone
        assert lab.run(worker, ["sh", "-c", "ls /tmp/lab/lab_reward.py"], check=False
                       ).returncode != 0
    pomona(lab, "head", "sweep", "/tmp/lab/grpo.yaml", "--address", lab.address,
           "--resource", "mlx_gpu", "--out", "/tmp/lab/grpo")
    rows = pq.read_table(lab.get("head", "/tmp/lab/grpo", tmp_path / "got")
                         / "results.parquet").to_pylist()
    assert [r["status"] for r in rows] == ["completed"] * 2, [r.get("reason") for r in rows]
    assert {r["node"] for r in rows} == {"w1", "w2"}
    assert all(0 <= r["best/val/reward"] <= 1 for r in rows), rows
    for worker in ("w1", "w2"):
        cached = lab.run(worker, ["sh", "-c", "ls /tmp/home/.cache/pomona/inputs/*/"]).stdout
        assert "lab_reward.py" in cached.split(), (worker, cached)


def board(path: Path) -> dict[str, dict]:
    return {r["trial_id"]: r for r in pq.read_table(path).to_pylist()}


def _running_on(lab: Lab, out: str, wait_s: float = 120.0) -> str:
    """The worker whose trial has sent the driver its first metric lines."""
    deadline = time.time() + wait_s
    while time.time() < deadline:
        lines = lab.run("head", ["sh", "-c", f"cat {out}/*/metrics.jsonl 2>/dev/null | wc -l"])
        if int(lines.stdout.strip() or 0) > 1:
            for worker in ("w1", "w2"):
                ls = lab.run(worker, ["sh", "-c", "ls /tmp/home/.cache/pomona/scratch/*/ "
                                      "2>/dev/null || true"])
                if ls.stdout.strip():
                    return worker
        time.sleep(0.5)
    raise AssertionError("the trial never started")


def _sweep_started(lab: Lab, spec: str, out: str) -> tuple[Any, dict]:
    """``pomona sweep`` on the head in a thread, with its process once it ends."""
    import threading

    done: dict = {}
    sweep = threading.Thread(target=lambda: done.update(proc=pomona(
        lab, "head", "sweep", spec, "--address", lab.address, "--resource", "mlx_gpu",
        "--out", out, check=False)))
    sweep.start()
    return sweep, done


def _retried_once(lab: Lab, sweep: Any, done: dict, out: str, tmp_path: Path,
                  steps: int) -> dict:
    """The sweep's one trial: completed on its second attempt, every step's metrics once."""
    sweep.join(timeout=400)
    proc = done["proc"]
    assert proc.returncode == 0, proc.stdout + proc.stderr
    got = lab.get("head", out, tmp_path)
    [row] = pq.read_table(got / "results.parquet").to_pylist()
    assert row["status"] == "completed" and row["attempts"] == 2, row
    lines = [json.loads(x) for x in (got / row["trial_id"] / "metrics.jsonl").read_text()
             .splitlines()]
    seen = [r["step"] for r in lines if r.get("split") == "train"]
    assert seen == sorted(set(seen)) and seen[-1] == steps, seen
    return row


@pytest.mark.parametrize("fault", ["kill", "cut"])
def test_a_worker_lost_mid_trial_loses_no_trial(lab: Lab, lab_dataset: str, tmp_path: Path,
                                                fault: str) -> None:
    """The node running the only trial is killed, or cut off the network (its process lives
    on, orphaned): the trial is retried on the other worker and completes, its metrics
    once each; the orphan can neither block the retry nor write the result."""
    out = f"/tmp/lab/lost-{fault}"
    lab.run("head", ["sh", "-c", f"sed -e 's#max_concurrent: 2#max_concurrent: 1#' -e "
                     f"'s#steps: 6#steps: 40#' -e 's#learning_rate: \\[1.0e-3, 3.0e-4\\]#"
                     f"learning_rate: [1.0e-3]#' ds.yaml > lost-{fault}.yaml"])
    sweep, done = _sweep_started(lab, f"/tmp/lab/lost-{fault}.yaml", out)
    victim = _running_on(lab, out)
    lab.kill(victim) if fault == "kill" else lab.cut(victim)
    row = _retried_once(lab, sweep, done, out, tmp_path, 40)
    assert row["node"] != victim
    lab.kill(victim)  # back as a new node, for the tests after this one
    lab.uncut(victim)
    lab.wait_nodes(2, 90)
    lab.start_node(victim)
    lab.wait_nodes(3, 90)


def test_a_grpo_trial_whose_worker_is_killed_is_retried(lab: Lab, lab_dataset: str,
                                                        tmp_path: Path) -> None:
    """Issue 73: a GRPO trial rewarded by the head's ``python:`` module, its worker killed
    mid-trial: retried on the other worker (the module sent there by content too), it
    completes with every step's metrics once."""
    (tmp_path / "lab_reward.py").write_text(LAB_REWARD)
    (tmp_path / "grpo-lost.yaml").write_text(
        GRPO_SPEC.replace("max_concurrent: 2", "max_concurrent: 1")
        .replace("steps: 2,", "steps: 40, report_every: 2,")
        .replace("temperature: [0.7, 1.0]", "temperature: [1.0]"))
    for name in ("lab_reward.py", "grpo-lost.yaml"):
        lab.put("head", tmp_path / name, f"/tmp/lab/{name}")
    out = "/tmp/lab/grpo-lost"
    sweep, done = _sweep_started(lab, "/tmp/lab/grpo-lost.yaml", out)
    victim = _running_on(lab, out)
    lab.kill(victim)
    row = _retried_once(lab, sweep, done, out, tmp_path / "got", 40)
    assert row["node"] != victim and 0 <= row["best/val/reward"] <= 1, row
    lab.wait_nodes(2, 90)
    lab.start_node(victim)  # back as a new node, for the tests after this one
    lab.wait_nodes(3, 90)


def test_a_gang_whose_node_is_killed_is_retried_whole(lab: Lab, lab_dataset: str,
                                                     tmp_path: Path) -> None:
    """One rank on each worker; w2 is killed mid-trial and comes back as a new node: the
    survivor's ring error counts as a lost node, so the whole gang is retried once (on w1
    and the new w2) and completes, with every step's metrics once."""
    out = "/tmp/lab/gang-lost"
    lab.run("head", ["sh", "-c", "sed -e 's#max_concurrent: 2#max_concurrent: 1\\n"
                     "ranks_per_trial: 2#' -e 's#steps: 6#steps: 40#' -e "
                     "'s#learning_rate: \\[1.0e-3, 3.0e-4\\]#learning_rate: [1.0e-3]#' "
                     "ds.yaml > gang-lost.yaml"])
    sweep, done = _sweep_started(lab, "/tmp/lab/gang-lost.yaml", out)
    _running_on(lab, out)
    lab.kill("w2")
    lab.wait_nodes(2, 90)
    lab.start_node("w2")  # the retry's placement group waits for two workers again
    row = _retried_once(lab, sweep, done, out, tmp_path, 40)
    assert row["world_size"] == 2 and {h.split()[0] for h in row["hosts"]} == {"w1", "w2"}
    lab.wait_nodes(3, 90)


def test_pipeline_on_private_disks_equals_one_node(lab: Lab, tiny_model: Path, tmp_path: Path,
                                                   prefect_api) -> None:
    """The pipeline on the lab (nothing shared but the code) completes with trials on both
    workers, tracked by the head (TensorBoard), and its leaderboard equals a one-node run of
    the same spec within 1e-6."""
    pomona(lab, "head", "pipeline", "/tmp/lab/sort.jsonl", "/tmp/lab/model",
           "/tmp/lab/spec.yaml", "--out", "/tmp/lab/out", "--address", lab.address,
           "--resource", "mlx_gpu", "--generations", "2", "--report-to", "tensorboard")
    out = lab.get("head", "/tmp/lab/out", tmp_path / "lab")
    results = pq.read_table(out / "sweep" / "results.parquet").to_pylist()
    assert {r["node"] for r in results} == {"w1", "w2"}, [r["node"] for r in results]
    if "libopenblas" in os.environ.get("LD_PRELOAD", ""):  # the driver's preload reached them
        assert all(r["openblas"] for r in results), [r["openblas"] for r in results]
    assert all((out / "sweep" / r["trial_id"] / "adapters.safetensors").exists()
               for r in results)
    assert (out / "best-adapter" / "adapters.safetensors").exists()
    lines = (out / "sweep" / results[0]["trial_id"] / "metrics.jsonl").read_text().splitlines()
    steps = [json.loads(x)["step"] for x in lines if json.loads(x).get("split") == "train"]
    assert steps == sorted(set(steps)), steps  # pulled back once, nothing duplicated
    # Tracked by the head alone, from what came back: each trial's curve and evaluation.
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    for r in results:
        events = EventAccumulator(str(out / "sweep" / "tb" / r["trial_id"]))
        events.Reload()
        assert {"loss", "eval/test/loss"} <= set(events.Tags()["scalars"]), r["trial_id"]
    # Answers generated on the workers come back to the head's folders, two a split.
    answers = (out / "base" / "generations.jsonl").read_text().splitlines()
    assert [json.loads(x)["split"] for x in answers] == ["valid", "valid", "test", "test"]

    from flows.pipeline import pipeline

    raw = tmp_path / "sort.jsonl"
    lab.get("head", "/tmp/lab/sort.jsonl", tmp_path)
    spec = tmp_path / "spec.yaml"
    spec.write_text(SPEC)
    state = pipeline(str(raw), str(tiny_model), str(spec), str(tmp_path / "one"),
                     generations=2, return_state=True)
    assert state.is_completed(), state
    here, there = board(tmp_path / "one" / "leaderboard.parquet"), board(
        out / "leaderboard.parquet")
    assert set(here) == set(there)
    for tid, row in here.items():
        for key in COMPARED:
            assert there[tid][key] == pytest.approx(row[key], abs=1e-6), (tid, key)


def test_a_worker_on_another_version_is_refused_in_one_line(lab: Lab,
                                                            lab_dataset: str) -> None:
    lab.kill("w2")
    lab.wait_nodes(2, 90)  # the head has seen it go (health checks: seconds here)
    lab.shadow("w2", "tasks", "# an edited checkout")
    lab.start_node("w2")
    lab.wait_nodes(3, 90)
    proc = pomona(lab, "head", "sweep", lab_dataset, "--address", lab.address, "--resource",
                  "mlx_gpu", "--out", "/tmp/lab/versions", check=False)
    text = proc.stdout + proc.stderr
    assert proc.returncode == 2, text
    assert "w2" in text and "pomona" in text and "Traceback" not in text, text


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
