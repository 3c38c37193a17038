"""Data parallel over ``mx.distributed``: one run's global batches split across processes.

Launched by ``mlx.launch`` (ring over TCP, jaccl over Thunderbolt, nccl on CUDA), every rank
runs the same trainer on the same data and seed. Each takes its shard of every global
micro-batch (pairs r, r + W, r + 2W, … of the batch every rank draws alike), so no pair is
trained twice and none is skipped. The step's normalisers (pairs, NLL tokens) are summed
over ranks before the loss and the gradients and metric sums after it: every rank then
applies the update one process would on the union batch (mlx-lm's trainer averages
gradients per rank instead, which weighs a token-mean NLL wrongly when ranks hold
different token counts). Only rank 0 writes files.

    mlx.launch -n 2 --backend ring python -m engine train --config run.yaml
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx

from engine.host.rendezvous import meet, rank_wait_s
from engine.losses import Norms


@dataclass(frozen=True)
class Ranks:
    """This process's place in the run (a single process: rank 0 of 1, no group)."""

    group: Any = None  # mx.distributed.Group
    rank: int = 0
    size: int = 1
    stream: Any = None  # where collectives run (the CPU for ring on Metal: GPU timeouts)

    @property
    def main(self) -> bool:
        """Whether this rank writes adapters, metrics and checkpoints."""
        return self.rank == 0

    def shard(self, pairs: Sequence) -> list:
        """This rank's pairs of a global micro-batch."""
        return list(pairs[self.rank :: self.size])

    def sum(self, x: mx.array) -> mx.array:
        if self.size == 1:
            return x
        return mx.distributed.all_sum(x, group=self.group, stream=self.stream)

    def sum_norms(self, norms: Norms) -> Norms:
        if self.size == 1:
            return norms
        both = self.sum(mx.array([norms.nll_tokens, norms.pairs], mx.float32)).tolist()
        return Norms(nll_tokens=float(both[0]), pairs=float(both[1]))

    def sum_floats(self, values: dict[str, float]) -> dict[str, float]:
        if self.size == 1 or not values:
            return values
        keys = sorted(values)
        summed = self.sum(mx.array([values[k] for k in keys], mx.float32)).tolist()
        return dict(zip(keys, summed, strict=True))

    def sum_arrays(self, arrays: dict[str, mx.array]) -> dict[str, mx.array]:
        """All-sum a dict of arrays in one collective (one float32 buffer)."""
        if self.size == 1:
            return arrays
        keys = sorted(arrays)
        flat = self.sum(mx.concatenate([arrays[k].astype(mx.float32).reshape(-1)
                                        for k in keys]))
        out, at = {}, 0
        for k in keys:
            a = arrays[k]
            out[k] = flat[at : at + a.size].reshape(a.shape).astype(a.dtype)
            at += a.size
        return out

    def gather_counts(self, count: int) -> list[int]:
        """Every rank's ``count``, in rank order."""
        if self.size == 1:
            return [count]
        one_hot = mx.zeros((self.size,), mx.float32).at[self.rank].add(float(count))
        return [int(v) for v in self.sum(one_hot).tolist()]


SINGLE = Ranks()  # one process


def init_ranks() -> Ranks:
    """The run's ranks: ``mx.distributed.init()`` under mlx.launch, else a single process.
    A ring hostfile without this rank's entry, or ranks on different MLX / mlx-lm versions,
    raise ValueError before any training (one says which, on every rank), and so does a
    rank that never started (engine/host/rendezvous.py: a time limit, then its number)."""
    if not mx.distributed.is_available():
        return SINGLE
    rank = os.environ.get("MLX_RANK")
    hosts = check_hostfile(os.environ.get("MLX_HOSTFILE"), rank)
    if hosts is not None:  # MLX's ring would wait forever for a rank that never started
        meet(hosts, int(rank or 0), rank_wait_s())
    group = mx.distributed.init()
    if group.size() == 1:
        return SINGLE
    on_metal = mx.default_device() == mx.gpu and not mx.cuda.is_available()
    ranks = Ranks(group, group.rank(), group.size(), mx.cpu if on_metal else None)
    if mx.default_device() == mx.cpu and ranks.rank > 0:
        own_jit_cache(ranks.rank)
    check_versions(ranks, versions())
    return ranks


def own_jit_cache(rank: int) -> None:
    """Point MLX's CPU kernel cache (``$TMPDIR/mlx/<version>/cpu``) at a folder of this
    rank's own. Ranks on one host otherwise compile the same kernels into the same files at
    once and one loads another's half-written library ("Could not load C++ shared library
    ... invalid ELF header"), which then stays in the cache for every later process. The
    folder is stable per rank, so its kernels are still compiled once."""
    base = Path(os.environ.get("TMPDIR") or "/tmp") / f"pomona-rank-{rank}"
    base.mkdir(parents=True, exist_ok=True)
    os.environ["TMPDIR"] = str(base)


def check_hostfile(path: str | None, rank: str | None) -> list[list[str]] | None:
    """The ring hostfile ``mlx.launch`` (or a sweep's gang) wrote: a JSON list with one
    non-empty list of "ip:port" per rank, and an entry for ``rank``; its hosts, or None
    without one. MLX itself would hang or abort on a missing entry."""
    if not path or rank is None:
        return None
    try:
        hosts = json.loads(Path(path).read_text())
    except (OSError, ValueError) as err:
        raise ValueError(f"MLX_HOSTFILE {path}: not a readable JSON hostfile ({err})") from None
    if not isinstance(hosts, list) or not all(
            isinstance(h, list) and h and all(isinstance(a, str) and ":" in a for a in h)
            for h in hosts):
        raise ValueError(f"MLX_HOSTFILE {path}: expected one list of \"ip:port\" per rank, "
                         f"got {json.dumps(hosts)[:200]}")
    if not rank.isdigit() or int(rank) >= len(hosts):
        raise ValueError(f"MLX_HOSTFILE {path}: no entry for rank {rank} (it lists "
                         f"{len(hosts)} rank(s))")
    return hosts


def versions() -> str:
    """What every rank must run alike: MLX and mlx-lm (a source checkout too: no
    package metadata needed)."""
    import mlx_lm

    return f"mlx {mx.__version__}, mlx-lm {mlx_lm.__version__}"


def check_versions(ranks: Ranks, mine: str) -> None:
    """Raise ValueError on every rank unless all ranks report ``mine`` alike (each rank
    puts a digest of its versions in its row; one sum shows every row to every rank)."""
    digest = list(hashlib.sha256(mine.encode()).digest()[:6])
    rows = mx.zeros((ranks.size, len(digest)), mx.float32)
    rows = rows.at[ranks.rank].add(mx.array(digest, mx.float32))
    seen = ranks.sum(rows).astype(mx.int32).tolist()
    differ = [r for r, row in enumerate(seen) if row != seen[0]]
    if differ:
        raise ValueError(f"ranks run different versions: rank(s) {differ} differ from rank 0 "
                         f"(this is rank {ranks.rank}: {mine}); install the same MLX and "
                         "mlx-lm on every machine")
