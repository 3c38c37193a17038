"""Issue 36, item 6: a Prefect server that is down, or dies mid-run.

With ``PREFECT_API_URL`` naming a `pomona ui` that was then killed, a pipeline logged
"Finished in state Running()", exited 1 after 253 s with six tracebacks and no line giving
the cause, and once hung over 5 minutes. Now the API is checked before the flow, and a
server lost during it ends the command in one line naming the URL.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(code_or_args: list[str], env: dict[str, str], timeout: float = 120
        ) -> tuple[int, list[str], float]:
    started = time.perf_counter()
    proc = subprocess.run([sys.executable, *code_or_args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT, env={**os.environ, **env})
    lines = [x for x in (proc.stdout + proc.stderr).splitlines() if x.strip()]
    return proc.returncode, lines, time.perf_counter() - started


@pytest.mark.integration
def test_a_prefect_api_that_is_down_is_one_line_before_any_work(tiny_model: Path,
                                                                tmp_path: Path) -> None:
    """Catches a flow started against a dead PREFECT_API_URL (minutes of retries)."""
    from tasks.data.synthetic import synth_rows, write_rows

    raw = write_rows(list(synth_rows("sort", 40, seed=0)), tmp_path / "raw.jsonl")
    spec = tmp_path / "spec.yaml"
    spec.write_text("name: p\nmodel: unused\ndata: unused\nfixed: {steps: 2}\n"
                    "grid: {orpo_lambda: [0.1]}\n")
    url = f"http://127.0.0.1:{free_port()}/api"
    code, lines, seconds = run(["-m", "cli.main", "pipeline", str(raw), str(tiny_model),
                                str(spec), "--out", str(tmp_path / "out")],
                               {"PREFECT_API_URL": url, "PREFECT_HOME": str(tmp_path / "ph")})
    assert code == 2 and len(lines) == 1 and url in lines[0], lines
    assert "no Prefect server answers" in lines[0] and seconds < 60
    assert not (tmp_path / "out" / "data").exists()  # no stage ran


FLOW = """
import os, signal, sys, time
from prefect import flow, task
from cli.prefect_ui import ApiGone, prefect_api

@task
def first(pgid: int) -> int:
    os.killpg(pgid, signal.SIGKILL)  # the server dies while the flow runs
    time.sleep(1)
    return 1

@task
def second(x: int) -> int:
    return x + 1

@flow
def two_stages(pgid: int) -> int:
    return second(first(pgid))

try:
    with prefect_api(sys.argv[2]):
        two_stages(int(sys.argv[1]))
except ApiGone as err:
    print(f"error: {err}")
    sys.exit(2)
"""


@pytest.mark.slow
def test_a_prefect_server_killed_mid_flow_ends_in_one_line(tmp_path: Path) -> None:
    """Catches the 253 s of retries and the hang after the server died: the run must end
    within a minute, its last line naming the API URL and the output folder."""
    port = free_port()
    url = f"http://127.0.0.1:{port}/api"
    env = {"PREFECT_HOME": str(tmp_path / "ph"), "PREFECT_API_URL": url,
           "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "PREFECT_LOGGING_LEVEL": "CRITICAL"}
    server = subprocess.Popen([sys.executable, "-m", "prefect", "server", "start", "--host",
                               "127.0.0.1", "--port", str(port)], env={**os.environ, **env},
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              start_new_session=True)
    try:
        deadline = time.time() + 120
        while time.time() < deadline:
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(1)
        else:
            pytest.fail("the Prefect server did not start within 120 s")
        code, lines, seconds = run(["-c", FLOW, str(server.pid), str(tmp_path / "out")],
                                   env, timeout=300)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(server.pid, signal.SIGKILL)
        server.wait()
    assert code == 2, lines[-20:]
    errors = [x for x in lines if "ERROR" in x or x.startswith("error:")]
    assert len(errors) == 1 and errors == lines[-1:], lines[-20:]  # nothing after the cause
    assert url in lines[-1] and "stopped answering" in lines[-1] and str(tmp_path / "out") \
        in lines[-1], lines[-20:]
    assert seconds < 60, seconds
