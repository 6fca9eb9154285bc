"""The one rule: sparse_jax never imports torch, dense_torch never imports jax."""

import ast
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _imported_modules(package: str) -> set[str]:
    names = set()
    for path in (ROOT / package).rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                names.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names.add(node.module.split(".")[0])
    return names


@pytest.mark.parametrize(("package", "forbidden"), [("sparse_jax", {"torch", "dense_torch", "hybrid"}), ("dense_torch", {"jax", "jaxlib", "sparse_jax", "hybrid"})])
def test_source_never_imports_the_other_framework(package, forbidden):
    assert not _imported_modules(package) & forbidden


@pytest.mark.parametrize(("package", "forbidden"), [("sparse_jax", "torch"), ("dense_torch", "jax")])
def test_importing_the_package_loads_no_other_framework(package, forbidden):
    code = f"import sys, {package}; assert {forbidden!r} not in sys.modules, sorted(m for m in sys.modules if m.startswith({forbidden!r}))"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)
