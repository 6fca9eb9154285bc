"""Pooled lookups over stacked tables: the fast per-position form and the reference form.

Both read a KJT (padded or not) and a `TableLayout`, and return one `[B, dim]` block per
feature. Ids are checked against their table's range by `check_ids` (eager) and, inside
the traced code, handled by `bounds_check`:
  "error": (default) `check_ids` raised before tracing; any id still out of range is skipped.
  "clamp": ids are clamped into `[0, num_embeddings)`.
  "skip":  out-of-range ids contribute nothing (MEAN still divides by the bag's length).

* `pooled_per_position` (the XLA path): a loop over the positions l < cap of the bags (cap =
  the KJT's length cap for the feature, `_capacity.length_cap`), the pooled sum being
  `sum_l w_l * table[id at bag offset + l]`, 4 positions an iteration, ids read straight
  from the values, so XLA fuses gather and add and never writes the gathered rows to memory.
  (`sum_positions` takes `[B, cap]` id and weight matrices instead: the sharded lookup.)
* `pooled_segment_sum` (reference): gather every id's row, then `segment_sum` per bag.

`id_stream` gives the flat (row, bag, scale) triples the fused optimizer consumes.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from sparse_jax._configs import PoolingType
from sparse_jax._jagged import KeyedJaggedTensor
from sparse_jax._layout import FeatureSlot, TableLayout
from sparse_jax._position_rows import cap_classes
from sparse_jax._validate import is_concrete

__all__ = [
    "BOUNDS_CHECKS",
    "KERNELS",
    "check_ids",
    "id_stream",
    "pooled_per_position",
    "pooled_segment_sum",
]

BOUNDS_CHECKS = ("error", "clamp", "skip")
KERNELS = ("auto", "ffi", "xla", "reference", "pallas")
_UNROLL = 4  # positions per loop iteration of the XLA per-position pooling


def check_bounds_mode(mode: str) -> str:
    if mode not in BOUNDS_CHECKS:
        raise ValueError(f"bounds_check={mode!r} is not one of {BOUNDS_CHECKS}")
    return mode


def check_kernel(kernel: str) -> str:
    if kernel not in KERNELS:
        raise ValueError(f"kernel={kernel!r} is not one of {KERNELS}")
    return kernel


def check_ids(kjt: KeyedJaggedTensor, layout: TableLayout) -> None:
    """Raise if any id is outside its table (eager; a no-op on traced arrays)."""
    if not is_concrete(kjt.values(), kjt.offsets()):
        return
    values = np.asarray(kjt.values())
    offsets = np.asarray(kjt.offsets())
    for slot, ki in zip(layout.features, layout.key_indices(kjt.keys()), strict=True):
        a, b = kjt._key_slice(ki)
        ids = values[a:b]
        bad = np.flatnonzero((ids < 0) | (ids >= slot.num_rows))
        if bad.size:
            i = a + int(bad[0])
            bag = int(np.searchsorted(offsets, i, side="right")) - 1
            raise ValueError(
                f"feature {slot.feature!r} (table {slot.table!r}, num_embeddings={slot.num_rows}): "
                f"id {int(values[i])} at batch position {bag - kjt._bag_range(ki)[0]}, index {i - int(offsets[bag])} "
                f"in the bag is outside [0, {slot.num_rows}) ({bad.size} such ids); fix the ids, or pass "
                "bounds_check='clamp' or 'skip'"
            )


def _bounded(ids, valid, slot: FeatureSlot, bounds_check: str):
    if bounds_check == "clamp":
        return jnp.clip(ids, 0, slot.num_rows - 1), valid
    inside = (ids >= 0) & (ids < slot.num_rows)
    return jnp.where(inside, ids, 0), valid & inside


def _bag_lengths(kjt: KeyedJaggedTensor, ki: int):
    stride = kjt.stride()
    return kjt.lengths()[ki * stride : (ki + 1) * stride]


def _per_id_weights(kjt: KeyedJaggedTensor, weighted: bool, dtype=jnp.float32):
    if weighted:
        return kjt.weights().astype(dtype)
    return jnp.ones(kjt.capacity(), dtype)


def _position_matrix(kjt, ki: int, cap: int, slot: FeatureSlot, weighted: bool, bounds_check: str):
    """[B, cap] rows (into the group buffer) and weights (0 on padding and skipped ids)."""
    stride = kjt.stride()
    start = kjt.offsets()[ki * stride : (ki + 1) * stride]
    lengths = _bag_lengths(kjt, ki)
    pos = jnp.arange(cap, dtype=start.dtype)
    idx = jnp.minimum(start[:, None] + pos[None, :], max(kjt.capacity() - 1, 0))
    valid = pos[None, :] < lengths[:, None]
    ids, valid = _bounded(kjt.values()[idx], valid, slot, bounds_check)
    w = jnp.where(valid, _per_id_weights(kjt, weighted)[idx], 0.0)
    if slot.pooling is PoolingType.MEAN:
        w = w / jnp.maximum(lengths, 1).astype(w.dtype)[:, None]
    # padding and skipped positions read the group's first row: one cache-hot line instead
    # of a random row (their weight is 0 either way)
    return jnp.where(valid, ids + slot.row_offset, 0), w


def use_ffi(kernel: str, table) -> bool:
    """Whether a buffer takes the fused C++ kernel: kernel "auto"/"ffi", fp32, CPU, built
    (a name outside `KERNELS` is refused, never taken for "xla")."""
    if check_kernel(kernel) not in ("auto", "ffi") or table.dtype != jnp.float32:
        return False
    from sparse_jax import _kernels

    if _kernels.available():
        return True
    if kernel == "ffi":
        raise ValueError(
            "kernel='ffi' was asked for but the CPU kernels are unavailable here (see the log); use kernel='auto' or 'xla'"
        )
    return False


def sum_positions(table, rows, w, kernel: str):
    """`sum_l w[:, l] * table[rows[:, l]]`, the kernel chosen when the program is lowered:
    the fused C++ kernel on CPU (fp32, "auto"/"ffi", built), the Pallas kernel on CUDA
    ("auto"/"pallas", power-of-two dims), else XLA (`_sum_positions`)."""
    from sparse_jax import _kernels
    from sparse_jax._kernels import _pallas
    from sparse_jax._kernels._platform import by_platform

    pallas_ok = _pallas.supports_dim(table.shape[1])
    if kernel == "pallas":
        _require_pallas(pallas_ok, table)
        impls = dict(
            default=functools.partial(_pallas.pooled_positions, interpret=True),
            cuda=_pallas.pooled_positions,
        )
    elif kernel in ("auto", "ffi"):
        cpu = None
        if use_ffi(kernel, table) or (kernel == "auto" and table.dtype == jnp.float32):
            cpu = _kernels.when_built(_kernels.pooled_sum, _sum_positions)
        impls = dict(
            default=_sum_positions, cpu=cpu, cuda=_pallas.pooled_positions if pallas_ok else None
        )
    else:
        return _sum_positions(table, rows, w)
    out = by_platform(
        (table, rows, w),
        [jax.ShapeDtypeStruct((rows.shape[0], table.shape[1]), jnp.float32)],
        **impls,
    )
    return out[0]


def _require_pallas(ok: bool, table) -> None:
    if not ok:
        raise ValueError(
            f"kernel='pallas' needs power-of-two embedding dims, got a [{table.shape[0]}, "
            f"{table.shape[1]}] buffer; use kernel='auto' (XLA for this buffer)"
        )


def _sum_positions(table, rows, w):
    """sum_l w[:, l] * table[rows[:, l]] in fp32 (`rows`, `w`: `[B, cap]`), one fused
    gather+add per position, summed by `_sum_terms` (which keeps a narrow table behind its
    barrier)."""
    cap = rows.shape[1]
    if cap == 0:
        return jnp.zeros((rows.shape[0], table.shape[1]), jnp.float32)

    def term(p, t):
        return w[:, p, None] * t.at[rows[:, p]].get(mode="promise_in_bounds").astype(jnp.float32)

    return _sum_terms(table, term, cap)


def _caps(kjt: KeyedJaggedTensor, key_indices: Sequence[int]) -> list[int]:
    caps = kjt.length_caps()
    if caps is None:
        raise ValueError(
            "the per-position lookup needs static bag-length caps: prepare the batch "
            "(module.prepare(kjt)) or call kjt.pad(...) first, or use kernel='reference'"
        )
    return [caps[ki] for ki in key_indices]


def _group_members(layout: TableLayout, group: str) -> list[int]:
    return [i for i, s in enumerate(layout.features) if s.group == group]


def _jagged_args(
    kjt, layout: TableLayout, group: str, *, weighted: bool, bounds_check: str
) -> dict:
    key_indices = layout.key_indices(kjt.keys())
    members = _group_members(layout, group)
    slots = [layout.features[i] for i in members]
    return dict(
        stride=kjt.stride(),
        keys=[key_indices[i] for i in members],
        row_offsets=[s.row_offset for s in slots],
        num_rows=[s.num_rows for s in slots],
        mean=[s.pooling is PoolingType.MEAN for s in slots],
        clamp=bounds_check == "clamp",
    )


def _group_per_position(
    table,
    kjt,
    layout: TableLayout,
    group: str,
    caps,
    *,
    weighted: bool,
    bounds_check: str,
    positions=None,
):
    """The XLA form of one group: `[B, F_g * dim]`. The features of one length cap
    (`cap_classes`) are pooled together, from the host-built `positions` (`position_rows`:
    one (rows, weights) pair per class) when the batch carries them, else from the KJT
    (`_pool_bags`). With one cap (the usual case) the pooled block is the group's as it
    is, else the blocks' columns are put back in feature order."""
    key_indices = layout.key_indices(kjt.keys())
    classes = cap_classes(layout, group, caps)
    members = _group_members(layout, group)
    dim = table.shape[1]
    columns: dict[int, jax.Array] = {}
    for c, (cap, features) in enumerate(classes):
        if positions is not None:
            rows, w = positions[c]
            pooled = _pool_rows(table, rows, w, kjt.stride())
        else:
            pooled = _pool_bags(
                table,
                kjt,
                [key_indices[i] for i in features],
                [layout.features[i] for i in features],
                cap,
                weighted=weighted,
                bounds_check=bounds_check,
            )
        if len(classes) == 1:
            return pooled
        for k, i in enumerate(features):
            columns[i] = pooled[:, k * dim : (k + 1) * dim]
    return jnp.concatenate([columns[i] for i in members], axis=1)


def _pool_rows(table, rows, w, stride: int):
    """`[B, n * dim]` from a class's host-built position matrices (`position_rows`, `[cap,
    B * n]` each): the sum over positions of `w[p] * table[rows[p]]`, as `_pool_bags` sums."""

    def term(p, t):
        return w[p][:, None] * t.at[rows[p]].get(mode="promise_in_bounds").astype(jnp.float32)

    return _sum_terms(table, term, rows.shape[0]).reshape(stride, -1)


def _pool_bags(
    table,
    kjt,
    keys: Sequence[int],
    slots: Sequence[FeatureSlot],
    cap: int,
    *,
    weighted: bool,
    bounds_check: str,
):
    """`[B, n * dim]` fp32: sample b's bag of feature `keys[k]` pooled into columns `k * dim`
    on, for bags of at most `cap` ids.

    The bags are taken sample-major (bag `b * n + k`), so the accumulator `[B * n, dim]` is
    the output's layout. Position p of every bag is one term, `w * table[row]`, whose id is
    read straight from the KJT's values at the bag's offset + p (no `[B, cap]` id matrix is
    built), 0 past the bag's end, skipped or clamped out of range, MEAN-scaled; the terms are
    summed in position order by `_sum_terms`."""
    stride, n = kjt.stride(), len(keys)
    bags = jnp.arange(stride * n, dtype=jnp.int32)
    feature = bags % n  # sample-major: bag b * n + k is sample b of feature keys[k]
    which = jnp.asarray(np.asarray(keys, np.int32))[feature] * stride + bags // n
    start, length = kjt.offsets()[which], kjt.lengths()[which]
    num_rows = jnp.asarray(np.array([s.num_rows for s in slots], np.int32))[feature]
    row_offset = jnp.asarray(np.array([s.row_offset for s in slots], np.int32))[feature]
    means = np.array([s.pooling is PoolingType.MEAN for s in slots])
    mean = jnp.asarray(means)[feature]
    values, last = kjt.values(), max(kjt.capacity() - 1, 0)
    per_id = kjt.weights().astype(jnp.float32) if weighted else None

    def term(p, t):
        at = jnp.minimum(start + p, last)
        valid = p < length
        ids = values[at]
        if bounds_check == "clamp":
            ids = jnp.clip(ids, 0, num_rows - 1)
        else:
            inside = (ids >= 0) & (ids < num_rows)
            ids, valid = jnp.where(inside, ids, 0), valid & inside
        w = jnp.where(valid, per_id[at] if weighted else 1.0, 0.0)
        if means.any():
            w = jnp.where(mean, w / jnp.maximum(length, 1).astype(w.dtype), w)
        # padding and skipped positions read the group's first row: one cache-hot line
        rows = jnp.where(valid, ids + row_offset, 0)
        return w[:, None] * t.at[rows].get(mode="promise_in_bounds").astype(jnp.float32)

    return _sum_terms(table, term, cap).reshape(stride, n * table.shape[1])


def _sum_terms(table, term, cap: int):
    """`sum_p term(p, table)` for 0 < cap positions, in position order, 4 terms a loop
    iteration (XLA fuses each iteration's gathers and adds and never writes gathered rows;
    a loop measured 4-7x faster than fully unrolled positions at cap 32). The first terms
    (cap mod 4, or 4) are summed before the loop: no zero-filled accumulator, and no
    remainder after it (a remainder outside the loop fused with the output into one
    single-threaded pass, measured 2 ms at W1)."""
    narrow = table.dtype != jnp.float32

    def barrier(t):
        # a narrow table stays behind a barrier: otherwise XLA rewrites gather + convert as
        # convert(whole table) + gather, materializing every row in fp32 on each call (5-13x
        # slower than fp32 tables; benchmarks/NOTES.md)
        return jax.lax.optimization_barrier(t) if narrow else t

    first = min(cap % _UNROLL or _UNROLL, cap)
    t = barrier(table)
    acc = term(0, t)
    for p in range(1, first):
        acc = acc + term(p, t)
    if cap > first:

        def add(p, carry):
            acc, t = carry
            t = barrier(t)
            return acc + term(p, t), t

        acc = jax.lax.fori_loop(first, cap, add, (acc, table), unroll=_UNROLL)[0]
    return acc


def _group_segment_sum(
    table, kjt, layout: TableLayout, group: str, *, weighted: bool, bounds_check: str
):
    """The reference form of one group (no caps needed): `[B, F_g * dim]`."""
    stride, n = kjt.stride(), len(_group_members(layout, group))
    rows, bag, scale = id_stream(kjt, layout, group, weighted=weighted, bounds_check=bounds_check)
    gathered = table.at[rows].get(mode="fill", fill_value=0).astype(jnp.float32) * scale[:, None]
    pooled = jax.ops.segment_sum(gathered, bag, num_segments=n * stride)
    return pooled.reshape(n, stride, -1).transpose(1, 0, 2).reshape(stride, -1)


def _jagged_kernel(fn, kjt, layout, group, weighted, bounds_check, **extra):
    args = _jagged_args(kjt, layout, group, weighted=weighted, bounds_check=bounds_check)

    def run(table, kjt):
        return fn(
            table, kjt.values(), kjt.offsets(), kjt.weights() if weighted else None, **args, **extra
        )

    return run


def pooled_group(
    table,
    kjt,
    layout: TableLayout,
    group: str,
    *,
    weighted: bool,
    bounds_check: str,
    kernel: str,
    positions=None,
):
    """One group's pooled sums `[B, F_g * dim]` fp32 (the group's features side by side), the
    kernel chosen when the program is lowered:

    | kernel | CPU | CUDA | other |
    |---|---|---|---|
    | "auto" | C++ jagged kernel (fp32, built), else XLA | Pallas jagged kernel (power-of-two dim), else XLA | XLA |
    | "ffi" | C++ (an error when unavailable) | as "auto" | as "auto" |
    | "pallas" | Pallas, interpret mode | Pallas | Pallas, interpret mode |
    | "xla" | XLA per-position | XLA per-position | XLA per-position |

    The XLA form needs the batch's length caps (a prepared batch); without them it is the
    segment-sum form. `positions`: the group's host-built position matrices
    (`position_rows`; a collection builds them only with kernel "xla"), which the XLA form
    then reads instead of the KJT's ids."""
    from sparse_jax import _kernels
    from sparse_jax._kernels import _pallas
    from sparse_jax._kernels._platform import by_platform

    caps = kjt.length_caps()
    caps = None if caps is None else [caps[ki] for ki in layout.key_indices(kjt.keys())]
    opts = dict(weighted=weighted, bounds_check=bounds_check)

    def xla(table, kjt, positions=None):
        if caps is None:
            return _group_segment_sum(table, kjt, layout, group, **opts)
        return _group_per_position(table, kjt, layout, group, caps, positions=positions, **opts)

    pallas_ok = _pallas.supports_dim(table.shape[1])
    if kernel == "xla":
        if caps is None:
            _caps(kjt, layout.key_indices(kjt.keys()))  # raises the prepare-first error
        return xla(table, kjt, positions)
    if kernel == "pallas":
        _require_pallas(pallas_ok, table)
        impls = dict(
            default=_jagged_kernel(
                _pallas.jagged_pooled_sum,
                kjt,
                layout,
                group,
                weighted,
                bounds_check,
                interpret=True,
            ),
            cuda=_jagged_kernel(
                _pallas.jagged_pooled_sum, kjt, layout, group, weighted, bounds_check
            ),
        )
    else:
        ffi = use_ffi(kernel, table) or (kernel == "auto" and table.dtype == jnp.float32)
        cpu = _jagged_kernel(_kernels.jagged_pooled_sum, kjt, layout, group, weighted, bounds_check)
        impls = dict(
            default=xla,
            cpu=_kernels.when_built(cpu, xla) if ffi else None,
            cuda=_jagged_kernel(
                _pallas.jagged_pooled_sum, kjt, layout, group, weighted, bounds_check
            )
            if pallas_ok
            else None,
        )
    leaves, treedef = jax.tree_util.tree_flatten((table, kjt))

    def flat(fn):
        return lambda *ops: [fn(*jax.tree_util.tree_unflatten(treedef, ops))]

    n = len(_group_members(layout, group))
    aval = jax.ShapeDtypeStruct((kjt.stride(), n * table.shape[1]), jnp.float32)
    return by_platform(
        leaves, [aval], **{k: flat(f) if f is not None else None for k, f in impls.items()}
    )[0]


def pooled_per_position(
    params,
    kjt,
    layout: TableLayout,
    *,
    weighted: bool,
    bounds_check: str,
    kernel: str,
    positions=None,
):
    """Per feature (output order) a `[B, dim]` fp32 block (`pooled_group` per group;
    `positions`: the batch's host-built position matrices by group, or None)."""
    out: list = [None] * len(layout.features)
    for group in layout.groups:
        pooled = pooled_group(
            params[group],
            kjt,
            layout,
            group,
            weighted=weighted,
            bounds_check=bounds_check,
            kernel=kernel,
            positions=None if positions is None else positions[group],
        )
        dim = layout.groups[group][1]
        for j, i in enumerate(_group_members(layout, group)):
            out[i] = pooled[:, j * dim : (j + 1) * dim]
    return out


def id_stream(kjt, layout: TableLayout, group: str, *, weighted: bool, bounds_check: str):
    """Flat per-id triples for one group: (row, bag, scale), each `[capacity]`.

    `row` indexes the group buffer, `bag = j * B + b` for the group's j-th feature and
    sample b, `scale` is the id's weight (times 1/length for MEAN). Ids that contribute
    nothing (padding, skipped, other groups' features) get row `num_rows` of the group, bag
    `F_g * B` (F_g: the group's features) and scale 0: both indices are out of range, so
    every scatter and segment sum drops them instead of piling them onto one real row or
    bag (on a GPU, one atomic hot spot).
    """
    total_rows = layout.groups[group][0]
    stride = kjt.stride()
    key_indices = layout.key_indices(kjt.keys())
    seg = kjt.segment_ids()
    num_bags = len(kjt.keys()) * stride
    key_of_slot = jnp.minimum(seg // max(stride, 1), len(kjt.keys()))
    sample = seg - key_of_slot * stride
    # static per-key tables (index num_keys = padding)
    n_keys = len(kjt.keys())
    in_group = np.zeros(n_keys + 1, bool)
    row_off = np.zeros(n_keys + 1, np.int32)
    num_rows = np.ones(n_keys + 1, np.int32)
    pos_in_group = np.zeros(n_keys + 1, np.int32)
    is_mean = np.zeros(n_keys + 1, bool)
    members = [i for i, s in enumerate(layout.features) if s.group == group]
    for j, i in enumerate(members):
        slot, ki = layout.features[i], key_indices[i]
        in_group[ki], row_off[ki], num_rows[ki] = True, slot.row_offset, slot.num_rows
        pos_in_group[ki], is_mean[ki] = j, slot.pooling is PoolingType.MEAN
    ids = kjt.values()
    valid = kjt.valid_mask() & jnp.asarray(in_group)[key_of_slot]
    n_rows = jnp.asarray(num_rows)[key_of_slot]
    if bounds_check == "clamp":
        ids = jnp.clip(ids, 0, n_rows - 1)
    else:
        valid = valid & (ids >= 0) & (ids < n_rows)
    rows = jnp.where(valid, ids + jnp.asarray(row_off)[key_of_slot], total_rows)
    bag = jnp.where(
        valid, jnp.asarray(pos_in_group)[key_of_slot] * stride + sample, len(members) * stride
    )
    scale = jnp.where(valid, _per_id_weights(kjt, weighted), 0.0)
    lengths = jnp.concatenate([kjt.lengths(), jnp.ones(1, kjt.lengths().dtype)])
    bag_len = jnp.maximum(lengths[jnp.minimum(seg, num_bags)], 1).astype(jnp.float32)
    scale = jnp.where(jnp.asarray(is_mean)[key_of_slot], scale / bag_len, scale)
    return rows.astype(jnp.int32), bag.astype(jnp.int32), scale


def pooled_segment_sum(params, kjt, layout: TableLayout, *, weighted: bool, bounds_check: str):
    """Reference: gather every id's row, weight it, `segment_sum` per bag.

    Padding and skipped ids carry the out-of-range bag `F_g * B` (`id_stream`): the segment
    sum drops them rather than adding zeros into bag 0."""
    stride = kjt.stride()
    out: list = [None] * len(layout.features)
    for group in layout.groups:
        members = [i for i, s in enumerate(layout.features) if s.group == group]  # never empty
        rows, bag, scale = id_stream(
            kjt, layout, group, weighted=weighted, bounds_check=bounds_check
        )
        table = params[group]
        gathered = (
            table.at[rows].get(mode="fill", fill_value=0).astype(jnp.float32) * scale[:, None]
        )
        pooled = jax.ops.segment_sum(gathered, bag, num_segments=len(members) * stride)
        for j, i in enumerate(members):
            out[i] = pooled[j * stride : (j + 1) * stride]
    return out
