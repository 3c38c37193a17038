"""File digests: one SHA-256 per file, cached by stat, the cache file written once per batch."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit


def test_a_batch_of_new_files_writes_the_hash_cache_once(tmp_path: Path, monkeypatch) -> None:
    """Tokenizing a folder of many files hashed each through the cache, which rewrote the
    whole cache file per file (N² bytes). Would catch: a write per file again, or a batch
    that never writes (every later run hashes all again)."""
    import engine.host.digests as digests

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(digests, "_memory", {})
    writes = []
    real_write = digests._write_cache
    monkeypatch.setattr(digests, "_write_cache", lambda e: (writes.append(len(e)),
                                                            real_write(e)))
    files = []
    for i in range(5):
        (tmp_path / f"f{i}.jsonl").write_text(f"row {i}\n")
        files.append(tmp_path / f"f{i}.jsonl")
    got = digests.file_digests(files)
    assert got == [hashlib.sha256(f.read_bytes()).hexdigest() for f in files]
    assert writes == [5]  # one write, holding all five
    assert digests.file_digests(files) == got and writes == [5]  # all cached: no write
    assert (tmp_path / "cache" / "pomona" / "file-hashes.json").exists()
    (tmp_path / "one.txt").write_text("x")
    digests.file_digest(tmp_path / "one.txt")  # alone: written at once
    assert writes == [5, 6]


def test_a_failed_cache_write_leaves_no_temporary(tmp_path: Path, monkeypatch) -> None:
    """Issue 36 (reference cache, low): a write that failed (a full disk; here the cache
    path is a folder, so the rename fails) left `.file-hashes.json.*.tmp` behind."""
    import engine.host.digests as digests

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    digests.hash_cache_path().mkdir(parents=True)  # os.replace onto a folder fails
    digests._write_cache({"x": {"sha256": "0"}})
    assert not list(digests.hash_cache_path().parent.glob(".file-hashes.json.*.tmp"))
