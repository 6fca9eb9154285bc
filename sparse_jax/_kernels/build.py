"""Build the fused CPU kernels (`SOURCES`: `embedding_cpu.cc`, `mc_remap_cpu.cc`,
`random_cpu.cc`, and `interaction_cpu.cc` for the served dense tower) into one shared
library, once.

`make` runs `python -m sparse_jax._kernels.build` at set-up; otherwise the first use builds
it. The library is cached under `$HYBRIDREC_CACHE` (default `~/.cache/hybridrec`), keyed by
the source, the jaxlib version and the compiler flags, so a change rebuilds it. Needs g++
(C++17, OpenMP) and jaxlib's XLA FFI headers (`jax.ffi.include_dir()`); nothing is downloaded.

Each library has a sidecar record (`<library>.json`, written after the library) holding the
sha256 of the source it was compiled from, the compiler, the flags, the jaxlib version and
the sha256 of the built `.so`. `build()` reuses a cached library only when that record
matches the current source, compiler, flags and jaxlib and the `.so` bytes still hash to
the recorded value; otherwise (no record, edited source, altered or truncated `.so`) it
logs a warning on `hybridrec.kernels` and rebuilds. If it cannot build, it raises
RuntimeError and the caller (`_ffi`) falls back to the XLA path with a warning.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import pathlib
import shutil
import subprocess
import tempfile

__all__ = ["build", "library_path", "record_path"]

log = logging.getLogger("hybridrec.kernels")

SOURCES = tuple(
    pathlib.Path(__file__).with_name(name)
    for name in ("embedding_cpu.cc", "mc_remap_cpu.cc", "random_cpu.cc", "interaction_cpu.cc")
)
FLAGS = [
    "-O3",
    "-march=native",
    "-fno-math-errno",
    "-fopenmp",
    "-fPIC",
    "-shared",
    "-std=c++17",
    "-w",
]


def _sha256(path: pathlib.Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def source_bytes() -> bytes:
    """Every source file's name and bytes, in order: what a library is built from."""
    return b"".join(p.name.encode() + b"\0" + p.read_bytes() for p in SOURCES)


def cache_dir() -> pathlib.Path:
    return pathlib.Path(
        os.environ.get("HYBRIDREC_CACHE", pathlib.Path.home() / ".cache" / "hybridrec")
    )


def library_path() -> pathlib.Path:
    import jaxlib

    key = hashlib.sha256(
        source_bytes() + jaxlib.__version__.encode() + " ".join(FLAGS).encode()
    ).hexdigest()[:16]
    return cache_dir() / f"libhybridrec_cpu_{key}.so"


def record_path(library: pathlib.Path) -> pathlib.Path:
    """The sidecar record of a built library."""
    return library.with_suffix(".json")


def _compiler() -> str | None:
    return shutil.which(os.environ.get("CXX", "g++"))


def _expected(compiler: str | None) -> dict:
    """What the record of a library built from the current inputs must say (less its hash)."""
    import jaxlib

    return {
        "source_sha256": hashlib.sha256(source_bytes()).hexdigest(),
        "compiler": compiler,
        "flags": FLAGS,
        "jaxlib": jaxlib.__version__,
    }


def _stale(target: pathlib.Path, compiler: str | None) -> str | None:
    """Why the cached `target` may not be reused, or None when it checks out."""
    if not target.exists():
        return "not built yet"
    try:
        record = json.loads(record_path(target).read_text())
    except (OSError, ValueError) as err:
        return f"no readable build record {record_path(target).name} ({type(err).__name__})"
    if not isinstance(record, dict):
        return f"build record {record_path(target).name} is not a JSON object"
    for field, value in _expected(compiler).items():
        if field == "compiler" and compiler is None:
            continue  # no compiler here to compare with: judge the library by its bytes
        if record.get(field) != value:
            return f"built from a different {field} ({record.get(field)!r}, now {value!r})"
    actual = _sha256(target)
    if record.get("so_sha256") != actual:
        return f"library bytes changed (sha256 {actual}, recorded {record.get('so_sha256')})"
    return None


def _compile(compiler: str, out: pathlib.Path) -> None:
    """Each source compiled to an object beside `out` (all at once: one compiler process per
    source), then linked into `out`."""
    import jax

    include = f"-I{jax.ffi.include_dir()}"
    objects = [out.with_name(f"{source.stem}.o") for source in SOURCES]
    steps = [
        [compiler, *FLAGS, include, "-c", str(source), "-o", str(obj)]
        for source, obj in zip(SOURCES, objects, strict=True)
    ]
    running = [
        (cmd, subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
        for cmd in steps
    ]
    for cmd, proc in running:
        _, err = proc.communicate()
        if proc.returncode != 0:
            raise RuntimeError(
                f"building hybridrec's CPU kernels failed ({' '.join(cmd)}):\n{err[-4000:]}"
            )
    cmd = [compiler, *FLAGS, *map(str, objects), "-o", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(
            f"building hybridrec's CPU kernels failed ({' '.join(cmd)}):\n{done.stderr[-4000:]}"
        )


def build(verbose: bool = False) -> pathlib.Path:
    """The verified library, compiled if missing or stale; RuntimeError when it cannot be built."""
    target = library_path()
    compiler = _compiler()
    problem = _stale(target, compiler)
    if problem is None:
        return target
    if problem != "not built yet":
        log.warning("hybridrec CPU kernels %s not reused, rebuilding: %s", target, problem)
    if compiler is None:
        raise RuntimeError(
            f"no C++ compiler (g++) found to build hybridrec's CPU kernels ({problem}); set CXX or use kernel='xla'"
        )
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        out = pathlib.Path(tmp) / target.name
        _compile(compiler, out)
        record = {**_expected(compiler), "so_sha256": _sha256(out)}
        side = pathlib.Path(tmp) / record_path(target).name
        side.write_text(json.dumps(record, indent=1) + "\n")
        # atomic renames, library first: concurrent builders never see a partial file, and a
        # record never vouches for a library that is not there yet
        os.replace(out, target)
        os.replace(side, record_path(target))
    if verbose:
        print(f"built {target}")
    return target


if __name__ == "__main__":
    build(verbose=True)
