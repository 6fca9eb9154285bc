"""pytest plugin for `make mutation` only (mutmut 3; loaded with `-p tests.mutmut_plugin` from
pyproject's [tool.mutmut] pytest_add_cli_args). Not used by `make test`.

mutmut forks one child per mutant. XLA's CPU client (and its thread pools) does not survive
fork(): a child that compiles with an inherited client waits forever on threads that only
existed in the parent. So:

* after fork, a child that inherited initialized JAX backends drops them (and every jit
  cache, which would otherwise also hide the mutant: a function traced in the parent is not
  re-traced with the mutant active) and builds a fresh CPU client on first use. The old
  clients are kept referenced, never destroyed: their destructors would join threads that
  do not exist in the child.
* during mutmut's stats run (which test reaches which function), jit caches are cleared
  before each test, so every test that *traces* a function is recorded as covering it, not
  only the first one to trace it.
* Hypothesis is derandomized, so a mutant is killed or not the same way on every run.
* XLA's persistent compilation cache (under mutants/, so it goes with it) lets each child load
  the executables it would otherwise recompile; a mutant that changes traced code changes the
  HLO and so the cache key, and is compiled afresh.
"""

import os
import pathlib

import jax
import jax.extend.backend  # noqa: F401  (used after fork; not imported by `import jax`)
import pytest
from hypothesis import settings

settings.register_profile("mutmut", derandomize=True, database=None)
settings.load_profile("mutmut")

jax.config.update(
    "jax_compilation_cache_dir",
    os.environ.get(
        "MUTMUT_JAX_CACHE", str(pathlib.Path(__file__).resolve().parents[1] / ".jax_cache")
    ),
)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)

_orphaned_backends = []  # inherited XLA clients, never destroyed in the child


def _fresh_jax_after_fork():
    from jax._src import xla_bridge

    if xla_bridge.backends_are_initialized():
        _orphaned_backends.append(dict(xla_bridge._backends))
        jax.clear_caches()
        jax.extend.backend.clear_backends()


os.register_at_fork(after_in_child=_fresh_jax_after_fork)


@pytest.fixture(autouse=True)
def _retrace_each_test_during_stats():
    if os.environ.get("MUTANT_UNDER_TEST") == "stats":
        jax.clear_caches()
    yield
