"""Where the Prefect UI of ``pomona ui`` tells the browser to find its API.

The server answers ``/ui-settings`` with an ``api_url`` the UI's JavaScript then calls. Prefect
derives it from ``PREFECT_API_URL`` or its own host/port settings, not from ``prefect server
start --host/--port``: on any port but 4200 the UI called ``http://127.0.0.1:4200/api`` and
showed nothing. ``pomona ui`` sets it from the address a browser can open.
"""

from __future__ import annotations

import ipaddress
import os
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
