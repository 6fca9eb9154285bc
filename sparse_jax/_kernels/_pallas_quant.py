"""The quantized pooled lookup in Pallas (Triton backend): bags of packed rows, dequantized in
registers.

`quant_pooled_sum` is `sparse_jax._quant`'s lookup (FBGEMM's IntN TBE row layout: int8 /
int4 / int2 rows with an fp16 scale and bias in front, or fp16 rows) on a GPU, shaped as
`_pallas.jagged_pooled_sum`: one program per (feature, sample) bag reads the bag's ids from
`offsets` (no length cap, no padding), reads each id's packed bytes from its feature's
table, dequantizes them in registers and accumulates in fp32, and writes its `[dim]` slice
of `[B, sum of dims]` once (a collection's features, of any weight types and tables, in one
call). No atomics: the same
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
from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from sparse_jax._kernels._pallas import (
    UNROLL,
    _compiler_params,
    _in_steps,
    _warps,
    checked_row,
    supports_dim,
)

__all__ = ["BITS", "QuantFeature", "quant_pooled_sum"]

BITS = {"int8": 8, "int4": 4, "int2": 2, "fp16": 16}
_SCALE_BIAS_BYTES = 4  # fp16 scale, fp16 bias in front of an int row


class QuantFeature(NamedTuple):
    """One output block: the bags `offsets[key * stride : (key + 1) * stride + 1]` pooled from
    packed table `table` (`weight_type`, `dim` values a row), MEAN or SUM; with `max_length` a
    bag reads at most that many ids (the XLA form's static loop; MEAN still divides by the
    full length)."""

    key: int
    table: int
    weight_type: str
    dim: int
    mean: bool = False
    max_length: int | None = None


def quant_pooled_sum(
    tables: Sequence,
    ids,
    offsets,
    weights,
    *,
    stride: int,
    features: Sequence[QuantFeature],
    clamp: bool,
    interpret: bool = False,
    unroll: int = UNROLL,
):
    """Pooled `[stride, sum of the features' dims]` fp32, feature blocks in `features`' order:
    block k pools its bags over `tables[k.table]` (uint8 `[rows, row_bytes]`, any row
    alignment), weighted by `weights` (fp32 per id, or None). Ids outside a table are clamped
    (`clamp`) or add nothing. One program per (feature, sample) bag, `unroll` ids read per
    loop step (the sum's order is the bag's order)."""
    features = tuple(QuantFeature(*f) for f in features)
    for f in features:
        if f.weight_type not in BITS:
            raise ValueError(f"weight_type={f.weight_type!r} is not one of {tuple(BITS)}")
        if not supports_dim(f.dim):
            raise ValueError(
                f"the Pallas quantized lookup needs power-of-two dims, got {f.dim}; use kernel='xla'"
            )
    num_rows = tuple(int(t.shape[0]) for t in tables)
    if ids.dtype.itemsize > 4:  # int32 in the kernel without wrapping ids into a table
        ids = jnp.clip(ids, -1, max(num_rows))
    weighted = weights is not None
    operands = [offsets.astype(jnp.int32), ids.astype(jnp.int32)]
    if weighted:
        operands.append(weights.astype(jnp.float32))
    operands += list(tables)
    kernel = functools.partial(
        _quant_kernel,
        features=features,
        num_rows=num_rows,
        stride=stride,
        clamp=clamp,
        weighted=weighted,
        unroll=max(1, int(unroll)),
    )
    width = sum(f.dim for f in features)
    if stride == 0:
        return jnp.zeros((0, width), jnp.float32)
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((stride, width), jnp.float32),
        grid=(len(features), stride),
        interpret=interpret,
        compiler_params=_compiler_params(_warps(max(f.dim for f in features))),
        name="hybridrec_quant_pooled_sum",
    )(*operands)


def _half(low, high):
    """fp32 of the fp16 whose little-endian bytes are `low`, `high` (int32)."""
    bits = (low | (high << 8)).astype(jnp.uint16)
    return jax.lax.bitcast_convert_type(bits, jnp.float16).astype(jnp.float32)


def _quant_kernel(off_ref, ids_ref, *refs, features, num_rows, stride, clamp, weighted, unroll):
    if weighted:
        w_ref, *refs = refs
    else:
        w_ref = None
    *t_refs, o_ref = refs
    j, b = pl.program_id(0), pl.program_id(1)
    col = 0
    for k, f in enumerate(features):
        pool = functools.partial(
            _pool_bag, off_ref, ids_ref, w_ref, t_refs[f.table], o_ref, b, f, col,
            num_rows=num_rows[f.table], stride=stride, clamp=clamp, unroll=unroll,
        )  # fmt: skip
        if len(features) == 1:
            pool()
        else:
            pl.when(j == k)(pool)
        col += f.dim


def _pool_bag(off_ref, ids_ref, w_ref, p_ref, o_ref, b, f, col, *, num_rows, stride, clamp, unroll):
    """Bag b of feature `f`: its sum into `o_ref[b, col : col + f.dim]`."""
    bits, dim = BITS[f.weight_type], f.dim
    bag = f.key * stride + b
    start, end = off_ref[bag], off_ref[bag + 1]
    stop = end if f.max_length is None else jnp.minimum(end, start + f.max_length)
    j = jax.lax.broadcasted_iota(jnp.int32, (dim,), 0)
    if bits == 16:
        low_at, high_at = 2 * j, 2 * j + 1
    else:
        byte_at, shift = _SCALE_BIAS_BYTES + j * bits // 8, (j * bits) % 8

    def byte(row, at):
        return p_ref[row, at].astype(jnp.int32)

    def add(i, in_bag, acc):
        row, keep = checked_row(ids_ref[i], in_bag, num_rows, clamp)
        w = w_ref[i] if w_ref is not None else jnp.float32(1)
        if bits == 16:
            new = acc + w * _half(byte(row, low_at), byte(row, high_at))
        else:
            scale = _half(byte(row, 0), byte(row, 1))
            bias = _half(byte(row, 2), byte(row, 3))
            q = ((byte(row, byte_at) >> shift) & ((1 << bits) - 1)).astype(jnp.float32)
            new = (acc + w * bias) + (w * scale) * q
        return jnp.where(keep, new, acc)

    acc = _in_steps(start, stop, unroll, add, jnp.zeros((dim,), jnp.float32))
    if f.mean:
        acc = acc * (1.0 / jnp.maximum(end - start, 1).astype(jnp.float32))
    o_ref[b, pl.ds(col, dim)] = acc
