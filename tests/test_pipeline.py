"""The pipeline flow end to end against a real Prefect API and a local Ray: raw JSONL →
tokenize → preprocess → sweep → evaluate → leaderboard; a second run hits the caches."""

from __future__ import annotations

import json
import shutil

import mlx.core as mx
import mlx_lm
import pyarrow.parquet as pq
import pytest

pytestmark = [pytest.mark.slow, pytest.mark.long]  # conftest.py: scheduled first


def counting(monkeypatch, module: object, name: str, counts: dict[str, int]) -> None:
    """``module.name`` counted in ``counts[name]`` each time it is called."""
    real = getattr(module, name)
    counts[name] = 0

    def counted(*args: object, **kwargs: object) -> object:
        counts[name] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, counted)


def test_pipeline_end_to_end(prefect_api, ray_cluster, tiny_model, tmp_path,
                             monkeypatch) -> None:
    """Run as ``pomona pipeline`` runs it: the inputs checked once before the flow, which
    takes what the checks produced (issue 71: the spec was read and the export's family
    checked again inside the flow)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    import flows.pipeline
    from flows.pipeline import check_pipeline_inputs, pipeline
    from tasks.data.synthetic import synth_rows, write_rows
    from tasks.sweep import spec_file

    raw = write_rows(list(synth_rows("sort", 160, seed=0)), tmp_path / "raw" / "sort.jsonl")
    spec = tmp_path / "spec.yaml"
    spec.write_text("name: pipe\nmodel: unused\ndata: unused\nmax_concurrent: 2\n"
                    "fixed: {steps: 16, batch_size: 4, lora_rank: 4, val_every: 8, "
                    "val_batches: 2, learning_rate: 1.0e-3, head_chunk: 16}\n"
                    "grid: {orpo_lambda: [0.1, 1.0]}\n"
                    "evaluation: {scorers: [task:sort, exact]}\nrank_by: gen/valid/sort\n"
                    "export: {gguf: f16, gguf_adapter: true}\n")
    out = tmp_path / "out"
    counts: dict[str, int] = {}
    counting(monkeypatch, spec_file, "parse_spec", counts)
    counting(monkeypatch, flows.pipeline, "exportable", counts)
    checked = check_pipeline_inputs(str(raw), str(tiny_model), str(spec), str(out), 2,
                                    ["tensorboard"])
    state = pipeline(str(raw), str(tiny_model), str(spec), str(out), generations=2, fuse=True,
                     report_to=["tensorboard"], return_state=True, checked=checked)
    assert state.is_completed(), state
    assert counts == {"parse_spec": 1, "exportable": 1}, counts  # once, before the flow
    summary = state.result()
    board = pq.read_table(out / "leaderboard.parquet").to_pylist()
    assert [r["trial_id"] for r in board][-1] == "base"
    assert [r["trial_id"] for r in board][-2] == "soup"  # the top-2 merged, evaluated
    assert (out / "soup" / "adapters.safetensors").exists()
    trials = [r for r in board if r["trial_id"] not in ("base", "soup")]
    # report_to (the flag, in place of the spec's none): each trial's curve and evaluation
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    for r in trials:
        events = EventAccumulator(str(out / "sweep" / "tb" / r["trial_id"]))
        events.Reload()
        assert {"loss", "val/loss", "eval/test/loss"} <= set(events.Tags()["scalars"])
    assert len(trials) == 2 and [r["rank"] for r in trials] == [1, 2]
    # Valid (ranked on) and test (reported) are scored apart, on the dataset's own splits.
    rows = json.loads((out / "data" / "manifest.json").read_text())["rows"]
    assert rows["valid"] > 0 and rows["test"] > 0
    for r in board:
        assert (r["eval/valid/rows"], r["eval/test/rows"]) == (rows["valid"], rows["test"])
    # The board's accuracies are what `pomona score` reads off the same pairs.
    from engine.cli import main as engine_main
    from engine.forward.scoring import preference_accuracy

    for r in (board[-1], trials[0]):
        for split in ("valid", "test"):
            scored = tmp_path / f"{r['trial_id']}-{split}.jsonl"
            adapter = [] if r["trial_id"] == "base" else ["--adapter", r["adapter"]]
            assert engine_main(["score", "--model", str(tiny_model), "--data", str(out / "data"),
                              "--split", split, "--out", str(scored), *adapter]) == 0
            acc = preference_accuracy([json.loads(x) for x in scored.read_text().splitlines()])
            assert r[f"eval/{split}/logps/accuracies"] == pytest.approx(acc, abs=1e-9), split
    assert "eval/test/logps/accuracies" in (out / "leaderboard.md").read_text()
    assert summary["best_trial"] == trials[0]["trial_id"]
    best = out / "best-adapter"
    assert (best / "adapters.safetensors").exists() and (best / "adapter_config.json").exists()
    # Issue 55: `export: {gguf: f16}` wrote the best adapter fused, as a GGUF beside it,
    # which imports back to the fused model's logits (f16: tests/test_gguf_export.py).
    from engine.model.gguf_import import import_gguf

    assert summary["gguf"] == str(out / "best-adapter.gguf")
    tokens = mx.array([[1, 17, 3, 250, 99, 4, 42, 7]])
    want = mlx_lm.load(str(tiny_model), adapter_path=str(best))[0](tokens)
    back = mlx_lm.load(str(import_gguf(out / "best-adapter.gguf", tmp_path / "back",
                                dtype="float32")))[0](tokens)
    assert float(mx.abs(back - want).max() / mx.abs(want).max()) < 5e-3
    # Issue 70: and alone, as llama.cpp's LoRA GGUF (its maths: tests/test_gguf_adapter.py)
    import gguf

    lora = gguf.GGUFReader(summary["gguf_adapter"])
    assert summary["gguf_adapter"] == str(out / "best-adapter-lora.gguf")
    assert all(t.name.endswith((".lora_a", ".lora_b")) for t in lora.tensors)
    assert (best / "SOURCE").read_text().strip() == trials[0]["trial_id"]
    fused, _ = mlx_lm.load(summary["fused"])  # a standalone model with the adapter inside

    tuned, _ = mlx_lm.load(str(tiny_model), adapter_path=str(best))
    base_model, _ = mlx_lm.load(str(tiny_model))
    tokens = mx.array([[1, 5, 9, 13, 17, 21]])
    want = tuned(tokens)
    effect = float(mx.abs(want - base_model(tokens)).max())  # what the adapter changes
    assert float(mx.abs(fused(tokens) - want).max()) < 0.1 * effect, effect
    samples = [json.loads(x) for x in (out / "base" / "generations.jsonl").read_text()
               .splitlines()]
    assert [x["split"] for x in samples] == ["valid", "valid", "test", "test"]
    assert all(set(x["scores"]) == {"sort", "exact"} for x in samples)
    # Ranked on the answers' score (rank_by: gen/valid/sort), each figure with its n and
    # interval, and each adapter's paired test against the base on the same prompts.
    assert [r["gen/valid/sort"] for r in trials] == sorted(
        (r["gen/valid/sort"] for r in trials), reverse=True)
    for r in board:
        assert r["gen/test/sort/n"] == 2 and r["gen/test/sort/low"] <= r["gen/test/sort"]
        assert r["eval/test/logps/accuracies/low"] <= r["eval/test/logps/accuracies"]
        assert not any(k.startswith("paired/") for k in r)
    for r in trials:
        assert r["vs_base/test/gen/sort/wins"] + r["vs_base/test/gen/sort/ties"] + \
            r["vs_base/test/gen/sort/losses"] == 2
        assert r["vs_base/test/logps/accuracies/ties"] + r["vs_base/test/logps/accuracies/wins"] \
            + r["vs_base/test/logps/accuracies/losses"] == rows["test"]
    assert "| 1 | " in (out / "leaderboard.md").read_text()
    with get_client(sync_client=True) as client:
        keys = ArtifactFilter(key=ArtifactFilterKey(any_=["pipe-leaderboard"]))
        [art] = client.read_artifacts(artifact_filter=keys, limit=1)
        keys = ArtifactFilter(key=ArtifactFilterKey(any_=["pipe-leaderboard-full"]))
        [full] = client.read_artifacts(artifact_filter=keys, limit=1)
        keys = ArtifactFilter(key=ArtifactFilterKey(any_=["pipe-answers"]))
        [answers] = client.read_artifacts(artifact_filter=keys, limit=1)
        keys = ArtifactFilter(key=ArtifactFilterKey(any_=["data-check"]))
        [check] = client.read_artifacts(artifact_filter=keys, limit=1)
    assert "length bias d" in check.data and "prompts in more than one split" in check.data
    assert trials[0]["trial_id"] in art.data
    assert "eval/test/nll_loss" not in art.data and "eval/test/nll_loss" in full.data
    assert "test sort: answers scored by sort, n=2" in art.data
    assert "against base, test" in art.data
    table = json.loads(answers.data) if isinstance(answers.data, str) else answers.data
    assert [r["chosen"] for r in table] == [x["chosen"] for x in samples[2:]]
    assert {"base answer", "best answer", "base sort", "best sort"} <= set(table[0])
    assert art.data.count("data:image/png;base64,") == 2  # curves + metric vs parameter
    for name in ("curves.png", "params.png"):
        assert (out / "plots" / name).read_bytes()[:4] == b"\x89PNG"

    # Issue 36 item 1: a user's files in what a re-run writes again survive byte for byte.
    users = [out / "best-adapter" / "README.md", out / "best-adapter" / "tokenizer.json",
             out / "soup" / "README.md", out / "plots" / "notes.txt",
             out / "sweep" / trials[0]["trial_id"] / "README.md"]
    for i, path in enumerate(users):
        path.write_bytes(f"user file {i}\n".encode())
    again = pipeline(str(raw), str(tiny_model), str(spec), str(out), generations=2,
                     return_state=True)
    assert again.is_completed()
    assert again.result()["gguf"] == summary["gguf"]  # its own earlier export, replaced
    assert again.result()["gguf_adapter"] == summary["gguf_adapter"]
    assert [p.read_bytes() for p in users] == [f"user file {i}\n".encode()
                                               for i in range(len(users))]
    with get_client(sync_client=True) as client:
        runs = [t for t in client.read_task_runs()
                if t.flow_run_id == again.state_details.flow_run_id]
    evals = [t for t in runs if t.name.startswith("evaluate-")]
    assert len(evals) == 4 and all(t.state.name == "Cached" for t in evals), \
        [(t.name, t.state.name) for t in evals]  # 2 trials, soup, base: same bytes, same data
    results = pq.read_table(out / "sweep" / "results.parquet").to_pylist()
    assert all(r["skipped"] for r in results)  # the sweep's cache
    assert again.result()["tokenize_cache_hit"] and not summary["tokenize_cache_hit"]
    assert again.result()["rows"] == summary["rows"]

    # The aggregate stages alone, on the finished sweep.
    from flows.pipeline import leaderboard_flow
    from tasks.eval.generation_eval import NO_GENERATION

    # Issue 67 case 3: on a copy of the sweep (one trial's adapter deleted from the copy
    # alone), the board reads the copy's adapters: the deleted one is missing, never ranked
    # (an absolute path in results.parquet had evaluated, ranked and souped the original's).
    copy = tmp_path / "copied-sweep"
    shutil.copytree(out / "sweep", copy)
    gone, kept = sorted(r["trial_id"] for r in trials)
    (copy / gone / "adapters.safetensors").unlink()
    alone = leaderboard_flow(str(copy), str(tiny_model), str(out / "data"),
                             metric="val/loss", out=str(tmp_path / "alone"),
                             generations=NO_GENERATION,
                             soup_k=0)
    board2 = {r["trial_id"]: r for r in
              pq.read_table(tmp_path / "alone" / "leaderboard.parquet").to_pylist()}
    assert sorted(board2) == sorted([gone, kept, "base"])
    assert board2[gone]["status"] == "missing" and board2[gone]["rank"] is None
    assert str(copy / gone) in board2[gone]["reason"]
    assert alone["best_trial"] == kept and board2[kept]["rank"] == 1
    assert (out / "sweep" / gone / "adapters.safetensors").is_file()  # the original's kept


@pytest.mark.unit  # a pure function: the fast tier runs it
def test_evaluation_fits_where_the_trials_trained() -> None:
    """Each trial is evaluated at its own batch size, head chunk and prefix sharing; the
    base and the soup at what suits all of them."""
    from engine.settings.forward_options import ForwardOptions as EvalSettings
    from tasks.prefect.pipeline_tasks import eval_settings

    a = {"param/batch_size": 8, "param/head_chunk": 0}
    b = {"param/batch_size": 2, "param/head_chunk": 512, "param/prefix_share": "on"}
    c = {"param/batch_size": 4, "param/head_chunk": 256, "param/prefix_share": "off"}
    assert eval_settings([a]) == EvalSettings(8, 0, "auto")
    assert eval_settings([b]) == EvalSettings(2, 512, "on")
    assert eval_settings([a, b]) == EvalSettings(2, 512, "auto")
    assert eval_settings([a, b, c]) == EvalSettings(2, 256, "off")
    assert eval_settings([]) == EvalSettings() == eval_settings([{}])


@pytest.mark.unit
def test_a_spec_without_batch_size_evaluates_at_the_trainers_default(
        tiny_model, tiny_data, tmp_path) -> None:
    """Issue 52, case 5: a trial whose spec set no batch_size trained at TrainConfig's
    default (4) and was evaluated at 8, a batch twice as large as the one that fit. The
    rows are those the sweep writes (``SweepPlan.table`` of its plans): a column for every
    effective setting, the spec's or a default, so evaluation reads what trained. Would
    catch: a param/ column only for what the spec set, or evaluation guessing one."""
    from engine.losses import OWNERS
    from engine.settings.config import TrainConfig
    from tasks.nodes.placement import Placement
    from tasks.prefect.pipeline_tasks import eval_settings
    from tasks.sweep.spec_file import load_spec
    from tasks.sweep.sweep_plan import plan_sweep
    from tasks.sweep.trial_plan import PATHS

    spec = tmp_path / "spec.yaml"
    spec.write_text(f"name: s\nmodel: {tiny_model}\ndata: {tiny_data}\nsearch: grid\n"
                    "grid: {learning_rate: [1.0e-5, 2.0e-5]}\n")
    plan = plan_sweep(load_spec(spec), tmp_path / "out", Placement())
    rows = plan.table([{"trial_id": p.id, "status": "completed"} for p in plan.todo], {}, [])
    defaults = TrainConfig.defaults()
    settings = {f"param/{k}" for k in defaults if k not in PATHS
                and (k not in OWNERS or OWNERS[k].kind == "orpo")}
    assert len(rows) == 2 and all(settings <= set(r) for r in rows), settings - set(rows[0])
    assert [r["param/batch_size"] for r in rows] == [defaults["batch_size"]] * 2 == [4, 4]
    assert [r["param/learning_rate"] for r in rows] == [1.0e-5, 2.0e-5]
    got = eval_settings(rows)
    assert got.batch_size == defaults["batch_size"] == 4
    assert (got.head_chunk, got.prefix_share) == (defaults["head_chunk"],
                                                   defaults["prefix_share"])
