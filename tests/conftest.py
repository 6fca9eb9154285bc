"""Test settings: 8 XLA CPU devices, strict dtype promotion, warnings as errors (pyproject),
one torch thread per test process, one XLA compilation cache per test session."""

import atexit
import os
import shutil
import tempfile

# Must happen before jax initializes its backends.
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

# One persistent XLA compilation cache per session: a fresh temporary directory, made by the
# first process that loads this file (pytest itself, before its xdist workers start) and
# handed to the workers and every subprocess through the environment, removed when that
# process exits. A program compiled once (same HLO, same options) is then loaded, not
# compiled again, by the next test, worker or subprocess that builds it: most of the suite's
# time is XLA:CPU compiles, many of the same programs. Every session starts cold.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _cache = tempfile.mkdtemp(prefix="hybridrec-xla-cache-")
    atexit.register(shutil.rmtree, _cache, ignore_errors=True)
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"
# Multi-process runs the suite starts (training, checkpoints, benchmarks) report a peer lost
# after this many seconds without its heartbeat: long, since a busy machine can hold one for
# seconds; the tests of the detection itself set their own (tests/test_dead_peer.py).
os.environ.setdefault("HYBRIDREC_WATCHDOG_TIMEOUT", "60")

import jax  # noqa: E402

jax.config.update("jax_numpy_dtype_promotion", "strict")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

# One torch intra-op thread per test process, as hybrid.train and hybrid.demo use while
# training (`train.torch_threads = 1`). `make test` runs two workers on two cores: with
# torch's default (a thread per core) each eager op's OpenMP threads wait on a core the other
# worker holds, and spin after it, slowing the XLA compiles beside them (on a loaded 2-core
# machine a TorchRec EmbeddingBagCollection forward took 27 ms instead of 0.5, and 100 of
# our jitted lookups 51 s instead of 2). Tests that set a thread count restore this one.
torch.set_num_threads(1)


@pytest.fixture
def rng():
    return np.random.default_rng(0)


# -- the order files run in ------------------------------------------------------------------
# `make test` hands whole files to two workers (`--dist loadfile`), each taking the next file
# from one queue as it finishes the last. The wall time is shortest when the longest files go
# first and the short ones fill in at the end. pytest-xdist's own order is by number of tests,
# which queued the files of a few long tests (multiprocess runs, benchmarks' tiny runs) last,
# where one of them alone could keep a worker busy a minute after the other had finished. So:
# first the files holding tests marked `slow` or `multiprocess` (the most such tests first),
# then the files below, of few tests that are long without the mark (benchmark and
# fresh-process runs, each 15-40 s of a quiet 2-core machine's two workers, measured
# 2026-11-27), then the rest, the most tests first, as pytest-xdist would. The tests of a file
# keep their order. Only the order changes: every test still runs.
_LONG = ("slow", "multiprocess")
_FEW_LONG_TESTS = (
    "tests/test_benchmarks.py",
    "tests/test_benchmark_gpu.py",
    "tests/test_export.py",
    "tests/test_readme.py",
    "tests/test_data_stream.py",
    "tests/test_serving_server.py",
    "tests/test_benchmark_serving_load.py",
)


def pytest_configure(config):
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False  # keep the order below (pytest-xdist's files)


def pytest_collection_modifyitems(config, items):
    files: dict[str, list[int]] = {}  # file -> [long tests, tests]
    for item in items:
        counts = files.setdefault(item.nodeid.split("::")[0], [0, 0])
        counts[0] += any(item.get_closest_marker(m) for m in _LONG)
        counts[1] += 1

    def weight(f):
        named = f in _FEW_LONG_TESTS
        return (-files[f][0], not named, _FEW_LONG_TESTS.index(f) if named else 0, -files[f][1])

    rank = {f: i for i, f in enumerate(sorted(files, key=weight))}
    items.sort(key=lambda item: rank[item.nodeid.split("::")[0]])
