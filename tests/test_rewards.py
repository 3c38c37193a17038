"""Issue 68, rewards (tasks/eval/rewards.py): ``reward:`` as Pomona's own scorers with TRL's
``reward_weights``, each completion's reward their weighted sum, each scorer's mean
reported (``rewards/<label>/mean``), a scorer's failure one line naming it and the row."""

from __future__ import annotations

import sys

import pytest

from tasks.eval.rewards import Reward
from tasks.eval.scorers import ScorerError

pytestmark = pytest.mark.unit
ROWS = [{"id": f"parity-{i}", "prompt": "Even or odd? 1 2", "chosen": "even",
         "rejected": "odd"} for i in range(4)]
COMPLETIONS = [" even", "odd", " even, it is", "even"]


def test_a_reward_is_the_weighted_sum_of_its_scorers() -> None:
    """Would catch: a weight left out or applied to the wrong scorer, a mean over the
    wrong rows, the order of the completions lost."""
    reward = Reward.parse({"task:parity": 1.0, "exact": 0.5})
    values, means = reward.function(10)([r["prompt"] for r in ROWS], COMPLETIONS, ROWS)
    parity = [1.0, 0.0, 0.0, 1.0]  # the verifier: the word alone, any case
    exact = [1.0, 0.0, 0.0, 1.0]
    assert values == [p + 0.5 * e for p, e in zip(parity, exact, strict=True)]
    assert means == {"rewards/parity/mean": 0.5, "rewards/exact/mean": 0.5}
    one = Reward.parse("contains")
    assert one.weights == (1.0,) and one.function(10)(
        ["p"] * 4, COMPLETIONS, ROWS)[0] == [1.0, 0.0, 1.0, 1.0]
    assert Reward.parse(["task:parity", "contains"]).weights == (1.0, 1.0)


def test_a_bad_reward_is_one_line_naming_it(tmp_path, monkeypatch) -> None:
    for value, named in ((None, "reward: expected a scorer"), ([], "reward: expected"),
                         (["exact", "exact"], "each once"),
                         ({"exact": float("nan")}, "exact: weight nan"),
                         ({"exact": 0}, "every weight is 0"),
                         ("nope", "scorer 'nope': expected exact"),
                         ({"exact": 1, "a=exact": 1, "b=exact": True}, "weight True")):
        with pytest.raises(ScorerError, match=named):
            Reward.parse(value)
    (tmp_path / "lab_reward68.py").write_text(
        "def boom(prompt, completion, row):\n    raise RuntimeError('no answer field')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("lab_reward68", None)
    fails = Reward.parse("python:lab_reward68:boom").function(10)
    with pytest.raises(ScorerError, match=r"scorer python:lab_reward68:boom: row parity-0: "
                                          r".*no answer field"):
        fails(["p"] * 4, COMPLETIONS, ROWS)
