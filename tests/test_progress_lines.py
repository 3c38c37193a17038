"""Issue 54, item 5: logs a person reads. A training record is one line holding its step,
loss, accuracy, learning rate, throughput and memory (engine/train/progress.py); an
evaluation one line a split with its intervals (tasks/board/eval_lines.py); no dict reaches
either. The Prefect task run's own log is checked on the real path in
tests/test_sweep_flow.py."""

from __future__ import annotations

import re

import pytest

from engine.train.progress import progress_line
from tasks.board.eval_lines import evaluation_lines

pytestmark = pytest.mark.unit

TRAIN = {"step": 50, "split": "train", "loss": 5.7612, "nll_loss": 5.1, "rewards/chosen": -0.3,
         "rewards/accuracies": 0.58, "logps/accuracies": 0.55, "grad_norm": 1.9,
         "learning_rate": 3.6e-4, "prefix_share_rate": 1.0, "tokens_per_sec": 4912.0,
         "peak_memory_gb": 0.031}
VALID = {"step": 50, "split": "valid", "val/loss": 5.8, "val/logps/accuracies": 0.61,
         "val/rows": 64, "val/rows_skipped": 0}


def test_a_record_is_one_line_with_its_headline_figures() -> None:
    assert progress_line(TRAIN, 100, "t-983b") == \
        "t-983b step 50/100 loss 5.76 acc 0.58 lr 3.6e-4 4.9k tok/s 0.03 GB"
    assert progress_line(VALID, 100, "t-983b") == "t-983b step 50/100 valid loss 5.8 acc 0.61"
    plain = progress_line({**TRAIN, "tokens_per_sec": 812.4, "learning_rate": 0.0}, None)
    assert plain == "step 50 loss 5.76 acc 0.58 lr 0 812 tok/s 0.03 GB"


def test_an_evaluation_is_one_line_a_split() -> None:
    metrics = {"eval/valid/loss": 0.6831, "eval/valid/logps/accuracies": 0.61,
               "eval/valid/logps/accuracies/low": 0.52, "eval/valid/logps/accuracies/high": 0.7,
               "eval/valid/rows": 64, "eval/test/missing": "no test rows",
               "gen/valid/exact": 0.2, "gen/valid/exact/n": 64, "gen/valid/exact/low": 0.12,
               "gen/valid/exact/high": 0.31, "gen/valid/tokens": 2048,
               "gen/valid/tokens_per_sec": 410.2,
               "paired/valid/gen/exact": {"r1": 1.0, "r2": 0.0}}
    lines = evaluation_lines("t-983b", metrics)
    assert lines == ["t-983b valid: loss 0.683, acc 0.61 [.52–.70] n=64; "
                     "exact 0.20 [.12–.31] n=64; 410 tok/s"]
    assert not any(re.search(r"[{}]", line) for line in lines)
