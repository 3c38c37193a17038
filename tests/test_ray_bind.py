"""A sweep's private local Ray listens on loopback only, and its token file is 0600.

Issue 14, item 11: the private Ray of a sweep or demo listened on every interface (GCS,
raylet, workers, dashboard agent on 0.0.0.0) and Ray wrote its generated token to
``~/.ray/auth_token`` with mode 0644. The cluster runs in a fresh interpreter: Ray reads
its settings once per process, and this one may hold another test's Ray.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LOOPBACK = {"127.0.0.1", "::1", "::ffff:127.0.0.1"}

# Every listening socket of the driver and the processes it started (GCS, raylet,
# workers, agents), found by process tree, so other Rays on this machine do not count.
_SESSION = r"""
import json, stat
from pathlib import Path
import ray
import psutil  # Ray's own copy (ray/thirdparty_files, on sys.path once ray is imported)
from tasks.nodes.ray_session import ray_session

@ray.remote
def one():
    return 1

with ray_session(None):
    assert ray.get(one.remote()) == 1
    me = psutil.Process()
    listening = []
    for p in [me, *me.children(recursive=True)]:
        try:
            conns = p.net_connections(kind="inet")
            name = p.name()
        except psutil.Error:
            continue
        listening += [[name, c.laddr.ip, c.laddr.port] for c in conns
                      if c.status == psutil.CONN_LISTEN]
    gcs = ray.get_runtime_context().gcs_address
token = Path.home() / ".ray" / "auth_token"
print(json.dumps({"listening": listening, "gcs": gcs,
                  "token_mode": stat.S_IMODE(token.stat().st_mode) if token.exists() else None}))
"""


@pytest.mark.long  # a server and a browser (or a Ray): scheduled first
@pytest.mark.slow
def test_private_ray_listens_on_loopback_and_keeps_its_token_private(tmp_path) -> None:
    """Catches a local cluster bound to 0.0.0.0 / the LAN IP, or a token readable by all."""
    tmp = tempfile.mkdtemp(prefix="rb", dir="/tmp")  # AF_UNIX socket paths: 107 bytes at most
    env = {k: v for k, v in os.environ.items()
           if k not in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH", "RAY_ADDRESS")}
    env.update(HOME=str(tmp_path), RAY_TMPDIR=tmp, PYTHONPATH=str(ROOT))  # Ray's defaults
    proc = subprocess.run([sys.executable, "-c", _SESSION], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    names = {name for name, _, _ in result["listening"]}
    assert "gcs_server" in names and "raylet" in names, result["listening"]
    exposed = [s for s in result["listening"] if s[1] not in LOOPBACK]
    assert not exposed, f"listening beyond loopback: {exposed}"
    assert result["gcs"].startswith("127.0.0.1:"), result["gcs"]
    assert result["token_mode"] == 0o600, oct(result["token_mode"] or 0)


@pytest.mark.unit
def test_token_file_is_created_private_and_tightened(tmp_path, monkeypatch) -> None:
    """Catches a token written with the umask's mode, or an existing 0644 one left as is."""
    from tasks.nodes.ray_session import private_token_file

    # Only the environment of private_token_file changes: no Ray starts in this test.
    for name in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    token = tmp_path / ".ray" / "auth_token"
    assert private_token_file(create=False) is None and not token.exists()  # joining: no token

    assert private_token_file(create=True) == token
    assert stat.S_IMODE(token.stat().st_mode) == 0o600
    assert len(token.read_text()) == 64  # 256 bits, hex, like Ray's own
    before = token.read_text()

    token.chmod(0o644)  # as `ray get-auth-token --generate` or an older run left it
    assert private_token_file(create=True) == token
    assert stat.S_IMODE(token.stat().st_mode) == 0o600 and token.read_text() == before

    monkeypatch.setenv("RAY_AUTH_TOKEN", "0" * 64)  # a token in the environment: no file
    token.unlink()
    assert private_token_file(create=True) is None and not token.exists()
