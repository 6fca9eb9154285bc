"""Managed-collision remapping: `sparse_jax.MCHManagedCollisionModule` (jitted, raw ids as two
32-bit words) against TorchRec's `MCHManagedCollisionModule` (CPU), on the same id stream.

    python -m benchmarks.mc_remap                        # ~1 min here
    python -m benchmarks.mc_remap --zch 4096 --ids 2048 --repeats 5 --alone-repeats 5   # smoke

A training call is `profile` (window, eviction every `--interval` calls) then `remap` of the
batch; an eval call is `remap` only. The share of a training step: a `hybrid.Model` (DLRM,
one managed table of `--zch` rows, `--ids` samples of one raw id each) against the same
model on a plain table fed `raw % zch` (the same lookup and update, no remap), interleaved,
every sparse update waited for. Ids are raw int64 drawn from a Zipf-like pool of
`--pool` 64-bit values (more ids than slots: the table keeps turning over). Both sides first
run the same `--check` batches and must give the same slots; then both are timed
interleaved (medians, per-round ratios; every JAX result waited for), and TorchRec is timed
again alone in a fresh process (`--side torchrec`).
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np

LEAD_IN_S = 0.05


def stream(ids: int, pool: int, seed: int = 0):
    """An endless generator of batches of `ids` raw int64 ids."""
    rng = np.random.default_rng(seed)
    values = rng.integers(-(2**62), 2**62, size=pool, dtype=np.int64)
    p = 1.0 / np.arange(1, pool + 1) ** 1.05
    p /= p.sum()
    while True:
        yield values[rng.choice(pool, size=ids, p=p)]


def ours(args):
    """(train, eval) callables on the next batch; each returns the slots."""
    import jax

    from sparse_jax import MCHManagedCollisionModule, RawIds

    mc = MCHManagedCollisionModule(
        args.zch,
        history_capacity=args.ids * args.interval,
        eviction_policy=args.policy,
        eviction_interval=args.interval,
    )

    @jax.jit
    def train(state, ids):
        state, evicted = mc.profile(state, ids)
        return state, mc.remap(state, ids), evicted

    evaluate = jax.jit(mc.remap)
    box = {"state": mc.init()}

    def train_call(batch):
        box["state"], slots, _ = train(box["state"], RawIds.from_int64(batch))
        return slots

    def eval_call(batch):
        return evaluate(box["state"], RawIds.from_int64(batch))

    return train_call, eval_call


def theirs(args):
    import torch
    from torchrec.modules import mc_modules
    from torchrec.sparse.jagged_tensor import JaggedTensor

    policy = (
        mc_modules.LRU_EvictionPolicy() if args.policy == "lru" else mc_modules.LFU_EvictionPolicy()
    )
    m = mc_modules.MCHManagedCollisionModule(
        zch_size=args.zch,
        device=torch.device("cpu"),
        eviction_policy=policy,
        eviction_interval=args.interval,
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


def step_share(args) -> dict[str, float]:
    """Median ms of a managed training step and of the same step on a plain table."""
    import torch

    import dense_torch
    import hybrid
    from benchmarks.timing import clocked, interleaved, summarize
    from sparse_jax import EmbeddingBagConfig, MCHManagedCollisionModule

    def build(managed: bool):
        torch.manual_seed(0)
        tables = [
            EmbeddingBagConfig(
                name="t", num_embeddings=args.zch, embedding_dim=16, feature_names=["f"]
            )
        ]
        module = MCHManagedCollisionModule(
            args.zch,
            history_capacity=args.ids * args.interval,
            eviction_policy=args.policy,
            eviction_interval=args.interval,
        )
        model = hybrid.Model(
            tables,
            dense_torch.DLRM(16, 1, 4, [16], [16, 1]),
            managed_collision_modules={"t": module} if managed else None,
        )
        return model, torch.optim.SGD(model.dense_parameters(), lr=0.01)

    sides = {"managed": build(True), "plain": build(False)}
    batches = stream(args.ids, args.pool, seed=2)
    lengths = torch.ones(args.ids, dtype=torch.int32)
    dense, labels = torch.randn(args.ids, 4), torch.randint(0, 2, (args.ids,)).float()

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
        "managed": clocked(lambda c: step(*sides["managed"], next(batches))),
        "plain": clocked(lambda c: step(*sides["plain"], next(batches) % args.zch)),
    }
    for case in cases.values():  # compile both
        case()
    samples = interleaved(cases, repeats=args.repeats, lead_in_s=LEAD_IN_S)
    return {k: summarize(v["total"])["median_ms"] for k, v in samples.items()}


def _timed(args, sides):
    from benchmarks.timing import clocked, interleaved

    batches = stream(args.ids, args.pool, seed=1)
    cases = {}
    for name, (train, evaluate) in sides.items():
        cases[f"{name} train"] = clocked(lambda c, f=train: f(next(batches)))
        cases[f"{name} eval"] = clocked(lambda c, f=evaluate: f(next(batches)))
    return interleaved(
        cases, repeats=args.repeats if len(sides) > 1 else args.alone_repeats, lead_in_s=LEAD_IN_S
    )


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--zch", type=int, default=1 << 18, help="slots per table")
    ap.add_argument("--ids", type=int, default=65536, help="ids per batch")
    ap.add_argument(
        "--pool", type=int, default=1 << 20, help="distinct raw ids the stream draws from"
    )
    ap.add_argument("--policy", choices=["lru", "lfu"], default="lru")
    ap.add_argument("--interval", type=int, default=1)
    ap.add_argument("--check", type=int, default=5, help="batches compared slot for slot first")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument(
        "--alone-repeats",
        type=int,
        default=15,
        help="rounds of the TorchRec-alone run (as many as paired: with eviction every few calls a "
        "short run's median can land on the calls around an eviction)",
    )
    ap.add_argument("--side", choices=["both", "torchrec"], default="both", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    from benchmarks.timing import paired_ratio, summarize

    if args.side == "torchrec":
        samples = _timed(args, {"torchrec": theirs(args)})
        print(json.dumps({k: summarize(v["total"])["median_ms"] for k, v in samples.items()}))
        return 0

    from benchmarks.e2e_step import competitor_alone, quietness_line, quietness_probe

    before = quietness_probe()
    check = stream(args.ids, args.pool, seed=0)
    a, b = ours(args), theirs(args)
    for step in range(args.check):
        batch = next(check)
        np.testing.assert_array_equal(
            np.asarray(a[0](batch)), b[0](batch).numpy(), err_msg=f"train batch {step}"
        )
    np.testing.assert_array_equal(np.asarray(a[1](batch)), b[1](batch).numpy(), err_msg="eval")
    samples = _timed(args, {"xla": a, "torchrec": b})
    med = {k: summarize(v["total"])["median_ms"] for k, v in samples.items()}
    fresh = competitor_alone("benchmarks.mc_remap", "torchrec", argv)
    share = step_share(args)
    after = quietness_probe()
    print(quietness_line(before, after))
    print(
        f"zch_size {args.zch}, {args.ids} ids per batch from {args.pool} raw int64 ids, {args.policy.upper()}, "
        f"eviction every {args.interval} call(s); first {args.check} batches equal slot for slot; "
        f"{args.repeats} interleaved rounds, medians"
    )
    print(
        "| call | XLA ms | XLA Mids/s | TorchRec ms (here) | TorchRec ms (alone) | XLA / TorchRec (paired) |"
    )
    print("|---|---|---|---|---|---|")
    for call in ("train", "eval"):
        r = paired_ratio(samples[f"xla {call}"]["total"], samples[f"torchrec {call}"]["total"])
        x = med[f"xla {call}"]
        print(
            f"| {call} | {x:.2f} | {args.ids / x / 1e3:.2f} | {med[f'torchrec {call}']:.2f} "
            f"| {fresh[f'torchrec {call}']:.2f} | {r['paired_median']:.2f}x |"
        )
    managed, plain = share["managed"], share["plain"]
    print(
        f"hybrid.Model training step, {args.ids} ids: {managed:.2f} ms managed, {plain:.2f} ms on a plain table; "
        f"the remap is {max(0.0, 1 - plain / managed):.0%} of the managed step"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
