"""The C++ lookup kernel for the serving process: `register(target) -> None | reason`, and
`library()`, the loaded library (`_direct` calls its plain C entry).

An artifact's "cpu_kernel" lookup programs hold a custom call (`HybridrecQuantPooled`) that
XLA compiles only once the target is registered in this process. The kernel lives in
sparse_jax's shared library (`sparse_jax/_kernels/build.py` builds and caches it under
`$HYBRIDREC_CACHE`); this module finds that library without importing sparse_jax (whose
package import pulls in the training library): when sparse_jax has already registered its
kernels in this process it reuses that, otherwise it loads `build.py` alone from the
sparse_jax source tree (`importlib.util.find_spec` does not import the package; `build.py`
needs only the standard library and jax), gets the verified library from it (built if
missing, as sparse_jax's first use would) and registers the target with `jax.ffi`.

Anything in the way (sparse_jax not installed, no compiler to build the library, a CPU
without the library's instructions, JAX's default backend not CPU) gives the reason as a
string: the predictor then runs the artifact's XLA programs and says so
(`Predictor.lookup`, `Predictor.lookup_fallback`).
"""

from __future__ import annotations

import ctypes
import functools
import importlib.util
import pathlib
import sys

import jax

__all__ = ["library", "register"]

_LIBS: list = []  # loaded libraries, kept alive


def _build_module():
    """sparse_jax's `_kernels/build.py` as a module of its own (sparse_jax not imported)."""
    spec = importlib.util.find_spec("sparse_jax")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("sparse_jax (which holds the kernel's source) is not installed")
    path = pathlib.Path(list(spec.submodule_search_locations)[0]) / "_kernels" / "build.py"
    if not path.is_file():
        raise RuntimeError(f"sparse_jax's kernel build script {path} is missing")
    module_spec = importlib.util.spec_from_file_location("hybrid.serving._kernel_build", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module


@functools.cache
def library() -> ctypes.CDLL | str:
    """sparse_jax's CPU kernel library loaded in this process (the same handle sparse_jax
    registered, when it did: one file), or why it cannot be (nothing raises)."""
    try:
        lib = ctypes.cdll.LoadLibrary(str(_build_module().build()))
    except (RuntimeError, OSError, ImportError) as e:
        return f"the C++ kernel library is unavailable ({type(e).__name__}: {e})"
    _LIBS.append(lib)
    return lib


@functools.cache
def register(target: str) -> str | None:
    """Register the custom-call `target` (a symbol of sparse_jax's CPU kernel library) for
    CPU; None when it is registered, else why it cannot be (nothing raises)."""
    if jax.default_backend() != "cpu":
        return f"JAX's default backend is {jax.default_backend()}, the kernel runs on CPU only"
    sparse_jax = sys.modules.get("sparse_jax")
    if sparse_jax is not None:  # loaded here: its registration covers the target
        return sparse_jax.cpu_kernels_problem(target)
    lib = library()
    if isinstance(lib, str):
        return lib
    handler = getattr(lib, target, None)
    if handler is None:
        return f"the C++ kernel library has no {target}"
    jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(handler), platform="cpu")
    return None
