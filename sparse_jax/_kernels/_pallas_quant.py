"""The quantized pooled lookup in Pallas (Triton backend): bags of packed rows, dequantized in
registers.

`quant_pooled_sum` is `sparse_jax._quant`'s lookup (FBGEMM's IntN TBE row layout: int8 /
int4 / int2 rows with an fp16 scale and bias in front, or fp16 rows) on a GPU, shaped as
`_pallas.jagged_pooled_sum`: one program per bag reads the bag's ids from `offsets` (no
length cap, no padding), reads each id's packed bytes, dequantizes them in registers and
accumulates in fp32, and writes its `[dim]` row of `[B, dim]` once. No atomics: the same
bits on every run. `interpret=True` runs it on any backend (the tests' CPU check against
the plain loops of `tests/reference.py` and against the XLA form).

The arithmetic is the XLA form's (`sparse_jax._quant._pooled`), in the same order:
`acc = (acc + w * bias) + (w * scale) * q` per id in the bag's order (fp16 rows:
`acc + w * x`), `w = 1` unweighted (an exact product), then `acc * (1 / len)` for MEAN
(`len` the bag's full length, at least 1). Ids outside `[0, rows)` (-1, FBGEMM's pruned
row, included) add nothing, or are clamped into the table (`clamp`).

The bytes are read by gathering loads within the row: value j of an int row is byte
`4 + j * bits // 8`, bits `(j * bits) % 8` up (low bits first); of an fp16 row bytes `2j`
(low) and `2j + 1` (high). So any row width (row alignment 1 or 16) is read in place; `dim`
must be a power of two (Triton block shapes): other dims take the XLA form.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from sparse_jax._kernels._pallas import UNROLL, _compiler_params, _in_steps, _warps, supports_dim

__all__ = ["BITS", "quant_pooled_sum"]

BITS = {"int8": 8, "int4": 4, "int2": 2, "fp16": 16}
_SCALE_BIAS_BYTES = 4  # fp16 scale, fp16 bias in front of an int row


def quant_pooled_sum(
    packed,
    ids,
    offsets,
    weights,
    *,
    weight_type: str,
    dim: int,
    mean: bool,
    clamp: bool,
    max_length: int | None = None,
    interpret: bool = False,
    unroll: int = UNROLL,
):
    """Pooled `[B, dim]` fp32 of the bags `ids[offsets[b]:offsets[b + 1]]` over the packed rows
    `packed` (uint8 `[rows, row_bytes]`, `weight_type` one of `BITS`), weighted by `weights`
    (fp32 per id, or None), MEAN (static `mean`) by `1 / len`. Ids outside the table are
    clamped (`clamp`) or add nothing; with `max_length` a bag reads at most that many ids (the
    XLA form's static loop; MEAN still divides by the full length). The signature of the C++
    kernel (`_ffi.quant_pooled`)."""
    if weight_type not in BITS:
        raise ValueError(f"weight_type={weight_type!r} is not one of {tuple(BITS)}")
    if not supports_dim(dim):
        raise ValueError(
            f"the Pallas quantized lookup needs a power-of-two dim, got {dim}; use kernel='xla'"
        )
    batch = offsets.shape[0] - 1
    num_rows = packed.shape[0]
    if ids.dtype.itemsize > 4:  # int32 in the kernel without wrapping ids into the table
        ids = jnp.clip(ids, -1, num_rows)
    weighted = weights is not None
    operands = [offsets.astype(jnp.int32), ids.astype(jnp.int32)]
    if weighted:
        operands.append(weights.astype(jnp.float32))
    operands.append(packed)
    kernel = functools.partial(
        _quant_kernel,
        bits=BITS[weight_type],
        dim=dim,
        num_rows=num_rows,
        mean=bool(mean),
        clamp=clamp,
        weighted=weighted,
        max_length=max_length,
        unroll=max(1, int(unroll)),
    )
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((batch, dim), jnp.float32),
        grid=(max(batch, 1),),
        interpret=interpret,
        compiler_params=_compiler_params(_warps(dim)),
        name="hybridrec_quant_pooled_sum",
    )(*operands)


def _half(low, high):
    """fp32 of the fp16 whose little-endian bytes are `low`, `high` (int32)."""
    bits = (low | (high << 8)).astype(jnp.uint16)
    return jax.lax.bitcast_convert_type(bits, jnp.float16).astype(jnp.float32)


def _quant_kernel(
    off_ref, ids_ref, *refs, bits, dim, num_rows, mean, clamp, weighted, max_length, unroll
):
    if weighted:
        w_ref, p_ref, o_ref = refs
    else:
        (p_ref, o_ref), w_ref = refs, None
    b = pl.program_id(0)
    start, end = off_ref[b], off_ref[b + 1]
    stop = end if max_length is None else jnp.minimum(end, start + max_length)
    j = jax.lax.broadcasted_iota(jnp.int32, (dim,), 0)
    if bits == 16:
        low_at, high_at = 2 * j, 2 * j + 1
    else:
        byte_at, shift = _SCALE_BIAS_BYTES + j * bits // 8, (j * bits) % 8

    def byte(row, at):
        return p_ref[row, at].astype(jnp.int32)

    def add(i, in_bag, acc):
        row = ids_ref[i]
        if clamp:
            keep = in_bag
            row = jnp.minimum(jnp.maximum(row, 0), num_rows - 1)
        else:
            keep = in_bag & (row >= 0) & (row < num_rows)
            row = jnp.where(keep, row, 0)
        w = w_ref[i] if weighted else jnp.float32(1)
        if bits == 16:
            new = acc + w * _half(byte(row, low_at), byte(row, high_at))
        else:
            scale = _half(byte(row, 0), byte(row, 1))
            bias = _half(byte(row, 2), byte(row, 3))
            q = ((byte(row, byte_at) >> shift) & ((1 << bits) - 1)).astype(jnp.float32)
            new = (acc + w * bias) + (w * scale) * q
        return jnp.where(keep, new, acc)

    acc = _in_steps(start, stop, unroll, add, jnp.zeros((dim,), jnp.float32))
    if mean:
        acc = acc * (1.0 / jnp.maximum(end - start, 1).astype(jnp.float32))
    o_ref[b, :] = acc
