"""The design card's layering: cli -> flows -> tasks -> engine, engine pure MLX, datasets
data-only; flows/ holds Prefect flows only and the ``pomona`` command line is cli/, its own
package; benchmarks (one home, python -m benchmarks) sit beside flows, above tasks, with no
Prefect or Ray so that a GPU machine with MLX alone runs them."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.unit

FORBIDDEN = {
    "engine": {"prefect", "ray", "rich", "typer", "tqdm", "tasks", "flows", "cli",
               "benchmarks"},
    "tasks": {"flows", "cli", "typer", "benchmarks"},
    "flows": {"cli", "typer", "benchmarks"},
    "benchmarks": {"flows", "cli", "typer", "prefect", "ray"},
}
PACKAGES = ("engine", "tasks", "flows", "cli", "benchmarks")


def imported_roots(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    roots = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            roots |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            roots.add(node.module.split(".")[0])
    return roots


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_imports_point_one_way(package: str) -> None:
    for path in sorted((ROOT / package).rglob("*.py")):
        bad = imported_roots(path) & FORBIDDEN[package]
        assert not bad, f"{path.relative_to(ROOT)} imports {sorted(bad)}"


def test_datasets_is_not_a_package() -> None:
    assert (ROOT / "datasets").is_dir()
    assert not list((ROOT / "datasets").rglob("*.py")), "datasets/ holds data only"


def test_packages_exist() -> None:
    for package in PACKAGES:
        assert (ROOT / package / "__init__.py").is_file()


def defines_a_flow(path: Path) -> bool:
    """Whether ``path`` defines a function decorated ``@flow`` or ``@flow(...)``."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.FunctionDef):
            for dec in node.decorator_list:
                target = dec.func if isinstance(dec, ast.Call) else dec
                if getattr(target, "id", None) == "flow" or getattr(target, "attr", "") == "flow":
                    return True
    return False


def test_flows_holds_flows_and_the_cli_is_its_own_package() -> None:
    """Every flows/ module defines a Prefect flow (issue 53: 9 of its 13 files were the
    command line); the ``pomona`` entry point is cli/'s."""
    loose = [p.name for p in sorted((ROOT / "flows").glob("*.py"))
             if p.name != "__init__.py" and not defines_a_flow(p)]
    assert not loose, f"flows/ modules without a flow: {loose}"
    assert 'pomona = "cli.main:main"' in (ROOT / "pyproject.toml").read_text()
    assert defines_a_flow(ROOT / "flows" / "pipeline.py")
    assert not defines_a_flow(ROOT / "cli" / "main.py")


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: Path, root: Path = ROOT) -> set[str]:
    """Every module ``path`` names in an import, wherever the import stands (a function-level
    import still closes a circle), plus ``package.name`` for each ``from package import
    name`` (a submodule when such a module exists)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    here = module_name(path, root).split(".")
    package = here if path.name == "__init__.py" else here[:-1]
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            found |= {module, *(f"{module}.{a.name}" for a in node.names)}
    return found


def import_graph(package: str, root: Path = ROOT) -> dict[str, set[str]]:
    """Module -> the modules of the same package it imports."""
    paths = {module_name(p, root): p for p in sorted((root / package).rglob("*.py"))}
    return {m: {n for n in imported_modules(p, root) if n in paths and n != m}
            for m, p in paths.items()}


def find_circle(graph: dict[str, set[str]]) -> list[str]:
    """One import circle of ``graph`` as the modules along it (first == last), or []."""
    state: dict[str, str] = {}  # "open" while on the current path, "done" after
    path: list[str] = []

    def visit(module: str) -> list[str]:
        state[module] = "open"
        path.append(module)
        for target in sorted(graph[module]):
            if state.get(target) == "open":
                return [*path[path.index(target):], target]
            if target not in state and (circle := visit(target)):
                return circle
        path.pop()
        state[module] = "done"
        return []

    for module in sorted(graph):
        if module not in state and (circle := visit(module)):
            return circle
    return []


def test_circle_detector_sees_function_level_and_relative_imports(tmp_path: Path) -> None:
    """The detector itself: a circle closed only inside a function, or through a relative
    import, is still one; a chain without a way back is none."""
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("def f():\n    from pkg import b\n")
    (pkg / "b.py").write_text("from .c import x\n")
    (pkg / "c.py").write_text("import pkg.a\n")
    assert find_circle(import_graph("pkg", tmp_path)) == ["pkg.a", "pkg.b", "pkg.c", "pkg.a"]
    (pkg / "c.py").write_text("import os\n")
    assert find_circle(import_graph("pkg", tmp_path)) == []


@pytest.mark.parametrize("package", PACKAGES)
def test_no_import_circle_inside_a_package(package: str) -> None:
    """A circle (a -> b -> a, however long, function-level imports included) means two
    modules are one concept split in two, or one reads the other's insides (issue 26)."""
    circle = find_circle(import_graph(package))
    assert not circle, "import circle: " + " -> ".join(circle)


# Each package's wings, its lowest floor first: a wing imports only the wings listed before
# it, so the folder list reads as the architecture (issue 38). A module outside every wing
# (the engine's cli.py and __main__.py) stands on top and may import any wing.
WINGS = {
    "engine": ("host", "losses", "settings", "model", "data", "forward", "backward", "check",
               "train"),
    "tasks": ("data", "models", "nodes", "eval", "board", "track", "sweep", "prefect"),
}
TOP = {"engine": {"engine", "engine.cli", "engine.__main__"}, "tasks": {"tasks"}}


def wing_of(module: str, package: str, root: Path = ROOT) -> str | None:
    """The wing (``package``'s sub-package) ``module`` lies in, or None for a top module."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and (root / package / parts[1]).is_dir() else None


def wing_violations(package: str, wings: tuple[str, ...], top: set[str],
                    root: Path = ROOT) -> list[str]:
    """Each import that points up between ``package``'s wings or into its top, and each
    module that lies in no wing and is not a top one."""
    floor = {w: i for i, w in enumerate(wings)}
    found = []
    for module, targets in sorted(import_graph(package, root).items()):
        if module in top:
            continue
        here = wing_of(module, package, root)
        if here not in floor:
            found.append(f"{module}: in no wing of {package} (its wings: {', '.join(wings)})")
            continue
        for target in sorted(targets):
            there = wing_of(target, package, root)
            if there is None:
                found.append(f"{module} imports {target}, the top of {package}")
            elif floor.get(there, len(wings)) > floor[here]:
                found.append(f"{module} ({here}) imports {target} ({there}), a higher wing")
    return found


def test_wing_detector(tmp_path: Path) -> None:
    """The detector itself: a wing importing a higher one, a module in no wing and a wing
    importing the top are each seen; imports down, or inside one wing, are not."""
    pkg = tmp_path / "pkg"
    for wing in ("low", "high"):
        (pkg / wing).mkdir(parents=True)
        (pkg / wing / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "cli.py").write_text("from pkg.high import b\n")
    (pkg / "low" / "a.py").write_text("def f():\n    from pkg.high import b\n")
    (pkg / "high" / "b.py").write_text("from pkg.low import a\nfrom .c import x\n")
    (pkg / "high" / "c.py").write_text("import pkg.cli\n")
    (pkg / "loose.py").write_text("")
    top = {"pkg", "pkg.cli"}
    assert wing_violations("pkg", ("low", "high"), top, tmp_path) == [
        "pkg.high.c imports pkg.cli, the top of pkg",
        "pkg.loose: in no wing of pkg (its wings: low, high)",
        "pkg.low.a (low) imports pkg.high (high), a higher wing",
        "pkg.low.a (low) imports pkg.high.b (high), a higher wing"]
    (pkg / "low" / "a.py").write_text("")
    (pkg / "high" / "c.py").write_text("")
    (pkg / "loose.py").unlink()
    assert wing_violations("pkg", ("low", "high"), top, tmp_path) == []


@pytest.mark.parametrize("package", sorted(WINGS))
def test_wings_point_down(package: str) -> None:
    """Every module of engine/ and tasks/ is in a wing, and wings import only lower ones:
    the direction between wings, as between packages (no circle between wings either)."""
    listed = set(WINGS[package])
    folders = {p.name for p in (ROOT / package).iterdir() if (p / "__init__.py").is_file()}
    assert folders == listed, f"{package}/'s wings {sorted(folders)} != listed {sorted(listed)}"
    found = wing_violations(package, WINGS[package], TOP[package])
    assert not found, "\n".join(found)


def private_imports(path: Path) -> list[str]:
    """``from our_module import _name`` in ``path``: another module's private name."""
    tree = ast.parse(path.read_text(), filename=str(path))
    ours = {*PACKAGES, "tests"}
    return [f"line {node.lineno}: from {node.module} import {a.name}"
            for node in ast.walk(tree)
            if isinstance(node, ast.ImportFrom) and node.module and not node.level
            and node.module.split(".")[0] in ours
            for a in node.names if a.name.startswith("_") and not a.name.startswith("__")]


@pytest.mark.parametrize("package", [*PACKAGES, "tests"])
def test_no_module_imports_another_modules_private_names(package: str) -> None:
    """A ``_name`` is its module's inside: make it public or move it (issue 26)."""
    found = [f"{p.relative_to(ROOT)} {line}" for p in sorted((ROOT / package).rglob("*.py"))
             for line in private_imports(p)]
    assert not found, "imports of private names:\n" + "\n".join(found)


RESOLVER = ROOT / "engine" / "model" / "source.py"
HUB_LOOKUPS = {"hf_repo_to_path", "snapshot_download"}


def resolver_leaks(source: str) -> list[str]:
    """What decides where a ``--model`` lives, or reads its config, outside the resolver:
    a looks-local rule (``count("/")``, ``startswith(("/", ".", "~"))``), a hub lookup, or
    ``… / "config.json"`` that is not the ``config_path=`` a writer (``save_config``) gets."""
    tree = ast.parse(source)
    written = {id(k.value) for node in ast.walk(tree) if isinstance(node, ast.Call)
               for k in node.keywords if k.arg == "config_path"}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and (
                (node.func.attr == "count" and any(isinstance(a, ast.Constant)
                                                   and a.value == "/" for a in node.args))
                or (node.func.attr == "startswith" and "~" in {
                    getattr(e, "value", None) for a in node.args for e in ast.walk(a)})):
            found.append(f"line {node.lineno}: a looks-local rule")
        elif (isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div)
              and isinstance(node.right, ast.Constant) and node.right.value == "config.json"
              and id(node) not in written):
            found.append(f"line {node.lineno}: a config.json read")
        elif ((isinstance(node, ast.Name) and node.id in HUB_LOOKUPS)
              or (isinstance(node, ast.Attribute) and node.attr in HUB_LOOKUPS)
              or (isinstance(node, ast.alias) and node.name in HUB_LOOKUPS)):
            found.append(f"line {node.lineno}: a hub lookup")
    return found


def test_resolver_leak_detector() -> None:
    """The detector itself: each way a second resolver crept in before (tasks/sweep/run.py's
    ``count("/") > 1``, engine/data/data_fit.py's ``startswith``, a hub lookup in
    tasks/data/tokenize.py and engine/model/content_key.py, a raw config read in
    tasks/sweep/memory_probe.py) is seen; writing a config is not a read."""
    leaks = resolver_leaks('local = model.count("/") > 1 or m.startswith(("/", "~"))\n'
                           'from huggingface_hub import snapshot_download\n'
                           'import mlx_lm.utils\np = mlx_lm.utils.hf_repo_to_path(m)\n'
                           'c = Path(m) / "config.json"\n')
    assert sorted(line.split(":")[0] for line in leaks) == ["line 1", "line 1", "line 2",
                                                             "line 4", "line 5"]
    assert resolver_leaks('save_config(c, config_path=out / "config.json")\n'
                          'n = text.count("a") + name.startswith("_")\n') == []


@pytest.mark.parametrize("package", ["engine", "tasks", "flows", "cli"])
def test_one_model_resolver(package: str) -> None:
    """Whether ``--model`` is a directory, a .gguf or a repo id, and its config.json, are
    engine/model/source.py's alone (issue 26: four rules had drifted apart)."""
    found = [f"{p.relative_to(ROOT)} {leak}" for p in sorted((ROOT / package).rglob("*.py"))
             if p != RESOLVER for leak in resolver_leaks(p.read_text())]
    assert not found, "use engine/model/source.py (source_kind, model_dir, read_config):\n" \
        + "\n".join(found)


SETUP = ROOT / "engine" / "train" / "prepared.py"
SETUP_CALLS = {"load_model", "checked_stack", "attach_lora", "chunk_mlps", "mlp_chunks",
               "load_reference_model"}
# Calls of a set-up step outside engine/train/prepared.py that set up no config's model, each
# with why: the float32 copy of a model already set up, the check's own internals, the
# benchmarks of random-init shapes (no checkpoint, no TrainConfig).
SETUP_ELSEWHERE = {
    "engine/model/recompute.py": {"chunk_mlps"},  # mlp_chunks is chunk_mlps undone after
    "engine/check/load_check.py": {"chunk_mlps", "mlp_chunks"},  # --verify's copy and plain path
    "engine/check/check_copy.py": {"attach_lora"},  # the copy's LoRA, from the model's own
    "benchmarks/check_bench.py": {"checked_stack"},  # the check of a mutated stack
    "benchmarks/bench_model.py": {"attach_lora"},  # random-init shapes
    "benchmarks/row_runner.py": {"chunk_mlps"},
    "benchmarks/layer_memory.py": {"chunk_mlps"},
    "engine/model/gguf_export.py": {"load_model"},  # fused for export: no stack, no levers
    # a pack's LoRA: its projections chosen as a lone adapter's are, then one per adapter
    "engine/model/packed_lora.py": {"attach_lora"},
}


def setup_calls(source: str) -> list[tuple[int, str]]:
    """(line, name) of each call of a set-up step (``f(...)`` or ``mod.f(...)``)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call):
            name = getattr(node.func, "id", None) or getattr(node.func, "attr", None)
            if name in SETUP_CALLS:
                found.append((node.lineno, name))
    return found


def test_setup_call_detector() -> None:
    assert setup_calls("m, t = load_model(p)\ns, _ = load_check.checked_stack(m)\n"
                       "def load_model(x): pass\n") == [(1, "load_model"), (2, "checked_stack")]


@pytest.mark.parametrize("package", PACKAGES)
def test_one_model_setup(package: str) -> None:
    """Loading, LoRA, the load check and the levers are engine/train/prepared.py's alone: five
    copies had drifted apart, and the probe measured a path training did not take (its
    MLPs unchunked: issue 38)."""
    found = []
    for path in sorted((ROOT / package).rglob("*.py")):
        rel = str(path.relative_to(ROOT))
        if path == SETUP:
            continue
        found += [f"{rel} line {line}: {name}" for line, name in setup_calls(path.read_text())
                  if name not in SETUP_ELSEWHERE.get(rel, set())]
    assert not found, "set the model up through engine/train/prepared.py:\n" + "\n".join(found)


MAX_LINES = 400  # a file longer than this holds more than one concept (issue 38)
# Floors held shorter: where the next keys land, so a split comes by concept (issue 71).
SHORTER = {"tasks/sweep": 330}


@pytest.mark.parametrize("package", [*PACKAGES, "tests", *SHORTER])
def test_no_file_over_400_lines(package: str) -> None:
    limit = SHORTER.get(package, MAX_LINES)
    long = [f"{p.relative_to(ROOT)}: {n} lines" for p in sorted((ROOT / package).rglob("*.py"))
            if (n := len(p.read_text().splitlines())) > limit]
    assert not long, f"over {limit} lines (split by concept):\n" + "\n".join(long)


MAX_FUNCTION_LINES = 60  # a longer function holds more than one step (issue 53)
LONG_FUNCTIONS: dict[str, str] = {}  # "path:function" -> why it stays long
SHORT_FLOORS = ("engine/train", "tasks/sweep")


def long_functions(path: Path) -> list[str]:
    """``name (N lines)`` of each function in ``path`` over MAX_FUNCTION_LINES."""
    return [f"{node.name} ({node.end_lineno - node.lineno + 1} lines)"
            for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
            and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES
            and f"{path.relative_to(ROOT)}:{node.name}" not in LONG_FUNCTIONS]


@pytest.mark.parametrize("floor", SHORT_FLOORS)
def test_no_long_function_in_the_loop_or_the_sweep(floor: str) -> None:
    """engine/train/ and tasks/sweep/ read top to bottom: no function over 60 lines (the
    trainer's loop was 130), or a listed exception with its reason."""
    found = [f"{p.relative_to(ROOT)}: {f}" for p in sorted((ROOT / floor).rglob("*.py"))
             for f in long_functions(p)]
    assert not found, f"over {MAX_FUNCTION_LINES} lines:\n" + "\n".join(found)


RECIPES = ("engine.train.trainer", "engine.train.pack_trainer", "engine.train.grpo_trainer")


def test_no_recipe_imports_another() -> None:
    """The lone, pack and GRPO trainers each call the shared parts (engine/train/run_parts.py)
    in their own order; none is another's library (the pack imported 9 names from the lone
    trainer, issue 71)."""
    found = [f"{r} imports {other}" for r in RECIPES for other in RECIPES if other != r
             and other in imported_modules(ROOT / (r.replace(".", "/") + ".py"))]
    assert not found, found
