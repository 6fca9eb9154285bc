"""Count device-to-host reads of jax.Arrays, and eager JAX ops (test instruments).

On CPU, `jax.transfer_guard_device_to_host` never fires (numpy reads a CPU jax.Array
through the buffer protocol), so the conversions themselves are instrumented: numpy's
array constructors called on a jax.Array, `jax.device_get`, and the `_value` property that
`float()`, `int()`, `bool()`, `.item()` and `.tolist()` go through. Each read records the
caller's file and line, so a failing test says where the read came from.
"""

from __future__ import annotations

import contextlib
import traceback

import jax
import numpy as np
from jax._src import array as _array

_NUMPY_READERS = ("asarray", "array", "asanyarray", "ascontiguousarray")


class HostReads:
    def __init__(self):
        self.sites: list[str] = []

    @property
    def count(self) -> int:
        return len(self.sites)

    def record(self) -> None:
        frames = [
            f for f in traceback.extract_stack()[:-2] if not f.filename.endswith("host_reads.py")
        ]
        ours = [
            f
            for f in frames
            if "/site-packages/" not in f.filename and "/lib/python" not in f.filename
        ]
        where = ours[-1] if ours else frames[-1]
        self.sites.append(f"{where.filename}:{where.lineno} ({where.name})")


@contextlib.contextmanager
def count_host_reads():
    """Within the block, every read of a jax.Array's values on the host is recorded."""
    reads = HostReads()
    patched = []

    def wrap_numpy(name):
        original = getattr(np, name)

        def reader(obj, *args, **kwargs):
            if isinstance(obj, jax.Array):
                reads.record()
            return original(obj, *args, **kwargs)

        patched.append((np, name, original))
        setattr(np, name, reader)

    for name in _NUMPY_READERS:
        wrap_numpy(name)
    original_get = jax.device_get

    def device_get(x):
        if any(isinstance(leaf, jax.Array) for leaf in jax.tree_util.tree_leaves(x)):
            reads.record()
        return original_get(x)

    patched.append((jax, "device_get", original_get))
    jax.device_get = device_get
    value = _array.ArrayImpl._value

    def counted_value(self):
        reads.record()
        return value.fget(self)

    patched.append((_array.ArrayImpl, "_value", value))
    _array.ArrayImpl._value = property(counted_value)
    try:
        yield reads
    finally:
        for owner, name, original in reversed(patched):
            setattr(owner, name, original)


@contextlib.contextmanager
def count_eager_ops():
    """Within the block, every JAX primitive run eagerly (outside a jitted program) is
    recorded with the line that ran it: each is a round of host dispatch, and on a GPU a
    few of them per step cost more than a fused update."""
    from jax._src import core

    ops = HostReads()
    run = core.EvalTrace.process_primitive

    def counting(self, prim, *args, **params):
        ops.record()
        ops.sites[-1] = f"{prim}: {ops.sites[-1]}"
        return run(self, prim, *args, **params)

    core.EvalTrace.process_primitive = counting
    try:
        yield ops
    finally:
        core.EvalTrace.process_primitive = run
