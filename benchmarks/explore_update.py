"""Issue 9: candidate formulations of OUR forward and fused update, measured side by side.

Nothing here changes sparse_jax: each candidate is rebuilt from the library's own pieces
(`_lookup.id_stream`, `_lookup._position_matrix`, the row rules) with one part swapped, is
checked against the library's result (rtol 1e-4) and then timed interleaved with it.

    python -m benchmarks.explore_update                # W1 uniform + W1 Zipf(1.15)
    python -m benchmarks.explore_update --tiny --part update

Update candidates (rowwise adagrad and sgd; "lib" = `make_update` as shipped):
  lib           lax.sort of (row, bag, scale) together, [N, D] per-id grads, segment_sum,
                gather rows + state, row rule, scatter .set(unique_indices=True)
  argsort       dedup by jnp.argsort(rows) + three gathers (what lax.sort replaced)
  sort_iota     lax.sort of (row, iota) only, then gather bag / scale by the permutation
  no_unique     lib, final scatters without unique_indices
  sorted_scatter lib, final scatters also with indices_are_sorted=True
  chunked       per-id grads built and scatter-added per chunk of ids inside a fori_loop
                (never materializes [N, D] per-id grads; only the [N, D] per-unique sums)
  sort_search   sort the row ids ALONE (one-operand jnp.sort), then each id's segment is
                `searchsorted(sorted_rows, row)` (its row's first sorted slot): no permutation,
                so no multi-operand sort; per-id grads summed by an unsorted segment_sum
  delta_add     lib, but no gather of the touched table rows: the rule is run on zero rows
                to get its delta and the table is updated by scatter-add (exact for rules
                whose step does not read the weights: sgd, rowwise adagrad, adagrad, adam
                without weight decay; bit-identical for fp32 tables)
  sort_search_delta  both
  sort_search_ucap   sort_search, with the per-unique-row work ([U, D] sums, gathered rows,
                rule, scatter) sized by a static cap U on the batch's distinct rows instead
                of the id capacity N (U = the capacity ladder's rung above the distinct count,
                which the eager side can compute, as it already checks ids; one compile per rung)
  sgd_scatter_add (sgd only) no dedup at all: table.at[rows].add(-lr * per-id grad)
  bf16_<candidate>  that candidate on bf16 tables (checked against fp32 lib at bf16's rtol)
  <candidate>_bits  16-bit tables gathered and scattered as uint16 bit patterns (XLA's CPU
                float normalization otherwise turns a bf16 scatter into an f32 round trip of
                the whole table)
  ffi           the library's fused C++ update (kernel="ffi")
With --fbgemm (default on) FBGEMM's forward, and its backward + fused update alone, are
timed in the same rounds, so each candidate also gets a ratio to FBGEMM.

Forward candidates ("lib" = jit(ebc._apply), power-of-two length cap, unrolled):
  lib, cap_exact (cap = the true max bag length instead of the power of two), fori
  (lax.fori_loop over positions), fori_cap_exact, bf16 (bf16 tables, lib code; any
  "bf16_<candidate>" runs that candidate on bf16 tables, checked against bf16 lib),
  bmajor / bmajor_cap_exact: the same unrolled sum, but bags stacked sample-major
  ([B, F, cap] -> [B*F, cap]) so the pooled [B*F, D] block *is* the [B, F*D] output (a
  reshape): no per-feature slices + concatenate after the loop; bmajor_fori_cap_exact: that
  layout with the fori_loop; fori_unroll4_cap_exact: fori_loop(..., unroll=4);
  carry_unroll4_cap_exact: the table rides in the loop carry behind an optimization_barrier,
  so XLA cannot hoist a whole-table convert out of the loop (matters for bf16 tables);
  ffi / ffi_cap_exact: the library's C++ pooled-sum kernel (kernel="ffi").
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import gate, report
from benchmarks.timing import interleaved, paired_ratio, summarize
from benchmarks.workloads import Workload, make_batch
from benchmarks.xla_side import XlaSide
from sparse_jax import _lookup
from sparse_jax._capacity import capacity_for
from sparse_jax._keyed_tensor import KeyedTensor
from sparse_jax._update import _bag_grads
from sparse_jax.optim._base import SparseOptState, is_row_leaf

__all__ = ["update_variant", "forward_variant", "main"]

UPDATE_VARIANTS = (
    "lib",
    "argsort",
    "sort_iota",
    "no_unique",
    "sorted_scatter",
    "chunked",
    "sort_search",
    "delta_add",
    "sort_search_delta",
    "sort_search_ucap",
    "sgd_scatter_add",
    "bf16_lib",
    "bf16_sort_search",
    "bf16_bits",
    "bf16_sort_search_bits",
    "ffi",
)
FORWARD_VARIANTS = (
    "lib",
    "cap_exact",
    "fori",
    "fori_cap_exact",
    "fori_unroll4_cap_exact",
    "bmajor",
    "bmajor_cap_exact",
    "bmajor_fori_cap_exact",
    "carry_unroll4_cap_exact",
    "bf16",
    "bf16_fori_unroll4_cap_exact",
    "bf16_carry_unroll4_cap_exact",
    "ffi",
    "ffi_cap_exact",
)
CHUNK = 8192


# -- update candidates ----------------------------------------------------------------------------
def _sorted_stream(how: str, rows, bag, scale):
    if how == "argsort":
        perm = jnp.argsort(rows)
        return rows[perm], bag[perm], scale[perm]
    if how == "sort_iota":
        rows_s, perm = jax.lax.sort((rows, jnp.arange(rows.shape[0], dtype=jnp.int32)), num_keys=1)
        return rows_s, bag[perm], scale[perm]
    return jax.lax.sort((rows, bag, scale), num_keys=1)


def _summed_grads(how: str, uidx, bag_s, scale_s, bag_grads):
    n, d = uidx.shape[0], bag_grads.shape[1]
    bag_grads = bag_grads.astype(jnp.float32)
    if how != "chunked":
        grads = bag_grads[bag_s] * scale_s[:, None]
        return jax.ops.segment_sum(grads, uidx, num_segments=n, indices_are_sorted=True)
    pad = (-n) % CHUNK
    uidx_p = jnp.concatenate([uidx, jnp.full(pad, n, uidx.dtype)])  # out of range: dropped
    bag_p = jnp.concatenate([bag_s, jnp.zeros(pad, bag_s.dtype)])
    scale_p = jnp.concatenate([scale_s, jnp.zeros(pad, scale_s.dtype)])

    def body(i, acc):
        sl = lambda x: jax.lax.dynamic_slice_in_dim(x, i * CHUNK, CHUNK)  # noqa: E731
        g = bag_grads[sl(bag_p)] * sl(scale_p)[:, None]
        return acc.at[sl(uidx_p)].add(g, mode="drop", indices_are_sorted=True)

    return jax.lax.fori_loop(0, (n + pad) // CHUNK, body, jnp.zeros((n, d), jnp.float32))


def _apply_variant(variant: str, rule, table, state, step, rows, bag, scale, bag_grads, ucap=None):
    num_rows = table.shape[0]
    if variant == "sgd_scatter_add":
        g = bag_grads.astype(jnp.float32)[bag] * scale[:, None]
        delta = (-rule.hyperparams["lr"] * g).astype(table.dtype)
        return table.at[rows].add(delta, mode="drop"), state
    n = rows.shape[0]
    bits = variant.endswith("_bits") or variant == "bits"
    variant = variant.removesuffix("_bits") if variant != "bits" else "lib"
    if variant == "sort_search_ucap":
        rows_s = jnp.sort(rows)
        first = jnp.concatenate([jnp.ones(1, bool), rows_s[1:] != rows_s[:-1]]) & (
            rows_s < num_rows
        )
        uidx_s = jnp.cumsum(first.astype(jnp.int32)) - 1  # compact index of each sorted slot's row
        seg = uidx_s[jnp.searchsorted(rows_s, rows, side="left")]
        seg = jnp.where(rows < num_rows, seg, ucap)  # padding ids: out of range, dropped
        grads = jax.ops.segment_sum(
            bag_grads.astype(jnp.float32)[bag] * scale[:, None], seg, num_segments=ucap
        )
        unique = (
            jnp.full(ucap, num_rows, jnp.int32)
            .at[jnp.where(first, uidx_s, ucap)]
            .set(rows_s, mode="drop")
        )
    elif variant.startswith("sort_search"):
        rows_s = jnp.sort(rows)
        seg = jnp.searchsorted(rows_s, rows, side="left").astype(jnp.int32)
        first = jnp.concatenate([jnp.ones(1, bool), rows_s[1:] != rows_s[:-1]])
        grads = jax.ops.segment_sum(
            bag_grads.astype(jnp.float32)[bag] * scale[:, None], seg, num_segments=n
        )
        unique = jnp.where(first & (rows_s < num_rows), rows_s, num_rows)
    else:
        rows_s, bag_s, scale_s = _sorted_stream(
            variant if variant in ("argsort", "sort_iota") else "sort3", rows, bag, scale
        )
        first = jnp.concatenate([jnp.ones(1, bool), rows_s[1:] != rows_s[:-1]])
        uidx = jnp.cumsum(first.astype(jnp.int32)) - 1
        grads = _summed_grads(
            "chunked" if variant == "chunked" else "segment", uidx, bag_s, scale_s, bag_grads
        )
        unique = jax.ops.segment_max(rows_s, uidx, num_segments=n, indices_are_sorted=True)
        unique = jnp.where((unique < 0) | (unique >= num_rows), num_rows, unique)

    def gather(x):
        return x.at[unique].get(mode="fill", fill_value=0) if is_row_leaf(x, num_rows) else x

    kw = {"mode": "drop", "unique_indices": variant != "no_unique"}
    if variant == "sorted_scatter":
        kw["indices_are_sorted"] = True
    if variant.endswith("delta") or variant == "delta_add":
        delta, new_state_rows = rule.update_rows(
            jnp.zeros_like(grads), jax.tree_util.tree_map(gather, state), grads, step
        )
        table = table.at[unique].add(delta.astype(table.dtype), **kw)
    elif bits and table.dtype.itemsize == 2:  # 16-bit tables moved as uint16 bit patterns
        raw = jax.lax.bitcast_convert_type(table, jnp.uint16)
        w = jax.lax.bitcast_convert_type(raw.at[unique].get(mode="fill", fill_value=0), table.dtype)
        new_w, new_state_rows = rule.update_rows(
            w.astype(jnp.float32), jax.tree_util.tree_map(gather, state), grads, step
        )
        new_raw = jax.lax.bitcast_convert_type(new_w.astype(table.dtype), jnp.uint16)
        table = jax.lax.bitcast_convert_type(raw.at[unique].set(new_raw, **kw), table.dtype)
    else:
        w = table.at[unique].get(mode="fill", fill_value=0).astype(jnp.float32)
        new_w, new_state_rows = rule.update_rows(
            w, jax.tree_util.tree_map(gather, state), grads, step
        )
        table = table.at[unique].set(new_w.astype(table.dtype), **kw)

    def scatter(old, new):
        if is_row_leaf(old, num_rows):
            return old.at[unique].set(new.astype(old.dtype), **kw)
        return new.astype(old.dtype) if hasattr(old, "dtype") else new

    return table, jax.tree_util.tree_map(scatter, state, new_state_rows)


def update_variant(ebc, rule, variant: str, ucap: int | None = None):
    """A jitted, donating step(params, state, kjt, pooled_grad) like `make_update(...).jitted`."""
    layout = ebc.layout
    if variant == "sgd_scatter_add" and rule.name != "sgd":
        raise ValueError("sgd_scatter_add is exact only for sgd")

    def step(params, opt_state, kjt, pooled_grad):
        count = opt_state.count + 1
        new_p, new_s = {}, {}
        for group in layout.groups:
            rows, bag, scale = _lookup.id_stream(
                kjt, layout, group, weighted=ebc.is_weighted(), bounds_check=ebc.bounds_check
            )
            new_p[group], new_s[group] = _apply_variant(
                variant,
                rule,
                params[group],
                opt_state.tables[group],
                count,
                rows,
                bag,
                scale,
                _bag_grads(layout, group, pooled_grad, kjt.stride()),
                ucap,
            )
        return new_p, SparseOptState(count=count, tables=new_s)

    return jax.jit(step, donate_argnums=(0, 1))


# -- forward candidates --------------------------------------------------------------------------
def _positions_fori(table, rows, w, unroll: int = 1, carry_table: bool = False):
    acc = jnp.zeros((rows.shape[0], table.shape[1]), jnp.float32)
    if carry_table:

        def add_c(p, c):
            acc, t = c
            t = jax.lax.optimization_barrier(t)
            r = t.at[rows[:, p]].get(mode="promise_in_bounds").astype(jnp.float32)
            return acc + w[:, p, None] * r, t

        return jax.lax.fori_loop(0, rows.shape[1], add_c, (acc, table), unroll=unroll)[0]

    def add(p, acc):
        r = table.at[rows[:, p]].get(mode="promise_in_bounds").astype(jnp.float32)
        return acc + w[:, p, None] * r

    return jax.lax.fori_loop(0, rows.shape[1], add, acc, unroll=unroll)


def _positions_unrolled(table, rows, w):
    acc = jnp.zeros((rows.shape[0], table.shape[1]), jnp.float32)
    for p in range(rows.shape[1]):
        r = table.at[rows[:, p]].get(mode="promise_in_bounds").astype(jnp.float32)
        acc = acc + w[:, p, None] * r
    return acc


def forward_variant(ebc, variant: str, exact_caps: tuple[int, ...]):
    """A jitted fwd(params, kjt) -> [B, sum dims] for `variant` (see module doc)."""
    layout = ebc.layout

    def fwd(params, kjt):
        if variant.endswith("cap_exact"):
            kjt = kjt._replace(length_caps=exact_caps)
        if variant in ("lib", "cap_exact"):
            return ebc._apply(params, kjt).values()
        key_indices = layout.key_indices(kjt.keys())
        caps = kjt.length_caps()
        stride = kjt.stride()
        blocks = []
        for i, slot in enumerate(layout.features):
            ki = key_indices[i]
            rows, w = _lookup._position_matrix(
                kjt, ki, caps[ki], slot, ebc.is_weighted(), ebc.bounds_check
            )
            blocks.append((rows, w))
        (group,) = layout.groups
        if variant.startswith("bmajor"):
            assert len({b[0].shape for b in blocks}) == 1, "bmajor needs one cap for all features"
            nf, d = len(blocks), layout.groups[group][1]
            rows = jnp.stack([b[0] for b in blocks], axis=1).reshape(stride * nf, -1)
            w = jnp.stack([b[1] for b in blocks], axis=1).reshape(stride * nf, -1)
            pos = _positions_fori if "fori" in variant else _positions_unrolled
            return pos(params[group], rows, w).reshape(stride, nf * d)
        rows = jnp.concatenate([b[0] for b in blocks])
        w = jnp.concatenate([b[1] for b in blocks])
        pooled = _positions_fori(
            params[group],
            rows,
            w,
            unroll=4 if "unroll4" in variant else 1,
            carry_table=variant.startswith("carry"),
        )
        out = [pooled[j * stride : (j + 1) * stride] for j in range(len(layout.features))]
        return KeyedTensor(
            layout.feature_names, layout.output_dims, jnp.concatenate(out, axis=1)
        ).values()

    return jax.jit(fwd)


# -- measurement ------------------------------------------------------------------------------------
def _split(v: str) -> tuple[str, str, str]:
    """candidate name -> (table dtype, collection kernel, formulation): "bf16_x" runs x on bf16
    tables, "ffi" / "ffi_x" runs the library code with kernel="ffi" (the C++ kernels)."""
    dtype, kernel = "fp32", "xla"
    if v == "bf16" or v.startswith("bf16_"):
        dtype, v = "bf16", v[5:] or "lib"
    if v == "ffi" or v.startswith("ffi_"):
        kernel, v = "ffi", v[4:] or "lib"
    return dtype, kernel, v


def _timer(fn):
    def case():
        t0 = time.perf_counter()
        fn()
        return {"total": time.perf_counter() - t0}

    return case


def explore_forward(w: Workload, args, log) -> dict:
    batch = make_batch(w)
    base = XlaSide(w, batch, "xla", None, lr=args.lr, eps=args.eps)
    exact = tuple(int(x) for x in np.asarray(base.kjt.lengths()).reshape(w.T, w.B).max(axis=1))
    sides = {("fp32", "xla"): base}
    for v in args.forward:
        dtype, kernel, _ = _split(v)
        if (dtype, kernel) not in sides:
            wv = dataclasses.replace(w, dtype=dtype)
            sides[(dtype, kernel)] = XlaSide(
                wv, make_batch(wv), kernel, None, lr=args.lr, eps=args.eps
            )
    fns, ref = {}, np.asarray(base.forward())
    refs = {"fp32": ref}
    if ("bf16", "xla") in sides:
        refs["bf16"] = np.asarray(sides[("bf16", "xla")].forward())
    checks, temp = [], {}
    for v in args.forward:
        dtype, kernel, cand = _split(v)
        side = sides[(dtype, kernel)]
        f = forward_variant(side.ebc, cand, exact)
        out = np.asarray(f(side.params, side.kjt))
        ma = f.lower(side.params, side.kjt).compile().memory_analysis()
        temp[v] = None if ma is None else int(ma.temp_size_in_bytes)
        # bf16 tables hold other values: checked against the library on the same bf16 tables
        checks.append(gate.close(f"forward {v} vs lib", out, refs[dtype]))
        fns[v] = _timer(lambda f=f, s=side: f(s.params, s.kjt).block_until_ready())
    if not all(c["ok"] for c in checks):
        return {"checks": checks, "error": "a forward candidate disagrees with the library"}
    if args.fbgemm:
        from benchmarks.fbgemm_side import FbgemmSide

        fb = FbgemmSide(w, batch, "rowwise_adagrad", lr=args.lr, eps=args.eps)
        checks.append(gate.close("forward lib vs FBGEMM", ref, fb.pooled()))
        fns["fbgemm"] = _timer(fb.forward)
    log(f"   forward: timing {list(fns)}")
    samples = interleaved(fns, warmup=args.warmup, repeats=args.repeats, budget_s=args.budget_s)
    return {
        "length_caps_lib": list(base.kjt.length_caps()),
        "length_caps_exact": list(exact),
        "checks": checks,
        "temp_bytes": temp,
        "times": {v: summarize(s["total"]) for v, s in samples.items()},
        "vs_lib": {
            v: paired_ratio(s["total"], samples["lib"]["total"]) for v, s in samples.items()
        },
        "vs_fbgemm": _vs_fbgemm(samples),
    }


def explore_update(w: Workload, opt: str, args, log) -> dict:
    batch = make_batch(w)
    variants = [v for v in args.update if v != "sgd_scatter_add" or opt == "sgd"]
    distinct = int(np.unique(batch.ids.reshape(w.T, -1) + (np.arange(w.T) * w.E)[:, None]).size)
    ucap = capacity_for(distinct)
    sides, fns = {}, {}
    for v in variants:
        dtype, kernel, cand = _split(v)
        wv = dataclasses.replace(w, dtype=dtype)
        side = XlaSide(
            wv, make_batch(wv) if dtype != w.dtype else batch, kernel, opt, lr=args.lr, eps=args.eps
        )
        if cand != "lib":
            side.update.jitted = update_variant(side.ebc, side.update.rule, cand, ucap)
        sides[v] = side
    for side in sides.values():  # one step each from identical starts
        side.run_update()
    ref_t, ref_s = sides["lib"].tables(), sides["lib"].row_state()
    checks = []
    for v, side in sides.items():
        if v == "lib":
            continue
        rtol = gate.update_rtol(side.w.dtype)
        checks.append(gate.close(f"{opt} {v}: weights vs lib", side.tables(), ref_t, rtol))
        if ref_s is not None:
            checks.append(gate.close(f"{opt} {v}: row state vs lib", side.row_state(), ref_s))
    if not all(c["ok"] for c in checks):
        return {"checks": checks, "error": "an update candidate disagrees with the library"}
    for v, side in sides.items():
        fns[v] = _timer(lambda s=side: s.run_update())
    if args.fbgemm:
        from benchmarks.fbgemm_side import FbgemmSide

        fb = FbgemmSide(w, batch, opt, lr=args.lr, eps=args.eps)

        def fb_backward():  # its forward untimed: backward + fused update alone
            out = fb.forward()
            t0 = time.perf_counter()
            out.backward(fb.grad)
            return {"total": time.perf_counter() - t0}

        fns["fbgemm"] = fb_backward
    log(f"   {opt}: timing {list(fns)}")
    samples = interleaved(fns, warmup=args.warmup, repeats=args.repeats, budget_s=args.budget_s)
    temp = {}
    for v, side in sides.items():
        ma = side.update_memory()
        temp[v] = None if ma is None else ma["temp_bytes"]
    return {
        "checks": checks,
        "distinct_rows": distinct,
        "ucap": ucap,
        "in_place": {v: all(s.in_place) for v, s in sides.items()},
        "temp_bytes": temp,
        "times": {v: summarize(s["total"]) for v, s in samples.items()},
        "vs_lib": {
            v: paired_ratio(s["total"], samples["lib"]["total"]) for v, s in samples.items()
        },
        "vs_fbgemm": _vs_fbgemm(samples),
    }


def _vs_fbgemm(samples: dict) -> dict:
    if "fbgemm" not in samples:
        return {}
    return {v: paired_ratio(s["total"], samples["fbgemm"]["total"]) for v, s in samples.items()}


def explore_pieces(w: Workload, args, log) -> dict:
    """What the library's update spends its time on: each piece jitted alone."""
    batch = make_batch(w)
    side = XlaSide(w, batch, "xla", "rowwise_adagrad", lr=args.lr, eps=args.eps)
    ebc, kjt, grad = side.ebc, side.kjt, side.grad
    (group,) = ebc.layout.groups
    stream = jax.jit(
        lambda kjt: _lookup.id_stream(
            kjt, ebc.layout, group, weighted=ebc.is_weighted(), bounds_check=ebc.bounds_check
        )
    )
    rows, bag, scale = stream(kjt)
    bag_grads = jax.jit(lambda g: _bag_grads(ebc.layout, group, g, kjt.stride()))(grad)
    n, d = rows.shape[0], w.D
    sort3 = jax.jit(lambda r, b, s: jax.lax.sort((r, b, s), num_keys=1))
    sort1 = jax.jit(jnp.sort)
    argsort = jax.jit(jnp.argsort)
    search = jax.jit(lambda srt, r: jnp.searchsorted(srt, r, side="left"))
    rows_sorted = sort1(rows)
    rows_s, bag_s, scale_s = sort3(rows, bag, scale)
    first = jnp.concatenate([jnp.ones(1, bool), rows_s[1:] != rows_s[:-1]])
    uidx = jnp.cumsum(first.astype(jnp.int32)) - 1
    per_id = jax.jit(lambda bg, b, s: bg[b] * s[:, None])
    seg = jax.jit(lambda g, u: jax.ops.segment_sum(g, u, num_segments=n, indices_are_sorted=True))
    gathered = per_id(bag_grads, bag_s, scale_s)
    fused = jax.jit(
        lambda bg, b, s, u: jax.ops.segment_sum(
            bg[b] * s[:, None], u, num_segments=n, indices_are_sorted=True
        )
    )
    urows = jnp.where(
        jnp.arange(n) < int(uidx[-1]) + 1, rows_s, side.params[group].shape[0]
    )  # stand-in ids
    gather_rows = jax.jit(lambda t, u: t.at[u].get(mode="fill", fill_value=0))
    cases = {
        "id_stream": _timer(lambda: jax.block_until_ready(stream(kjt))),
        "lax.sort (row, bag, scale)": _timer(
            lambda: jax.block_until_ready(sort3(rows, bag, scale))
        ),
        "jnp.sort (rows)": _timer(lambda: sort1(rows).block_until_ready()),
        "jnp.argsort (rows)": _timer(lambda: argsort(rows).block_until_ready()),
        "jnp.searchsorted (rows in sorted rows)": _timer(
            lambda: search(rows_sorted, rows).block_until_ready()
        ),
        "per-id grads [N, D]": _timer(
            lambda: per_id(bag_grads, bag_s, scale_s).block_until_ready()
        ),
        "segment_sum [N, D]": _timer(lambda: seg(gathered, uidx).block_until_ready()),
        "per-id grads + segment_sum (one jit)": _timer(
            lambda: fused(bag_grads, bag_s, scale_s, uidx).block_until_ready()
        ),
        "gather touched rows [N, D]": _timer(
            lambda: gather_rows(side.params[group], urows).block_until_ready()
        ),
        "full update (lib)": _timer(side._update),
    }
    log("   pieces: timing")
    samples = interleaved(
        cases, warmup=args.warmup, repeats=max(5, args.repeats // 2), budget_s=args.budget_s
    )
    return {
        "n": int(n),
        "unique": int(uidx[-1]) + 1,
        "d": d,
        "times": {k: summarize(s["total"]) for k, s in samples.items()},
    }


def _fb(block: dict, v: str) -> str:
    r = block.get("vs_fbgemm", {}).get(v)
    return "-" if r is None else f"{r['ratio_of_medians']:.2f} ({r['paired_median']:.2f})"


def _markdown(res: dict) -> str:
    lines = ["# explore_update: candidate formulations (time / library's, lower is better)", ""]
    for wr in res["workloads"]:
        lines += [f"## {wr['workload']}", ""]
        f = wr.get("forward")
        if f and "times" in f:
            lines += [
                f"Forward (length caps lib {f['length_caps_lib'][0]}, exact {f['length_caps_exact'][0]}):",
                "",
                "| candidate | median ms [IQR] | vs lib (ratio of medians; paired) | vs FBGEMM | XLA temp MiB |",
                "|---|---|---|---|---|",
            ]
            for v, t in f["times"].items():
                r = f["vs_lib"][v]
                tb = f["temp_bytes"].get(v)
                lines.append(
                    f"| {v} | {t['median_ms']:.2f} [{t['p25_ms']:.2f}-{t['p75_ms']:.2f}] | "
                    f"{r['ratio_of_medians']:.2f} ({r['paired_median']:.2f}) | {_fb(f, v)} | "
                    f"{'-' if tb is None else f'{tb / 2**20:.1f}'} |"
                )
            lines.append("")
        for opt, u in wr.get("update", {}).items():
            if "times" not in u:
                lines += [f"{opt}: {u.get('error')}", ""]
                continue
            lines += [
                f"Update only ({opt}; {u.get('distinct_rows')} distinct rows, ucap {u.get('ucap')}; "
                "fbgemm = its backward + fused update alone):",
                "",
                "| candidate | median ms [IQR] | vs lib (ratio of medians; paired) | vs FBGEMM | XLA temp MiB | in place |",
                "|---|---|---|---|---|---|",
            ]
            for v, t in u["times"].items():
                r = u["vs_lib"][v]
                tb = u["temp_bytes"].get(v)
                lines.append(
                    f"| {v} | {t['median_ms']:.2f} [{t['p25_ms']:.2f}-{t['p75_ms']:.2f}] | "
                    f"{r['ratio_of_medians']:.2f} ({r['paired_median']:.2f}) | {_fb(u, v)} | "
                    f"{'-' if tb is None else f'{tb / 2**20:.0f}'} | {u['in_place'].get(v, '-')} |"
                )
            lines.append("")
        p = wr.get("pieces")
        if p:
            lines += [
                f"Pieces of the library's update (N = {p['n']} id slots, {p['unique']} unique rows):",
                "",
                "| piece | median ms [IQR] |",
                "|---|---|",
            ]
            for k, t in p["times"].items():
                lines.append(
                    f"| {k} | {t['median_ms']:.2f} [{t['p25_ms']:.2f}-{t['p75_ms']:.2f}] |"
                )
            lines.append("")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.explore_update",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--alpha", type=float, nargs="+", default=[1.0, 1.15])
    p.add_argument(
        "--part",
        nargs="+",
        choices=("forward", "update", "pieces"),
        default=["forward", "update", "pieces"],
    )
    p.add_argument("--forward", nargs="+", choices=FORWARD_VARIANTS, default=list(FORWARD_VARIANTS))
    p.add_argument("--update", nargs="+", choices=UPDATE_VARIANTS, default=list(UPDATE_VARIANTS))
    p.add_argument(
        "--optimizers",
        nargs="+",
        choices=("rowwise_adagrad", "sgd"),
        default=["rowwise_adagrad", "sgd"],
    )
    p.add_argument(
        "--fbgemm",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="time FBGEMM in the same rounds (ratios to it)",
    )
    p.add_argument("--torch-threads", type=int, default=2)
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--eps", type=float, default=1e-8)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--budget-s", type=float, default=40.0)
    report.add_output_args(p, "explore_update")
    args = p.parse_args(argv)
    args.out = report.output_dir(p, args, "explore_update")
    for need in ("lib",):
        if need not in args.forward:
            args.forward.insert(0, need)
        if need not in args.update:
            args.update.insert(0, need)
    if args.fbgemm:
        import torch

        torch.set_num_threads(args.torch_threads)
    t0 = time.perf_counter()

    def log(msg):
        print(f"[{time.perf_counter() - t0:6.1f}s] {msg}", file=sys.stderr, flush=True)

    base = dict(T=2, E=1000, D=16, B=64, L=4) if args.tiny else {}
    res = {
        "command": "python -m benchmarks.explore_update "
        + " ".join(sys.argv[1:] if argv is None else argv),
        "loadavg_start": list(os.getloadavg()),
        "workloads": [],
    }
    for a in args.alpha:
        w = Workload(**base, alpha=a)
        log(f"== {w.name}")
        wr: dict = {"workload": w.name}
        if "forward" in args.part:
            wr["forward"] = explore_forward(w, args, log)
        if "update" in args.part:
            wr["update"] = {opt: explore_update(w, opt, args, log) for opt in args.optimizers}
        if "pieces" in args.part:
            wr["pieces"] = explore_pieces(w, args, log)
        res["workloads"].append(wr)
    res["loadavg_end"] = list(os.getloadavg())
    res["elapsed_s"] = time.perf_counter() - t0
    os.makedirs(args.out, exist_ok=True)
    stem = os.path.join(args.out, "explore_update")
    with open(stem + ".json", "w") as f:
        json.dump(res, f, indent=1)
    md = _markdown(res)
    with open(stem + ".md", "w") as f:
        f.write(md)
    print(md)
    print(f"results: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
