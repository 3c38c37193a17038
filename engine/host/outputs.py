"""Where a Pomona command may write: the one rule every verb that writes follows.

1. An output never equals or sits inside an input (``check_apart``).
2. A folder output (a training run, a sweep, a pipeline or the demo) is claimed before any
   work (``claim``): it must be absent, empty (OS litter aside) or carry Pomona's mark,
   the ``.pomona`` file a claim writes; a folder an earlier version wrote, before the mark
   existed, is recognised by what it holds (the caller's ``legacy``). Anything else is
   refused with one line naming the path.
3. The mark is also the folder's lock: one writer at a time (``fcntl.flock``, released
   when the holder exits or dies); a second writer is refused, naming the holder's pid.
4. A claimed folder is proven writable (a file is made and removed) before any work; one
   the claim made is removed again when the work fails before writing anything in it.
5. A file output (scores, synthetic data) replaces only an empty file or one its verb
   recognises as its own (``check_file``); a folder given as a file output is refused.

Datasets (tasks/data/dataset_dir.py) and models (tasks/models/model_factory.py) are replaced
whole and atomically, and carry their own marks (``manifest.json``, ``pomona_model.json``); they use
rule 1 and ``entries`` from here. A dataset's readers and its writer meet at a lock file
beside it (``.<name>.pomona-lock``, never deleted: a lock file removed while held is no
lock): a reader holds it shared (``reading``), a writer exclusively (``replacing``), so a
dataset is never replaced under a run that reads it, nor by two writers at once. A file a
writer swaps into place is first written under a unique hidden name (engine/host/atomic.py), never
over a user's file. Standard library only: every layer imports it.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

MARK = ".pomona"
# Files an OS drops into any folder a user browses: not user data.
OS_LITTER = frozenset({".DS_Store", "Thumbs.db", "desktop.ini"})
HOST = socket.gethostname()

# Claims this process holds: resolved path -> [lock fd, depth]. A flow that claims its
# folder and then calls a stage claiming it again must not lock itself out.
_held: dict[str, list[int]] = {}
_held_lock = threading.Lock()


class RefusedOutput(ValueError):
    """An output Pomona may not write: not its own, an input, busy, or not writable."""


def entries(folder: Path) -> list[str]:
    """The names in ``folder``, OS litter aside, sorted."""
    return sorted(p.name for p in Path(folder).iterdir() if p.name not in OS_LITTER)


def _shown(names: list[str]) -> str:
    return ", ".join(names[:3]) + (" …" if len(names) > 3 else "")


def check_apart(out: str | Path, inputs: Iterable[str | Path | None], *,
                may_hold: bool = False, flag: str = "--out") -> None:
    """Raise RefusedOutput when ``out`` is an input or lies inside an input folder; unless
    ``may_hold``, also when an input lies inside ``out`` (a writer that replaces its
    folder whole would delete it)."""
    target = Path(out).expanduser().resolve()
    for path in inputs:
        if not path:
            continue
        src = Path(path).expanduser().resolve()
        if target == src or (not may_hold and src.exists() and src.is_relative_to(target)):
            raise RefusedOutput(f"{flag} {out}: would replace the input {path}. Choose "
                                f"another {flag}, not an input and holding none")
        if src.is_dir() and target.is_relative_to(src):
            raise RefusedOutput(f"{flag} {out}: inside the input folder {path}, whose files "
                                f"are read as input. Write outside it")


def mark_kind(folder: Path) -> str | None:
    """What ``folder``'s mark says it holds ("run", "sweep", ...): None without a mark,
    "" for a mark cut short (its writer killed while writing it: still Pomona's)."""
    try:
        text = (Path(folder) / MARK).read_text()
    except (FileNotFoundError, NotADirectoryError):
        return None
    except (OSError, UnicodeDecodeError):
        return ""
    try:
        kind = json.loads(text).get("kind")
    except (ValueError, AttributeError):
        return ""
    return kind if isinstance(kind, str) else ""


def _check_ours(out: Path, kinds: tuple[str, ...], legacy: Callable[[Path], bool] | None,
                flag: str) -> None:
    if not out.exists() and not out.is_symlink():
        return
    if not out.is_dir():
        raise RefusedOutput(f"{flag} {out}: exists and is not a folder; refusing to replace "
                            f"it. Choose another {flag}")
    names = entries(out)
    kind = mark_kind(out)
    if not names or (kind is None and legacy is not None and legacy(out)):
        return
    if kind is None:
        raise RefusedOutput(f"{flag} {out}: holds files Pomona did not write "
                            f"({_shown(names)}); refusing to write a {kinds[0]} there. "
                            "Choose a new or empty folder")
    if kind and kind not in kinds:
        raise RefusedOutput(f"{flag} {out}: holds a Pomona {kind}, not a {kinds[0]}; "
                            f"choose another {flag}")


def _holder(out: Path, mark_file: str = MARK, tries: int = 10) -> str:
    """Who holds the lock: its pid (and host). A holder writes its mark just after taking
    the lock (truncated, then written): a reader in between waits a moment for it."""
    for attempt in range(tries):
        try:
            mark = json.loads((out / mark_file).read_text())
            pid, host = mark["pid"], mark.get("host")
            return f"pid {pid}" + (f" on {host}" if host and host != HOST else "")
        except (OSError, ValueError, KeyError, TypeError):
            if attempt + 1 < tries:
                time.sleep(0.02)
    return "pid unknown"


def _lock(out: Path, kinds: tuple[str, ...], flag: str) -> int:
    """Make ``out``, open and lock its mark, write who holds it, prove a file can be made."""
    def unwritable(err: OSError) -> RefusedOutput:
        return RefusedOutput(f"{flag} {out}: cannot write there ({err.strerror or err}); "
                             "choose a folder you can write to")

    try:
        out.mkdir(parents=True, exist_ok=True)
        fd = os.open(out / MARK, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as err:
        raise unwritable(err) from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:  # BlockingIOError: held by another process
        os.close(fd)
        raise RefusedOutput(f"{flag} {out}: another Pomona process ({_holder(out)}) is "
                            f"writing there; wait for it to finish or choose another "
                            f"{flag}") from None
    try:
        mark = {"kind": mark_kind(out) or kinds[0], "pid": os.getpid(), "host": HOST}
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(mark) + "\n").encode(), 0)
        probe, name = tempfile.mkstemp(dir=out, prefix=".pomona-probe-")
        os.close(probe)
        os.unlink(name)
    except OSError as err:
        os.close(fd)
        raise unwritable(err) from None
    return fd


@contextmanager
def claim(out: str | Path, kinds: tuple[str, ...], *,
          legacy: Callable[[Path], bool] | None = None,
          inputs: Iterable[str | Path | None] = (), may_hold: bool = True,
          new_ok: bool = True, flag: str = "--out") -> Iterator[Path]:
    """Hold folder ``out`` as this process's output of one of ``kinds`` (``kinds[0]`` for a
    new folder) while the block runs; RefusedOutput (one line) when it may not be.
    ``legacy(out)`` says whether an unmarked folder is one an earlier version wrote;
    ``new_ok`` False: ``out`` must exist already (a verb that adds to an earlier output).
    A folder the claim made is removed again where the block raises before anything but
    the mark is in it."""
    out = Path(out)
    check_apart(out, inputs, may_hold=may_hold, flag=flag)
    if not new_ok and not out.exists():
        raise RefusedOutput(f"{flag} {out}: no such folder")
    key, fresh = str(out.expanduser().resolve()), False
    with _held_lock:
        if key in _held:
            _held[key][1] += 1
        else:
            _check_ours(out, kinds, legacy, flag)
            fresh = not out.exists() and not out.is_symlink()
            _held[key] = [_lock(out, kinds, flag), 1]
    failed = False
    try:
        yield out
    except BaseException:
        failed = True
        raise
    finally:
        with _held_lock:
            _held[key][1] -= 1
            if _held[key][1] == 0:
                if failed and fresh:  # refused or failed before writing: no folder left
                    _drop_bare_claim(out)
                os.close(_held.pop(key)[0])  # closing the descriptor releases the lock


def _drop_bare_claim(out: Path) -> None:
    """Remove folder ``out``, made by this claim, where it still holds nothing but the
    mark: a run refused after its claim leaves no empty folder behind. Anything else in
    it (a file written meanwhile, by this run or another) keeps the folder as it is."""
    try:
        if entries(out) == [MARK]:
            (out / MARK).unlink()
            out.rmdir()  # refused (and kept) if a file appeared since
    except OSError:
        pass


def check_file(out: str | Path, ours: Callable[[Path], bool], what: str, *,
               inputs: Iterable[str | Path | None] = (), flag: str = "--out") -> None:
    """Raise RefusedOutput unless file ``out`` may be written: not an input nor inside one,
    not a folder, absent, empty or ``ours`` (``what`` names such a file), and its folder
    writable (made if missing)."""
    out = Path(out)
    check_apart(out, inputs, may_hold=True, flag=flag)
    if out.is_dir():
        raise RefusedOutput(f"{flag} {out}: is a folder; {flag} takes the path of {what} "
                            "to write (a file name in it, say)")
    above = next((p for p in out.parents if p.exists() or p.is_symlink()), None)
    if above is not None and not above.is_dir():
        raise RefusedOutput(f"{flag} {out}: {above} is a file, not a folder; choose a path "
                            "in a folder")
    if out.exists() and out.stat().st_size and not ours(out):
        raise RefusedOutput(f"{flag} {out}: exists and is not {what} Pomona wrote; refusing "
                            f"to overwrite it. Choose another {flag}")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        probe, name = tempfile.mkstemp(dir=out.parent, prefix=".pomona-probe-")
        os.close(probe)
        os.unlink(name)
    except OSError as err:
        raise RefusedOutput(f"{flag} {out}: cannot write to {out.parent} "
                            f"({err.strerror or err}); choose a folder you can write to"
                            ) from None


LOCK_KIND = "dataset-lock"


def lock_file(folder: str | Path) -> Path:
    """The lock file of folder ``folder`` (a dataset), beside it: it outlives the folder's
    replacement, which a lock inside the folder would not."""
    folder = Path(folder).expanduser().resolve()
    return folder.with_name(f".{folder.name}.pomona-lock")


def _lock_is_ours(lock: Path) -> bool:
    try:
        text = lock.read_text()
    except OSError:
        return False
    try:
        return not text.strip() or json.loads(text).get("kind") == LOCK_KIND
    except (ValueError, AttributeError):
        return False


@contextmanager
def reading(folder: str | Path) -> Iterator[Path]:
    """Hold folder ``folder`` (a dataset) shared while the block reads it: ``replacing`` it
    is refused meanwhile, and RefusedOutput (one line) when a writer is replacing it now.
    Where no lock file can be made (a read-only share) nothing can replace the folder
    either, and the block runs unlocked."""
    folder = Path(folder)
    lock = lock_file(folder)
    fd = _open_for_reading(lock)
    if fd is None:
        yield folder
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError:
            raise RefusedOutput(f"{folder}: another Pomona process "
                                f"({_holder(lock.parent, lock.name)}) is replacing this "
                                "dataset now; wait for it to finish and run again") from None
        yield folder
    finally:
        os.close(fd)


def _open_for_reading(lock: Path) -> int | None:
    for flags in (os.O_RDWR | os.O_CREAT, os.O_RDONLY):
        try:
            return os.open(lock, flags, 0o644)
        except OSError:
            continue
    return None


@contextmanager
def replacing(folder: str | Path, flag: str = "--out") -> Iterator[Path]:
    """Hold folder ``folder`` (a dataset) exclusively while the block writes or replaces it;
    RefusedOutput (one line, naming the holder) while another process reads it (a training
    run, a sweep: ``reading``) or writes it."""
    folder = Path(folder)
    lock = lock_file(folder)
    if lock.is_symlink() or (lock.exists() and not _lock_is_ours(lock)):
        raise RefusedOutput(f"{flag} {folder}: {lock} is not a lock file Pomona wrote; "
                            "refusing to write over it. Move it away or choose another "
                            f"{flag}")
    try:
        lock.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as err:
        raise RefusedOutput(f"{flag} {folder}: cannot write there ({err.strerror or err}); "
                            "choose a folder you can write to") from None
    try:
        _lock_exclusive(fd, folder, lock, flag)
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps({"kind": LOCK_KIND, "pid": os.getpid(), "host": HOST})
                       + "\n").encode(), 0)
        yield folder
    finally:
        os.close(fd)


def _lock_exclusive(fd: int, folder: Path, lock: Path, flag: str) -> None:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return
    except OSError:
        pass
    try:  # a shared lock granted now: only readers hold it
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        fcntl.flock(fd, fcntl.LOCK_UN)
        who = "a training run or sweep is reading it"
    except OSError:
        who = f"another Pomona process ({_holder(lock.parent, lock.name)}) is writing it"
    raise RefusedOutput(f"{flag} {folder}: {who}; wait for it to finish or choose another "
                        f"{flag}")
