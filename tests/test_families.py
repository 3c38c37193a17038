"""Each family as a user meets it: `pomona model init --arch A`, `pomona train --verify`,
then mlx-lm loading the adapter and generating. Same seed, same bytes."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

import mlx.core as mx
import mlx_lm
import pytest
from typer.testing import CliRunner

from cli.main import app
from engine.data.pairs import write_pairs_jsonl
from tests.family_specs import MOE, SPECS, family_pairs

pytestmark = pytest.mark.integration
runner = CliRunner()
ARCHS = {**SPECS, **MOE}


def init_args(name: str, out: Path) -> list[str]:
    """The spec as `pomona model init` options: every field, so a field the command line
    does not offer fails here."""
    args = ["model", "init", "--out", str(out)]
    for key, value in asdict(ARCHS[name]).items():
        flag = f"--{key.replace('_', '-')}"
        if isinstance(value, bool):
            args.append(flag if value else f"--no-{flag[2:]}")
        elif value is not None:
            args += [flag, str(value)]
    return args


@pytest.mark.parametrize("name", sorted(ARCHS))
def test_init_train_verify_load_generate(name: str, tmp_path: Path) -> None:
    """`--verify` compares the configured path (segments of 2, bounded head, prefix
    sharing on) with the plain one on the first batch; the adapter loads in mlx-lm."""
    model = tmp_path / "model"
    result = runner.invoke(app, init_args(name, model))
    assert result.exit_code == 0, result.output
    again = runner.invoke(app, init_args(name, tmp_path / "again"))
    assert again.exit_code == 0
    for f in model.iterdir():  # same seed, same bytes
        assert f.read_bytes() == (tmp_path / "again" / f.name).read_bytes(), f.name
    data = write_pairs_jsonl(family_pairs(6, 3), tmp_path / "pairs.jsonl", split="train")
    out = tmp_path / "run"
    result = runner.invoke(app, ["train", "--model", str(model), "--data", str(data), "--out",
                                 str(out), "--steps", "2", "--batch-size", "2",
                                 "--segment-size", "2", "--head-chunk", "16", "--prefix-share",
                                 "on", "--val-every", "0", "--learning-rate", "1e-3",
                                 "--verify"])
    assert result.exit_code == 0, result.output
    loaded, tok = mlx_lm.load(str(model), adapter_path=str(out))
    base, _ = mlx_lm.load(str(model))
    prompt = mx.array([tok.encode("hello")])
    moved = float(mx.abs(loaded(prompt) - base(prompt)).max())
    assert moved > 0, "mlx-lm loaded the adapter, but it changes nothing"  # it was applied
    assert isinstance(mlx_lm.generate(loaded, tok, prompt=tok.encode("hello"), max_tokens=3),
                      str)
