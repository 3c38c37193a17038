"""The one model resolver (engine/model/source.py): each of its rules (a directory, a .gguf
file, a repo id, a mistyped path that looks local) through ``source_kind``, the verbs that
read a model agreeing with it, the one ``config.json`` reader, and cache keys pinned so a
change to the resolver or the hashing cannot silently invalidate every cached trial and
dataset."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from engine.data.data_fit import tokenizer_problem
from engine.model.content_key import model_fingerprint
from engine.model.source import local_model, model_dir, read_config, source_kind

pytestmark = pytest.mark.unit

MISTYPED = ("./nope", "nope/model/dir", "nope.gguf", "~/no-such-pomona-model")


def test_each_rule_through_source_kind(tmp_path: Path, monkeypatch) -> None:
    """A directory, a .gguf file and ``org/name`` are the three kinds; a repo id is only
    what no local rule claims (the rule ``count("/") > 1`` once lived in the sweep alone)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "m").mkdir()
    (tmp_path / "w.gguf").write_bytes(b"GGUF")
    assert source_kind("m") == "dir" and source_kind(str(tmp_path / "m")) == "dir"
    assert source_kind("w.gguf") == "gguf"
    assert source_kind("org/name") == "repo" and source_kind("name") == "repo"
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(FileNotFoundError, match=r"^model notes.txt: a file, but not a .gguf"):
        source_kind("notes.txt")


@pytest.mark.parametrize("name", MISTYPED)
def test_a_mistyped_local_path_is_named_by_every_reader(name: str, tmp_path: Path,
                                                        monkeypatch) -> None:
    """A path that looks local but is not there: an error naming it from the resolver and
    from what mlx-lm would load, never a hub lookup; the content key and the tokenizer
    check cannot tell, and say nothing rather than fail with a hub error."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    for read in (source_kind, local_model, model_dir):
        with pytest.raises(FileNotFoundError, match=rf"^model not found: {name} \(no such"):
            read(name)
    assert model_fingerprint(name) == f"repo:{name}"
    data = tmp_path / "data"
    data.mkdir()
    (data / "manifest.json").write_text(json.dumps({"tokenizer_hash": "abc"}))
    assert tokenizer_problem(data, name) is None


def test_a_repo_id_reads_its_local_snapshot(tiny_model: Path, tmp_path: Path,
                                            monkeypatch) -> None:
    """A repo id already downloaded is the snapshot mlx-lm loads, keyed on its bytes like
    the same files in a directory; one not downloaded is an error naming it and the
    working directory, and its key is its name."""
    import huggingface_hub.constants

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    commit = "a" * 40
    repo = tmp_path / "hub" / "models--org--tiny"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    for f in tiny_model.iterdir():
        (snapshot / f.name).write_bytes(f.read_bytes())
    assert model_dir("org/tiny") == snapshot
    assert model_fingerprint("org/tiny") == model_fingerprint(str(tiny_model))
    with pytest.raises(FileNotFoundError, match=rf"^model 'org/typo': no such directory here "
                                                rf"\({tmp_path}\), and as a Hugging Face"):
        model_dir("org/typo")
    assert model_fingerprint("org/typo") == "repo:org/typo"
    from tasks.data.tokenize import tokenize_dataset

    (tmp_path / "raw.jsonl").write_text('{"prompt": "p", "chosen": "a", "rejected": "b"}\n')
    with pytest.raises(FileNotFoundError, match=r"^--model 'org/typo': no such directory"):
        tokenize_dataset(tmp_path / "raw.jsonl", "org/typo", tmp_path / "out")  # the option


def test_a_gguf_file_is_read_through_its_import(tmp_path: Path, monkeypatch) -> None:
    """A .gguf is keyed on its own bytes without importing it, and read from its cached
    import (engine/model/source.py: ``imported_gguf``) by every reader."""
    import hashlib

    import engine.model.source as model_source

    gguf = tmp_path / "w.gguf"
    gguf.write_bytes(b"GGUF-bytes")
    imported = tmp_path / "imported"
    monkeypatch.setattr(model_source, "imported_gguf", lambda path: imported)
    assert model_dir(str(gguf)) == imported and local_model(str(gguf)) == str(imported)
    digest = hashlib.sha256(b"GGUF-bytes").hexdigest()
    assert model_fingerprint(str(gguf)).startswith(f"gguf-{digest[:24]}-bfloat16-v")


def test_read_config_names_the_file(tiny_model: Path, tmp_path: Path) -> None:
    """The one reader of ``config.json``: the dict, or one line naming the file."""
    assert read_config(tiny_model)["model_type"] == "llama"
    with pytest.raises(FileNotFoundError, match=rf"^{tmp_path}/config.json: no such file"):
        read_config(tmp_path)
    for text, error in (("{oops", "not valid JSON"), ("[1, 2]", "a JSON list, not")):
        (tmp_path / "config.json").write_text(text)
        with pytest.raises(ValueError, match=rf"^{tmp_path}/config.json: {error}") as err:
            read_config(tmp_path)
        assert "\n" not in str(err.value)


def test_cache_keys_are_pinned(tiny_model: Path, tmp_path: Path, monkeypatch) -> None:
    """The keys of the tests' tiny model and a fixed preference file, computed before the
    resolver and the hashing were made one (issue 26): a change to either that moved them
    would re-run every cached trial and re-tokenize every dataset."""
    from tasks.data.tokenize import tokenize_dataset
    from tasks.sweep.sweep_plan import data_fingerprint

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    raw = tmp_path / "raw.jsonl"
    raw.write_text("".join(json.dumps({"prompt": f"p{i}", "chosen": f"a{i}",
                                       "rejected": f"b{i}"}) + "\n" for i in range(40)))
    report = tokenize_dataset(raw, str(tiny_model), tmp_path / "data")
    assert model_fingerprint(str(tiny_model)) == "model-486861c0c251843f7bda347a"
    # moved once on purpose (data code 3, issue 67): splits drawn by prompt re-tokenize
    assert report.fingerprint == ("567700577d1a58ecea20e5f161918e2a"
                                  "745be7de2ab627eaf6a137a7433f1f93")
    assert data_fingerprint(str(tmp_path / "data")) == (
        "4d21fb92851aae143bc7cbde7df2bd886e668b1872fec006ce9b518006a47e1f")
    raw_sha = "a1d491af98b2e03955bc9a6a1775de197f6535c356908ccc1b77bd4c3ee6485c"
    manifest = json.loads((tmp_path / "data" / "manifest.json").read_text())
    assert data_fingerprint(str(raw)) == raw_sha == manifest["sources"][0]["sha256"]


def test_segment_size_auto_probes_the_layers_a_model_states(tmp_path: Path, monkeypatch) -> None:
    """``segment_size: auto`` probes powers of two below the real layer count: a GGUF's
    header, a multimodal config's text_config (Gemma 4 E4B: 42 layers, so 32 is a
    candidate); 32 only where nothing says (it was assumed for every GGUF and repo id)."""
    import gguf

    from tasks.sweep.memory_probe import candidate_sizes

    writer = gguf.GGUFWriter(str(tmp_path / "m.gguf"), "llama")
    writer.add_block_count(12)
    writer.add_tensor("blk.0.attn_q.weight", np.zeros((4, 32), np.float32))
    for step in (writer.write_header_to_file, writer.write_kv_data_to_file,
                 writer.write_tensors_to_file, writer.close):
        step()
    assert candidate_sizes(str(tmp_path / "m.gguf")) == [0, 1, 2, 4, 8]
    mm = tmp_path / "mm"
    mm.mkdir()
    (mm / "config.json").write_text('{"model_type": "gemma4", '
                                    '"text_config": {"num_hidden_layers": 42}}')
    assert candidate_sizes(str(mm)) == [0, 1, 2, 4, 8, 16, 32]
    from tests.test_gguf_import import write_gguf

    bare = write_gguf(tmp_path / "bare.gguf", "llama")  # no block_count
    cut = tmp_path / "cut.gguf"  # a truncated header
    cut.write_bytes((tmp_path / "m.gguf").read_bytes()[:40])
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    for unknown in (str(bare), str(cut), "nobody/not-downloaded-here"):
        assert candidate_sizes(unknown) == [0, 1, 2, 4, 8, 16]
