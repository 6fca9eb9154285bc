"""The non-finite guard by predication: a step that must leave the buffers as they were
writes nothing, decided on the device with no branch.

`make_update(..., skip_nonfinite=True)` traces the module's step inside `predicated(good)`;
every fused update reached while tracing reads `current()` and masks its writes with it:
the ids' rows become out of range (every scatter drops them, every kernel skips them), the
C++ jagged kernel sees empty bags, global state leaves and the step count keep their old
values. A `lax.cond` would do the same on CPU, but XLA's GPU conditional copies its
predicate to the host and waits: one host sync per training step.

A context, not an argument: the guard wraps any module's step (unsharded, sharded, sequence,
managed) without each step growing a parameter. `shard_map` cannot close over a value
placed on Explicit mesh axes, so a sharded step hands the flag in as an operand
(`through_shard_map`).
"""

from __future__ import annotations

import contextlib
import contextvars

import jax.numpy as jnp

__all__ = ["current", "next_count", "predicated", "through_shard_map"]

_GOOD: contextvars.ContextVar = contextvars.ContextVar("hybridrec_good", default=None)


@contextlib.contextmanager
def predicated(good):
    """Trace the enclosed step with its writes masked by the traced boolean `good`."""
    token = _GOOD.set(good)
    try:
        yield
    finally:
        _GOOD.reset(token)


def current():
    """The traced boolean of the enclosing `predicated`, or None (unguarded)."""
    return _GOOD.get()


def next_count(count):
    """The step counter after this step: `count + 1`, or `count` when the guard says skip."""
    good = current()
    return count + 1 if good is None else jnp.where(good, count + 1, count)


def through_shard_map(body):
    """`(body, extra operands)`: `body` taking the guard flag as its last operand (spec
    `P()`) and tracing itself under it, for a step that calls `jax.shard_map`; unguarded,
    `body` and no extra operand."""
    good = current()
    if good is None:
        return body, ()

    def guarded(*args):
        *args, flag = args
        with predicated(flag):
            return body(*args)

    return guarded, (good,)
