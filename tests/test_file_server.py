"""The driver's FileServer (tasks/node_files.py) on a real Ray: one actor per driver and
session serves every sweep, evaluation and reference that lists inputs (each actor is a
worker process to start), and a lost one is replaced."""

from __future__ import annotations

from pathlib import Path

import pytest

from tasks.node_files import Bundle, fetch, server_reader
from tasks.trial_inputs import SweepFiles

pytestmark = pytest.mark.integration


def test_every_listing_shares_one_server_and_a_lost_one_is_replaced(
        ray_cluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import ray

    monkeypatch.setenv("POMONA_CACHE", str(tmp_path / "cache"))
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "w.bin").write_bytes(b"w" * 5000)
    (tmp_path / "data.jsonl").write_text('{"x": 1}\n')
    sweep, evaluation = SweepFiles(), SweepFiles()  # as a sweep and a later evaluation list
    first = sweep.for_paths({"model": str(tmp_path / "model")})
    second = evaluation.for_paths({"data": str(tmp_path / "data.jsonl")})
    assert first["server"] == second["server"]  # one actor, told of both
    for inputs in (first, second):
        [data] = inputs["bundles"].values()
        # As a node without the bytes at that path reads them: from the server, by digest.
        bundle = Bundle.from_dict({**data, "path": str(tmp_path / "elsewhere" /
                                                       Path(data["path"]).name)})
        copy = Path(fetch(bundle, server_reader(inputs["server"], bundle.digest)))
        assert copy.is_relative_to(tmp_path / "cache")
        assert Bundle.of(copy).digest == bundle.digest
    ray.kill(first["server"])
    third = SweepFiles().for_paths({"model": str(tmp_path / "model")})
    assert third["server"] != first["server"]
    [data] = third["bundles"].values()
    assert ray.get(third["server"].read.remote(data["digest"], "w.bin", 0, 10)) == b"w" * 10
