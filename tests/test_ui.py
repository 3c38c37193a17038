"""`pomona ui` on a port other than 4200 serves a UI that reaches its own API.

Issue 14, item 13: the server told its UI to call http://127.0.0.1:4200/api whatever
``--port`` said; in a browser the artifact page said "Oops. Something went wrong". The
browser test renders the leaderboard artifact in Debian's headless Chromium (``./run test``
installs it on Linux as root; elsewhere the test is skipped with the reason).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

ROOT = Path(__file__).resolve().parents[1]
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
# Flags that work headless in a container with no display, GPU or network.
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                  "--no-first-run", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync"]


@pytest.mark.unit
@pytest.mark.parametrize(("host", "port", "public", "url"), [
    ("127.0.0.1", 4311, None, "http://127.0.0.1:4311"),
    ("::1", 4311, None, "http://[::1]:4311"),
    ("head-mac.lab", 4200, None, "http://head-mac.lab:4200"),
    ("0.0.0.0", 4200, "http://head-mac.lab:4200/", "http://head-mac.lab:4200"),
    ("127.0.0.1", 4200, "https://lab.example/prefect", "https://lab.example/prefect"),
])
def test_browser_url_follows_host_port_and_public_url(host, port, public, url) -> None:
    """Catches a UI API URL that ignores --port/--host, or keeps a trailing slash."""
    from flows.prefect_ui import browser_url

    assert browser_url(host, port, public) == url


@pytest.mark.unit
@pytest.mark.parametrize("args", [["--host", "0.0.0.0"], ["--host", "::"],
                                  ["--public-url", "head-mac.lab:4200"]])
def test_ui_refuses_an_address_no_browser_can_open(args: list[str], monkeypatch) -> None:
    """Catches a lab-network bind that hands browsers http://0.0.0.0:4200/api."""
    from flows.cli import app

    def execv(path, argv):  # the server would replace this test process
        raise AssertionError(f"started {argv}")

    monkeypatch.setattr(os, "execv", execv)
    result = CliRunner().invoke(app, ["ui", *args])
    assert result.exit_code == 2, (result.output, result.exception)
    assert "--public-url" in result.output


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def leaderboard_markdown(tmp: Path) -> str:
    """The pipeline's leaderboard artifact for two trials: the table and a plot inline."""
    from tasks.leaderboard import markdown
    from tasks.plots import inline_png, metric_vs_params_png

    rows = [{"rank": i + 1, "trial_id": t, "status": "completed", "best/val/loss": loss,
             "param/learning_rate": lr}
            for i, (t, loss, lr) in enumerate([("t-40bd8a3a61", 4.6894, 1e-3),
                                               ("t-5c29816416", 5.8219, 3e-4)])]
    plot = metric_vs_params_png(rows, "val/loss", ["param/learning_rate"], tmp / "params.png")
    return markdown(rows, "val/loss", "ui-check") + "\n" + inline_png(plot, "val/loss by lr")


def wait_healthy(base: str, server: subprocess.Popen, log: Path, timeout: float = 180) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert server.poll() is None, f"pomona ui exited: {log.read_text()[-2000:]}"
        try:
            if httpx.get(f"{base}/api/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise AssertionError(f"no healthy Prefect server at {base} after {timeout:.0f} s")


def dump_dom(page: str, tmp: Path) -> str:
    """The page's DOM after its scripts ran, from a fresh headless Chromium profile."""
    profile = tempfile.mkdtemp(prefix="chromium-", dir=tmp)
    dom = subprocess.run(
        [CHROMIUM, *CHROMIUM_FLAGS, f"--user-data-dir={profile}",
         "--virtual-time-budget=30000", "--dump-dom", page],
        capture_output=True, text=True, timeout=180,
        # ./run preloads OpenBLAS for MLX; Chromium's GPU process aborts under it
        env={k: v for k, v in os.environ.items() if k != "LD_PRELOAD"})
    assert dom.returncode == 0, dom.stderr[-2000:]
    return dom.stdout


@pytest.mark.long  # a server and a browser (or a Ray): scheduled first
@pytest.mark.slow
@pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed "
                    "(apt-get install chromium; ./run test installs it on Linux as root)")
def test_artifact_page_shows_the_leaderboard_on_a_non_default_port(tmp_path) -> None:
    """Catches a UI that calls port 4200's API: no table, "Oops. Something went wrong"."""
    import httpx

    port = free_port()
    assert port != 4200
    base = f"http://127.0.0.1:{port}"
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PREFECT_API_", "PREFECT_UI_", "PREFECT_SERVER_UI_"))}
    env.update(PREFECT_HOME=str(tmp_path / "prefect"), PYTHONPATH=str(ROOT))
    log = (tmp_path / "server.log").open("w")
    server = subprocess.Popen(
        [sys.executable, "-c", "from flows.cli import main; main()", "ui", "--port", str(port)],
        env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
        start_new_session=True)  # its own process group: stopped as one below
    try:
        wait_healthy(base, server, tmp_path / "server.log")
        artifact = httpx.post(f"{base}/api/artifacts/", json={
            "key": "ui-check-leaderboard", "type": "markdown",
            "data": leaderboard_markdown(tmp_path), "description": "leaderboard"})
        artifact.raise_for_status()
        page = f"{base}/artifacts/artifact/{artifact.json()['id']}"
        for _ in range(3):  # a busy machine can stop the clock before the page has data
            html = dump_dom(page, tmp_path)
            if "<table" in html or "Oops" in html:
                break
        assert "Oops" not in html, f"the UI could not reach its API: {html[-2000:]}"
        assert "<table" in html and "t-40bd8a3a61" in html and "t-5c29816416" in html, \
            html[-3000:]
        assert 'src="data:image/png;base64,' in html  # the inline plot
        assert httpx.get(f"{base}/ui-settings").json()["api_url"] == f"{base}/api"
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()
        log.close()
