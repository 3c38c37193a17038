"""Connecting to Ray for a sweep: a given cluster, or a private local one."""

from __future__ import annotations

import logging
import os
import secrets
import socket
import stat
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType

from tasks.nodes.stop_signals import hear_stop_signals

LOOPBACK = "127.0.0.1"


class RayAddressError(ValueError):
    """``--address`` is no Ray address, or no cluster answers at it."""


def check_address(address: str | None) -> None:
    """Raise RayAddressError unless ``address`` is None, ``auto``, ``local`` or a head's
    ``HOST:PORT`` (``ray://HOST:PORT`` for Ray Client): one line, before anything starts."""
    if address is None or address in ("auto", "local"):
        return
    host, _, port = address.removeprefix("ray://").rpartition(":")
    if not host.strip("[]") or not port.isdigit() or not 0 < int(port) < 65536:
        raise RayAddressError(f"--address {address!r}: expected auto or a Ray head's HOST:PORT "
                              "(e.g. 10.0.0.5:6379; docs/cluster.md)")


@contextmanager
def ray_session(address: str | None) -> Iterator[None]:
    """Inside: connected to ``address`` (``auto`` or HOST:PORT; else ``RAY_ADDRESS``, as Ray
    reads it), or, with neither, to a private local Ray that never joins whatever else runs
    on this machine and listens on 127.0.0.1 only. Shut down after. A process already
    connected keeps its connection (and it is not shut down).

    Auth is Ray's own default, token auth on (Ray ≥ 2.59 for local clusters), unless the
    shell sets ``RAY_AUTH_MODE``. It is never changed from inside the process: Ray reads it
    once, at import, and a GCS started with another mode than the driver's aborts. A
    cluster's token comes from ``RAY_AUTH_TOKEN``, ``RAY_AUTH_TOKEN_PATH`` or
    ``~/.ray/auth_token`` (docs/cluster.md); that file is kept at mode 0600."""
    import ray

    if ray.is_initialized():
        yield
        return
    address = address or os.environ.get("RAY_ADDRESS") or None
    check_address(address)
    private_token_file(create=not address)
    if address:
        _connect(ray, address)
    else:
        _init_loopback(ray)
    hear_stop_signals()  # ray.init made SIGTERM a sys.exit the scheduler cannot act on
    try:
        yield
    finally:
        ray.shutdown()


def check_reachable(address: str, timeout_s: float = 5.0) -> None:
    """RayAddressError unless something accepts TCP at ``address``'s HOST:PORT within
    ``timeout_s`` (Ray itself retries an absent head for minutes)."""
    host, _, port = address.removeprefix("ray://").rpartition(":")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
    except OSError as err:
        raise RayAddressError(f"--address {address}: nothing answers there within "
                              f"{timeout_s:g} s ({err.strerror or err}); is the head running "
                              "(`ray start --head`) and reachable from here?") from None


def _connect(ray: ModuleType, address: str) -> None:
    """``ray.init`` at ``address``; its failures (Ray exits the process when no head
    answers) as one RayAddressError."""
    if address != "auto":
        check_reachable(address)
    try:
        ray.init(address=address, log_to_driver=False)
    except (ConnectionError, ValueError, RuntimeError, SystemExit) as err:
        first = (str(err).strip().splitlines() or [""])[0]
        why = first if not isinstance(err, SystemExit) else "no head answered"
        raise RayAddressError(f"--address {address}: no Ray cluster to join ({why}); is its "
                              "head running (`ray start --head`)?") from None


class HandledNotices(logging.Filter):
    """Ray's notices about a private local cluster that Pomona has already dealt with: token
    auth is on (its token file is made private first: ``private_token_file``) and a local
    instance started (this session's own, on loopback). A user's cluster keeps them."""

    LOGGERS = ("ray._private.authentication.authentication_token_setup", "ray._private.worker")
    SAID = ("Token authentication is enabled for this Ray cluster",
            "Started a local Ray instance")

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.SAID)


def _init_loopback(ray: ModuleType) -> None:
    """Start a new local Ray (``address="local"``: never RAY_ADDRESS or a ``ray start``
    head) whose GCS, raylet, workers and agents bind 127.0.0.1.

    Ray binds loopback only when the node IP is loopback, and on Linux it turns a given
    127.0.0.1 into the host's LAN IP unless its multi-node switch
    (``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER``, read at import) is off; it is switched off for
    this one call, the way macOS runs a single-node Ray."""
    from ray._private import ray_constants

    multi_node = ray_constants.ENABLE_RAY_CLUSTER
    ray_constants.ENABLE_RAY_CLUSTER = False
    quiet = HandledNotices()
    for name in HandledNotices.LOGGERS:
        logging.getLogger(name).addFilter(quiet)
    try:
        ray.init(address="local", num_cpus=os.cpu_count(), include_dashboard=False,
                 log_to_driver=False, _node_ip_address=LOOPBACK)
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = multi_node
        for name in HandledNotices.LOGGERS:
            logging.getLogger(name).removeFilter(quiet)
    gcs = ray.get_runtime_context().gcs_address
    if not gcs.startswith(f"{LOOPBACK}:"):
        warnings.warn(f"the private Ray's GCS is at {gcs}, not on {LOOPBACK}: this Ray "
                      "version may listen on the network (docs/cluster.md)", stacklevel=3)


def private_token_file(create: bool) -> Path | None:
    """Make sure Ray's token file is readable by its owner only (mode 0600) and return it.

    Ray writes a generated token to ``~/.ray/auth_token`` with the umask's mode (0644 as a
    rule: any local user could read it). With ``create`` (a new local cluster with token auth
    and no token yet) the token is written here first, 0600 from the start, and Ray reads
    it instead of writing its own. Nothing happens with ``RAY_AUTH_MODE`` other than token
    or with the token in ``RAY_AUTH_TOKEN``."""
    if os.environ.get("RAY_AUTH_MODE", "token").lower() != "token" \
            or os.environ.get("RAY_AUTH_TOKEN"):
        return None
    path = Path(os.environ.get("RAY_AUTH_TOKEN_PATH") or "~/.ray/auth_token").expanduser()
    if not path.exists():
        if not create:
            return None
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:  # another process wrote it meanwhile
            pass
        else:
            with os.fdopen(fd, "w") as f:
                f.write(secrets.token_hex(32))  # what Ray generates: 256 bits, hex
            return path
    if stat.S_IMODE(path.stat().st_mode) & 0o077:
        try:
            path.chmod(0o600)
        except OSError as e:  # another user's file: say so, leave it
            warnings.warn(f"{path} is readable by other users and could not be made "
                          f"private ({e}): chmod 600 {path}", stacklevel=3)
    return path
