"""The memory probe measures the path training takes (issue 38, item 1): with ``mlp_chunk``
set, its steps run the MLPs chunked as the trainer's do, and the probe's cache key tells
an ``mlp_chunk`` apart (before, the probe ran whole MLPs and one cached peak served both)."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.settings.config import TrainConfig

pytestmark = pytest.mark.integration


def test_the_probe_chunks_the_mlps_as_training_does(tiny_model: Path, tiny_data: Path,
                                                    tmp_path: Path, monkeypatch) -> None:
    from engine.model import recompute
    from engine.train.probe import probe_steps
    from tasks.sweep.memory_probe import probe_key

    chunked = []
    real = recompute.ChunkedMLP.__call__

    def counted(self, x, *args, **kwargs):
        if self.mlp_chunk and x.ndim == 3 and x.shape[-2] > self.mlp_chunk:
            chunked.append(x.shape[-2])
        return real(self, x, *args, **kwargs)

    monkeypatch.setattr(recompute.ChunkedMLP, "__call__", counted)
    cfg = TrainConfig().replace(model=str(tiny_model), data=str(tiny_data),
                                out=str(tmp_path / "p"), batch_size=2, lora_rank=4,
                                mlp_chunk=4)
    [row] = probe_steps(cfg, [{"segment_size": 1}])
    assert "error" not in row and row["peak_gb"] > 0, row
    assert chunked, "the probe ran whole MLPs where training chunks them"
    chunked.clear()
    [plain] = probe_steps(cfg.replace(mlp_chunk=0), [{"segment_size": 1}])
    assert "error" not in plain and not chunked  # and whole ones where training does
    fields = {"model": "m", "batch_size": 2}
    assert probe_key({**fields, "mlp_chunk": 4}, "d") != probe_key(fields, "d")
