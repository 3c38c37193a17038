"""`pomona bench train --row`: what a row sets, and each row's ratio against the first."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.unit


def test_train_rows_take_a_specs_values_and_repeated_rows_their_own_ratios() -> None:
    """``--row levers,shared_lora_inputs=false`` reads the value as a spec does (a bare
    string never was a bool), and a row named twice is set against the first row by itself,
    not by its name (both copies showed the last one's ratio)."""
    import argparse

    from benchmarks.trainer_rows import against_first, row_fields

    a = argparse.Namespace(mlp_chunk=0, memory_limit_gb=0.0)
    assert row_fields("levers,shared_lora_inputs=false,lora_rank=16", a) == {
        "mlp_chunk": 0, "memory_limit_gb": 0.0, "shared_lora_inputs": False, "lora_rank": 16}
    rows = [{"name": "x", "step_s": 2.0, "peak_gb": 1.0}, {"name": "y", "step_s": 1.0,
            "peak_gb": 1.0}, {"name": "x", "step_s": 3.0, "peak_gb": 2.0}]
    assert [against_first(r, rows)["step"] for r in rows] == [1.0, 0.5, 1.5]


def test_trl_liger_is_a_peer_row_beside_plain_trl_and_needs_trl() -> None:
    """``--trl --liger`` runs TRL with ``use_liger_kernel`` beside plain TRL (with and
    without checkpointing), each its own process; ``--liger`` alone is refused."""
    from benchmarks.train_bench import check_args, parser, trl_commands

    both = parser().parse_args(["--trl", "--liger", "--seq", "1024", "--pairs", "8"])
    rows = dict(trl_commands(both))
    assert list(rows) == ["trl", "trl_gc", "trl_liger"]
    assert "--liger" in rows["trl_liger"] and "--liger" not in rows["trl"]
    assert "--gradient-checkpointing" in rows["trl_gc"]
    assert rows["trl_liger"][rows["trl_liger"].index("--batch") + 1] == "8"
    assert list(dict(trl_commands(parser().parse_args(["--trl"])))) == ["trl", "trl_gc"]
    with pytest.raises(ValueError, match="--liger: only with --trl"):
        check_args(parser().parse_args(["--liger"]))


def test_torch_attention_peer_runs_where_mlx_and_torch_are_absent() -> None:
    """``benchmarks/torch_attention.py`` (torch's causal attention at ``bench attention``'s
    shapes) imports torch only to run a shape: its help comes up anywhere."""
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).parents[1] / "benchmarks" / "torch_attention.py"
    proc = subprocess.run([sys.executable, str(script), "--help"], capture_output=True,
                          text=True, check=True)
    assert "--shapes" in proc.stdout and "GQA" in proc.stdout
