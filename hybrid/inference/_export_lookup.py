"""The pooled lookup `hybrid.export` serializes: a JAX program over plain arrays.

    program(*tables, ids, offsets[, weights]) -> pooled fp32 [max_batch_size, sum of dims]

- `tables`: one argument per table, in config order: fp32 / fp16 / bf16 `[rows, dim]`, or
  packed uint8 `[rows, row_bytes]` rows of a quantized table (FBGEMM's layout, see
  `sparse_jax._quant`);
- `ids`: int32 `[num_ids]`, every feature's ids one feature after another, then padding.
  `num_ids` is a symbolic dimension: the program takes any count (the server pads it to a
  rung of the artifact's id capacities so that each rung compiles once);
- `offsets`: int32 `[num_features * max_batch_size + 1]`, feature-major bags as a KJT's
  offsets: bag b of feature k is `ids[offsets[k * B + b] : offsets[k * B + b + 1]]`;
- `weights`: float32 `[num_ids]`, per-id weights (weighted models only).

Per output feature (a feature read by two tables gives two blocks) the bags are pooled
with one loop over bag positions up to the longest bag, each step gathering one row per
bag: quantized tables through `quantized_pooled_lookup`, in one of two forms (`FORMS`):
"xla" (kernel="xla": no custom call, any platform) or "cpu_kernel" (kernel="ffi": the fused
C++ kernel as the custom call `KERNEL_TARGET`, CPU only, exported with that custom call's
safety check disabled; only a process that registers the target can compile it, which
`hybrid.serving` does when the kernel library is built). The two forms' results are bit
for bit each other's (see `sparse_jax._quant`); float tables with
`acc += w * row` in bag order, then MEAN scales by `1 / length` (the order of the CPU
kernel; the XLA kernel divides each weight first, a difference of an ulp or so).
Out-of-range ids: with bounds_check "clamp" they are clamped, otherwise they add nothing
(the server refuses them first when bounds_check is "error").
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp

from sparse_jax import quantized_pooled_lookup

__all__ = ["FORMS", "KERNEL_TARGET", "OutputSlot", "export_lookup", "lookup_program"]

FORMS = ("xla", "cpu_kernel")
KERNEL_TARGET = "HybridrecQuantPooled"  # the custom call a "cpu_kernel" program holds


class OutputSlot(NamedTuple):
    """One `[B, dim]` block of the output: which input feature's bags, pooled from which table."""

    feature_index: int  # position of the feature among the program's input features
    table_index: int  # which table argument
    dim: int
    mean: bool
    packed_type: (
        str | None
    )  # None: float rows; else the packed rows' type ("int8", "int4", "int2", "fp16")


def _float_bags(table, ids, bags, weights, *, mean: bool, clamp: bool):
    """fp32 `[B, dim]`: bag b sums `w * table[id]` over `ids[bags[b]:bags[b + 1]]` in order."""
    starts = bags[:-1]
    lengths = bags[1:] - starts
    num_rows, last = table.shape[0], ids.shape[0] - 1

    def add(pos, acc):
        at = jnp.minimum(starts + pos, last)
        row = ids[at]
        hit = pos < lengths
        if clamp:
            row = jnp.clip(row, 0, num_rows - 1)
        else:
            hit = hit & (row >= 0) & (row < num_rows)
        got = (
            table.at[jnp.clip(row, 0, num_rows - 1)]
            .get(mode="promise_in_bounds")
            .astype(jnp.float32)
        )
        new = acc + (got if weights is None else weights[at][:, None] * got)
        return jnp.where(hit[:, None], new, acc)

    acc = jnp.zeros((lengths.shape[0], table.shape[1]), jnp.float32)
    acc = jax.lax.fori_loop(0, jnp.max(lengths), add, acc)
    if not mean:
        return acc
    return acc * (1.0 / jnp.maximum(lengths, 1).astype(jnp.float32))[:, None]


def lookup_program(
    slots: Sequence[OutputSlot],
    num_tables: int,
    max_batch_size: int,
    *,
    weighted: bool,
    bounds_check: str,
    form: str = "xla",
) -> Callable:
    """The program (module docstring) for these output blocks, as a plain function; `form`
    (one of `FORMS`) picks the quantized tables' lookup."""
    if form not in FORMS:
        raise ValueError(f"form={form!r} is not one of {FORMS}")
    kernel = "xla" if form == "xla" else "ffi"
    slots = tuple(slots)
    batch = max_batch_size
    clamp = bounds_check == "clamp"

    def program(*args):
        tables, ids, offsets = args[:num_tables], args[num_tables], args[num_tables + 1]
        weights = args[num_tables + 2] if weighted else None
        blocks = []
        for s in slots:
            table = tables[s.table_index]
            bags = offsets[s.feature_index * batch : (s.feature_index + 1) * batch + 1]
            if s.packed_type is None:
                blocks.append(_float_bags(table, ids, bags, weights, mean=s.mean, clamp=clamp))
                continue
            # as QuantEmbeddingBagCollection._apply: clamp, or let the lookup skip them
            rows = jnp.clip(ids, 0, table.shape[0] - 1) if clamp else ids
            # "ffi": the C++ kernel's custom call, which only a process that registered it runs
            blocks.append(
                quantized_pooled_lookup(
                    table,
                    s.packed_type,
                    s.dim,
                    rows,
                    bags,
                    "MEAN" if s.mean else "SUM",
                    weights,
                    kernel=kernel,
                )
            )
        return jnp.concatenate(blocks, axis=1)

    return program


def export_lookup(
    program: Callable,
    tables: Sequence[jax.ShapeDtypeStruct],
    num_features: int,
    max_batch_size: int,
    *,
    weighted: bool,
    platforms: Sequence[str],
    custom_calls: Sequence[str] = (),
) -> jax.export.Exported:
    """`jax.export` of `program` with a symbolic id count (serialize with `.serialize()`);
    `custom_calls`: the custom-call targets it may hold (their safety check disabled)."""
    (num_ids,) = jax.export.symbolic_shape("num_ids")
    args = [
        *tables,
        jax.ShapeDtypeStruct((num_ids,), jnp.int32),
        jax.ShapeDtypeStruct((num_features * max_batch_size + 1,), jnp.int32),
    ]
    if weighted:
        args.append(jax.ShapeDtypeStruct((num_ids,), jnp.float32))
    disabled = [jax.export.DisabledSafetyCheck.custom_call(name) for name in custom_calls]
    return jax.export.export(
        jax.jit(program), platforms=tuple(platforms), disabled_checks=disabled
    )(*args)
