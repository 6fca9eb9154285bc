"""Managed-collision remapping: `sparse_jax.MCHManagedCollisionModule` (jitted, raw ids as two
32-bit words; on CPU the fused C++ kernel when built) against TorchRec's sorted
`MCHManagedCollisionModule` (CPU), on the same id streams.

    python -m benchmarks.mc_remap            # 2^17 and 2^20 slots x uniform, Zipf x LRU, LFU
    python -m benchmarks.mc_remap --tiny     # seconds: the smoke run the suite makes
    python -m benchmarks.mc_remap --zch 262144 --policy lru --stream zipf --with-xla

A training call is `profile_remap` (window, eviction every `--interval` calls, then the
batch's slots on the new state; the state donated, as a training step donates it; one
kernel call on CPU, as in the library's training program); an eval call is `remap` only.
"ours" is the form `hybrid.Model` trains with on CPU: the hashed form of the map
(`sparse_jax.managed._hashed`, when the kernels are built); `--with-sorted` adds the sorted
form's kernel (the CPU training form before it, the form checkpoints hold).
Ids are raw int64 drawn from a pool of `--pool` 64-bit values, uniformly or Zipf-like
(p ~ 1 / rank^1.05), drawn before timing (drawing inside the timed calls added ~10-40 ms
to both sides before this version); more ids than slots, so the table keeps turning over. Per case both
sides first run the same `--check` batches and must give the same slots; then they are
timed interleaved (medians, per-round ratios; every JAX result waited for), and TorchRec is
timed again alone in a fresh process (`--side torchrec`): the two TorchRec figures should
agree within ~15%, else the harness is unfair to it; the last column is ours against
TorchRec's alone median, and issue 34's verdict takes the lower of the two ratios. `--with-xla` adds the XLA form (the
sorted form a GPU runs, as lowered on CPU with the kernels switched off).

The share of a training step: a `hybrid.Model` (DLRM, one managed table of the largest
`--zch`, `--ids` samples of one raw id each, Zipf ids) against the same model on a plain
table fed `raw % zch` (the same lookup and update, no remap), interleaved for
`--share-repeats` rounds, every sparse update waited for. The quiet-machine probe (pooled
lookups with 1 and 2 threads, in a fresh process) runs before and after; when the machine
was contended every figure is void.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys

import numpy as np

LEAD_IN_S = 0.05
DONE_SPEEDUP, DONE_SHARE = 10.0, 0.15  # issue 34: >= 10x TorchRec's ids/s, <= 15% of a step
TINY = ["--zch", "64", "--ids", "32", "--pool", "200", "--check", "4", "--repeats", "2"]
TINY += ["--alone-repeats", "2", "--share-repeats", "2", "--policy", "lru", "--stream", "zipf"]
CYCLE = 256  # batches of ids drawn before timing (`stream`)


def stream(ids: int, pool: int, seed: int = 0, kind: str = "zipf", batches: int = CYCLE):
    """An endless iterator of batches of `ids` raw int64 ids (`kind`: "zipf" or "uniform").
    `batches * ids` draws are made up front (drawing with weights from a pool of 2^21 takes
    ~10 ms a batch: never inside a timed call); batch j takes the next `ids` of them,
    cycling, the start shifted by 9973 at each wrap (at the defaults, 256 batches of 65,536
    draws hold more distinct ids than 2^20 slots: the map keeps turning over)."""
    rng = np.random.default_rng(seed)
    values = rng.integers(-(2**62), 2**62, size=pool, dtype=np.int64)
    n = ids * batches
    if kind == "zipf":  # p ~ 1 / rank^1.05; sorted draws search the cdf ~3x faster
        cdf = np.cumsum(1.0 / np.arange(1, pool + 1) ** 1.05)
        ranks = np.searchsorted(cdf / cdf[-1], np.sort(rng.random(n)), side="right")
        ranks = rng.permutation(np.minimum(ranks, pool - 1).astype(np.int32))
    else:
        ranks = rng.integers(0, pool, size=n, dtype=np.int32)
    for j in itertools.count():
        start = (j * ids + (j // batches) * 9973) % n
        end = start + ids
        at = ranks[start:end] if end <= n else np.concatenate([ranks[start:], ranks[: end - n]])
        yield values[at]


def on_next(batches, fn):
    """A timing case: `fn(next batch)`, the batch taken before the clock starts."""
    from benchmarks.timing import Clock

    def case() -> dict[str, float]:
        batch = next(batches)
        clock = Clock()
        return clock.finish(fn(batch))

    return case


def _module(case):
    from sparse_jax import MCHManagedCollisionModule

    return MCHManagedCollisionModule(
        case.zch,
        history_capacity=case.ids * case.interval,
        eviction_policy=case.policy,
        eviction_interval=case.interval,
    )


def ours(case, form: str = "hashed"):
    """(train, eval) callables on the next batch; each returns the slots. `form`: "hashed"
    (what `hybrid.Model` trains with on CPU: `sparse_jax.managed._hashed`, when the kernels
    are built), "sorted" (the sorted form's kernel: what it trained with before) or "xla"
    (the sorted form a GPU runs, lowered with the CPU kernels switched off)."""
    import contextlib
    from unittest import mock

    import jax

    from sparse_jax import RawIds
    from sparse_jax._kernels import _ffi
    from sparse_jax.managed import _hashed

    mc = _module(case)
    hashed = form == "hashed" and _hashed.hashes(mc)

    def train(state, ids):  # as the library's training program calls it (`_unsharded`)
        if hashed:
            state, evicted, _, slots = _hashed.profile_remap(mc, state, ids)
        else:
            state, evicted, _, slots = mc.profile_remap(state, ids)
        return state, slots, evicted

    def evaluate(state, ids):
        return _hashed.remap(mc, state, ids) if hashed else mc.remap(state, ids)

    off = (
        mock.patch.object(_ffi, "_register", lambda: "off")
        if form == "xla"
        else contextlib.nullcontext()
    )
    with off:  # lowered here, once: the choice of kernels is made at lowering
        jax.clear_caches()  # (jax reuses cached lowerings: the other form's, if lowered before)
        state = mc.init()
        if hashed:
            state = jax.jit(lambda s: _hashed.to_hashed(mc, s))(state)
        ids = RawIds.from_int64(np.arange(case.ids, dtype=np.int64))
        train_exe = jax.jit(train, donate_argnums=0).lower(state, ids).compile()
        eval_exe = jax.jit(evaluate).lower(state, ids).compile()
        jax.clear_caches()
    box = {"state": state}

    def train_call(batch):
        box["state"], slots, _ = train_exe(box["state"], RawIds.from_int64(batch))
        return slots

    def eval_call(batch):
        return eval_exe(box["state"], RawIds.from_int64(batch))

    return train_call, eval_call


def theirs(case):
    import torch
    from torchrec.modules import mc_modules
    from torchrec.sparse.jagged_tensor import JaggedTensor

    policy = (
        mc_modules.LRU_EvictionPolicy() if case.policy == "lru" else mc_modules.LFU_EvictionPolicy()
    )
    m = mc_modules.MCHManagedCollisionModule(
        zch_size=case.zch,
        device=torch.device("cpu"),
        eviction_policy=policy,
        eviction_interval=case.interval,
    )

    def call(batch, training):
        m.train(training)
        values = torch.from_numpy(batch)
        with torch.no_grad():
            out = m(
                {
                    "t": JaggedTensor(
                        values=values, lengths=torch.ones_like(values, dtype=torch.int32)
                    )
                }
            )
        m.evict()
        return out["t"].values()

    return (lambda b: call(b, True)), (lambda b: call(b, False))


def step_share(case, repeats: int) -> dict[str, float]:
    """Median ms of a managed training step and of the same step on a plain table."""
    import torch

    import dense_torch
    import hybrid
    from benchmarks.timing import interleaved, summarize
    from sparse_jax import EmbeddingBagConfig

    def build(managed: bool):
        torch.manual_seed(0)
        tables = [
            EmbeddingBagConfig(
                name="t", num_embeddings=case.zch, embedding_dim=16, feature_names=["f"]
            )
        ]
        model = hybrid.Model(
            tables,
            dense_torch.DLRM(16, 1, 4, [16], [16, 1]),
            managed_collision_modules={"t": _module(case)} if managed else None,
        )
        return model, torch.optim.SGD(model.dense_parameters(), lr=0.01)

    sides = {"managed": build(True), "plain": build(False)}
    batches = stream(case.ids, case.pool, seed=2, kind=case.stream)
    lengths = torch.ones(case.ids, dtype=torch.int32)
    dense, labels = torch.randn(case.ids, 4), torch.randint(0, 2, (case.ids,)).float()

    def step(model, opt, raw):
        loss = torch.nn.functional.binary_cross_entropy_with_logits(
            model(dense, (["f"], torch.from_numpy(raw), lengths)).squeeze(-1), labels
        )
        loss.backward()
        opt.step()
        opt.zero_grad()
        model.wait_for_sparse_update()  # the asynchronous update (and remap) inside the time
        return loss.detach()

    cases = {
        "managed": on_next(batches, lambda raw: step(*sides["managed"], raw)),
        "plain": on_next((b % case.zch for b in batches), lambda raw: step(*sides["plain"], raw)),
    }
    for run in cases.values():  # compile both, fill the map
        for _ in range(3):
            run()
    samples = interleaved(cases, repeats=repeats, lead_in_s=LEAD_IN_S)
    return {k: summarize(v["total"])["median_ms"] for k, v in samples.items()}


class Case(argparse.Namespace):
    @property
    def name(self) -> str:
        return f"{self.zch} {self.stream} {self.policy}"


def cases(args) -> list[Case]:
    return [
        Case(zch=z, stream=s, policy=p, ids=args.ids, pool=args.pool, interval=args.interval)
        for z, s, p in itertools.product(args.zch, args.stream, args.policy)
    ]


def _timed(case, sides, repeats):
    from benchmarks.timing import interleaved

    batches = stream(case.ids, case.pool, seed=1, kind=case.stream)
    timed = {}
    for name, (train, evaluate) in sides.items():
        timed[f"{name} train"] = on_next(batches, train)
        timed[f"{name} eval"] = on_next(batches, evaluate)
    return interleaved(timed, repeats=repeats, lead_in_s=LEAD_IN_S)


def _checked_sides(case, args):
    """Our side(s) and TorchRec's, after the first `--check` batches gave the same slots."""
    sides = {"ours": ours(case)}
    if args.with_sorted:
        sides["sorted"] = ours(case, "sorted")
    if args.with_xla:
        sides["xla"] = ours(case, "xla")
    sides["torchrec"] = theirs(case)
    check = stream(case.ids, case.pool, seed=0, kind=case.stream, batches=args.check + 1)
    for step in range(args.check):
        batch = next(check)
        want = sides["torchrec"][0](batch).numpy()
        for name in sides.keys() - {"torchrec"}:
            np.testing.assert_array_equal(
                np.asarray(sides[name][0](batch)), want, err_msg=f"{case.name}: train batch {step}"
            )
    want = sides["torchrec"][1](batch).numpy()
    for name in sides.keys() - {"torchrec"}:
        np.testing.assert_array_equal(
            np.asarray(sides[name][1](batch)), want, err_msg=f"{case.name}: eval"
        )
    return sides


def parse(argv):
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--zch", type=int, nargs="+", default=[1 << 17, 1 << 20], help="slots per table"
    )
    ap.add_argument("--ids", type=int, default=65536, help="ids per batch")
    ap.add_argument(
        "--pool", type=int, default=1 << 21, help="distinct raw ids the stream draws from"
    )
    ap.add_argument("--policy", nargs="+", choices=["lru", "lfu"], default=["lru", "lfu"])
    ap.add_argument("--stream", nargs="+", choices=["uniform", "zipf"], default=["uniform", "zipf"])
    ap.add_argument("--interval", type=int, default=1, help="calls between evictions")
    ap.add_argument("--check", type=int, default=5, help="batches compared slot for slot first")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument(
        "--alone-repeats",
        type=int,
        default=15,
        help="rounds of the TorchRec-alone run (as many as paired: with eviction every few calls a "
        "short run's median can land on the calls around an eviction)",
    )
    ap.add_argument(
        "--with-sorted",
        action="store_true",
        help="time the sorted form's kernel too (the CPU training form before the hashed one)",
    )
    ap.add_argument("--with-xla", action="store_true", help="time the XLA form too (slow)")
    ap.add_argument("--no-share", action="store_true", help="skip the hybrid.Model step share")
    ap.add_argument(
        "--share-repeats",
        type=int,
        default=61,
        help="interleaved rounds of the two hybrid.Model steps (a step of ~30-40 ms moves by "
        "10-20%% from one round to the next here: 15 rounds' medians read the share 14-20%%)",
    )
    ap.add_argument("--json", help="also write the figures to this JSON file")
    ap.add_argument("--tiny", action="store_true", help="a few seconds: " + " ".join(TINY))
    ap.add_argument("--side", choices=["both", "torchrec"], default="both", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.tiny:
        args = ap.parse_args([*TINY, *[a for a in (argv or sys.argv[1:]) if a != "--tiny"]])
        args.tiny = True
    return args


def main(argv=None) -> int:
    args = parse(argv)
    from benchmarks.timing import paired_ratio, summarize

    if args.side == "torchrec":
        out = {}
        for case in cases(args):
            samples = _timed(case, {"torchrec": theirs(case)}, args.alone_repeats)
            for k, v in samples.items():
                out[f"{case.name} {k}"] = summarize(v["total"])["median_ms"]
        print(json.dumps(out))
        return 0

    from benchmarks.e2e_step import competitor_alone, quietness_line, quietness_probe

    checked = [(case, _checked_sides(case, args)) for case in cases(args)]  # the gate first
    probe = {"rows": 200_000, "bags": 4096, "L": 20} if args.tiny else {}
    before = quietness_probe(**probe)
    rows, speedups = [], {}
    for case, sides in checked:
        samples = _timed(case, sides, args.repeats)
        med = {k: summarize(v["total"])["median_ms"] for k, v in samples.items()}
        for call in ("train", "eval"):
            row = {"case": case.name, "call": call}
            for name in sides:
                row[f"{name}_ms"] = med[f"{name} {call}"]
            for name in sides.keys() - {"torchrec"}:
                r = paired_ratio(
                    samples[f"torchrec {call}"]["total"], samples[f"{name} {call}"]["total"]
                )
                row[f"{name}_speedup"] = r["paired_median"]  # ids/s ours / TorchRec's
            rows.append(row)
            if call == "train":
                speedups[case.name] = row["ours_speedup"]
    fresh = competitor_alone("benchmarks.mc_remap", "torchrec", argv)
    shares = {}
    if not args.no_share:
        for case in cases(args):
            if case.zch == max(args.zch) and case.stream == args.stream[-1]:
                shares[case.name] = step_share(case, args.share_repeats)
    after = quietness_probe(**probe)
    quiet = before["quiet"] and after["quiet"]
    void = "" if quiet else " (VOID: contended)"
    print(quietness_line(before, after))
    print(
        f"{args.ids} ids per batch from {args.pool} raw int64 ids, eviction every {args.interval} "
        f"call(s); first {args.check} batches equal slot for slot; {args.repeats} interleaved "
        f"rounds, medians; speedup = our ids/s / TorchRec's (median of per-round ratios){void}"
    )
    extra = [
        (name, title)
        for name, title, on in (
            ("sorted", "sorted form ms", args.with_sorted),
            ("xla", "XLA form ms", args.with_xla),
        )
        if on
    ]
    print(
        "| slots | stream | policy | call | ours ms | ours Mids/s | "
        + "".join(f"{title} | " for _, title in extra)
        + "TorchRec ms (here) | TorchRec ms (alone) | speedup | vs TorchRec alone |"
    )
    print("|---" * (10 + len(extra)) + "|")
    for row in rows:
        zch, kind, policy = row["case"].split()
        ms = row["ours_ms"]
        alone = fresh[f"{row['case']} torchrec {row['call']}"]
        # TorchRec beside ours can run slower than alone (the harness then flatters us): the
        # bar takes the lower of the paired ratio and ours against TorchRec's alone median
        row["speedup_vs_alone"] = alone / ms
        print(
            f"| {zch} | {kind} | {policy} | {row['call']} | {ms:.2f} | {args.ids / ms / 1e3:.2f} | "
            + "".join(f"{row[name + '_ms']:.2f} | " for name, _ in extra)
            + f"{row['torchrec_ms']:.2f} | {alone:.2f} | {row['ours_speedup']:.2f}x{void} | "
            + f"{row['speedup_vs_alone']:.2f}x |"
        )
    for name, share in shares.items():
        managed, plain = share["managed"], share["plain"]
        share["remap_share"] = max(0.0, 1 - plain / managed)
        print(
            f"hybrid.Model training step ({name}), {args.ids} ids: {managed:.2f} ms managed, "
            f"{plain:.2f} ms on a plain table; the remap is {share['remap_share']:.0%} of the "
            f"managed step{void}"
        )
    largest = [n for n in speedups if int(n.split()[0]) == max(args.zch)]
    vs_alone = {r["case"]: r["speedup_vs_alone"] for r in rows if r["call"] == "train"}
    met = (
        bool(shares)
        and all(min(speedups[n], vs_alone[n]) >= DONE_SPEEDUP for n in largest)
        and all(s["remap_share"] <= DONE_SHARE for s in shares.values())
    )
    print(
        f"issue 34 (training remap >= {DONE_SPEEDUP:.0f}x TorchRec's ids/s at {max(args.zch)} slots, "
        f"<= {DONE_SHARE:.0%} of a step): "
        + (
            ("met" if met else "NOT met" if shares else "not judged (--no-share)")
            if quiet
            else "void (the machine was contended)"
        )
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "rows": rows,
                    "torchrec_alone": fresh,
                    "shares": shares,
                    "quiet": quiet,
                    "probe": {"before": before, "after": after},
                    "met": met if quiet else None,
                },
                f,
                indent=1,
            )
    return 0


if __name__ == "__main__":
    from hybrid._cpu_env import reexec_with_hugepages

    reexec_with_hugepages()  # XLA:CPU's fresh buffers in huge pages, both sides alike
    sys.exit(main())
