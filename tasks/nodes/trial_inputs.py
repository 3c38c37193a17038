"""A trial's files across nodes: its inputs by content, its results back to the driver.

The driver (``InputServer``) lists every local input a trial reads — the model (a folder or
a GGUF file; a Hub id is each node's own download), the data, a warm start, a DPO reference
adapter, a reference log-prob file — as ``Bundle``s when the trial is planned, and serves
them from its node (tasks/nodes/node_files.py). The trial's process (``localised``) trains on
exactly those bytes: its config's paths point at this node's copies, and it trains in a
node-local scratch folder (``scratch_dir``). Its outputs come back as a ``Bundle`` the
driver pulls into ``<sweep>/<trial>/`` (``pull_outputs``): only the driver writes the sweep
folder, so a process orphaned by a lost node can neither block a retry nor overwrite a
result. ``MetricsBox`` carries the trial's metric lines to the driver while it trains, so
its log follows it in the Prefect UI.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import shutil
import socket
import sys
import uuid
from pathlib import Path
from typing import Any

from engine.host.cache import cache_root
from engine.host.scratch import process_alive
from engine.settings.config import TrainConfig
from engine.settings.reference_kind import adapter_path
from tasks.nodes.node_files import Bundle, fetch, file_server, server_reader

FIELDS = ("model", "data", "warm_start", "reference", "reference_logps")  # paths a trial reads
SKIP_OUTPUTS = ("checkpoints",)  # resume state stays on the node; a retry starts afresh


def input_paths(config: TrainConfig) -> dict[str, str]:
    """The local paths ``config`` reads, by field (a Hub id or the base reference is none)."""
    return {f: p for f, p in named_paths(config).items() if p and Path(p).exists()}


def named_paths(config: TrainConfig) -> dict[str, str | None]:
    """Each input field's path as ``config`` names it (None: not set, or the base)."""
    return {**{f: getattr(config, f) for f in FIELDS},
            "reference": adapter_path(config.reference)}


class InputServer:
    """The driver's side: each input listed once (its bytes as planned) and served."""

    def __init__(self) -> None:
        self.bundles: dict[str, Bundle] = {}  # path -> its bundle, as first listed
        self.server: Any = None

    def for_config(self, config: TrainConfig, modules: dict[str, str] | None = None
                   ) -> dict[str, Any]:
        """What a trial's process needs to fetch ``config``'s inputs and import ``modules``
        (a ``python:`` reward's, by name: its file or package folder) (plain values and the
        server's handle, for Ray)."""
        return self.for_paths(input_paths(config), modules)

    def for_paths(self, paths: dict[str, str], modules: dict[str, str] | None = None
                  ) -> dict[str, Any]:
        """What a process on another node needs to fetch ``paths`` (by name) and import
        ``modules``."""
        listed = {field: self.listed(path) for field, path in paths.items()}
        code = {name: self.listed(path) for name, path in (modules or {}).items()}
        if (listed or code) and self.server is None:
            self.server = file_server(list(self.bundles.values()))
        return {"bundles": listed, "modules": code, "server": self.server}

    def listed(self, path: str) -> dict[str, Any]:
        """``path``'s bundle, as first listed (a new one: a server that serves it too)."""
        if path not in self.bundles:
            self.bundles[path] = Bundle.of(path)
            self.server = None
        return self.bundles[path].to_dict()


def localised(config: TrainConfig, inputs: dict[str, Any] | None, trial_id: str
              ) -> tuple[TrainConfig, dict[str, str]]:
    """``config`` with its inputs on this node (fetched by content where this node lacks
    their bytes) and its ``out`` a fresh scratch folder; and the map back from each local
    path to the driver's. InputChanged / OSError name the file that could not be had."""
    local = fetched(inputs)
    importable(inputs)
    named = named_paths(config)
    back = {path: named[field] for field, path in local.items()}
    changes = {"out": str(scratch_dir(trial_id)), **local}
    return dataclasses.replace(config, **changes), back


def fetched(inputs: dict[str, Any] | None) -> dict[str, str]:
    """This node's path of each of ``inputs`` (``InputServer.for_paths``), by name."""
    return {name: fetch(Bundle.from_dict(data), server_reader(inputs["server"],
                                                              data["digest"]))
            for name, data in ((inputs or {}).get("bundles") or {}).items()}


def importable(inputs: dict[str, Any] | None) -> dict[str, str]:
    """Each module ``inputs`` carries (a ``python:`` reward's) imported in this process from
    this node's copy of the bytes the sweep planned with, ahead of any other on sys.path
    (a node's own older copy never scores); its copy's path by name. RuntimeError naming
    the module when it cannot be imported from there: never a silent zero reward."""
    copies = {}
    for name, data in ((inputs or {}).get("modules") or {}).items():
        copy = Path(fetch(Bundle.from_dict(data), server_reader(inputs["server"],
                                                                data["digest"])))
        if str(copy.parent) not in sys.path:
            sys.path.insert(0, str(copy.parent))
        top = name.split(".")[0]
        for stale in [k for k in sys.modules if k == top or k.startswith(f"{top}.")]:
            del sys.modules[stale]
        importlib.invalidate_caches()
        try:
            module = importlib.import_module(name)
        except KeyboardInterrupt:
            raise
        except BaseException as err:  # a lab's module: anything at import, sys.exit too
            raise RuntimeError(f"reward module {name}: cannot import the sweep's copy "
                               f"({type(err).__name__}: {err})") from None
        found = Path(getattr(module, "__file__", None) or "?").resolve()
        if not (found == copy.resolve() or found.is_relative_to(copy.resolve())):
            raise RuntimeError(f"reward module {name}: imported from {found}, not the "
                               f"sweep's copy {copy}")
        copies[name] = str(copy)
    return copies


def scratch_dir(trial_id: str) -> Path:
    """A new folder for one attempt of a trial on this node (never shared by two): under
    the host's name, so that nodes sharing a home folder never judge each other's pids."""
    return (cache_root() / "scratch" / socket.gethostname()
            / f"{trial_id}-{os.getpid()}-{uuid.uuid4().hex[:8]}")


def remove_stale_scratch() -> list[Path]:
    """This host's scratch folders whose attempt's process is gone (its node was cut off
    or killed mid-trial, or the driver was lost before it pulled them): removed, as
    Pomona's own; the folders removed."""
    mine, gone = cache_root() / "scratch" / socket.gethostname(), []
    for folder in sorted(mine.iterdir()) if mine.is_dir() else []:
        pid = folder.name.rsplit("-", 2)[-2] if folder.name.count("-") >= 2 else ""
        if pid.isdigit() and not process_alive(int(pid)):
            shutil.rmtree(folder, ignore_errors=True)
            gone.append(folder)
    return gone


def outputs_bundle(out: str, back: dict[str, str]) -> Bundle:
    """The attempt's outputs, with the adapter config's paths put back to the driver's (a
    one-node run records those), listed for the driver to pull."""
    config = Path(out) / "adapter_config.json"
    if config.exists() and back:
        data = json.loads(config.read_text())
        for key, value in data.items():
            if isinstance(value, str) and value in back:
                data[key] = back[value]
        config.write_text(json.dumps(data, indent=2) + "\n")
    return Bundle.of(out, skip=SKIP_OUTPUTS)


def remove_scratch(out: str) -> None:
    """The attempt's scratch folder, once the driver has its files (Pomona's own)."""
    path = Path(out)
    if path.is_relative_to(cache_root() / "scratch"):
        shutil.rmtree(path, ignore_errors=True)


class MetricsBox:
    """A Ray actor on the driver's node: metric lines trials send while they train."""

    def __init__(self) -> None:
        self.lines: dict[str, list[str]] = {}

    def add(self, trial_id: str, line: str) -> None:
        self.lines.setdefault(trial_id, []).append(line)

    def take(self, trial_id: str) -> list[str]:
        return self.lines.pop(trial_id, [])


class SendMetrics:
    """Engine callback: each metrics record as a JSON line to the driver's ``MetricsBox``."""

    def __init__(self, box: Any, trial_id: str):
        self.box, self.trial_id = box, trial_id

    def on_metrics(self, record: dict[str, Any]) -> None:
        self.box.add.remote(self.trial_id, json.dumps(record, default=str))


def metrics_box() -> Any:
    """A ``MetricsBox`` pinned to this (the driver's) node."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
    return ray.remote(num_cpus=0)(MetricsBox).options(scheduling_strategy=here).remote()
