"""Where the Prefect UI of ``pomona ui`` tells the browser to find its API.

The server answers ``/ui-settings`` with an ``api_url`` the UI's JavaScript then calls. Prefect
derives it from ``PREFECT_API_URL`` or its own host/port settings, not from ``prefect server
start --host/--port``: on any port but 4200 the UI called ``http://127.0.0.1:4200/api`` and
showed nothing. ``pomona ui`` sets it from the address a browser can open.

A flow entered from the CLI (``prefect_api``) first asks the server ``PREFECT_API_URL``
names whether it is up, and a server that dies mid-run ends the command in one line naming
that URL: Prefect's client otherwise retried each call for minutes (253 s, six tracebacks
and no cause, once a hang).
"""

from __future__ import annotations

import ipaddress
import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from urllib.parse import urlsplit

WILDCARDS = ("0.0.0.0", "::", "")


def browser_url(host: str, port: int, public_url: str | None = None) -> str:
    """The URL a browser opens for a server bound to ``host:port`` (no trailing slash).

    ``public_url`` (the lab name or IP the server is reached at, or a proxy's URL) wins; a
    wildcard bind needs one, since 0.0.0.0 is no address a browser can open. ``port`` must
    be one a server can be told to bind: 0 (any free port) would leave the UI an API URL
    on port 0."""
    if not 0 < port < 65536:
        raise ValueError(f"--port {port}: choose a port from 1 to 65535" + (
            " (0 lets the server pick one its UI could not be told)" if port == 0 else ""))
    if public_url:
        parts = urlsplit(public_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"--public-url {public_url!r}: give a full URL such as "
                             f"http://head-mac.lab:{port}")
        return public_url.rstrip("/")
    if host.strip("[]") in WILDCARDS:
        raise ValueError(f"--host {host!r} listens on every interface, and a browser "
                         "cannot open that address: add --public-url http://<this machine's "
                         f"lab name or IP>:{port}")
    try:
        bracketed = f"[{host}]" if ipaddress.ip_address(host).version == 6 else host
    except ValueError:  # a host name
        bracketed = host
    return f"http://{bracketed}:{port}"


def point_ui_at(url: str) -> str:
    """Make the server started from this environment give its UI ``url``'s API; return it.

    ``PREFECT_SERVER_UI_API_URL`` outranks ``PREFECT_UI_API_URL`` and a shell's
    ``PREFECT_API_URL`` (which may name another server)."""
    api = f"{url}/api"
    os.environ.pop("PREFECT_UI_API_URL", None)
    os.environ["PREFECT_SERVER_UI_API_URL"] = api
    return api


# Seconds the health check waits, and the client's retries per call once a run is under
# way (Prefect's default, 5 with backoff, took minutes to give up on a dead server).
HEALTH_TIMEOUT_S = 5.0
CLIENT_RETRIES = 1


class ApiGone(RuntimeError):
    """The Prefect API a flow reports to does not answer (one line naming its URL)."""


def api_url() -> str | None:
    """The Prefect API this process reports to: None when Prefect starts its own."""
    from prefect.settings import PREFECT_API_URL

    return PREFECT_API_URL.value() or None


def check_api(url: str | None = None) -> None:
    """Raise ApiGone unless the server at ``url`` (default: ``PREFECT_API_URL``) is up."""
    import httpx

    url = url or api_url()
    if not url:
        return
    try:
        httpx.get(f"{url.rstrip('/')}/health", timeout=HEALTH_TIMEOUT_S).raise_for_status()
    except httpx.HTTPError as err:
        raise ApiGone(f"PREFECT_API_URL {url}: no Prefect server answers there ({_why(err)});"
                      " start it (`pomona ui`) or unset PREFECT_API_URL to let the run "
                      "start its own") from None


def _why(err: BaseException) -> str:
    return " ".join(str(err).split())[:120] or type(err).__name__


def lost_api(err: BaseException) -> BaseException | None:
    """The connection error to the Prefect API inside ``err`` (its causes and contexts),
    or None when ``err`` is something else."""
    import httpx

    seen: set[int] = set()
    while err is not None and id(err) not in seen:
        if isinstance(err, (httpx.TransportError, httpx.HTTPStatusError)):
            return err
        seen.add(id(err))
        err = err.__cause__ or err.__context__
    return None


class TemporaryServerNote(logging.Filter):
    """Prefect's notice of its temporary server, said in Pomona's words: why there is one
    and how to keep one to watch runs in (its own text points at a page instead)."""

    def filter(self, record: logging.LogRecord) -> bool:
        text = str(record.msg)
        if text.startswith("Starting temporary server on "):
            address = text.split("\n")[0].removeprefix("Starting temporary server on ")
            record.msg, record.args = (f"Prefect: a temporary server on {address} for this "
                                       "run (no PREFECT_API_URL set; `pomona ui` starts one "
                                       "that stays, to watch runs in)"), ()
        return True


def explain_temporary_server() -> None:
    """Prefect's logger says why a temporary server starts (once per process)."""
    logger = logging.getLogger("prefect")
    if not any(isinstance(f, TemporaryServerNote) for f in logger.filters):
        logger.addFilter(TemporaryServerNote())


@contextmanager
def prefect_api(out: str | os.PathLike | None = None) -> Iterator[None]:
    """Run a flow against a Prefect API known to be up; ApiGone (one line naming the URL
    and where the finished stages' files are) when it goes away during the block."""
    from prefect.settings import PREFECT_CLIENT_MAX_RETRIES, temporary_settings

    url = api_url()
    check_api(url)
    if not url:
        explain_temporary_server()
    retries = ({} if "PREFECT_CLIENT_MAX_RETRIES" in os.environ or not url
               else {PREFECT_CLIENT_MAX_RETRIES: CLIENT_RETRIES})  # a user's own setting wins
    try:
        with temporary_settings(updates=retries):
            yield
    except Exception as err:
        cause = lost_api(err) if url else None
        if cause is None:
            raise
        # Prefect's services log their own failure at exit for each call left unsent:
        # noise after the one line that says why
        for name in ["prefect", *logging.root.manager.loggerDict]:
            if name.startswith("prefect"):  # its internal loggers ignore levels
                logging.getLogger(name).disabled = True
        where = f"; what finished is in {out}" if out else ""
        raise ApiGone(f"PREFECT_API_URL {url}: the Prefect server stopped answering during "
                      f"the run ({_why(cause)}){where}. Restart it (`pomona ui`) and run "
                      "again: finished stages are cached") from None
