"""A sweep against a Ray head with token auth on; a client without the token is refused.

Ray reads RAY_AUTH_MODE once per process, and this test process has Ray set up for the
other tests, so the head and the sweep run in a fresh interpreter (``_HEAD``), which also
launches the would-be intruders as their own processes.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import tempfile

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.long]  # conftest.py: scheduled first

_HEAD = r"""
import json, os, subprocess, sys
import ray
from tasks.sweep.run import run_sweep
from tasks.sweep.spec_file import parse_spec

model, data, out, home = sys.argv[1:5]
ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
address = ray.get_runtime_context().gcs_address
spec = parse_spec({"name": "auth", "model": model, "data": data,
                   "fixed": {"steps": 2, "batch_size": 2, "lora_rank": 4, "val_every": 0}})
[row] = run_sweep(spec, out)

def connect(token):
    env = {k: v for k, v in os.environ.items() if k != "RAY_AUTH_TOKEN"}
    env["HOME"] = home  # no ~/.ray/auth_token to fall back on
    if token:
        env["RAY_AUTH_TOKEN"] = token
    code = f"import ray; ray.init(address={address!r}); print('connected')"
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       timeout=120)
    return {"rc": p.returncode, "connected": "connected" in p.stdout, "err": p.stderr[-600:]}

print(json.dumps({"status": row["status"], "reason": row.get("reason"),
                  "without": connect(None), "wrong": connect("0" * 64),
                  "right": connect(os.environ["RAY_AUTH_TOKEN"])}))
ray.shutdown()
"""


def test_token_auth_sweep_runs_and_strangers_are_refused(tiny_model, tiny_data,
                                                         tmp_path) -> None:
    tmp = tempfile.mkdtemp(prefix="ra", dir="/tmp")  # AF_UNIX socket paths: 107 bytes at most
    env = {**os.environ, "RAY_TMPDIR": tmp, "RAY_AUTH_MODE": "token",
           "RAY_AUTH_TOKEN": secrets.token_hex(32)}
    proc = subprocess.run([sys.executable, "-c", _HEAD, str(tiny_model), str(tiny_data),
                           str(tmp_path / "out"), str(tmp_path)], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["status"] == "completed", result
    assert result["right"]["connected"], result["right"]  # the check itself can connect
    assert not result["without"]["connected"] and result["without"]["rc"] != 0
    assert "AuthenticationError" in result["without"]["err"], result["without"]
    assert not result["wrong"]["connected"] and result["wrong"]["rc"] != 0
