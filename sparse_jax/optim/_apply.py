"""The one generic fused update: apply any row rule to the rows a batch touched.

Input: the flat per-id stream of one table buffer (`row`, `bag`, `scale`, from
`sparse_jax._lookup.id_stream`) and the gradient of the pooled output per bag. Steps:
1. sort the rows alone; each id's slot is its row's first sorted position (`searchsorted`);
2. per-id gradient `grad[bag] * scale`, summed per slot (`segment_sum`);
3. gather the unique rows and their state, step them with the rule (fp32);
4. round the rows to the table's dtype (fp16 / bf16: stochastically unless the rule says
   otherwise, `_rounding`) and scatter rows and state back into the (donated) buffers.
No `[rows, dim]` gradient is ever built. Ids that contribute nothing carry the row index
`num_rows`; they get the out-of-range slot N (and bag index), which every scatter drops, so
padding never lands on one shared address (one atomic hot spot on a GPU) and never on a
real row. All shapes are static (the stream's capacity).

`apply_sorted_runs` is the same update from a stream already sorted on the host
(`sparse_jax._sorted_ids`, built by `prepare`): steps 1-2 become `sum_runs` (the runs
bucketed by length on the host; per bucket, its `[runs, cap]` gradient rows gathered and
added position by position: no scatter-add), and steps 3-4 (`step_unique_rows`) run on
`[unique rows, dim]`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from sparse_jax.optim._base import RowRule, is_row_leaf

__all__ = [
    "apply_row_rule",
    "apply_sorted_runs",
    "dedup_row_grads",
    "step_unique_rows",
    "sum_runs",
]


def dedup_row_grads(rows, bag, scale, bag_grads, *, num_rows: int):
    """(unique rows, summed grads): `[N]` int32 and `[N, dim]` fp32, aligned by slot.

    The ids are sorted alone (a one-operand sort; no permutation is carried); each id's slot
    is its row's first position in the sorted ids (`searchsorted`), and the per-id
    gradients are summed into those slots. A slot holds its row if it is the first of its
    run, else -1 (and zero grads). Measured 0.64-0.78x of sorting (row, bag, scale)
    together (benchmarks/NOTES.md).

    Ids whose row is outside `[0, num_rows)` (padding, skipped ids) get slot N, which
    `segment_sum` drops: summing them into one slot would make every padding id an atomic
    add on the same address on a GPU. No slot ever holds such a row (it reads -1). Their
    bag may be out of range too: the gradient gather fills 0 there.
    """
    n = rows.shape[0]
    if n == 0:
        return rows, jnp.zeros((0, bag_grads.shape[1]), jnp.float32)
    rows_s = jnp.sort(rows)
    inside = (rows >= 0) & (rows < num_rows)
    slot = jnp.where(inside, jnp.searchsorted(rows_s, rows, side="left"), n).astype(jnp.int32)
    first = jnp.concatenate([jnp.ones(1, bool), rows_s[1:] != rows_s[:-1]])
    first = first & (rows_s >= 0) & (rows_s < num_rows)
    grads = bag_grads.astype(jnp.float32).at[bag].get(mode="fill", fill_value=0) * scale[:, None]
    summed = jax.ops.segment_sum(grads, slot, num_segments=n)
    return jnp.where(first, rows_s, -1), summed


def apply_row_rule(
    rule: RowRule,
    table,
    state,
    step,
    rows,
    bag,
    scale,
    bag_grads,
    *,
    scatter_add: bool = True,
    good=None,
):
    """One fused update of one buffer in XLA ops. Returns (new table, new state).

    `scatter_add`: SGD on an fp32 table may scatter-add every id's step without dedup (the
    fastest form on CPU); a GPU program passes False (a float scatter-add over repeated rows is
    an atomic per id there, and its sum order changes from run to run). `good` (traced bool
    or None): when false, nothing is written (rows out of range, global leaves kept).
    Which kernel runs the update (C++, Pallas or this) is chosen by the caller
    (`sparse_jax._row_update`), not here.
    """
    num_rows = table.shape[0]
    if good is not None:
        rows = jnp.where(good, rows, num_rows)
    if scatter_add and rule.native == "sgd" and table.dtype == jnp.float32:
        # SGD is linear: scatter-add every id's step, no dedup (measured 0.24-0.29x of the
        # sort + segment_sum form, benchmarks/NOTES.md); ids that contribute nothing carry
        # the row index num_rows (and an out-of-range bag, read as 0) and are dropped
        g = bag_grads.astype(jnp.float32).at[bag].get(mode="fill", fill_value=0)
        step_rows = g * (-rule.hyperparams["lr"] * scale)[:, None]
        return table.at[rows].add(step_rows, mode="drop"), state
    unique, grads = dedup_row_grads(rows, bag, scale, bag_grads, num_rows=num_rows)
    unique = jnp.where(unique < 0, num_rows, unique)  # -1 would wrap to the last row
    return step_unique_rows(rule, table, state, step, unique, grads, good=good)


def _position_sums(rows, index, scale=None):
    """`[R, dim]` fp32: `sum_l rows[index[:, l]] * scale[:, l]` (scale None: 1), the positions
    added in order (l = 0 first) by a loop over l: each step is one fused gather + add, so
    the `[R, cap, dim]` gathered rows are never written (a gather + reduce over the cap axis
    measured several times slower on XLA:CPU). `index` must be in range."""

    def add(pos, acc):
        at = jax.lax.dynamic_index_in_dim(index, pos, axis=1, keepdims=False)
        got = rows.at[at].get(mode="promise_in_bounds")
        if scale is not None:
            got = got * jax.lax.dynamic_index_in_dim(scale, pos, axis=1, keepdims=False)[:, None]
        return acc + got

    cap = index.shape[1]
    acc = jnp.zeros((index.shape[0], rows.shape[1]), jnp.float32)
    return jax.lax.fori_loop(0, cap, add, acc, unroll=min(4, cap))


def sum_runs(ids, bag_grads):
    """(rows `[U']` int32, summed gradients `[U', dim]` fp32) of a host-sorted stream's
    runs (`ids`: a `sparse_jax._sorted_ids.SortedIds`), grouped by bucket (rows ascending
    within a bucket; padding rows are the buffer's `num_rows` with zero sums).

    Per bucket, its `[R, cap]` bags are gathered from the pooled gradient (with one zero
    row appended: the padding bag) and added position by position; runs longer than the
    last bucket sum their chunks that way, then each run's chunk sums. No scatter-add, no
    `[ids, dim]` temporary; the padded work is under 2x the ids."""
    grad_rows = bag_grads.astype(jnp.float32)
    zero = jnp.zeros((1, grad_rows.shape[1]), jnp.float32)
    padded = jnp.concatenate([grad_rows, zero])  # index F_g * B: the padding bag
    rows = [b.rows for b in ids.buckets]
    sums = [_position_sums(padded, b.bag, b.scale) for b in ids.buckets]
    if ids.long is not None:
        chunk_sums = _position_sums(padded, ids.long.bag, ids.long.scale)
        rows.append(ids.long.rows)
        sums.append(_position_sums(jnp.concatenate([chunk_sums, zero]), ids.long.chunks))
    return jnp.concatenate(rows), jnp.concatenate(sums)


def apply_sorted_runs(rule: RowRule, table, state, step, ids, bag_grads, *, good=None):
    """One fused update of one buffer from its host-sorted id stream (`ids`: a
    `sparse_jax._sorted_ids.SortedIds`). Returns (new table, new state).

    `sum_runs` gives each touched row's gradient (no sort, no `searchsorted`, no
    scatter-add); a run of at most `CHUNK` ids is added in batch order, as `apply_row_rule`
    adds it. The rule then steps `[unique, dim]` rows and they are written back as unique
    rows (`step_unique_rows`; an additive rule's step, fp32 SGD's included, is added to
    them). `good`: as `apply_row_rule`."""
    num_rows = table.shape[0]
    unique, grads = sum_runs(ids, bag_grads)
    if good is not None:
        unique = jnp.where(good, unique, num_rows)
    return step_unique_rows(rule, table, state, step, unique, grads, good=good)


def step_unique_rows(rule: RowRule, table, state, step, unique, grads, *, good=None):
    """Gather the `unique` rows (out of range: skipped) and their state, step them with the
    summed `grads` `[U, dim]`, round and write them back (unique indices)."""
    num_rows = table.shape[0]

    def gather(x):
        return x.at[unique].get(mode="fill", fill_value=0) if is_row_leaf(x, num_rows) else x

    state_rows = jax.tree_util.tree_map(gather, state)
    if rule.row_step is not None and table.dtype == jnp.float32:
        # `w + delta` as one read-modify-write of each unique row (an add over unique
        # indices: no atomics), instead of a gather of the rows, the rule and a set: one
        # random pass over the rows fewer (W1 rowwise Adagrad: 0.7x the update's time)
        delta, new_state_rows = rule.row_step(state_rows, grads, step)
        table = table.at[unique].add(delta, mode="drop", unique_indices=True)
    else:
        w = table.at[unique].get(mode="fill", fill_value=0).astype(jnp.float32)
        new_w, new_state_rows = rule.update_rows(w, state_rows, grads, step)
        new_w = rule.write_back(new_w, table.dtype, step=step, at=unique)
        table = table.at[unique].set(new_w, mode="drop", unique_indices=True)

    def scatter(old, new):
        if is_row_leaf(old, num_rows):
            return old.at[unique].set(new.astype(old.dtype), mode="drop", unique_indices=True)
        if not hasattr(old, "dtype"):
            return new
        new = new.astype(old.dtype)
        return new if good is None else jnp.where(good, new, old)

    state = jax.tree_util.tree_map(scatter, state, new_state_rows)
    return table, state
