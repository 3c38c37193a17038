"""A user's data mistake that only shows inside the pipeline flow (every row bad, an
empty file) ends `pomona pipeline` with exit 2 and its one-line message, not a traceback;
the flow run in Prefect ends Failed, its tokenize task run Failed with that message (what
the UI shows)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.long]  # conftest.py: scheduled first
ROOT = Path(__file__).resolve().parents[1]
SPEC = ROOT / "flows" / "configs" / "tiny.yaml"


def _pipeline_error(raw: Path, model: Path, spec: Path, out: Path, api: str) -> str:
    """``pomona pipeline``'s one error line: exit 2 and no traceback asserted."""
    env = {**os.environ, "PREFECT_API_URL": api, "RAY_ADDRESS": ""}
    proc = subprocess.run([sys.executable, "-m", "cli.main", "pipeline", str(raw), str(model),
                           str(spec), "--out", str(out)],
                          capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    text = proc.stdout + proc.stderr
    assert proc.returncode == 2, text
    assert "Traceback" not in text, text
    [line] = [ln for ln in proc.stdout.splitlines() if ln.startswith("error:")]
    return line


@pytest.mark.parametrize(("rows", "says"), [
    ("", "no rows"), ('{"prompt": "p", "chosen": "", "rejected": ""}\n', "are bad")])
def test_pipeline_data_mistakes_exit_2(rows: str, says: str, prefect_api, tiny_model: Path,
                                       tmp_path: Path) -> None:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowFilter, FlowFilterName
    from prefect.settings import PREFECT_API_URL

    raw = tmp_path / "raw.jsonl"
    raw.write_text(rows)
    line = _pipeline_error(raw, tiny_model, SPEC, tmp_path / "out", PREFECT_API_URL.value())
    assert says in line.lower() and "raw.jsonl" in line, line
    # The run as Prefect recorded it (what the UI shows): Failed, and the failed tokenize task
    # run in it carries the same message.
    with get_client(sync_client=True) as client:
        runs = client.read_flow_runs(
            flow_filter=FlowFilter(name=FlowFilterName(any_=["pomona-pipeline"])))
        [run] = [r for r in runs if r.parameters.get("raw") == str(raw)]
        tasks = [t for t in client.read_task_runs() if t.flow_run_id == run.id]
    assert run.state is not None and run.state.is_failed(), run.state
    [tokenize] = [t for t in tasks if t.name.startswith("tokenize")]
    assert tokenize.state is not None and tokenize.state.is_failed(), tokenize.state
    assert says in (tokenize.state.message or "").lower(), tokenize.state.message


def test_a_pipeline_whose_trials_all_fail_stops_in_one_line(prefect_api, tiny_model: Path,
                                                            tmp_path: Path) -> None:
    """Every trial diverges (learning rate 1e30): the flow stops after the sweep with one
    line naming a trial's reason, before any evaluation (was: the base evaluated anyway,
    then a 311-line traceback)."""
    from prefect.settings import PREFECT_API_URL

    from tasks.data.synthetic import synth_rows, write_rows

    raw = write_rows(list(synth_rows("sort", 60, seed=0)), tmp_path / "raw.jsonl")
    spec = tmp_path / "spec.yaml"
    spec.write_text("name: fails\nmodel: unused\ndata: unused\nfixed: {steps: 2, batch_size: 4,"
                    " lora_rank: 4, val_every: 0, learning_rate: 1.0e+30, grad_clip: 0.0}\n")
    line = _pipeline_error(raw, tiny_model, spec, tmp_path / "out", PREFECT_API_URL.value())
    assert "no trial completed" in line and "non_finite" in line, line
    assert not (tmp_path / "out" / "base").exists()  # nothing evaluated
