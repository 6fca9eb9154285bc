"""`hybrid` works with what its install command installs: torch, jax, optax, numpy. The
parity extra (torchrec, fbgemm-gpu-cpu, torchmetrics, ...) and the test extra are optional:
importing the packages and starting the training script must not need them."""

import os
import subprocess
import sys
import tomllib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_BLOCKED = """
import importlib.abc, sys
BLOCKED = {blocked!r}

class Blocker(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ImportError(f"{{name}} is not installed (blocked by the test)")
        return None

sys.meta_path.insert(0, Blocker())
"""


def _optional_modules() -> list[str]:
    """Top-level modules of the optional extras (distribution names -> import names)."""
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        extras = tomllib.load(f)["project"]["optional-dependencies"]
    names = {
        "torchrec",
        "fbgemm_gpu",
        "torchmetrics",
        "tensordict",
        "hypothesis",
        "pytest",
        "matplotlib",
        "ruff",
    }
    for dists in extras.values():
        for d in dists:
            base = d.split("[")[0].split("=")[0].split(">")[0].split("<")[0].strip()
            names.add(base.replace("-", "_").removesuffix("_cpu"))
    names.discard("jax")  # the cuda12 extra names jax itself, which is a core dependency
    return sorted(names)


def test_packages_and_the_training_script_import_without_the_optional_extras():
    code = _BLOCKED.format(blocked=_optional_modules())
    code += "import dense_torch, hybrid, sparse_jax, hybrid.demo  # noqa\n"
    code += "from hybrid.train import main\ntry:\n    main(['--help'])\nexcept SystemExit as e:\n    assert e.code == 0, e.code\n"
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "--mesh" in done.stdout


def test_the_blocker_blocks():
    """The import check above would notice a dependency on an optional module."""
    code = _BLOCKED.format(blocked=["torch"]) + "import hybrid\n"
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert done.returncode != 0 and "blocked by the test" in done.stderr
