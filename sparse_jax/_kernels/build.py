"""Build the fused CPU kernels (`embedding_cpu.cc`) into a shared library, once.

`make` runs `python -m sparse_jax._kernels.build` at set-up; otherwise the first use builds
it. The library is cached under `$HYBRIDREC_CACHE` (default `~/.cache/hybridrec`), keyed by
the source, the jaxlib version and the compiler flags, so a change rebuilds it. Needs g++
(C++17, OpenMP) and jaxlib's XLA FFI headers (`jax.ffi.include_dir()`); nothing is downloaded.
"""

from __future__ import annotations

import hashlib
import os
import pathlib
import shutil
import subprocess
import tempfile

__all__ = ["build", "library_path"]

SOURCE = pathlib.Path(__file__).with_name("embedding_cpu.cc")
FLAGS = ["-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-std=c++17", "-w"]


def library_path() -> pathlib.Path:
    import jaxlib

    key = hashlib.sha256(SOURCE.read_bytes() + jaxlib.__version__.encode() + " ".join(FLAGS).encode()).hexdigest()[:16]
    cache = pathlib.Path(os.environ.get("HYBRIDREC_CACHE", pathlib.Path.home() / ".cache" / "hybridrec"))
    return cache / f"libhybridrec_cpu_{key}.so"


def build(verbose: bool = False) -> pathlib.Path:
    """Compile if the cached library is missing; returns its path. Raises RuntimeError on failure."""
    import jax

    target = library_path()
    if target.exists():
        return target
    compiler = shutil.which(os.environ.get("CXX", "g++"))
    if compiler is None:
        raise RuntimeError("no C++ compiler (g++) found to build hybridrec's CPU kernels; set CXX or use kernel='xla'")
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        out = pathlib.Path(tmp) / target.name
        cmd = [compiler, *FLAGS, f"-I{jax.ffi.include_dir()}", str(SOURCE), "-o", str(out)]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"building hybridrec's CPU kernels failed ({' '.join(cmd)}):\n{done.stderr[-4000:]}")
        os.replace(out, target)  # atomic: concurrent builders never see a partial file
    if verbose:
        print(f"built {target}")
    return target


if __name__ == "__main__":
    build(verbose=True)
