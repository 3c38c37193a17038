"""Files across nodes by content (tasks/nodes/node_files.py), without Ray: a node that holds the
same bytes uses them in place; one that does not gets a checked copy in its cache once;
bytes changed since planning are refused, naming the file; a pull keeps other files."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tasks.nodes.node_files import Bundle, InputChanged, fetch, holds, local_reader, pull


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("POMONA_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _folder(root: Path) -> Path:
    (root / "sub").mkdir(parents=True)
    (root / "a.bin").write_bytes(b"a" * 1000)
    (root / "sub" / "b.txt").write_text("bee")
    (root / ".lock").write_text("not content")
    return root


def test_a_folder_is_used_in_place_where_its_bytes_are(tmp_path: Path, cache: Path) -> None:
    bundle = Bundle.of(_folder(tmp_path / "model"))
    assert [f[0] for f in bundle.files] == ["a.bin", "sub/b.txt"]  # dotfiles are no content
    assert holds(bundle)
    assert fetch(bundle, local_reader(bundle)) == bundle.path
    assert not (cache / "inputs").exists()  # nothing copied (the hash cache lies beside)


def test_a_node_without_the_bytes_gets_a_checked_copy_once(tmp_path: Path,
                                                           cache: Path) -> None:
    source = Bundle.of(_folder(tmp_path / "driver" / "model"))
    elsewhere = Bundle(str(tmp_path / "node" / "model"), source.files, source.digest, True)
    calls: list[str] = []
    reader = local_reader(source)

    def counting(rel: str, offset: int, n: int) -> bytes:
        calls.append(rel)
        return reader(rel, offset, n)

    got = Path(fetch(elsewhere, counting))
    assert got.is_relative_to(cache / "inputs" / source.digest) and got.name == "model"
    assert (got / "sub" / "b.txt").read_text() == "bee"
    assert Bundle.of(got).digest == source.digest
    before = len(calls)
    assert Path(fetch(elsewhere, counting)) == got and len(calls) == before  # cached


def test_bytes_changed_since_planning_are_refused_naming_the_file(tmp_path: Path,
                                                                  cache: Path) -> None:
    """The dataset replaced on the driver after the trial was planned: the node's copy
    would be other rows; the fetch fails naming the file, and no copy is left cached."""
    planned = Bundle.of(_folder(tmp_path / "data"))
    (tmp_path / "data" / "a.bin").write_bytes(b"b" * 1000)  # replaced, same size
    elsewhere = Bundle(str(tmp_path / "other" / "data"), planned.files, planned.digest, True)
    assert not holds(planned)
    with pytest.raises(InputChanged, match=r"a\.bin: not the bytes this run was planned"):
        fetch(elsewhere, local_reader(planned))
    assert not (cache / "inputs" / planned.digest).exists()


def test_a_pull_replaces_its_files_and_keeps_the_users(tmp_path: Path) -> None:
    outputs = Bundle.of(_folder(tmp_path / "scratch"))
    dest = tmp_path / "sweep" / "t1"
    dest.mkdir(parents=True)
    (dest / "a.bin").write_bytes(b"old")
    (dest / "NOTES.md").write_text("mine")
    pull(outputs, local_reader(outputs), dest)
    assert (dest / "a.bin").read_bytes() == b"a" * 1000
    assert (dest / "sub" / "b.txt").read_text() == "bee"
    assert (dest / "NOTES.md").read_text() == "mine"
    assert sorted(p.name for p in dest.iterdir()) == ["NOTES.md", "a.bin", "sub"]


def test_scratch_of_attempts_whose_process_is_gone_is_removed(cache: Path) -> None:
    """An attempt lost with its process (its node cut off, the driver gone before it
    pulled) leaves a scratch folder: the next trial on that host removes it, and keeps a
    live process's folder and another host's (a home folder shared by two Macs)."""
    import os
    import socket
    import subprocess
    import sys

    from tasks.nodes.trial_inputs import remove_stale_scratch, scratch_dir

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    live = scratch_dir("t-1")
    assert live.parent.name == socket.gethostname() and f"-{os.getpid()}-" in live.name
    dead = live.parent / f"t-1-{gone.pid}-0123abcd"
    other = cache / "scratch" / "another-mac" / f"t-1-{gone.pid}-0123abcd"
    for folder in (live, dead, other):
        (folder / "adapters.safetensors").parent.mkdir(parents=True)
        (folder / "adapters.safetensors").write_bytes(b"x")
    assert remove_stale_scratch() == [dead]
    assert live.is_dir() and other.is_dir() and not dead.exists()


def test_the_same_bytes_under_two_names_are_two_copies(tmp_path: Path, cache: Path) -> None:
    """A dataset tokenized again under another name has the same digest: each name gets
    its copy, and the second fetch neither fails on the first's folder (it did: `…/data:
    not found`) nor removes it under a trial still reading it."""
    first = Bundle.of(_folder(tmp_path / "driver" / "ds"))
    again = Bundle.of(_folder(tmp_path / "driver" / "data"))
    assert first.digest == again.digest
    here = [Bundle(str(tmp_path / "node" / Path(b.path).name), b.files, b.digest, True)
            for b in (first, again)]
    a = Path(fetch(here[0], local_reader(first)))
    b = Path(fetch(here[1], local_reader(again)))
    assert (a.name, b.name) == ("ds", "data") and a.parent == b.parent
    assert Bundle.of(a).digest == Bundle.of(b).digest == first.digest


def _edit_keeping_stat(path: Path, data: bytes) -> None:
    """``path``'s bytes rewritten in place, same size, its mtime put back (as
    ``rsync --inplace -t`` does): only its ctime tells."""
    st = path.stat()
    assert len(data) == st.st_size
    with path.open("r+b") as f:
        f.write(data)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert (path.stat().st_mtime_ns, path.stat().st_ino) == (st.st_mtime_ns, st.st_ino)


def test_bytes_edited_with_their_mtime_restored_are_hashed_again(tmp_path: Path,
                                                                  private_cache: Path) -> None:
    """Issue 52, case 4: digests were cached by (size, mtime, inode), so a model edited in
    place with its mtime restored kept its old digest (the next sweep: "2 cached, 0 to
    run")."""
    from engine.host.digests import file_digest, sha256_file

    weights = tmp_path / "model.safetensors"
    weights.write_bytes(b"a" * 4096)
    before = file_digest(weights)
    _edit_keeping_stat(weights, b"b" * 4096)
    assert file_digest(weights) == sha256_file(weights) != before


def test_a_cached_copy_tampered_with_is_made_again(tmp_path: Path, cache: Path,
                                                   private_cache: Path) -> None:
    """Issue 52, case 4: a copy under $POMONA_CACHE/inputs/<digest>/ changed with its mtime
    restored was handed to a trial. Each process reads a copy whole before its first use,
    and the hash cache sees the ctime after that."""
    source = Bundle.of(_folder(tmp_path / "driver" / "model"))
    elsewhere = Bundle(str(tmp_path / "node" / "model"), source.files, source.digest, True)
    got = Path(fetch(elsewhere, local_reader(source)))
    for _ in range(2):  # once read whole (this process's first use), once from the cache
        assert Path(fetch(elsewhere, local_reader(source))) == got
        _edit_keeping_stat(got / "a.bin", b"z" * 1000)
        assert Path(fetch(elsewhere, local_reader(source))) == got
        assert (got / "a.bin").read_bytes() == b"a" * 1000, "the tampered copy was used"
