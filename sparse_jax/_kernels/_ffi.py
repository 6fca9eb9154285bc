"""Registration of the CPU kernels with XLA and their call wrappers."""

from __future__ import annotations

import ctypes
import functools
import logging

import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
    "cpu_kernels_problem",
    "RULES",
    "available",
    "fused_update",
    "jagged_fused_update",
    "jagged_pooled_sum",
    "last_update_phases",
    "pooled_sum",
    "when_built",
    "quant_pooled",
]

log = logging.getLogger("hybridrec.kernels")
RULES = {"sgd": 0, "rowwise_adagrad": 1, "adagrad": 2}


_LIB: list = []  # the loaded library, once registered


@functools.cache
def _register() -> str | None:
    """Load and register the library; None when it cannot be built (reason logged)."""
    from sparse_jax._kernels import (
        build as _build,  # imported late: `python -m ...build` stays clean
    )

    try:
        lib = ctypes.cdll.LoadLibrary(str(_build.build()))
    except (RuntimeError, OSError) as err:
        return f"hybridrec CPU kernels unavailable, using the XLA path: {err}"
    _LIB.append(lib)
    for name in (
        "HybridrecPooledSum",
        "HybridrecJaggedPooledSum",
        "HybridrecFusedUpdate",
        "HybridrecJaggedFusedUpdate",
        "HybridrecQuantPooled",
        "HybridrecMchProfile",
        "HybridrecMchProfileRemap",
        "HybridrecMchRemap",
        "HybridrecMchHashProfileRemap",
        "HybridrecMchHashRemap",
        "HybridrecMchToHash",
        "HybridrecMchFromHash",
        "HybridrecMaskPositions",
        "HybridrecRowBits",
        "HybridrecTableBits",
        "HybridrecResetRows",
        "HybridrecZeroRows",
    ):
        jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(getattr(lib, name)), platform="cpu")
    return None


def cpu_kernels_problem(target: str | None = None) -> str | None:
    """None when the fused CPU kernel library is registered in this process (and holds
    the custom-call `target`, when one is named); else why not: JAX's default backend is
    not CPU, or the library cannot be built or loaded here."""
    if jax.default_backend() != "cpu":
        return f"JAX's default backend is {jax.default_backend()}, the kernels run on CPU only"
    problem = _register()
    if problem is not None:
        return problem
    if target is not None and getattr(_LIB[0], target, None) is None:
        return f"the CPU kernel library has no {target}"
    return None


def available() -> bool:
    """True when the default backend is CPU and the kernels are built (or could be)."""
    if jax.default_backend() != "cpu":
        return False
    problem = _register()
    if problem is not None:
        log.warning(problem)
        return False
    return True


def when_built(ffi_fn, fallback):
    """`ffi_fn` when the CPU kernels are built, else `fallback`: decided when it is called,
    i.e. when the CPU program is lowered (`by_platform`), not where it was traced."""

    def run(*ops):
        return ffi_fn(*ops) if _register() is None else fallback(*ops)

    return run


def last_update_phases() -> dict[str, float]:
    """Seconds spent by the last fused update in this process, per phase: building the
    per-id records, sorting them by row, applying the rule (summing each row's gradient,
    reading and writing its row and state). For the benchmarks' breakdown."""
    if _register() is not None:
        raise RuntimeError("the CPU kernels are not available")
    out = (ctypes.c_int64 * 3)()
    _LIB[0].HybridrecLastUpdatePhases(out)
    return {name: out[i] / 1e9 for i, name in enumerate(("records", "sort", "apply"))}


def pooled_sum(table: jax.Array, rows: jax.Array, weights: jax.Array) -> jax.Array:
    """`[bags, dim]` fp32: `sum_l weights[b, l] * table[rows[b, l]]` (zero weights skip)."""
    _register()
    out = jax.ShapeDtypeStruct((rows.shape[0], table.shape[1]), jnp.float32)
    return jax.ffi.ffi_call("HybridrecPooledSum", out)(
        table, rows.astype(jnp.int32), weights.astype(jnp.float32)
    )


def jagged_pooled_sum(
    table, values, offsets, weights, *, stride: int, keys, row_offsets, num_rows, mean, clamp: bool
) -> jax.Array:
    """`[stride, len(keys) * dim]` pooled bags read straight from a KJT's values/offsets,
    feature f in columns `f * dim : (f + 1) * dim` (the KeyedTensor layout).

    keys / row_offsets / num_rows / mean: per pooled feature, its KJT key index, first row
    in `table`, table rows and MEAN flag (static). `weights`: per id, or None.
    """
    _register()
    meta = [jnp.asarray(np.asarray(x, np.int32)) for x in (keys, row_offsets, num_rows, mean)]
    out = jax.ShapeDtypeStruct((stride, len(keys) * table.shape[1]), jnp.float32)
    weighted = weights is not None
    weights = weights.astype(jnp.float32) if weighted else jnp.zeros((1,), jnp.float32)
    return jax.ffi.ffi_call("HybridrecJaggedPooledSum", out)(
        table,
        values.astype(jnp.int32),
        offsets.astype(jnp.int32),
        weights,
        *meta,
        stride=np.int64(stride),
        clamp=np.int32(clamp),
        weighted=np.int32(weighted),
    )


QUANT_KINDS = {"int8": 8, "int4": 4, "int2": 2, "fp16": 16}


def quant_pooled(
    packed,
    ids,
    offsets,
    weights,
    *,
    weight_type: str,
    dim: int,
    mean: bool,
    clamp: bool,
    max_length: int | None,
) -> jax.Array:
    """`[B, dim]` fp32 pooled bags of packed rows (`sparse_jax._quant`'s layout), dequantized
    in registers: bag b is `ids[offsets[b]:offsets[b + 1]]`, the rows `scale * q + bias` (or
    fp16), weighted by `weights` (per id, or None), MEAN (static) by `1 / len`. Ids outside
    the table are clamped (`clamp`) or add nothing; a bag reads at most `max_length` ids."""
    _register()
    out = jax.ShapeDtypeStruct((offsets.shape[0] - 1, dim), jnp.float32)
    weighted = weights is not None
    weights = weights.astype(jnp.float32) if weighted else jnp.zeros((1,), jnp.float32)
    return jax.ffi.ffi_call("HybridrecQuantPooled", out)(
        packed,
        ids.astype(jnp.int32),
        offsets.astype(jnp.int32),
        weights,
        kind=np.int32(QUANT_KINDS[weight_type]),
        weighted=np.int32(weighted),
        clamp=np.int32(clamp),
        mean=np.int32(mean),
        max_length=np.int64(-1 if max_length is None else max_length),
    )


def _update_call(target: str, table, state):
    """The in-place call (outputs alias `table` and `state`) and the state it is given."""
    _register()
    if state is None or (hasattr(state, "size") and state.size == 0):
        state = jnp.zeros((1,), jnp.float32)
    outs = (
        jax.ShapeDtypeStruct(table.shape, jnp.float32),
        jax.ShapeDtypeStruct(state.shape, jnp.float32),
    )
    return jax.ffi.ffi_call(target, outs, input_output_aliases={0: 0, 1: 1}), state


def fused_update(
    rule: str, table, state, rows, bags, scale, bag_grads, *, lr: float, eps: float = 0.0
):
    """One fused row-rule step in place from an id stream: per id its row, its bag (a row of
    `bag_grads`) and its scale; ids with a row or bag out of range, or scale 0, are dropped."""
    call, state = _update_call("HybridrecFusedUpdate", table, state)
    return call(
        table,
        state,
        rows.astype(jnp.int32),
        bags.astype(jnp.int32),
        scale.astype(jnp.float32),
        bag_grads.astype(jnp.float32),
        rule=np.int32(RULES[rule]),
        lr=np.float32(lr),
        eps=np.float32(eps),
    )


def jagged_fused_update(
    rule: str,
    table,
    state,
    values,
    offsets,
    weights,
    pooled_grad,
    *,
    stride: int,
    keys,
    row_offsets,
    num_rows,
    mean,
    grad_columns,
    clamp: bool,
    lr: float,
    eps: float = 0.0,
):
    """One fused row-rule step in place, read straight from a KJT's values / offsets and the
    pooled gradient `[stride, total_dim]` (no id stream, no gradient copy).

    keys / row_offsets / num_rows / mean / grad_columns: per feature of the buffer, its KJT
    key index, first row in `table`, table rows, MEAN flag and first column in `pooled_grad`
    (static). Ids outside their table are clamped (`clamp`) or dropped."""
    call, state = _update_call("HybridrecJaggedFusedUpdate", table, state)
    meta = [
        jnp.asarray(np.asarray(x, np.int32))
        for x in (keys, row_offsets, num_rows, mean, grad_columns)
    ]
    weighted = weights is not None
    weights = weights.astype(jnp.float32) if weighted else jnp.zeros((1,), jnp.float32)
    return call(
        table,
        state,
        values.astype(jnp.int32),
        offsets.astype(jnp.int32),
        weights,
        *meta,
        pooled_grad.astype(jnp.float32),
        stride=np.int64(stride),
        clamp=np.int32(clamp),
        weighted=np.int32(weighted),
        rule=np.int32(RULES[rule]),
        lr=np.float32(lr),
        eps=np.float32(eps),
    )
