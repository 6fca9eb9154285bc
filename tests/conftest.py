"""Test settings: 8 XLA CPU devices, strict dtype promotion, warnings as errors (pyproject),
one XLA compilation cache per test session."""

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

import jax  # noqa: E402

jax.config.update("jax_numpy_dtype_promotion", "strict")

import numpy as np  # noqa: E402
import pytest  # noqa: E402


@pytest.fixture
def rng():
    return np.random.default_rng(0)
