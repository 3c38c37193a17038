"""Before a ring joins: every rank checks in with rank 0 within a time limit.

MLX's ring backend (``mx.distributed.init``) blocks in ``accept()`` until its neighbour
connects, with no timeout and the GIL held: one rank that never starts (a host missing
from the launch, a dead machine, a Ray actor that never got its node) leaves every other
rank waiting forever, printing nothing. So each rank first meets rank 0 over TCP at rank
0's hostfile address (the port MLX binds a moment later) within ``POMONA_RANK_WAIT_S``
seconds (default 60). Rank 0 names the ranks that never came and tells those that did,
so every started rank fails with the same line; a rank that cannot reach rank 0 names
it. Standard library only.
"""

from __future__ import annotations

import os
import socket
import time

WAIT_ENV = "POMONA_RANK_WAIT_S"
DEFAULT_WAIT_S = 60.0
RETRY_S = 0.2  # between a rank's attempts to reach rank 0


def rank_wait_s() -> float:
    """Seconds a rank waits for the others (``POMONA_RANK_WAIT_S``), or ValueError."""
    raw = os.environ.get(WAIT_ENV, "")
    try:
        value = float(raw) if raw else DEFAULT_WAIT_S
    except ValueError:
        value = -1.0
    if not value > 0:
        raise ValueError(f"{WAIT_ENV}={raw!r}: expected a number of seconds above 0")
    return value


def meet(hosts: list[list[str]], rank: int, timeout: float) -> None:
    """Return once every rank of ``hosts`` (a ring hostfile: rank r listens on
    ``hosts[r]``) has checked in with rank 0; ValueError naming the missing rank(s), or
    rank 0, after ``timeout`` seconds."""
    if len(hosts) < 2:
        return
    host, _, port = hosts[0][0].rpartition(":")
    where = (host.strip("[]"), int(port))
    if rank == 0:
        _gather(where, len(hosts), timeout)
    else:
        _check_in(where, rank, timeout)


def _missing_line(me: int, missing: list[int], where: tuple[str, int], timeout: float) -> str:
    names = ("rank " if len(missing) == 1 else "ranks ") + ", ".join(map(str, missing))
    return (f"rank {me}: {names} never started (no check-in at rank 0, "
            f"{where[0]}:{where[1]}, within {timeout:g} s); launch every rank of the hostfile, "
            f"or raise {WAIT_ENV}")


def _gather(where: tuple[str, int], size: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    joined: dict[int, socket.socket] = {}
    with socket.create_server(where) as server:  # SO_REUSEADDR: MLX binds it next
        while len(joined) < size - 1 and (left := deadline - time.monotonic()) > 0:
            server.settimeout(left)
            try:
                conn, _ = server.accept()
            except TimeoutError:
                break
            rank = _read_rank(conn, size)
            if rank is None:
                conn.close()
            else:
                joined.setdefault(rank, conn)
    missing = sorted(set(range(1, size)) - set(joined))
    reply = b"ok\n" if not missing else f"missing {' '.join(map(str, missing))}\n".encode()
    for conn in joined.values():
        _answer(conn, reply)
    if missing:
        raise ValueError(_missing_line(0, missing, where, timeout))


def _read_rank(conn: socket.socket, size: int) -> int | None:
    """The rank a peer announces ("rank N"), or None for anything else (a port scan)."""
    conn.settimeout(5.0)
    try:
        words = conn.recv(64).decode(errors="replace").split()
    except OSError:
        return None
    if len(words) == 2 and words[0] == "rank" and words[1].isdigit():
        return int(words[1]) if 0 < int(words[1]) < size else None
    return None


def _answer(conn: socket.socket, reply: bytes) -> None:
    """Send ``reply``; wait for the peer to close first, so the closed connections'
    TIME_WAIT lands on its side and not on the port MLX binds next."""
    try:
        conn.sendall(reply)
        conn.settimeout(2.0)
        conn.recv(1)
    except OSError:
        pass
    finally:
        conn.close()


def _check_in(where: tuple[str, int], rank: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            conn = socket.create_connection(where, timeout=min(2.0, max(timeout, 0.1)))
            break
        except OSError:
            if time.monotonic() > deadline:
                raise ValueError(f"rank {rank}: rank 0 never started (nothing listens at "
                                 f"{where[0]}:{where[1]} after {timeout:g} s); launch every "
                                 f"rank of the hostfile, or raise {WAIT_ENV}") from None
            time.sleep(RETRY_S)
    with conn:
        conn.sendall(f"rank {rank}\n".encode())
        conn.settimeout(timeout + 10.0)  # rank 0 answers by its own deadline
        try:
            reply = conn.recv(256).decode(errors="replace").split()
        except OSError:
            reply = []
    if reply[:1] == ["ok"]:
        return
    if reply[:1] == ["missing"]:
        raise ValueError(_missing_line(rank, [int(r) for r in reply[1:]], where, timeout))
    raise ValueError(f"rank {rank}: rank 0 ({where[0]}:{where[1]}) did not confirm that every "
                     f"rank started within {timeout:g} s; check rank 0's output")
