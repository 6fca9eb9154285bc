"""`by_platform`: one traced op whose implementation is chosen when the program is lowered.

A jitted step is traced once, on whatever host, and may then be lowered for CPU, CUDA or
TPU (`jax.jit(f).trace(...).lower(lowering_platforms=("cuda",))` works on a CPU machine).
Choosing a kernel while tracing (by the host's backend) would embed the host's kernel in
another platform's program: a CPU-only custom call in a CUDA program. `by_platform` binds
one primitive whose abstract value is given and whose lowering rule, per platform, lowers
that platform's implementation (`mlir.lower_fun`): the CUDA program holds the GPU kernel,
the CPU program the CPU kernel, and neither holds a `case` on the platform (which
`jax.lax.platform_dependent` would leave in the StableHLO for XLA to fold).

    out = by_platform((table, ids), out_avals, default=xla_form, cpu=ffi_form, cuda=pallas_form)

Every implementation takes the same operands and returns arrays of `out_avals`' shapes and
dtypes (a list or tuple, or the one array when there is one output). Implementations are traced only when that platform is lowered, after the
caller's trace has ended: the non-finite guard's flag (`sparse_jax._guard`), if one is set
at the bind, travels as an extra operand and is set again around the implementation.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
from jax.extend import core as jex_core
from jax.interpreters import mlir

from sparse_jax import _guard

__all__ = ["PLATFORMS", "by_platform"]

PLATFORMS = ("cpu", "cuda", "rocm", "tpu")

_by_platform_p = jex_core.Primitive("hybridrec_by_platform")
_by_platform_p.multiple_results = True


def by_platform(
    operands: Sequence,
    out_avals: Sequence[jax.ShapeDtypeStruct],
    *,
    default: Callable,
    **impls: Callable | None,
) -> list:
    """Bind the op. `impls`: platform name (one of `PLATFORMS`) -> implementation; a missing
    or None entry uses `default`."""
    unknown = set(impls) - set(PLATFORMS)
    if unknown:
        raise ValueError(f"by_platform: unknown platform(s) {sorted(unknown)}; known: {PLATFORMS}")
    avals = tuple((tuple(a.shape), jax.numpy.dtype(a.dtype)) for a in out_avals)
    chosen = tuple(sorted((p, f) for p, f in impls.items() if f is not None))
    good = _guard.current()
    if good is not None:
        operands = (*operands, good)
    return _by_platform_p.bind(
        *operands, out_avals=avals, default=default, impls=chosen, guarded=good is not None
    )


def _call(fn, operands, guarded: bool):
    """`fn`'s outputs as a list (an implementation may return one array or a sequence)."""
    if guarded:
        *operands, good = operands
        with _guard.predicated(good):
            out = fn(*operands)
    else:
        out = fn(*operands)
    return list(out) if isinstance(out, list | tuple) else [out]


def _abstract_eval(*operands, out_avals, default, impls, guarded):
    del operands, default, impls, guarded
    return [jax.core.ShapedArray(shape, dtype) for shape, dtype in out_avals]


def _impl(*operands, out_avals, default, impls, guarded):
    """Eager call: the default backend's implementation, jitted."""
    del out_avals
    fn = dict(impls).get(jax.default_backend(), default)
    return jax.jit(lambda *xs: _call(fn, xs, guarded))(*operands)


def _lowering(platform: str):
    def lower(ctx, *operands, out_avals, default, impls, guarded):
        del out_avals
        fn = dict(impls).get(platform, default)
        return mlir.lower_fun(lambda *xs: _call(fn, xs, guarded), multiple_results=True)(
            ctx, *operands
        )

    return lower


_by_platform_p.def_abstract_eval(_abstract_eval)
_by_platform_p.def_impl(_impl)
for _p in PLATFORMS:
    mlir.register_lowering(_by_platform_p, _lowering(_p), platform=_p)
