"""Files that cross nodes by content: a sweep's inputs sent to each node once, its results
pulled back to the driver (docs/design.md: a lab usually has no shared disk; never assume one).

    bundle = Bundle.of("/lab/model")          # the driver: each file's SHA-256, one digest
    server = file_server([bundle, ...])       # a Ray actor on the driver's node serving them
    local = fetch(bundle, server)             # a node: the path itself, or its cached copy
    pull(outputs, trial_actor.read, out_dir)  # the driver: a trial's files, checked, in place

A node uses ``bundle.path`` as it is when it holds the same bytes there (a shared folder, or
the driver's own node); otherwise the bytes come from the driver's ``FileServer`` in chunks
of ``CHUNK`` (Ray's object store is capped at 2 GiB on macOS) into
``cache_root()/inputs/<digest>/``, once per digest per node (a file lock), each file checked
against its SHA-256 and the folder renamed into place whole; a cached copy is read whole
again the first time each process uses it (``copy_holds``), and made again when its bytes
changed. A file that no longer has the
bytes the sweep planned with is refused (``InputChanged``), naming it: a trial never trains
on a stale or replaced copy. Dotfiles (locks, marks) are not content. Ray is imported only
where an actor is made.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.host.cache import cache_root
from engine.host.digests import file_digest, sha256_file

CHUNK = 16 << 20  # bytes a read returns: bounded, well under macOS's 2 GiB object store
Reader = Callable[[str, int, int], bytes]  # (relative path, offset, length) -> bytes


class InputChanged(RuntimeError):
    """A file's bytes differ from the digest a trial was planned with."""


@dataclass(frozen=True)
class Bundle:
    """A file or a folder by content: its path where it was listed, its files (relative
    path, size, SHA-256), and the digest of that list."""

    path: str
    files: tuple[tuple[str, int, str], ...]
    digest: str
    folder: bool

    @classmethod
    def of(cls, path: str | Path, skip: Iterable[str] = ()) -> Bundle:
        """``path`` listed and hashed (each file's hash cached by its stat: engine/host/digests);
        top-level names in ``skip`` left out. FileNotFoundError naming it if absent."""
        root = Path(path)
        if root.is_file():
            files = ((root.name, root.stat().st_size, file_digest(root)),)
        elif root.is_dir():
            skipped = set(skip)
            files = tuple((rel, (root / rel).stat().st_size, file_digest(root / rel))
                          for rel in _listing(root) if rel.split("/")[0] not in skipped)
        else:
            raise FileNotFoundError(f"{path}: not found")
        body = json.dumps([root.is_dir(), files]).encode()
        return cls(str(path), files, hashlib.sha256(body).hexdigest(), root.is_dir())

    def to_dict(self) -> dict[str, Any]:
        return {"path": self.path, "files": [list(f) for f in self.files],
                "digest": self.digest, "folder": self.folder}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Bundle:
        return cls(data["path"], tuple((r, int(s), h) for r, s, h in data["files"]),
                   data["digest"], bool(data["folder"]))

    def file(self, rel: str) -> Path:
        """Where file ``rel`` of the bundle lies at ``path``."""
        return Path(self.path) if not self.folder else Path(self.path) / rel


def _listing(root: Path) -> list[str]:
    """Every regular file under ``root`` (relative, sorted), dotfiles and their folders
    aside, and Python's ``__pycache__`` (remade from the sources wherever they are read)."""
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith(".")
                             and d != "__pycache__")
        rel = Path(dirpath).relative_to(root)
        out += [(rel / f).as_posix() for f in filenames if not f.startswith(".")]
    return sorted(out)


def holds(bundle: Bundle) -> bool:
    """Whether this node sees ``bundle``'s bytes at its path (a shared folder)."""
    try:
        return Bundle.of(bundle.path).digest == bundle.digest
    except OSError:
        return False


class FileServer:
    """A Ray actor on the driver's node: chunks of the bundles it was given."""

    def __init__(self, bundles: list[dict[str, Any]]):
        self.bundles = {b["digest"]: Bundle.from_dict(b) for b in bundles}

    def read(self, digest: str, rel: str, offset: int, length: int) -> bytes:
        with self.bundles[digest].file(rel).open("rb") as f:
            f.seek(offset)
            return f.read(min(length, CHUNK))


def file_server(bundles: list[Bundle]) -> Any:
    """A ``FileServer`` actor pinned to this (the driver's) node, serving ``bundles``."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
    cls = ray.remote(num_cpus=0, max_concurrency=8)(FileServer)
    return cls.options(scheduling_strategy=here).remote([b.to_dict() for b in bundles])


def server_reader(server: Any, digest: str) -> Reader:
    import ray

    return lambda rel, offset, length: ray.get(server.read.remote(digest, rel, offset, length))


@contextlib.contextmanager
def _locked(path: Path):
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield


def fetch(bundle: Bundle, read: Reader) -> str:
    """A local path holding ``bundle``'s bytes: its own path when this node sees them
    there, else this node's cached copy, downloaded once through ``read``."""
    if holds(bundle):
        return bundle.path
    # One folder per digest, a copy per name in it: the same bytes under two names (a
    # dataset tokenized again elsewhere) are two copies, and neither removes the other.
    root = cache_root() / "inputs" / bundle.digest
    target = root / Path(bundle.path).name
    with _locked(root.with_name(f".{bundle.digest}.lock")):
        if target.exists() and copy_holds(target, bundle):
            return str(target)
        if target.exists():  # a copy that no longer checks out: Pomona's own, made again
            shutil.rmtree(target) if target.is_dir() else target.unlink()
        root.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=root))
        try:
            for rel, size, sha in bundle.files:
                dest = tmp / target.name / rel if bundle.folder else tmp / target.name
                copy_checked(read, rel, size, sha, dest, bundle.file(rel))
            (tmp / target.name).rename(target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
            with contextlib.suppress(OSError):
                root.rmdir()  # only when empty: a fetch that failed leaves nothing
    return str(target)


_read_here: set[tuple[str, str]] = set()  # (copy, digest) whose bytes this process read


def copy_holds(copy: Path, bundle: Bundle) -> bool:
    """Whether the cached ``copy`` still holds ``bundle``'s bytes: read whole the first
    time a process uses it (an edit that kept size, mtime and inode would pass the hash
    cache's stat check on a file system with a coarse ctime), from the hash cache after."""
    key = (str(copy), bundle.digest)
    if key in _read_here:
        return Bundle.of(str(copy)).digest == bundle.digest
    try:
        files = [(rel, (copy / rel if bundle.folder else copy).stat().st_size,
                  sha256_file(copy / rel if bundle.folder else copy))
                 for rel, _, _ in bundle.files]
    except OSError:
        return False
    same = tuple(files) == bundle.files and (
        not bundle.folder or len(_listing(copy)) == len(bundle.files))
    if same:
        _read_here.add(key)
    return same


def copy_checked(read: Reader, rel: str, size: int, sha: str, dest: Path, shown: Path
                 ) -> None:
    """File ``rel`` read in chunks into ``dest``; InputChanged naming ``shown`` when its
    bytes are not the ones planned (replaced since, or cut short)."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    h, got = hashlib.sha256(), 0
    with dest.open("wb") as f:
        while got < size:
            block = read(rel, got, CHUNK)
            if not block:
                break
            f.write(block)
            h.update(block)
            got += len(block)
    if got != size or h.hexdigest() != sha:
        raise InputChanged(f"{shown}: not the bytes this run was planned with (sha256 "
                           f"{sha[:12]}…, {size} B; now {got} B read, {h.hexdigest()[:12]}…): "
                           "it changed since the run started; run it again")


def pull(bundle: Bundle, read: Reader, dest: Path) -> list[Path]:
    """``bundle``'s files (a trial's outputs on its node) into folder ``dest``, each checked
    and then moved over its old copy; files of ``dest`` not in the bundle are left alone."""
    dest.mkdir(parents=True, exist_ok=True)
    written = []
    for rel, size, sha in bundle.files:
        final = dest / rel
        final.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{final.name}.", dir=final.parent)
        os.close(fd)
        try:
            copy_checked(read, rel, size, sha, Path(tmp), bundle.file(rel))
            os.chmod(tmp, 0o644)
            os.replace(tmp, final)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        written.append(final)
    return written


def local_reader(bundle: Bundle) -> Reader:
    """Reads of ``bundle``'s files where they lie (what a trial's process serves)."""

    def read(rel: str, offset: int, length: int) -> bytes:
        with bundle.file(rel).open("rb") as f:
            f.seek(offset)
            return f.read(min(length, CHUNK))

    return read
