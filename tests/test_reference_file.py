"""The reference log-prob file and its cache (engine/train/reference_file.py,
engine/train/reference.py): a hand-edited file is a one-line error naming the file, column
and row; two pairs under one id are refused; a cached file is read without taking the lock;
a full disk is said before the pass; and ``pomona sweep`` makes the reference before its
trials, as the Prefect flow does. Every test points ``XDG_CACHE_HOME`` at its own folder.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from engine.train import reference as reference_mod
from engine.train import reference_file
from engine.train.reference import ReferenceSpec, cache_dir, compute_reference, ensure_reference
from engine.train.reference_file import read_reference
from tests.pairs import REFERENCE_OPTIONS as OPTIONS
from tests.pairs import write_reference_for

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("private_cache")]


def test_two_pairs_under_one_id_are_refused_by_name(tiny_model: Path, tiny_data: Path,
                                                   tmp_path: Path) -> None:
    """The reference file keys pairs by id: two different pairs under one id (hand-written
    engine JSONL; tokenize refuses them) would train against one pair's reference."""
    lines = tiny_data.read_text().splitlines()
    twin = json.loads(lines[1])
    twin["id"] = json.loads(lines[0])["id"]
    data = tmp_path / "twins.jsonl"
    data.write_text("\n".join([*lines, json.dumps(twin)]) + "\n")
    with pytest.raises(ValueError, match=re.escape(repr(twin["id"])) + ".*two different"):
        compute_reference(ReferenceSpec(str(tiny_model), str(data)))


@pytest.mark.parametrize("chosen,needle", [
    (None, "column ref_chosen_logps is empty (null) in row 1 (pair id 'b')"),
    ("text", "column ref_chosen_logps is string"),
    ("list", "column ref_chosen_logps is list"),
    ("dup", "pair id 'a' appears twice with different values"),
    ("positive", "pair 'b' are positive"),
])
def test_hand_edited_reference_files_are_one_line(tmp_path: Path, chosen, needle) -> None:
    """Issue 36 item 8 and the reference-values low item: old code raised TypeError on a
    null or string value and "unhashable type" on lists, and kept the last of two ids."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    ids, values = ["a", "b"], {None: [-1.0, None], "text": ["-1", "-2"],
                               "list": [[-1.0], [-2.0]], "dup": [-1.0, -2.0],
                               "positive": [-1.0, 50.0]}[chosen]
    if chosen == "dup":
        ids = ["a", "a"]
    table = pa.table({"id": ids, "ref_chosen_logps": values,
                      "ref_rejected_logps": [-3.0, -4.0]})
    path = tmp_path / "refs.parquet"
    pq.write_table(table.replace_schema_metadata({reference_file.KEY_FIELD: b"k"}), path)
    with pytest.raises(ValueError) as err:
        read_reference(path, "k")
    message = str(err.value)
    assert "\n" not in message and str(path) in message and needle in message, message


def test_a_cached_file_is_read_without_a_lock_and_a_full_disk_is_said_first(
        tiny_model: Path, tiny_data: Path, monkeypatch) -> None:
    """Issue 36 (reference cache, low): a cache holding the right file opened `.lock` for
    writing (refused on a read-only cache), and a full disk was said only after the whole
    pass, by an error naming no file."""
    import errno

    spec = ReferenceSpec(str(tiny_model), str(tiny_data))
    target = cache_dir() / f"{spec.key()}.parquet"
    computed = []
    monkeypatch.setattr(reference_mod, "compute_reference",
                        lambda *a, **k: computed.append(1) or {})

    def full(*_a):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(reference_file.os, "posix_fallocate", full)
    with pytest.raises(OSError, match=re.escape(str(target))):
        ensure_reference(spec, options=OPTIONS)
    assert not computed, "the pass ran before the full disk was said"
    write_reference_for(target, spec.key(), tiny_data)
    (target.parent / f"{target.name}.lock").unlink()
    assert ensure_reference(spec, options=OPTIONS) == (target, True)
    assert not (target.parent / f"{target.name}.lock").exists()


def test_pomona_sweep_makes_the_reference_before_its_trials(
        ray_cluster, tiny_model: Path, tiny_data: Path, tmp_path: Path) -> None:
    """Issue 38: `pomona sweep` left DPO's reference to its first trial, the others waiting
    on its lock, where the Prefect flow made it first; both now make it before any trial,
    through one function (tasks/sweep/references.py: reference_on_ray)."""
    from typer.testing import CliRunner

    from cli.main import app
    from tests.pairs import uncached_copy

    data = uncached_copy(tiny_data, tmp_path / "pairs.jsonl")
    spec = tmp_path / "dpo.yaml"
    spec.write_text(f"name: dpo_cli\nmodel: {tiny_model}\ndata: {data}\nmax_concurrent: 2\n"
                    "fixed: {loss: dpo, steps: 1, batch_size: 2, lora_rank: 4, "
                    "val_every: 1, val_batches: 1}\ngrid: {learning_rate: [1.0e-3, 3.0e-4]}\n"
                    "metric: val/logps/accuracies\nmode: max\n")
    result = CliRunner().invoke(app, ["sweep", str(spec), "--out", str(tmp_path / "out"),
                                      "--no-prefect"])
    assert result.exit_code == 0, result.output
    assert "2 trials: 0 cached, 2 to run" in result.output, result.output
    assert "reference log-probs computed" in result.output, result.output
    made = result.output.index("reference log-probs computed")
    assert made < result.output.index("completed"), result.output  # before any trial ended
    path = result.output[made:].split(": ", 1)[1].split()[0]
    key = ReferenceSpec(str(tiny_model), str(data)).key()  # the workers' cache: Ray's env
    assert Path(path).is_file() and Path(path).name == f"{key}.parquet", path


def test_edited_log_probs_are_computed_again_or_refused(tiny_model: Path, tiny_data: Path,
                                                        tmp_path: Path, caplog) -> None:
    """Issue 52, case 3: ref_chosen_logps shifted by -30 with the key kept was trained on
    (DPO's first loss 0.0486, not log 2). The cache's file is computed again, saying so; a
    file the user named is refused in one line."""
    import logging

    import pyarrow as pa
    import pyarrow.parquet as pq

    spec = ReferenceSpec(str(tiny_model), str(tiny_data))
    target, cached = ensure_reference(spec, options=OPTIONS)
    assert not cached
    honest = read_reference(target, spec.key())
    table = pq.read_table(target)
    shifted = pa.compute.subtract(table.column("ref_chosen_logps"), 30.0)
    edited = table.set_column(1, "ref_chosen_logps", shifted)  # the metadata kept
    pq.write_table(edited.replace_schema_metadata(table.schema.metadata), target)
    mine = tmp_path / "mine.parquet"
    pq.write_table(edited.replace_schema_metadata(table.schema.metadata), mine)
    with pytest.raises(ValueError, match=re.escape(f"{mine}: its log-probs are not the ones "
                                                   "written with its key")):
        read_reference(mine, spec.key())
    with caplog.at_level(logging.WARNING, logger=reference_mod.__name__):
        assert ensure_reference(spec, options=OPTIONS) == (target, False)
    assert "are not the ones written with its key" in caplog.text
    assert "computing it again" in caplog.text
    assert read_reference(target, spec.key()) == honest
