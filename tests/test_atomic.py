"""engine/host/atomic.py: a file appears whole or not at all, under a temporary that never takes
a file already there, and a failed write is an OSError naming the target."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.host.atomic import atomic_write_text, temp_beside, write_atomic, written

pytestmark = pytest.mark.unit


def test_a_write_replaces_the_file_and_leaves_no_temporary(tmp_path: Path) -> None:
    target = tmp_path / "sub" / "table.txt"  # the parent is made
    atomic_write_text(target, "one\n")
    atomic_write_text(target, "two\n")
    assert target.read_text() == "two\n"
    assert sorted(p.name for p in target.parent.iterdir()) == ["table.txt"]


def test_a_failed_write_keeps_the_old_file_and_names_the_target(tmp_path: Path) -> None:
    target = tmp_path / "results.parquet"
    target.write_text("before")

    def half(tmp: Path) -> None:
        tmp.write_text("half of it")
        raise RuntimeError("[write] Unable to write 8 bytes")  # as MLX reports a full disk

    with pytest.raises(OSError, match=f"cannot write {target}"):
        write_atomic(target, half)
    assert target.read_text() == "before"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["results.parquet"]


def test_the_temporary_never_takes_a_users_file(tmp_path: Path) -> None:
    target = tmp_path / "curves.png"
    names = {temp_beside(target, ".png").name for _ in range(50)}
    assert len(names) == 50 and all(n.startswith(".curves.png.") and n.endswith(".png")
                                    for n in names)
    mine = tmp_path / ".curves.png.tmp"
    mine.write_text("a user's")
    with written(target) as tmp:
        assert tmp != mine and tmp.exists() and tmp.read_text() == ""  # made new, empty
        tmp.write_text("png")
    assert mine.read_text() == "a user's" and target.read_text() == "png"


def test_a_full_disk_is_said_as_such_and_nothing_is_left(tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 67, low: an export to a full disk said ``[Errno None] … 16384 requested and
    11976 written`` (numpy's ``tofile`` sets no errno). Would catch: the errno-less error
    passed on as it is, or ENOSPC without the disk named full."""
    import errno
    import shutil
    from collections import namedtuple

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda _: usage(100, 100, 0))
    out = tmp_path / "model.gguf"
    for err in (OSError("16384 requested and 11976 written"),
                OSError(errno.ENOSPC, "No space left on device")):
        def write(tmp: Path, err: OSError = err) -> None:
            tmp.write_bytes(b"half")
            raise err

        with pytest.raises(OSError, match=f"cannot write {out}: no space left on its disk"):
            write_atomic(out, write)
        assert sorted(p.name for p in tmp_path.iterdir()) == []
