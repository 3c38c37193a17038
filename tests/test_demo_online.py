"""Issue 73, step 4: ``pomona demo --online`` (cli/demo.py ``ONLINE``), at toy size: the
pipeline's warm-start stage trains SFT on the train split, every GRPO trial starts from it
and takes its KL against it, and the base row is that warm start (what the verifier added
is read against where training began). The demo at full size, and what it learns, is
measured in the README (its figures, seeds and BLAS threads)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import yaml
from rich.console import Console

pytestmark = pytest.mark.integration


def test_the_online_demo_starts_every_trial_and_the_base_row_from_its_warm_start(
        prefect_api, ray_cluster, tmp_path, monkeypatch) -> None:
    import cli.demo as demo
    from engine.model.content_key import adapter_fingerprint
    from tasks.eval.evaluate import evaluate_adapter
    from tasks.eval.generation_eval import parse_generation

    spec = yaml.safe_load(demo.ONLINE["tiny"].spec.read_text())
    spec["fixed"].update(steps=2, report_every=1)
    spec["evaluation"].update(valid_prompts=8, test_prompts=16)
    small = tmp_path / "demo-online.yaml"
    small.write_text(yaml.safe_dump(spec))
    monkeypatch.setitem(demo.ONLINE, "tiny", dataclasses.replace(
        demo.ONLINE["tiny"], spec=small, rows=300))  # its 80 warm steps: signal
    console = Console(record=True, width=200)
    out = tmp_path / "out"
    demo.run_demo(out, console, None, "tiny", online=True)
    text = console.export_text()
    assert "test answers scored by parity: warm start" in text, text
    [start] = (out / "warm-start").iterdir()  # named by what it was trained from
    assert (start / "adapters.safetensors").exists()
    board = pq.read_table(out / "leaderboard.parquet").to_pylist()
    trials = [r for r in board if r["status"] == "completed"]
    assert len(trials) == 2 and {r["param/grpo_beta"] for r in trials} == {0.1, 0.2}
    base = next(r for r in board if r["trial_id"] == "base")
    alone = evaluate_adapter(str(out / "model"), str(start), str(out / "data"),
                             generation=parse_generation(spec["evaluation"])).metrics
    assert base["gen/test/parity"] == alone["gen/test/parity"]  # the base row: the start
    key = adapter_fingerprint(start)
    for r in trials:  # each trial began at the start, not at fresh LoRA weights
        block = json.loads((Path(r["adapter"]) / "adapter_config.json").read_text())["pomona"]
        assert block["warm_start_key"] == key, block
