"""The one rule: sparse_jax never imports torch, dense_torch never imports jax.

Inside sparse_jax, the plan types (`sparse_jax.plan`) import neither the planner nor the
sharded runtime, and the planner (`sparse_jax.planner`) does not import the runtime
(`sparse_jax.sharding`): plans flow planner -> plan -> runtime, never back."""

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


@pytest.mark.parametrize(
    ("package", "forbidden"),
    [
        ("sparse_jax", {"torch", "dense_torch", "hybrid"}),
        ("dense_torch", {"jax", "jaxlib", "sparse_jax", "hybrid"}),
    ],
)
def test_source_never_imports_the_other_framework(package, forbidden):
    assert not _imported_modules(package) & forbidden


@pytest.mark.parametrize(
    ("package", "forbidden"), [("sparse_jax", "torch"), ("dense_torch", "jax")]
)
def test_importing_the_package_loads_no_other_framework(package, forbidden):
    code = f"import sys, {package}; assert {forbidden!r} not in sys.modules, sorted(m for m in sys.modules if m.startswith({forbidden!r}))"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, timeout=600)


def _full_imports(source: str, module: str, *, is_package: bool = False) -> set[str]:
    """Every module that `source` (module `module`) imports, lazy imports too, as absolute
    dotted names; for `from m import a` both `m` and `m.a` (a may be a submodule)."""
    package = module.split(".") if is_package else module.split(".")[:-1]
    names = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            target = ".".join([*base, *([node.module] if node.module else [])])
            names.add(target)
            names.update(f"{target}.{alias.name}" for alias in node.names)
    return names


def _module_imports(path: pathlib.Path) -> set[str]:
    parts = path.relative_to(ROOT).with_suffix("").parts
    if path.name == "__init__.py":
        return _full_imports(path.read_text(), ".".join(parts[:-1]), is_package=True)
    return _full_imports(path.read_text(), ".".join(parts))


def test_full_imports_resolves_every_form():
    source = (
        "import sparse_jax.sharding\nfrom sparse_jax import plan\nfrom ..sharding import _work\n"
        "def f():\n    from . import _x\n"
    )
    assert _full_imports(source, "sparse_jax.planner._a") >= {
        "sparse_jax.sharding",
        "sparse_jax.plan",
        "sparse_jax.sharding._work",
        "sparse_jax.planner._x",
    }
    assert "sparse_jax.planner._x" in _full_imports(
        "from . import _x", "sparse_jax.planner", is_package=True
    )


@pytest.mark.parametrize(
    ("package", "forbidden"),
    [
        ("sparse_jax/planner", ("sparse_jax.sharding",)),
        ("sparse_jax/plan", ("sparse_jax.sharding", "sparse_jax.planner")),
    ],
)
def test_plans_flow_from_planner_to_runtime_only(package, forbidden):
    paths = sorted((ROOT / package).rglob("*.py"))
    assert paths, f"no modules under {package}"
    bad = {
        str(path.relative_to(ROOT)): sorted(
            n
            for n in _module_imports(path)
            if any(n == f or n.startswith(f + ".") for f in forbidden)
        )
        for path in paths
    }
    assert not {k: v for k, v in bad.items() if v}, f"{package} must not import {forbidden}"


def test_importing_the_planner_loads_no_sharded_runtime():
    code = "import sys, sparse_jax.planner; assert not [m for m in sys.modules if m.startswith('sparse_jax.sharding')]"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, timeout=600)


def test_checkpoints_import_neither_the_training_script_nor_the_training_package():
    """The checkpoint preflight raises `hybrid._errors.ConfigError`; it does not reach into
    `hybrid.train` (the script) or `hybrid.training` (its config) for it."""
    paths = sorted((ROOT / "hybrid" / "checkpoint").rglob("*.py"))
    assert paths, "no modules under hybrid/checkpoint"
    forbidden = ("hybrid.train", "hybrid.training")
    bad = {
        str(path.relative_to(ROOT)): sorted(
            n
            for n in _module_imports(path)
            if any(n == f or n.startswith(f + ".") for f in forbidden)
        )
        for path in paths
    }
    assert not {k: v for k, v in bad.items() if v}
