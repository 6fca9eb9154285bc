"""GPU settings that must be in the environment before JAX starts its backends.

Torch and JAX share each GPU in the process model (one process per accelerator), so:

- `XLA_PYTHON_CLIENT_PREALLOCATE=false`: by default XLA grabs 75% of GPU memory at its
  first operation and torch's allocator then runs out. Turning preallocation off (or
  giving XLA a fixed share with `XLA_PYTHON_CLIENT_MEM_FRACTION`) lets both allocate.
- `--xla_backend_extra_options=-nvptx-allow-ftz-atomics` in `XLA_FLAGS` on jaxlib
  0.10.x - 0.11.0: without it f32 scatter-add (the sparse update's scatter, segment sums)
  is lowered to a slow CAS loop on NVIDIA GPUs (jax#38806). The option names an NVPTX
  (LLVM) flag, so it is only added when a CUDA plugin for jax is installed: a CPU-only
  jaxlib would reject it.

Call `configure_gpu_env()` first thing in a training script (before any JAX operation;
importing jax is fine). It is harmless on CPU. Settings the user already made are kept.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
from collections.abc import MutableMapping

__all__ = ["FTZ_ATOMICS_FLAG", "configure_gpu_env"]

FTZ_ATOMICS_FLAG = "--xla_backend_extra_options=-nvptx-allow-ftz-atomics"
_CUDA_PLUGINS = ("jax_cuda12_plugin", "jax_cuda13_plugin")


def _jaxlib_needs_ftz_flag() -> bool:
    try:
        parts = importlib.metadata.version("jaxlib").split(".")
        version = tuple(int(p) for p in parts[:3])
    except (importlib.metadata.PackageNotFoundError, ValueError):
        return False
    return (0, 10, 0) <= version <= (0, 11, 0)


def _cuda_plugin_installed() -> bool:
    return any(importlib.util.find_spec(name) is not None for name in _CUDA_PLUGINS)


def _backends_started() -> bool:
    try:
        from jax._src import xla_bridge
    except ImportError:  # jax not installed or moved: nothing started by it either
        return False
    started = getattr(xla_bridge, "backends_are_initialized", None)
    return bool(started and started())


def configure_gpu_env(
    environ: MutableMapping[str, str] | None = None,
    *,
    memory_fraction: float | None = None,
    ftz_atomics: bool | None = None,
) -> dict[str, str]:
    """Set the GPU environment for torch + JAX in one process; returns what it changed.

    Args:
      environ: the mapping to edit (default `os.environ`; pass a dict to inspect the result).
      memory_fraction: give XLA this share of each GPU (`XLA_PYTHON_CLIENT_MEM_FRACTION`)
        instead of turning preallocation off.
      ftz_atomics: add the ftz-atomics flag (True), leave it out (False), or decide from the
        installed jaxlib version and CUDA plugin (None, default).

    Raises RuntimeError when editing `os.environ` after JAX's backends started (the
    settings would be ignored): call it before the first JAX operation.
    """
    if environ is None:
        if _backends_started():
            raise RuntimeError(
                "configure_gpu_env() ran after JAX initialized its backends, so XLA would "
                "ignore the settings; call it before the first JAX operation (right after "
                "the imports of your training script)"
            )
        environ = os.environ
    changed: dict[str, str] = {}
    if memory_fraction is not None:
        if not 0.0 < memory_fraction <= 1.0:
            raise ValueError(
                f"configure_gpu_env: memory_fraction={memory_fraction} must be in (0, 1]"
            )
        if "XLA_PYTHON_CLIENT_MEM_FRACTION" not in environ:
            changed["XLA_PYTHON_CLIENT_MEM_FRACTION"] = f"{memory_fraction:g}"
    elif (
        "XLA_PYTHON_CLIENT_PREALLOCATE" not in environ
        and "XLA_PYTHON_CLIENT_MEM_FRACTION" not in environ
    ):
        changed["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
    if ftz_atomics is None:
        ftz_atomics = _jaxlib_needs_ftz_flag() and _cuda_plugin_installed()
    flags = environ.get("XLA_FLAGS", "")
    if ftz_atomics and FTZ_ATOMICS_FLAG not in flags.split():
        changed["XLA_FLAGS"] = f"{flags} {FTZ_ATOMICS_FLAG}".strip()
    environ.update(changed)
    return changed
