"""A lab of Ray nodes simulated on one Linux host (root): each node its own address and disk.

Each node gets a network namespace with a veth link to a bridge in a namespace of its own
(addresses of ``SUBNET`` that exist only there, no route out), and mount, UTS and PID
namespaces: a private ``/tmp`` (tmpfs: its Ray session, ``HOME``, Pomona's cache and its
lab folder ``/tmp/lab``), its own host name, and a PID namespace so that ending a node
ends everything it started and nothing else (docs/design.md, lab cluster facts). The code and
its virtual environment are the host's, at the same path on every node, as a lab installs
Pomona on each Mac; ``shadow`` gives one node an edited copy of a package (another
version). ``run`` executes a command inside a node (``timeout`` inside ``nsenter``, or the
process outlives it); ``put``/``get`` move files into and out of a node's private disk.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import select
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
SUBNET = "10.231.{}.{}"  # /24 per lab; only inside the lab's namespaces


def namespaces_allowed() -> str | None:
    """Why a lab cannot be simulated here (None: it can)."""
    if sys.platform != "linux" or os.geteuid() != 0:
        return "needs Linux and root (network, mount and PID namespaces)"
    for path in (REPO, BIN):  # every node mounts a private /tmp over the host's
        if path.is_relative_to("/tmp"):
            return f"the checkout and its .venv must lie outside /tmp ({path} is under it)"
    for tool in ("ip", "unshare", "nsenter", "timeout", "tar"):
        if shutil.which(tool) is None:
            return f"needs {tool}"
    probe = f"pomona-probe-{secrets.token_hex(3)}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"ip netns add failed: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


@dataclass
class Node:
    name: str
    ip: str
    netns: str
    ray_args: list[str]
    shadow: dict[str, Path] = field(default_factory=dict)  # repo path -> its stand-in
    proc: subprocess.Popen | None = None
    init_pid: int = 0  # the node's PID 1, seen from the host


class Lab:
    """Nodes ``head`` (no GPU) and ``w1``, ``w2``, … (one ``mlx_gpu`` each), started with
    ``start`` and ended with ``stop``."""

    def __init__(self, root: Path, workers: int = 2, lab_id: int | None = None):
        self.root = root
        self.id = lab_id if lab_id is not None else os.getpid() % 200 + 20
        self.tag = f"pl{self.id}"
        self.token = secrets.token_hex(32)
        self._poller: subprocess.Popen | None = None
        self.kernels = root / "kernels"  # TMPDIR of ``warm_kernels``: its mlx/ seeds nodes
        self.nodes: dict[str, Node] = {}
        names = ["head", *(f"w{i}" for i in range(1, workers + 1))]
        for i, name in enumerate(names, start=1):
            args = (["--head", "--port", "6379", "--num-gpus", "0", "--num-cpus", "1",
                     "--include-dashboard", "false"] if name == "head" else
                    ["--address", f"{SUBNET.format(self.id, 1)}:6379", "--num-cpus", "1",
                     "--num-gpus", "1", "--resources", json.dumps({"mlx_gpu": 1})])
            self.nodes[name] = Node(name, SUBNET.format(self.id, i), f"{self.tag}-{name}",
                                    args)

    @property
    def address(self) -> str:
        return f"{self.nodes['head'].ip}:6379"

    def env(self) -> dict[str, str]:
        """What every node's processes start with: no Ray of the host, the lab's token."""
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("RAY_", "PREFECT_", "PYTEST")) and k != "XDG_CACHE_HOME"}
        env.update({"HOME": "/tmp/home", "RAY_AUTH_MODE": "token",
                    "RAY_AUTH_TOKEN": self.token, "PATH": f"{BIN}:{env.get('PATH', '')}",
                    "OPENBLAS_NUM_THREADS": "1",
                    # A killed node is declared dead in seconds (Ray's default: ~30 s).
                    "RAY_health_check_period_ms": "1000",
                    "RAY_health_check_timeout_ms": "1000",
                    "RAY_health_check_failure_threshold": "3"})
        return env

    def _ip(self, *args: str, ns: str | None = None) -> None:
        cmd = ["ip", *(["netns", "exec", ns, "ip"] if ns else []), *args]
        subprocess.run(cmd, check=True, capture_output=True, text=True)

    def _network(self) -> None:
        bridge = f"{self.tag}-br"
        subprocess.run(["ip", "netns", "add", bridge], check=True)
        self._ip("link", "add", "br0", "type", "bridge", ns=bridge)
        self._ip("link", "set", "br0", "up", ns=bridge)
        for i, node in enumerate(self.nodes.values(), start=1):
            subprocess.run(["ip", "netns", "add", node.netns], check=True)
            self._ip("link", "add", f"{self.tag}v{i}", "netns", node.netns, "type", "veth",
                     "peer", "name", f"{self.tag}b{i}", "netns", bridge)
            self._ip("link", "set", f"{self.tag}b{i}", "master", "br0", "up", ns=bridge)
            self._ip("addr", "add", f"{node.ip}/24", "dev", f"{self.tag}v{i}", ns=node.netns)
            self._ip("link", "set", f"{self.tag}v{i}", "up", ns=node.netns)
            self._ip("link", "set", "lo", "up", ns=node.netns)

    def shadow(self, node: str, package: str, edit: str) -> None:
        """Give ``node`` a copy of ``package`` with ``edit`` appended to its __init__.py
        (another Pomona version there), mounted over the real one at its start."""
        copy = self.root / f"shadow-{node}-{package}"
        shutil.copytree(REPO / package, copy, ignore=shutil.ignore_patterns("__pycache__"))
        with (copy / "__init__.py").open("a") as f:
            f.write(f"\n{edit}\n")
        self.nodes[node].shadow[str(REPO / package)] = copy

    def start_node(self, name: str, limit_s: int = 1800) -> None:
        node = self.nodes[name]
        mounts = "".join(f"mount --bind {src} {dst} && " for dst, src in node.shadow.items())
        # Shadows first: their copies lie under the host's /tmp, which the tmpfs hides.
        # MLX's CPU kernels, compiled once on the host (``warm_kernels``), come in on
        # stdin: a fresh node compiles ~15 CPU-s of them again, at every restart.
        script = (f"{mounts}mount -t tmpfs tmpfs /tmp && mkdir -p /tmp/home /tmp/lab && "
                  f"tar -C /tmp -xf - && hostname {name} && exec timeout {limit_s} "
                  f"{BIN}/ray start "
                  f"--node-ip-address {node.ip} --disable-usage-stats --block "
                  + " ".join(f"'{a}'" for a in node.ray_args))
        log = (self.root / f"{name}.log").open("w")
        # A plain `ray start`: no OpenBLAS preload (the driver's reaches trials: placement.py)
        env = {k: v for k, v in self.env().items() if k != "LD_PRELOAD"}
        node.proc = subprocess.Popen(
            ["ip", "netns", "exec", node.netns, "unshare", "--mount", "--uts", "--pid",
             "--fork", "--mount-proc", "bash", "-c", script],
            stdin=subprocess.PIPE, stdout=log, stderr=subprocess.STDOUT, env=env,
            start_new_session=True)
        seed = ["-C", str(self.kernels), "mlx"] if (self.kernels / "mlx").is_dir() else [
            "-T", "/dev/null"]
        node.proc.stdin.write(subprocess.run(["tar", "-cf", "-", *seed], check=True,
                                             capture_output=True).stdout)
        node.proc.stdin.close()
        node.init_pid = self._init_pid(node)

    def warm_kernels(self, model: Path, data: Path) -> None:
        """Compile MLX's CPU kernels for the lab's trials once, on the host, into the
        folder every node start copies into its private ``/tmp`` (tar: no file that a
        compile is still writing, as a shared folder could hand out)."""
        self.kernels.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-m", "engine", "train", "--model", str(model),
                        "--data", str(data), "--out", str(self.root / "warm"), "--steps", "2",
                        "--batch-size", "4", "--lora-rank", "4", "--val-every", "1",
                        "--val-batches", "1", "--segment-size", "2", "--head-chunk", "16"],
                       check=True, capture_output=True, timeout=300,
                       env={**os.environ, "TMPDIR": str(self.kernels)})

    def _init_pid(self, node: Node, wait_s: float = 10.0) -> int:
        """The node's PID 1 (the child of its ``unshare``), as the host sees it."""
        deadline = time.time() + wait_s
        while time.time() < deadline:
            kids = Path(f"/proc/{node.proc.pid}/task/{node.proc.pid}/children")
            for _ in range(2):  # ip netns exec -> unshare -> the node's init
                try:
                    pids = kids.read_text().split()
                except OSError:
                    pids = []
                if not pids:
                    break
                name = Path(f"/proc/{pids[0]}/comm").read_text().strip()
                if name != "unshare":
                    return int(pids[0])
                kids = Path(f"/proc/{pids[0]}/task/{pids[0]}/children")
            time.sleep(0.1)
        raise RuntimeError(f"node {node.name} did not start (see {self.root}/{node.name}.log)")

    def start(self, wait_s: float = 90.0) -> None:
        self._network()
        self.start_node("head")
        self.wait_nodes(1, wait_s)
        for name in self.nodes:
            if name != "head":
                self.start_node(name)
        self.wait_nodes(len(self.nodes), wait_s)

    # One driver on the head answers every count: a new process a poll (import Ray, join
    # the cluster) cost ~2 CPU-s each, tens of times a module on a 2-core box.
    POLLER = ("import sys, ray\nray.init(address='auto', log_to_driver=False)\n"
              "for _ in sys.stdin:\n"
              "    print('alive:', sum(n['Alive'] for n in ray.nodes()), flush=True)\n")

    def alive_nodes(self) -> int:
        """Nodes the head sees alive (0 while it cannot say: starting, or it was lost)."""
        poller = self._poller
        if poller is None or poller.poll() is not None:
            n = self.nodes["head"]
            poller = self._poller = subprocess.Popen(
                ["nsenter", "-t", str(n.init_pid), "-n", "-m", "-u", "-p", "sh", "-c",
                 'cd /tmp/lab && exec "$@"', "poller", f"{BIN}/python", "-u", "-c",
                 self.POLLER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL, env=self.env())
        try:
            poller.stdin.write(b"\n")
            poller.stdin.flush()
            deadline = time.time() + 60
            while time.time() < deadline:
                ready, _, _ = select.select([poller.stdout], [], [], 1.0)
                if not ready:
                    continue
                line = poller.stdout.readline().decode(errors="replace")
                if not line:
                    break  # it exited: the head was down, or not up yet
                if line.startswith("alive: "):  # Ray writes notes to stdout too
                    return int(line.split()[-1])
        except (BrokenPipeError, OSError):
            pass
        self._end_poller()
        return 0

    def _end_poller(self) -> None:
        if self._poller is not None:
            with contextlib.suppress(ProcessLookupError):
                self._poller.kill()
            self._poller.wait(timeout=30)
            self._poller = None

    def wait_nodes(self, count: int, wait_s: float) -> None:
        deadline = time.time() + wait_s
        while self.alive_nodes() != count:
            if time.time() > deadline:
                logs = {n: (self.root / f"{n}.log").read_text()[-1500:] for n in self.nodes}
                raise RuntimeError(f"the lab did not reach {count} nodes: {logs}")
            time.sleep(1.0)

    def run(self, node: str, argv: list[str], timeout: int = 600, check: bool = True,
            stdin: bytes | None = None, cwd: str = "/tmp/lab", env: dict | None = None
            ) -> subprocess.CompletedProcess:
        """``argv`` inside ``node`` (its network, disk, name and PIDs), ended after
        ``timeout`` s by a ``timeout`` inside the node."""
        n = self.nodes[node]
        cmd = ["nsenter", "-t", str(n.init_pid), "-n", "-m", "-u", "-p", "timeout", "-s",
               "KILL", str(timeout), "sh", "-c", 'cd "$0" && exec "$@"', cwd, *argv]
        proc = subprocess.run(cmd, input=stdin, capture_output=True, env=env or self.env(),
                              timeout=timeout + 30)
        out = subprocess.CompletedProcess(proc.args, proc.returncode,
                                          proc.stdout.decode(errors="replace"),
                                          proc.stderr.decode(errors="replace"))
        if check and proc.returncode != 0:
            raise AssertionError(f"{node}: {argv} -> {proc.returncode}\n{out.stdout[-3000:]}"
                                 f"\n{out.stderr[-3000:]}")
        return out

    def put(self, node: str, src: Path, dest: str) -> None:
        """Copy host file or folder ``src`` to ``dest`` on ``node``'s private disk."""
        parent = str(Path(dest).parent)
        data = subprocess.run(["tar", "-C", str(src.parent), "-cf", "-", src.name],
                              check=True, capture_output=True).stdout
        self.run(node, ["sh", "-c", f"mkdir -p {parent} && tar -C {parent} -xf - && "
                        f"[ '{src.name}' = '{Path(dest).name}' ] || "
                        f"mv {parent}/{src.name} {dest}"], stdin=data, cwd="/")

    def get(self, node: str, src: str, dest: Path) -> Path:
        """Copy ``src`` from ``node``'s private disk into host folder ``dest``."""
        dest.mkdir(parents=True, exist_ok=True)
        data = subprocess.run(["nsenter", "-t", str(self.nodes[node].init_pid), "-m",
                               "tar", "-C", str(Path(src).parent), "-cf", "-", Path(src).name],
                              check=True, capture_output=True).stdout
        subprocess.run(["tar", "-C", str(dest), "-xf", "-"], input=data, check=True)
        return dest / Path(src).name

    def kill(self, name: str) -> None:
        """End node ``name`` at once: every process in its namespace (a machine lost)."""
        pids = subprocess.run(["ip", "netns", "pids", self.nodes[name].netns],
                              capture_output=True, text=True).stdout.split()
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGKILL)
        if self.nodes[name].proc is not None:
            self.nodes[name].proc.wait(timeout=30)

    def _link(self, name: str, state: str) -> None:
        i = list(self.nodes).index(name) + 1
        self._ip("link", "set", f"{self.tag}b{i}", state, ns=f"{self.tag}-br")

    def cut(self, name: str) -> None:
        """Cut node ``name`` off the network; everything on it goes on running."""
        self._link(name, "down")

    def uncut(self, name: str) -> None:
        self._link(name, "up")

    def stop(self) -> None:
        self._end_poller()
        for name in self.nodes:
            self.kill(name)
        for name in [*(n.netns for n in self.nodes.values()), f"{self.tag}-br"]:
            subprocess.run(["ip", "netns", "del", name], capture_output=True)


SPEC = ("name: lab\nmodel: unused\ndata: unused\nmax_concurrent: 2\n"
        "fixed: {steps: 6, batch_size: 4, lora_rank: 4, val_every: 3, val_batches: 2, "
        "head_chunk: 16, segment_size: 2}\n"
        "grid: {learning_rate: [1.0e-3, 3.0e-4]}\n")


def stocked_lab(root: Path, model: Path, data: Path):
    """A started Lab whose head holds ``model``, 121 sort pairs and ``SPEC`` under
    /tmp/lab, its nodes' kernels compiled on ``data`` (tokenized pairs for ``model``)
    (generator: stopped after); pytest.skip where namespaces are not allowed."""
    import pytest

    from tasks.data.synthetic import synth_rows, write_rows

    why = namespaces_allowed()
    if why:
        pytest.skip(f"no simulated lab: {why}")
    # 121 rows: an odd train split (101 pairs by prompt), so the gang test's epoch ends on a
    # micro-batch of one pair for two ranks
    raw = write_rows(list(synth_rows("sort", 121, seed=0)), root / "raw" / "sort.jsonl")
    (root / "spec.yaml").write_text(SPEC)
    lab = Lab(root)
    lab.warm_kernels(model, data)
    try:
        lab.start()
        for src, dest in ((model, "/tmp/lab/model"), (raw, "/tmp/lab/sort.jsonl"),
                          (root / "spec.yaml", "/tmp/lab/spec.yaml")):
            lab.put("head", src, dest)
        yield lab
    finally:
        lab.stop()


def pomona(lab: Lab, node: str, *args: str, timeout: int = 400, check: bool = True):
    """The ``pomona`` CLI inside ``node``."""
    return lab.run(node, [f"{BIN}/python", "-m", "cli.main", *args], timeout=timeout,
                   check=check)
