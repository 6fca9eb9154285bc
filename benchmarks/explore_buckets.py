"""Issue 31 (CPU bar of the pure-XLA update): each unique row's gradient sum without a
scatter-add, from the host-sorted id stream, measured piece by piece beside the library's
kernel="xla" update and FBGEMM's CPU TBE on the same batch (interleaved rounds).

Candidate ("buckets"): on the host, the runs of the row-sorted stream are put in classes by
length (caps 1, 2, 4, ..., `--max-cap`, or a finer ladder with `--fine`); a run longer than
the largest cap is cut into chunks of that cap, and its chunk sums are summed by a second
gather + reduce. Per class, a `[runs, cap]` matrix of bag indices and one of scales
(padding: a zero gradient row) is gathered from the pooled gradient and reduced over the cap
axis: no scatter-add. The unique rows come out grouped by class; the rule runs on
`[unique, D]` and one scatter of unique rows writes them back.

    python -m benchmarks.explore_buckets --alpha 1.0 1.15 --repeats 15

Nothing here changes sparse_jax; the candidate is checked against the library's update
(the benchmark's gate, rtol 1e-5) before anything is timed. Forms (`--forms`): "fori" (a
loop over the cap, one fused gather + add per position: what the library adopted),
"unroll" (the same, unrolled), "reduce" (gather `[R, cap, D]`, then sum over the cap: XLA
materializes the gathered rows, several times slower); a "_sorted" suffix permutes the sums
back to ascending rows before the rule.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.timing import clocked, interleaved, paired_ratio, summarize
from benchmarks.workloads import Workload, make_batch
from benchmarks.xla_side import XlaSide
from sparse_jax._update import _bag_grads
from sparse_jax.optim._apply import step_unique_rows


def classes_of(max_cap: int, fine: bool) -> list[int]:
    caps, c = [], 1
    while c <= max_cap:
        caps.append(c)
        if fine and c >= 2 and c + c // 2 <= max_cap:
            caps.append(c + c // 2)
        c *= 2
    return caps


def host_buckets(unique, offsets, bag, scale, *, no_bag: int, caps: list[int], rung):
    """numpy: per class (cap, bag matrix [R, cap], scale matrix [R, cap], rows [R]) and the
    long runs' (chunk bag matrix [K, C], scale [K, C], run-of-chunk matrix [R_long, M], rows)."""
    n_runs = int(np.sum(unique < np.iinfo(np.int32).max))  # set by caller (real runs only)
    del n_runs
    starts, ends = offsets[:-1], offsets[1:]
    lengths = ends - starts
    cmax = caps[-1]
    cls = np.searchsorted(np.asarray(caps), lengths, side="left")  # index of first cap >= len
    out = []
    for k, c in enumerate(caps):
        sel = np.flatnonzero(cls == k)
        r = rung(sel.size)
        pos = starts[sel][:, None] + np.arange(c)[None, :]
        ok = pos < ends[sel][:, None]
        bm = np.full((r, c), no_bag, np.int32)
        sm = np.zeros((r, c), np.float32)
        bm[: sel.size] = np.where(ok, bag[np.minimum(pos, bag.size - 1)], no_bag)
        sm[: sel.size] = np.where(ok, scale[np.minimum(pos, bag.size - 1)], 0)
        rows = np.full(r, -1, np.int64)
        rows[: sel.size] = unique[sel]
        out.append((c, bm, sm, rows))
    long = np.flatnonzero(cls == len(caps))
    long_part = None
    if long.size:
        per = -(-lengths[long] // cmax)
        k_total = int(per.sum())
        kc = rung(k_total)
        first = np.cumsum(per) - per
        chunk_run = np.repeat(np.arange(long.size), per)
        begin = starts[long][chunk_run] + (np.arange(k_total) - first[chunk_run]) * cmax
        end = ends[long][chunk_run]
        pos = begin[:, None] + np.arange(cmax)[None, :]
        ok = pos < end[:, None]
        bm = np.full((kc, cmax), no_bag, np.int32)
        sm = np.zeros((kc, cmax), np.float32)
        bm[:k_total] = np.where(ok, bag[np.minimum(pos, bag.size - 1)], no_bag)
        sm[:k_total] = np.where(ok, scale[np.minimum(pos, bag.size - 1)], 0)
        m = int(per.max())
        m = 1 << (m - 1).bit_length()
        rl = rung(long.size)
        cm = np.full((rl, m), kc, np.int32)  # padding: out-of-range chunk -> 0
        idx = first[:, None] + np.arange(m)[None, :]
        cm[: long.size] = np.where(np.arange(m)[None, :] < per[:, None], idx, kc)
        rows = np.full(rl, -1, np.int64)
        rows[: long.size] = unique[long]
        long_part = (bm, sm, cm, rows)
    return out, long_part


def device_sums(g, classes, long_part, *, form: str):
    """[sum of class rungs (+ long rungs), D] fp32: each run's gradient sum, class by class."""
    no_bag = g.shape[0]
    gz = jnp.concatenate([g, jnp.zeros((1, g.shape[1]), g.dtype)], axis=0)

    def reduce(bm, sm):
        if form == "reduce":
            x = gz.at[bm].get(mode="promise_in_bounds") * sm[..., None]
            return jnp.sum(x, axis=1)
        if form == "unroll":
            acc = gz.at[bm[:, 0]].get(mode="promise_in_bounds") * sm[:, 0, None]
            for pos in range(1, bm.shape[1]):
                acc = acc + gz.at[bm[:, pos]].get(mode="promise_in_bounds") * sm[:, pos, None]
            return acc
        if form == "fori":

            def body(pos, acc):
                b = jax.lax.dynamic_index_in_dim(bm, pos, axis=1, keepdims=False)
                s = jax.lax.dynamic_index_in_dim(sm, pos, axis=1, keepdims=False)
                return acc + gz.at[b].get(mode="promise_in_bounds") * s[:, None]

            acc = jnp.zeros((bm.shape[0], g.shape[1]), jnp.float32)
            return jax.lax.fori_loop(0, bm.shape[1], body, acc, unroll=min(4, bm.shape[1]))
        raise ValueError(form)

    del no_bag
    parts = [reduce(bm, sm) for bm, sm in classes]
    if long_part is not None:
        bm, sm, cm = long_part
        chunk = reduce(bm, sm)
        cz = jnp.concatenate([chunk, jnp.zeros((1, g.shape[1]), jnp.float32)], axis=0)
        parts.append(jnp.sum(cz.at[cm].get(mode="promise_in_bounds"), axis=1))
    return jnp.concatenate(parts, axis=0)


class Candidate:
    def __init__(self, side: XlaSide, w: Workload, *, caps, form: str, rung):
        ids = jax.tree_util.tree_map(np.asarray, side.batch.sorted_ids[side.group])
        num_rows = side.params[side.group].shape[0]
        n_real = int(np.sum(ids.unique < num_rows))
        offsets = ids.offsets[: n_real + 1].astype(np.int64)
        unique = ids.unique[:n_real].astype(np.int64)
        no_bag = w.T * w.B
        t0 = time.perf_counter()
        classes, long_part = host_buckets(
            unique, offsets, ids.bag, ids.scale, no_bag=no_bag, caps=caps, rung=rung
        )
        self.host_ms = (time.perf_counter() - t0) * 1e3
        rows = [r for *_, r in classes] + ([long_part[3]] if long_part is not None else [])
        rows = np.concatenate(rows)
        rows = np.where(rows < 0, num_rows, rows).astype(np.int32)
        # ascending: the position in the class-grouped sums of each unique row, rows ascending
        order = np.argsort(rows, kind="stable")
        self.sorted_order = order.astype(np.int32)
        self.sorted_rows = rows[order]
        self.padded = sum(bm.size for _, bm, _, _ in classes) + (
            long_part[0].size if long_part is not None else 0
        )
        self.n = int(offsets[-1])
        self.counts = {c: int(np.sum(r >= 0)) for c, _, _, r in classes}
        self.n_long = 0 if long_part is None else int(np.sum(long_part[3] >= 0))
        self.ops = dict(
            classes=[(jnp.asarray(bm), jnp.asarray(sm)) for _, bm, sm, _ in classes],
            long=None if long_part is None else tuple(jnp.asarray(x) for x in long_part[:3]),
            rows=jnp.asarray(rows),
            order=jnp.asarray(self.sorted_order),
            sorted_rows=jnp.asarray(self.sorted_rows),
        )
        self.form = form
        self.side = side
        layout, group, rule = side.ebc.layout, side.group, side.update.rule
        native = rule.native

        ascending = form.endswith("_sorted")
        form = form.removesuffix("_sorted")

        def sums(pooled_grad, ops):
            g = _bag_grads(layout, group, pooled_grad).astype(jnp.float32)
            out = device_sums(g, ops["classes"], ops["long"], form=form)
            if ascending:
                out = out.at[ops["order"]].get(mode="promise_in_bounds")
            return out

        def update(table, state, pooled_grad, ops, count):
            return rule_only(table, state, sums(pooled_grad, ops), ops, count)

        def rule_only(table, state, grads, ops, count):
            unique = ops["sorted_rows"] if ascending else ops["rows"]
            if native == "sgd":
                return table.at[unique].add(
                    grads * -rule.hyperparams["lr"], mode="drop", unique_indices=True
                ), state
            return step_unique_rows(rule, table, state, count + 1, unique, grads)

        self.sums = jax.jit(sums)
        self.update = jax.jit(update, donate_argnums=(0, 1))
        self.rule_only = jax.jit(rule_only, donate_argnums=(0, 1))


def lib_sums(side: XlaSide):
    """The library's gradient sums alone (`optim._apply.sum_runs`). Before e5d1783 the library
    summed the first two ids of each run by gathers and the rest by a sorted scatter-add; the
    figures in benchmarks/NOTES.md (issue 31) were taken against that form (5410254)."""
    from sparse_jax.optim._apply import sum_runs

    layout, group = side.ebc.layout, side.group
    return jax.jit(
        lambda pooled_grad, ids: sum_runs(ids, _bag_grads(layout, group, pooled_grad))[1]
    )


def probe() -> str:
    """1- vs 2-thread pooled lookup in a fresh process (PERF_NOTES' quietness probe)."""
    code = (
        "import torch,time,statistics as s\n"
        "t=torch.randn(800000,64);i=torch.randint(0,800000,(16384*20,));o=torch.arange(0,16384*20,20)\n"
        "def m(n):\n torch.set_num_threads(n);r=[]\n"
        " for _ in range(12):\n  a=time.perf_counter();torch.nn.functional.embedding_bag(i,t,o,mode='sum');r.append(time.perf_counter()-a)\n"
        " return s.median(r[2:])\n"
        "a=m(1);b=m(2);print(f'probe 1t {a*1e3:.1f} ms 2t {b*1e3:.1f} ms ratio {b/a:.2f}')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    return out.stdout.strip() + f" | {os.getloadavg()}"


def measure(w: Workload, batch, opt: str, args, rung) -> None:
    """One workload and optimizer: gate every candidate, then time them interleaved."""
    side = XlaSide(w, batch, "xla", opt, lr=0.01, eps=1e-8)
    ref = XlaSide(w, batch, "xla", opt, lr=0.01, eps=1e-8)
    ref.run_update()
    want_t = np.asarray(ref.params[ref.group])
    want_s = [np.asarray(x) for x in jax.tree_util.tree_leaves(ref.state.tables)]
    cands = {}
    for form in args.forms:
        for mc in args.max_cap:
            caps = classes_of(mc, args.fine)
            c = Candidate(side, w, caps=caps, form=form, rung=rung)
            name = f"{form}_cap{mc}{'_fine' if args.fine else ''}"
            # gate: one update on fresh copies against the library's
            t = jnp.array(np.asarray(side.params[side.group]), copy=True)
            s = jax.tree_util.tree_map(
                lambda x: jnp.array(np.asarray(x), copy=True), side.state.tables[side.group]
            )
            t, s = c.update(t, s, side.grad, c.ops, side.state.count)
            got_s = [np.asarray(x) for x in jax.tree_util.tree_leaves(s)]
            for a, b in zip([np.asarray(t), *got_s], [want_t, *want_s], strict=True):
                # the benchmark's gate: |a - b| <= rtol * (|b| + max|b|), rtol 1e-5
                bad = np.abs(a - b) > 1e-5 * (np.abs(b) + np.abs(b).max())
                assert not bad.any(), (name, int(bad.sum()), float(np.abs(a - b).max()))
            print(
                f"{w.name} {opt} {name}: gate ok; host buckets {c.host_ms:.1f} ms; "
                f"N {c.n}, padded {c.padded} ({c.padded / c.n:.2f}x); runs per cap "
                f"{c.counts}; long runs {c.n_long}",
                flush=True,
            )
            cands[name] = c
    del ref
    # the candidate's own table / state (the side's are the library's)
    own = {
        k: [
            jnp.array(np.asarray(side.params[side.group]), copy=True),
            jax.tree_util.tree_map(
                lambda x: jnp.array(np.asarray(x), copy=True), side.state.tables[side.group]
            ),
        ]
        for k in cands
    }
    cases = {}
    cases["lib_fwd+upd"] = clocked(lambda clock, s=side: s.time_step(clock))

    def cand_step(clock, k, c):
        out = side.forward()
        clock.mark("fwd", out)
        t, s = own[k]
        own[k][0], own[k][1] = c.update(t, s, side.grad, c.ops, side.state.count)
        clock.mark("bwd", own[k][0], own[k][1])

    for k, c in cands.items():
        cases[f"{k}_fwd+upd"] = clocked(lambda clock, k=k, c=c: cand_step(clock, k, c))
    if args.pieces:
        ls = lib_sums(side)
        ids = side.batch.sorted_ids[side.group]
        cases["lib_sums"] = clocked(lambda clock: ls(side.grad, ids))
        for k, c in cands.items():
            cases[f"{k}_sums"] = clocked(lambda clock, c=c: c.sums(side.grad, c.ops))
            grads0 = c.sums(side.grad, c.ops)
            k0 = next(iter(cands))

            def rule_case(clock, k=k, c=c, grads0=grads0):
                t, s = own[k]
                own[k][0], own[k][1] = c.rule_only(t, s, grads0, c.ops, side.state.count)
                return own[k]

            if k == k0:
                cases[f"{k}_rule+scatter"] = clocked(rule_case)
    if args.fbgemm:
        from benchmarks.fbgemm_side import FbgemmSide

        fb = FbgemmSide(w, batch, opt, lr=0.01, eps=1e-8)
        cases["fbgemm_fwd+bwd"] = clocked(fb.time_step)
        cases["fbgemm_fwd"] = clocked(fb.time_forward)
    cases["lib_fwd"] = clocked(side.time_forward)
    la = os.getloadavg()
    res = interleaved(cases, warmup=3, repeats=args.repeats, lead_in_s=0.06)
    lb = os.getloadavg()
    print(f"== {w.name} {opt} (load {la[0]:.2f} -> {lb[0]:.2f})")
    base = "fbgemm_fwd+bwd" if args.fbgemm else "lib_fwd+upd"
    for name, seg in res.items():
        s = summarize(seg["total"])
        r = paired_ratio(seg["total"], res[base]["total"])
        extra = ""
        if "bwd" in seg:
            extra = (
                f" (fwd {np.median(seg['fwd']) * 1e3:.2f}, upd {np.median(seg['bwd']) * 1e3:.2f})"
            )
        print(
            f"  {name:28s} {s['median_ms']:8.2f} ms [{s['p25_ms']:.2f}-{s['p75_ms']:.2f}]{extra}"
            f"  /{base}: {r['ratio_of_medians']:.2f} (paired {r['paired_median']:.2f})",
            flush=True,
        )
    if args.fbgemm:
        r = paired_ratio(res["lib_fwd"]["total"], res["fbgemm_fwd"]["total"])
        print(f"  forward lib/fbgemm {r['ratio_of_medians']:.2f} (paired {r['paired_median']:.2f})")


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--alpha", type=float, nargs="+", default=[1.0, 1.15])
    p.add_argument("--optimizers", nargs="+", default=["rowwise_adagrad", "sgd"])
    p.add_argument("--forms", nargs="+", default=["reduce"])
    p.add_argument("--max-cap", type=int, nargs="+", default=[64])
    p.add_argument("--fine", action="store_true")
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--pieces", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--fbgemm", action=argparse.BooleanOptionalAction, default=True)
    args = p.parse_args(argv)
    from sparse_jax._capacity import capacity_for
    from sparse_jax._sorted_ids import RUN_LADDER

    def rung(n):
        return capacity_for(max(n, 1), RUN_LADDER, what="bucket")

    print(probe(), flush=True)
    for alpha in args.alpha:
        w = Workload(alpha=alpha)
        batch = make_batch(w)
        for opt in args.optimizers:
            measure(w, batch, opt, args, rung)
    print(probe(), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
