"""GPU kernels in Pallas (Triton backend): the jagged pooled lookup and the sorted-run update.

Both read the jagged layout as it is (offsets, no length caps, no padding to a power of two)
and use no atomics: every output element has exactly one writer, so results are bitwise the
same on every run. `interpret=True` runs them on any backend (the tests' CPU check against
the plain loops of `tests/reference.py`); a program lowered for CUDA holds one Triton custom
call per kernel.

* `jagged_pooled_sum`: one program per (feature, sample) bag, as FBGEMM's warp-per-bag
  forward: it walks the bag's ids from `offsets`, accumulates weighted rows in registers
  (fp32, whatever the table's dtype) and writes its `[dim]` slice of `[B, F * dim]` once.
  The same signature as the C++ kernel (`_ffi.jagged_pooled_sum`).
* `sorted_runs` (XLA, no scatter): the id stream sorted by row (ids outside the table sort
  last) with the permutation that sorted it: one key + value sort.
* `sorted_run_update`: one program per sorted position; the first of each run of equal
  rows sums the run's gradient rows (`grad[bag] * scale`, in sorted order), applies the row rule in registers (the rule's own
  `update_rows` on a `[1, dim]` row) and writes the row and its per-row state once, in
  place (the buffers are aliased to the outputs). No `[rows, dim]` gradient, no per-id
  temporaries beyond the sort.

* `run_update`: one program per run already found (by the host, `sparse_jax._sorted_ids`,
  or in the program, `sorted_chunks`), no search for the run's end. `host_runs_update`
  reads a host-sorted batch; `chunked_run_update` an unsorted stream.
* `chunk_sums`, for long runs (a hot row of Zipf ids holds thousands of ids, and one
  program summing them in a row was the whole update's time): the runs are cut into chunks
  of consecutive ids, one program per chunk sums its gradient rows in order into a
  `[chunks, dim]` buffer, then each run's program adds its chunk sums in order. Still one
  writer per element and a fixed order: the same bits on every run.

Limits (callers fall back to the XLA form): `dim` a power of two (Triton block shapes), rules
whose state is per-row only (sgd, adagrad, rowwise_adagrad, adam).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

UNROLL = 4  # ids read per loop step in the jagged kernels

__all__ = [
    "CHUNK",
    "UNROLL",
    "SortedChunks",
    "chunk_sums",
    "chunked_run_update",
    "host_runs_update",
    "jagged_pooled_sum",
    "per_row_state",
    "pooled_positions",
    "run_update",
    "sorted_chunks",
    "sorted_run_update",
    "sorted_runs",
    "supports_dim",
]


def supports_dim(dim: int) -> bool:
    """Triton blocks are powers of two: rows of another width take the XLA form."""
    return dim >= 1 and dim & (dim - 1) == 0


def per_row_state(state, num_rows: int, dim: int) -> bool:
    """Whether every state leaf is per-row (`[rows]` or `[rows, dim]`): the kernel reads and
    writes them with the row; global leaves (an optax step count) need the XLA form."""
    return all(
        hasattr(x, "ndim")
        and x.ndim in (1, 2)
        and x.shape[0] == num_rows
        and (x.ndim == 1 or x.shape[1] == dim)
        for x in jax.tree_util.tree_leaves(state)
    )


def _compiler_params(num_warps: int):
    from jax.experimental.pallas import triton as plt

    return plt.CompilerParams(num_warps=num_warps, num_stages=1)


def _warps(dim: int) -> int:
    return max(1, min(4, dim // 64))


def jagged_pooled_sum(
    table,
    values,
    offsets,
    weights,
    *,
    stride: int,
    keys,
    row_offsets,
    num_rows,
    mean,
    clamp: bool,
    interpret: bool = False,
    unroll: int = UNROLL,
):
    """Pooled sums `[stride, len(keys) * dim]` fp32 of the KJT features `keys` (indices into
    the KJT's keys), each reading the table buffer at its `row_offsets` with `num_rows`
    rows; `mean` divides a feature's bags by their length; ids outside `[0, num_rows)` are
    clamped (`clamp`) or skipped. `weights`: per-id weights or None. `unroll` ids are read
    per loop step (their loads in flight together; the sum's order is the bag's order)."""
    n_feat = len(keys)
    dim = table.shape[1]
    if not supports_dim(dim):
        raise ValueError(f"the Pallas lookup needs a power-of-two dim, got {dim}; use kernel='xla'")
    static = jnp.asarray(
        [list(keys), list(row_offsets), list(num_rows), [int(bool(m)) for m in mean]], jnp.int32
    )
    weighted = weights is not None
    operands = [static, offsets.astype(jnp.int32), values.astype(jnp.int32)]
    if weighted:
        operands.append(weights.astype(jnp.float32))
    operands.append(table)
    kernel = functools.partial(
        _pooled_kernel,
        stride=stride,
        dim=dim,
        clamp=clamp,
        weighted=weighted,
        unroll=max(1, int(unroll)),
    )
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((stride, n_feat * dim), jnp.float32),
        grid=(n_feat, stride),
        interpret=interpret,
        compiler_params=_compiler_params(_warps(dim)),
        name="hybridrec_jagged_pooled_sum",
    )(*operands)


def _in_steps(start, end, unroll: int, body, init):
    """`body(i, in_range, acc)` for i in [start, end), `unroll` positions per loop step (the
    positions past `end` of the last step are masked); the calls run in order."""

    def step(g, acc):
        for u in range(unroll):
            i = start + g * unroll + u
            acc = body(jnp.minimum(i, jnp.maximum(end - 1, start)), i < end, acc)
        return acc

    return jax.lax.fori_loop(0, (end - start + unroll - 1) // unroll, step, init)


def checked_row(row, in_bag, num_rows, clamp: bool):
    """(row to read, whether it counts) for a bag position: `clamp` pins an out-of-range id
    to the nearest row and keeps it; else it is skipped (read as row 0, not counted)."""
    if clamp:
        return jnp.minimum(jnp.maximum(row, 0), num_rows - 1), in_bag
    keep = in_bag & (row >= 0) & (row < num_rows)
    return jnp.where(keep, row, 0), keep


def _pooled_kernel(static_ref, off_ref, val_ref, *refs, stride, dim, clamp, weighted, unroll):
    if weighted:
        w_ref, t_ref, o_ref = refs
    else:
        (t_ref, o_ref), w_ref = refs, None
    j, b = pl.program_id(0), pl.program_id(1)
    bag = static_ref[0, j] * stride + b
    row_offset, n_rows, is_mean = static_ref[1, j], static_ref[2, j], static_ref[3, j]
    start, end = off_ref[bag], off_ref[bag + 1]

    def add(i, in_bag, acc):
        idx, keep = checked_row(val_ref[i], in_bag, n_rows, clamp)
        w = w_ref[i] if weighted else jnp.float32(1)
        w = jnp.where(keep, w, jnp.float32(0))
        return jnp.where(keep, acc + w * t_ref[idx + row_offset, :].astype(jnp.float32), acc)

    acc = _in_steps(start, end, unroll, add, jnp.zeros((dim,), jnp.float32))
    length = jnp.maximum(end - start, 1).astype(jnp.float32)
    acc = jnp.where(is_mean != 0, acc / length, acc)
    o_ref[b, pl.ds(j * dim, dim)] = acc


def pooled_positions(table, rows, w, *, interpret: bool = False):
    """`sum_l w[:, l] * table[rows[:, l]]` `[bags, dim]` fp32 (the per-position matrices of
    the sharded lookup, as the C++ `pooled_sum`): one program per bag, rows accumulated in
    registers; positions of weight 0 (padding) read row 0 (one cache-hot row) and add nothing."""
    dim = table.shape[1]
    if not supports_dim(dim):
        raise ValueError(f"the Pallas lookup needs a power-of-two dim, got {dim}; use kernel='xla'")
    bags, cap = rows.shape
    kernel = functools.partial(_positions_kernel, cap=cap, dim=dim)
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((bags, dim), jnp.float32),
        grid=(max(bags, 1),),
        interpret=interpret,
        compiler_params=_compiler_params(_warps(dim)),
        name="hybridrec_pooled_positions",
    )(rows.astype(jnp.int32), w.astype(jnp.float32), table)


def _positions_kernel(rows_ref, w_ref, t_ref, o_ref, *, cap, dim):
    b = pl.program_id(0)

    def add(p, acc):
        w = w_ref[b, p]
        row = jnp.where(w != 0, rows_ref[b, p], 0)
        return acc + w * t_ref[row, :].astype(jnp.float32)

    o_ref[b, :] = jax.lax.fori_loop(0, cap, add, jnp.zeros((dim,), jnp.float32))


def sorted_runs(rows, num_rows: int):
    """The id stream sorted by row: `(rows_s, perm)`, both `[N]` int32.

    `rows_s`: rows ascending, ids outside `[0, num_rows)` (padding, skipped) as `num_rows`,
    sorted last; `perm[i]`: the stream position of the i-th sorted id (its bag and scale are
    read through it). One key + value sort (a radix sort on a GPU), stable: equal rows keep
    the stream's order, so the sums are reproducible. Integer work only, no scatter."""
    n = rows.shape[0]
    key = jnp.where((rows >= 0) & (rows < num_rows), rows, num_rows).astype(jnp.int32)
    rows_s, perm = jax.lax.sort((key, jnp.arange(n, dtype=jnp.int32)), num_keys=1, is_stable=True)
    return rows_s, perm


CHUNK = 32  # ids per chunk when the runs are found in the program (no host to size them)


class SortedChunks(NamedTuple):
    """A stream sorted in the program with its runs found (`sorted_chunks`), `[N]`-sized
    with padding at the end. Run u is row `unique[u]`: a short run (at most `CHUNK` ids)
    sums its sorted positions `starts[u] : ends[u]`; a long one has an empty id range and
    sums chunk sums `chunk_lo[u] : chunk_hi[u]` instead. Chunk c (of a long run) is sorted
    positions `chunk_starts[c] : chunk_ends[c]`; `perm[i]` is the stream position of sorted
    position i. Chunks exist for long runs only, so their buffer is `[N // CHUNK * 2 + 2]`,
    not `[N]`."""

    unique: jax.Array
    starts: jax.Array
    ends: jax.Array
    chunk_lo: jax.Array
    chunk_hi: jax.Array
    chunk_starts: jax.Array
    chunk_ends: jax.Array
    perm: jax.Array


def sorted_chunks(rows, num_rows: int, size: int = CHUNK) -> SortedChunks:
    """The id stream sorted by row (`sorted_runs`), its runs found and the long ones cut
    into chunks of `size` ids, in the program: integer work only (a sort, scans, gathers
    and scatters to unique positions), no host. Ids outside `[0, num_rows)` belong to no
    run."""
    n = rows.shape[0]
    k_cap = 2 * (n // size) + 2  # a long run of L > size ids has ceil(L / size) < 2 L / size chunks
    rows_s, perm = sorted_runs(rows, num_rows)
    pos = jnp.arange(n, dtype=jnp.int32)
    valid = rows_s < num_rows
    n_valid = valid.sum(dtype=jnp.int32)
    prev = jnp.concatenate([jnp.full((1,), -1, jnp.int32), rows_s[:-1]])
    new_run = valid & (rows_s != prev)
    run_id = jnp.cumsum(new_run, dtype=jnp.int32) - 1
    run_at = jnp.where(new_run, run_id, n + 1)  # out of range: dropped by the scatters
    starts = (
        jnp.full((n + 1,), n_valid, jnp.int32).at[run_at].set(pos, mode="drop", unique_indices=True)
    )
    ends = starts[1:]
    starts = starts[:-1]
    unique = (
        jnp.full((n,), num_rows, jnp.int32).at[run_at].set(rows_s, mode="drop", unique_indices=True)
    )
    long_run = ends - starts > size
    run_of = jnp.clip(run_id, 0, max(n - 1, 0))
    offset = pos - starts[run_of]  # rank in the run
    new_chunk = valid & long_run[run_of] & (offset % size == 0)
    chunk_id = jnp.cumsum(new_chunk, dtype=jnp.int32) - 1
    chunk_at = jnp.where(new_chunk, chunk_id, k_cap + 1)
    chunk_starts = (
        jnp.full((k_cap,), n, jnp.int32).at[chunk_at].set(pos, mode="drop", unique_indices=True)
    )
    chunk_ends = (
        jnp.full((k_cap,), n, jnp.int32)
        .at[chunk_at]
        .set(jnp.minimum(pos + size, ends[run_of]), mode="drop", unique_indices=True)
    )
    # a long run's first chunk starts at its first position: the chunk id there
    first_chunk = (
        jnp.zeros((n,), jnp.int32).at[run_at].set(chunk_id, mode="drop", unique_indices=True)
    )
    chunk_lo = jnp.where(long_run, first_chunk, 0)
    chunk_hi = jnp.where(long_run, chunk_lo + (ends - starts + size - 1) // size, 0)
    starts, ends = jnp.where(long_run, 0, starts), jnp.where(long_run, 0, ends)
    return SortedChunks(unique, starts, ends, chunk_lo, chunk_hi, chunk_starts, chunk_ends, perm)


def chunked_run_update(
    rule,
    table,
    state,
    step,
    rows,
    bag,
    scale,
    bag_grads,
    good=None,
    *,
    interpret: bool = False,
    size: int = CHUNK,
):
    """The fused update of an unsorted id stream with no host help (a sharded step's local
    ids, a batch prepared without `sort_ids`): `sorted_chunks` finds the runs in the
    program, `chunk_sums` sums each chunk of the long runs, and `run_update` steps each run
    from its ids (short runs) or its chunk sums (long ones). No atomics, no binary search;
    a hot row's ids are summed by many programs."""
    c = sorted_chunks(rows, table.shape[0], size)
    bag_s, scale_s = bag.astype(jnp.int32)[c.perm], scale.astype(jnp.float32)[c.perm]
    sums = chunk_sums(c.chunk_starts, c.chunk_ends, bag_s, scale_s, bag_grads, interpret=interpret)
    return run_update(
        rule, table, state, step, c.unique, (c.starts, c.ends), bag_s, scale_s, bag_grads, good,
        chunks=(c.chunk_lo, c.chunk_hi, sums), interpret=interpret,
    )  # fmt: skip


def host_runs_update(
    rule, table, state, step, ids, bag_grads, good=None, *, interpret: bool = False
):
    """The fused update of a host-sorted batch (`ids`: a buffer's `SortedIds`, or any object
    with its `unique`, `offsets`, `bag`, `scale`, `chunks`, `run_chunks`): `run_update` over
    the host's runs; when the host cut them into chunks, `chunk_sums` first and each run
    adds its chunks' sums."""
    if ids.chunks is None:
        return run_update(
            rule, table, state, step, ids.unique, ids.offsets, ids.bag, ids.scale, bag_grads,
            good, interpret=interpret,
        )  # fmt: skip
    sums = chunk_sums(
        ids.chunks[:-1], ids.chunks[1:], ids.bag, ids.scale, bag_grads, interpret=interpret
    )
    none = jnp.zeros(ids.unique.shape, jnp.int32)  # every id is in a chunk
    return run_update(
        rule, table, state, step, ids.unique, (none, none), ids.bag, ids.scale, bag_grads, good,
        chunks=(ids.run_chunks[:-1], ids.run_chunks[1:], sums), interpret=interpret,
    )  # fmt: skip


def chunk_sums(
    starts, ends, bag, scale, bag_grads, *, interpret: bool = False, unroll: int = UNROLL
):
    """`[chunks, dim]` fp32: chunk c's `sum(scale[i] * bag_grads[bag[i]])` over the sorted
    positions `starts[c] : ends[c]`, in order (an empty chunk sums to 0; bags outside
    `bag_grads` add nothing). One program per chunk, one writer per row, no atomics."""
    n_chunks = starts.shape[0]
    dim = bag_grads.shape[1]
    if not supports_dim(dim):
        raise ValueError(f"the Pallas update needs a power-of-two dim, got {dim}; use kernel='xla'")
    kernel = functools.partial(
        _chunk_kernel, num_bags=bag_grads.shape[0], dim=dim, unroll=max(1, int(unroll))
    )
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((n_chunks, dim), jnp.float32),
        grid=(max(n_chunks, 1),),
        interpret=interpret,
        compiler_params=_compiler_params(_warps(dim)),
        name="hybridrec_chunk_sums",
    )(
        starts.astype(jnp.int32),
        ends.astype(jnp.int32),
        bag.astype(jnp.int32),
        scale.astype(jnp.float32),
        bag_grads,
    )


def _grad_adder(bag_ref, scale_ref, g_ref, num_bags: int, perm_ref=None):
    """`add(i, in_range, acc)`: `acc + scale * g[bag]` of sorted position i (read through
    `perm_ref` when given); bags outside `g` and positions out of range add nothing."""

    def add(i, in_range, acc):
        at = i if perm_ref is None else perm_ref[i]
        b = bag_ref[at]
        keep = in_range & (b >= 0) & (b < num_bags)
        s = jnp.where(keep, scale_ref[at], jnp.float32(0))
        return jnp.where(keep, acc + s * g_ref[jnp.where(keep, b, 0), :].astype(jnp.float32), acc)

    return add


def _chunk_kernel(start_ref, end_ref, bag_ref, scale_ref, g_ref, o_ref, *, num_bags, dim, unroll):
    c = pl.program_id(0)

    add = _grad_adder(bag_ref, scale_ref, g_ref, num_bags)
    acc = _in_steps(start_ref[c], end_ref[c], unroll, add, jnp.zeros((dim,), jnp.float32))
    o_ref[c, :] = acc


def _flags(step, good):
    """`[step, good]` int32: the 1-based step and the guard's flag (1: write)."""
    good = jnp.ones((), bool) if good is None else good
    return jnp.stack([jnp.asarray(step, jnp.int32).reshape(()), good.astype(jnp.int32).reshape(())])


def _call_in_place(kernel, inputs, table, leaves, treedef, *, grid: int, dim: int, name, interpret):
    """`kernel` over `inputs`, then `table` and its state `leaves`, which it updates in place
    (aliased to the outputs): `(new table, new state)`."""
    first = len(inputs)
    outs = pl.pallas_call(
        kernel,
        out_shape=[jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (table, *leaves)],
        grid=(max(grid, 1),),
        input_output_aliases={first + i: i for i in range(1 + len(leaves))},
        interpret=interpret,
        compiler_params=_compiler_params(_warps(dim)),
        name=name,
    )(*inputs, table, *leaves)
    return outs[0], jax.tree_util.tree_unflatten(treedef, outs[1:])


def _check_update(rule, state, num_rows: int, dim: int) -> None:
    if not supports_dim(dim):
        raise ValueError(f"the Pallas update needs a power-of-two dim, got {dim}; use kernel='xla'")
    if not per_row_state(state, num_rows, dim):
        raise ValueError(
            f"{rule.name}: the Pallas update needs per-row state leaves ([rows] or [rows, dim]), got "
            f"{[getattr(x, 'shape', x) for x in jax.tree_util.tree_leaves(state)]}; use kernel='xla'"
        )


def sorted_run_update(
    rule,
    table,
    state,
    step,
    rows_s,
    perm,
    bag,
    scale,
    bag_grads,
    good=None,
    *,
    interpret: bool = False,
    unroll: int = UNROLL,
):
    """One fused update of one buffer from `sorted_runs`' output: `(new table, new state)`.

    `bag`, `scale`: the stream's (unsorted) per-id bag and scale; `state`: the rule's per-row
    leaves (`[rows]` or `[rows, dim]` fp32); `step` the 1-based step (int32 scalar);
    `bag_grads` `[bags, dim]`; `good` (bool scalar or None): when false no program writes, so
    the buffers stay exactly as they were (the non-finite guard by predication, no host
    sync). The table and state are updated in place (aliased). One program per sorted
    position; the first position of each run finds the run's end (a binary search with a
    static trip count) and does the run's work, the others exit. (A `while_loop` over the
    run crashed Triton's compiler at dim 64 on jax 0.11.2.)"""
    num_rows, dim = table.shape
    _check_update(rule, state, num_rows, dim)
    leaves, treedef = jax.tree_util.tree_flatten(state)
    n = rows_s.shape[0]
    inputs = [_flags(step, good), rows_s, perm, bag.astype(jnp.int32)]
    inputs += [scale.astype(jnp.float32), bag_grads]
    kernel = functools.partial(
        _update_kernel,
        rule=rule,
        treedef=treedef,
        num_rows=num_rows,
        num_bags=bag_grads.shape[0],
        n=n,
        dim=dim,
        unroll=max(1, int(unroll)),
    )
    return _call_in_place(
        kernel, inputs, table, leaves, treedef, grid=n, dim=dim,
        name="hybridrec_sorted_run_update", interpret=interpret,
    )  # fmt: skip


def _update_kernel(
    flags_ref,
    rows_ref,
    perm_ref,
    bag_ref,
    scale_ref,
    g_ref,
    t_in,
    *refs,
    rule,
    treedef,
    num_rows,
    num_bags,
    n,
    dim,
    unroll,
):

    k_leaves = treedef.num_leaves
    s_in, t_out, s_out = refs[:k_leaves], refs[k_leaves], refs[k_leaves + 1 :]
    k = pl.program_id(0)
    row = rows_ref[k]
    prev = rows_ref[jnp.maximum(k - 1, 0)]
    step, good = flags_ref[0], flags_ref[1]
    active = ((k == 0) | (row != prev)) & (row < num_rows) & (good != 0)

    @pl.when(active)
    def _():
        def halve(_, bounds):  # the run's end: the first sorted position past `row`
            lo, hi = bounds
            mid = (lo + hi) // 2
            past = rows_ref[jnp.minimum(mid, n - 1)] > row
            return jnp.where(past, lo, mid + 1), jnp.where(past, mid, hi)

        _, end = jax.lax.fori_loop(0, max(n, 1).bit_length(), halve, (k, jnp.int32(n)))

        add = _grad_adder(bag_ref, scale_ref, g_ref, num_bags, perm_ref)
        grad = _in_steps(k, end, unroll, add, jnp.zeros((dim,), jnp.float32))
        _step_row(rule, treedef, row, grad, step, t_in, s_in, t_out, s_out)


def _step_row(rule, treedef, row, grad, step, t_in, s_in, t_out, s_out):
    """The row rule on table row `row` with its summed gradient `grad` `[dim]` fp32, in
    registers; the row and its per-row state written once, in place."""
    w = t_in[row, :].astype(jnp.float32)
    rows_state = jax.tree_util.tree_unflatten(
        treedef,
        [ref[pl.ds(row, 1)] if len(ref.shape) == 1 else ref[row, :][None, :] for ref in s_in],
    )
    new_w, new_state = rule.update_rows(w[None, :], rows_state, grad[None, :], step)
    new_w = rule.write_back(new_w, t_out.dtype, step=step, at=jnp.full((1,), row, jnp.int32))
    t_out[row, :] = new_w[0].astype(t_out.dtype)
    for ref, value in zip(s_out, jax.tree_util.tree_leaves(new_state), strict=True):
        value = value.astype(ref.dtype)
        if len(ref.shape) == 1:
            ref[pl.ds(row, 1)] = value.reshape(1)
        else:
            ref[row, :] = value[0]


def run_update(
    rule,
    table,
    state,
    step,
    unique,
    offsets,
    bag,
    scale,
    bag_grads,
    good=None,
    *,
    chunks=None,
    interpret: bool = False,
    unroll: int = UNROLL,
):
    """`sorted_run_update` for runs already found (on the host, `sparse_jax._sorted_ids`,
    or by `sorted_chunks`): one program per run u, row `unique[u]`, its ids at sorted
    positions `offsets[u] : offsets[u + 1]` (`offsets` `[U + 1]`, or a `(starts, ends)`
    pair of `[U]`; `bag`, `scale` in sorted order). `chunks=(lo, hi, sums)`: run u also adds
    rows `sums[lo[u] : hi[u]]` (its chunks' sums), after its ids. No search for a run's end
    and no idle program per id: the programs are the runs. Rows outside the table (padding)
    and empty runs write nothing; the sums are in stream order, as `sorted_run_update`
    forms them (the same bits)."""
    num_rows, dim = table.shape
    _check_update(rule, state, num_rows, dim)
    leaves, treedef = jax.tree_util.tree_flatten(state)
    n_runs = unique.shape[0]
    starts, ends = offsets if isinstance(offsets, tuple) else (offsets[:-1], offsets[1:])
    inputs = [_flags(step, good), unique.astype(jnp.int32), starts.astype(jnp.int32)]
    inputs += [ends.astype(jnp.int32), bag.astype(jnp.int32), scale.astype(jnp.float32)]
    inputs += [bag_grads]
    if chunks is not None:
        inputs += [chunks[0].astype(jnp.int32), chunks[1].astype(jnp.int32), chunks[2]]
    kernel = functools.partial(
        _runs_kernel,
        rule=rule,
        treedef=treedef,
        num_rows=num_rows,
        num_bags=bag_grads.shape[0],
        dim=dim,
        unroll=max(1, int(unroll)),
        chunked=chunks is not None,
    )
    return _call_in_place(
        kernel, inputs, table, leaves, treedef, grid=n_runs, dim=dim,
        name="hybridrec_run_update", interpret=interpret,
    )  # fmt: skip


def _runs_kernel(
    flags_ref,
    unique_ref,
    start_ref,
    end_ref,
    bag_ref,
    scale_ref,
    g_ref,
    *refs,
    rule,
    treedef,
    num_rows,
    num_bags,
    dim,
    unroll,
    chunked,
):
    if chunked:
        lo_ref, hi_ref, sums_ref, *refs = refs
    k_leaves = treedef.num_leaves
    t_in, s_in, t_out, s_out = (
        refs[0],
        refs[1 : 1 + k_leaves],
        refs[1 + k_leaves],
        refs[2 + k_leaves :],
    )
    u = pl.program_id(0)
    row = unique_ref[u]
    start, end = start_ref[u], end_ref[u]
    lo, hi = (lo_ref[u], hi_ref[u]) if chunked else (0, 0)
    step, good = flags_ref[0], flags_ref[1]

    @pl.when((row >= 0) & (row < num_rows) & ((end > start) | (hi > lo)) & (good != 0))
    def _():
        add = _grad_adder(bag_ref, scale_ref, g_ref, num_bags)
        grad = _in_steps(start, end, unroll, add, jnp.zeros((dim,), jnp.float32))
        if chunked:

            def add_chunk(i, in_run, acc):
                return jnp.where(in_run, acc + sums_ref[i, :], acc)

            grad = _in_steps(lo, hi, unroll, add_chunk, grad)
        _step_row(rule, treedef, row, grad, step, t_in, s_in, t_out, s_out)
