"""Issue 73, step 3: prompt data (prompts and answers, no pairs) through ``pomona pipeline``:
tokenized as a prompts dataset, no preprocess, a GRPO sweep, each adapter and the base
judged by their greedy answers (the scorers that rewarded training), the board ranked on
``gen/valid/<label>`` with the test split's intervals and the paired test; a pair loss, or
an evaluation that scores no answers, refused before the flow starts, in one line; GRPO's
metrics reach TensorBoard as every metric does."""

from __future__ import annotations

from pathlib import Path

import pyarrow.parquet as pq
import pytest

from tasks.data.synthetic import synth_rows, write_rows
from tasks.sweep.spec_rules import SpecError

SPEC = ("name: prompts\nmodel: unused\ndata: unused\nmax_concurrent: 2\n"
        "fixed: {{loss: {loss}, reward: 'python:tests.grpo_rewards:digits', steps: 2, "
        "batch_size: 2, num_generations: 2, max_completion_length: 4, lora_rank: 4, "
        "val_every: 0}}\ngrid: {{temperature: [0.7, 1.0]}}\n"
        "evaluation: {{scorers: [task:parity], prompts: {prompts}, max_tokens: 4}}\n"
        "rank_by: gen/valid/parity\n")


def prompt_rows(folder: Path, rows: int = 200) -> Path:
    return write_rows(list(synth_rows("parity", rows, seed=0, layout="prompts",
                                      distinct=True)), folder / "raw" / "parity.jsonl")


def spec_file(folder: Path, loss: str = "grpo", prompts: int = 8) -> Path:
    path = folder / f"spec-{loss.split(',')[0]}-{prompts}.yaml"
    loss = loss if loss == "grpo" else f"{loss}, pairs: online"  # online pairs read pairs too
    path.write_text(SPEC.format(loss=loss, prompts=prompts).replace(
        "rank_by: gen/valid/parity\n", "" if prompts == 0 else "rank_by: gen/valid/parity\n"))
    return path


@pytest.mark.unit
def test_prompt_data_with_a_pair_loss_or_no_scored_answers_is_refused(tiny_model,
                                                                      tmp_path) -> None:
    from flows.pipeline import check_pipeline_inputs

    raw = prompt_rows(tmp_path, 20)
    check_pipeline_inputs(str(raw), str(tiny_model), str(spec_file(tmp_path)))
    for loss, prompts, message in (
            ("orpo", 8, "loss orpo: trains on pairs, and {raw} holds prompts alone"),
            ("grpo", 0, "evaluation: {raw} holds prompts alone, judged by their answers")):
        with pytest.raises(SpecError, match=r"^[^\n]*$") as err:
            check_pipeline_inputs(str(raw), str(tiny_model),
                                  str(spec_file(tmp_path, loss, prompts)))
        assert message.format(raw=raw) in str(err.value)


@pytest.mark.integration
def test_prompt_data_runs_the_whole_pipeline_judged_by_its_answers(
        prefect_api, ray_cluster, tiny_model, tmp_path) -> None:
    from flows.pipeline import pipeline

    out = tmp_path / "out"
    state = pipeline(str(prompt_rows(tmp_path)), str(tiny_model), str(spec_file(tmp_path)),
                     str(out), report_to=["tensorboard"], return_state=True)
    assert state.is_completed(), state
    board = pq.read_table(out / "leaderboard.parquet").to_pylist()
    trials = [r for r in board if r["trial_id"] not in ("base", "soup")]
    assert len(trials) == 2 and [r["rank"] for r in trials] == [1, 2]
    base = next(r for r in board if r["trial_id"] == "base")
    for r in [*trials, base]:
        assert 0 <= r["gen/test/parity"] <= 1 and r["gen/test/parity/n"] == 8, r
        assert r["eval/test/rows"] == 0 and "a prompts dataset" in r["eval/test/missing"]
    assert all(0 < r["vs_base/test/gen/parity/p"] <= 1 for r in trials), trials
    assert (out / "best-adapter" / "adapters.safetensors").exists()
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    for r in trials:  # GRPO's metrics reach the trackers as every metric does
        events = EventAccumulator(str(out / "sweep" / "tb" / r["trial_id"]))
        events.Reload()
        assert {"reward", "frac_reward_zero_std", "val/reward"} <= set(
            events.Tags()["scalars"]), events.Tags()["scalars"]


@pytest.mark.unit
def test_a_warm_start_stage_never_replaces_the_specs_own(tiny_model, tmp_path) -> None:
    """``pomona pipeline --warm-start N`` sets every trial's warm_start and reference: a
    spec that gives either is refused in one line (never replaced), as are negative steps."""
    from tests.test_grpo_train import pomona

    raw = prompt_rows(tmp_path, 20)
    spec = spec_file(tmp_path)
    own = tmp_path / "own.yaml"
    own.write_text(spec.read_text().replace("val_every: 0}", "val_every: 0, reference: base}"))
    for path, steps, message in (
            (own, "5", "--warm-start 5 with the spec's reference: the warm-start stage sets "
                       "both warm_start and reference; drop one of them"),
            (spec, "-1", "--warm-start -1: expected steps of SFT >= 0"),
            (spec, "5", "--warm-start 5: its SFT trains on pairs' chosen responses, and "
                        f"{raw} holds prompts alone")):
        code, lines = pomona("pipeline", str(raw), str(tiny_model), str(path), "--out",
                             str(tmp_path / "out"), "--warm-start", steps)
        assert code == 2 and len(lines) == 1 and message in lines[0], lines
    assert not (tmp_path / "out").exists()
