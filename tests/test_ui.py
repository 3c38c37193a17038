"""`pomona ui` on a port other than 4200 serves a UI that reaches its own API.

Issue 14, item 13: the server told its UI to call http://127.0.0.1:4200/api whatever
``--port`` said; in a browser the artifact page said "Oops. Something went wrong". The
browser test renders the leaderboard artifacts in Debian's headless Chromium, 1400 px wide,
over the DevTools protocol (``./run test`` installs it on Linux as root; elsewhere the test
is skipped with the reason): issue 28, item 15, the leading board must fit that width.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

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
    from cli.prefect_ui import browser_url

    assert browser_url(host, port, public) == url


@pytest.mark.unit
@pytest.mark.parametrize("args", [["--host", "0.0.0.0"], ["--host", "::"],
                                  ["--public-url", "head-mac.lab:4200"]])
def test_ui_refuses_an_address_no_browser_can_open(args: list[str], monkeypatch) -> None:
    """Catches a lab-network bind that hands browsers http://0.0.0.0:4200/api."""
    from cli.main import app

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


BOARD = [{"rank": i + 1, "trial_id": t, "status": "completed", "best/val/loss": loss,
          "param/learning_rate": lr, "param/lora_rank": rank, "param/orpo_lambda": lam,
          "eval/valid/logps/accuracies": 0.7312, "eval/test/logps/accuracies": 0.6875,
          "eval/test/logps/margin": 0.1234, "eval/test/loss": 4.5678,
          "eval/test/nll_loss": 4.4321, "peak_memory_gb": 1.23, "tokens_per_sec": 12345.6,
          "duration_s": 321.0, "eval/test/rows": 220, "eval/test/logps/accuracies/low": 0.6232,
          "eval/test/logps/accuracies/high": 0.7459, "gen/test/add-small": 0.42,
          "gen/test/add-small/n": 250, "gen/test/add-small/low": 0.3597,
          "gen/test/add-small/high": 0.4827, "vs_base/test/gen/add-small/wins": 105,
          "vs_base/test/gen/add-small/ties": 145, "vs_base/test/gen/add-small/losses": 0,
          "vs_base/test/gen/add-small/p": 4.9e-32}
         for i, (t, loss, lr, rank, lam) in enumerate([("t-40bd8a3a61", 4.6894, 1e-3, 16, 0.1),
                                                       ("t-5c29816416", 5.8219, 3e-4, 8, 1.0),
                                                       ("t-77aa01c3e2", 5.9, 1e-4, 32, 0.5)])]
BOARD += [{"trial_id": "base", "status": "baseline", "rank": None, "eval/test/rows": 220,
           "eval/valid/logps/accuracies": 0.5, "eval/test/logps/accuracies": 0.51,
           "gen/test/add-small": 0.0, "gen/test/add-small/n": 250,
           "gen/test/add-small/low": 0.0, "gen/test/add-small/high": 0.0152}]
COMPACT_HEAD = ["#", "trial", "learning_rate", "lora_rank", "orpo_lambda", "val acc",
                "test acc", "test add-small"]
# The answers table artifact (tasks/board/leaderboard.py: answer_samples), as the pipeline posts it.
ANSWERS = [{"prompt": f"What is the sum? {a} + {b}", "chosen": str(a + b),
            "base answer": f"The answer is {a + b}.", "base add-small": 0.0,
            "best answer": str(a + b), "best add-small": 1.0}
           for a, b in ((26, 12), (37, 39), (4, 31))]


def board_artifacts(tmp: Path) -> list[dict[str, str]]:
    """The pipeline's two leaderboard artifacts for three trials and the base, a plot inline
    in the first (tasks/prefect/pipeline_tasks.py: aggregate_task)."""
    from tasks.board.plots import inline_png, metric_vs_params_png
    from tasks.prefect.pipeline_tasks import board_artifacts

    plot = metric_vs_params_png(BOARD[:3], "val/loss", ["param/learning_rate"],
                                tmp / "params.png")
    return board_artifacts(BOARD, "val/loss", "ui-check", inline_png(plot, "val/loss by lr"),
                           "leaderboard")


def table_head(text: str) -> list[str]:
    line = next(x for x in text.splitlines() if x.startswith("|"))
    return [c.strip() for c in line.strip("|").split("|")]


@pytest.mark.unit
def test_the_board_artifact_leads_with_the_clis_few_columns(tmp_path) -> None:
    """Issue 28, item 15: the artifact held every column and Chromium cut it off at 1400 px
    after the third metric. Would catch: the full table leading again, or lost."""
    lead, full = board_artifacts(tmp_path)
    assert (lead["key"], full["key"]) == ("ui-check-leaderboard", "ui-check-leaderboard-full")
    assert table_head(lead["markdown"]) == COMPACT_HEAD
    rows = [x for x in lead["markdown"].splitlines() if x.startswith("| 1 |")]
    assert rows == ["| 1 | t-40bd8a3a61 | 0.001 | 16 | 0.1 | 0.731 | 0.69 [.62–.75] | "
                    "0.42 [.36–.48] |"]
    assert "test add-small: answers scored by add-small, n=250" in lead["markdown"]
    assert ("best (t-40bd8a3a61) against base, test gen/add-small: 105 better, 145 same, 0 "
            "worse of 250; sign test p=4.9e-32 (significant at 0.05)") in lead["markdown"]
    assert "data:image/png;base64," in lead["markdown"]
    assert "eval/test/nll_loss" in table_head(full["markdown"])


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


# What a rendered artifact page shows, once it shows a table (or fails): the table's
# headers, where its last header cell ends and where the nearest clipping box (or the
# window) ends, and whether the inline plot is there.
RENDERED = """(() => {
  const oops = document.body.innerText.includes('Oops');
  const table = document.querySelector('table');
  if (!table && !oops) return null;
  if (!table) return JSON.stringify({oops});
  if (document.fonts && document.fonts.status !== 'loaded') return null;  // widths change
  const th = [...table.querySelectorAll('th')];
  let clip = document.documentElement.clientWidth;
  for (let e = table.parentElement; e; e = e.parentElement)
    if (getComputedStyle(e).overflowX !== 'visible')
      clip = Math.min(clip, e.getBoundingClientRect().right);
  return JSON.stringify({oops, headers: th.map(x => x.textContent.trim()),
    right: th[th.length - 1].getBoundingClientRect().right, clip,
    img: !!document.querySelector('img[src^="data:image/png;base64,"]'),
    text: document.body.innerText});
})()"""


class Browser:
    """Headless Chromium, 1400 px wide, driven over the DevTools protocol."""

    def __init__(self, tmp: Path):
        import re

        import httpx

        profile = tempfile.mkdtemp(prefix="chromium-", dir=tmp)
        self.proc = subprocess.Popen(
            [CHROMIUM, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", "--window-size=1400,1000",
             "--remote-debugging-port=0", "about:blank"], stderr=subprocess.PIPE, text=True,
            # ./run preloads OpenBLAS for MLX; Chromium's GPU process aborts under it
            env={k: v for k, v in os.environ.items() if k != "LD_PRELOAD"})
        for line in self.proc.stderr:
            if m := re.search(r"DevTools listening on ws://[^:]+:(\d+)/", line):
                break
        else:
            raise AssertionError("chromium did not start its DevTools endpoint")
        pages = httpx.get(f"http://127.0.0.1:{m.group(1)}/json/list").json()
        self.ws = next(t["webSocketDebuggerUrl"] for t in pages if t["type"] == "page")
        self.calls = 0

    def call(self, conn: Any, method: str, **params: Any) -> dict:
        self.calls += 1
        conn.send(json.dumps({"id": self.calls, "method": method, "params": params}))
        while (reply := json.loads(conn.recv())).get("id") != self.calls:
            pass
        return reply.get("result", {})

    def rendered(self, page: str, timeout: float = 120) -> dict:
        """RENDERED on ``page`` once it has a table (laid out: the same twice in a row,
        0.5 s apart; under CI's load a first reading came before the layout settled) or
        failed."""
        from websockets.sync.client import connect

        with connect(self.ws, max_size=None) as conn:
            self.call(conn, "Page.navigate", url=page)
            deadline, last = time.monotonic() + timeout, None
            while time.monotonic() < deadline:
                got = self.call(conn, "Runtime.evaluate", expression=RENDERED,
                                returnByValue=True)["result"].get("value")
                if got and (got == last or json.loads(got).get("oops")):
                    return json.loads(got)
                last = got
                time.sleep(0.5)
        raise AssertionError(f"{page}: no table after {timeout:.0f} s")

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()


@pytest.mark.long  # a server and a browser (or a Ray): scheduled first
@pytest.mark.slow
@pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed "
                    "(apt-get install chromium; ./run test installs it on Linux as root)")
def test_artifact_page_shows_the_leaderboard_on_a_non_default_port(tmp_path) -> None:
    """Catches a UI that calls port 4200's API: no table, "Oops. Something went wrong";
    and a leading board artifact wider than a 1400 px window (issue 28, item 15)."""
    import httpx

    port = free_port()
    assert port != 4200
    base = f"http://127.0.0.1:{port}"
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PREFECT_API_", "PREFECT_UI_", "PREFECT_SERVER_UI_"))}
    env.update(PREFECT_HOME=str(tmp_path / "prefect"), PYTHONPATH=str(ROOT))
    log = (tmp_path / "server.log").open("w")
    server = subprocess.Popen(
        [sys.executable, "-c", "from cli.main import main; main()", "ui", "--port", str(port)],
        env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
        start_new_session=True)  # its own process group: stopped as one below
    try:
        wait_healthy(base, server, tmp_path / "server.log")
        browser = Browser(tmp_path)
        try:
            seen = []
            for art in board_artifacts(tmp_path):
                posted = httpx.post(f"{base}/api/artifacts/", json={
                    "key": art["key"], "type": "markdown", "data": art["markdown"],
                    "description": art["description"]})
                posted.raise_for_status()
                seen.append(browser.rendered(f"{base}/artifacts/artifact/{posted.json()['id']}"))
            posted = httpx.post(f"{base}/api/artifacts/", json={
                "key": "ui-check-answers", "type": "table", "data": json.dumps(ANSWERS),
                "description": "held-out answers"})
            posted.raise_for_status()
            answers = browser.rendered(f"{base}/artifacts/artifact/{posted.json()['id']}")
        finally:
            browser.close()
        lead, full = seen
        # The answers table: its columns and a row of it on the page.
        assert not answers["oops"] and set(ANSWERS[0]) <= set(answers["headers"]), answers
        assert "The answer is 38." in answers["text"]
        assert not lead["oops"], f"the UI could not reach its API: {lead}"
        assert all(t in lead["text"] for t in ("t-40bd8a3a61", "t-5c29816416"))
        assert lead["img"]  # the inline plot
        # Issue 28, item 15: the leading board fits a 1400 px window, every column shown.
        assert lead["headers"] == COMPACT_HEAD, lead["headers"]
        assert lead["right"] <= lead["clip"], (lead["right"], lead["clip"])
        assert "eval/test/nll_loss" in full["headers"]  # the full table, one click away
        assert "gen/test/add-small [95% CI]" in full["headers"]
        assert httpx.get(f"{base}/ui-settings").json()["api_url"] == f"{base}/api"
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()
        log.close()
