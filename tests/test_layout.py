"""The design card's layering: flows -> tasks -> engine, engine pure MLX, datasets data-only;
benchmarks (one home, python -m benchmarks) sit beside flows, above tasks, with no Prefect or
Ray so that a GPU machine with MLX alone runs them."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.unit

FORBIDDEN = {
    "engine": {"prefect", "ray", "rich", "typer", "tqdm", "tasks", "flows", "benchmarks"},
    "tasks": {"flows", "typer", "benchmarks"},
    "benchmarks": {"flows", "typer", "prefect", "ray"},
}


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
    for package in ("engine", "tasks", "flows", "benchmarks"):
        assert (ROOT / package / "__init__.py").is_file()
