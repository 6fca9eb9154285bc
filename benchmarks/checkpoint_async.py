"""What an asynchronous checkpoint costs a training step (`hybrid.checkpoint.AsyncCheckpointer`,
the "orbax" format) against no save, and against the synchronous "npz" save.

    python -m benchmarks.checkpoint_async                     # ~1-2 min here
    python -m benchmarks.checkpoint_async --rows 20000 --rounds 2 --steps 4   # smoke

One process, `--devices` XLA CPU devices (tables row-wise over them), a DLRM `hybrid.Model`
with `--tables` tables of `--rows` x `--dim` (rowwise Adagrad: one state value per row) and
`--batch` samples of `--ids` ids per table. Each round, interleaved: `--steps` steps with no
save, then an asynchronous save followed by steps until it has committed (the step times
while Orbax writes in the background), then a synchronous "npz" save. Every step waits for
its sparse update. Reports medians: step time without a save, step time during a save (and
the ratio, per round), the time `save()` blocks (the host copy of the shards), the time
until the commit, and the "npz" save. A quietness probe runs before and after (see
PERF_NOTES.md): on a contended machine the figures are void and marked so.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--devices", type=int, default=2)
    ap.add_argument("--tables", type=int, default=4)
    ap.add_argument("--rows", type=int, default=500_000)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--batch", type=int, default=2048)
    ap.add_argument("--ids", type=int, default=20, help="ids per sample per table")
    ap.add_argument("--steps", type=int, default=8, help="steps without a save, per round")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--dir", default="", help="where checkpoints are written (default: a temp dir)")
    args = ap.parse_args(argv)
    flags = os.environ.get("XLA_FLAGS", "")
    os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={args.devices}"

    import numpy as np
    import torch

    import dense_torch
    import hybrid
    from benchmarks.e2e_step import quietness_line, quietness_probe
    from hybrid.checkpoint import AsyncCheckpointer, save_checkpoint
    from sparse_jax import EmbeddingBagConfig, optim

    before = quietness_probe()
    torch.manual_seed(0)
    keys = [f"f{i}" for i in range(args.tables)]
    tables = [
        EmbeddingBagConfig(
            name=f"t{i}", num_embeddings=args.rows, embedding_dim=args.dim, feature_names=[k]
        )
        for i, k in enumerate(keys)
    ]
    mesh = hybrid.make_mesh({"model": args.devices}) if args.devices > 1 else None
    model = hybrid.Model(
        tables,
        dense_torch.DLRM(args.dim, args.tables, 13, [64, args.dim], [64, 1]),
        mesh=mesh,
        plan={t.name: "row_wise" for t in tables} if mesh is not None else None,
        sparse_optimizer=optim.rowwise_adagrad(lr=0.01),
    )
    opt = torch.optim.Adam(model.dense_parameters(), lr=1e-3)
    rng = np.random.default_rng(0)
    n = args.batch * args.ids

    def step():
        values = torch.from_numpy(rng.integers(0, args.rows, size=n * args.tables))
        lengths = torch.full((args.batch * args.tables,), args.ids, dtype=torch.int32)
        dense = torch.randn(args.batch, 13)
        t0 = time.perf_counter()
        logits = model(dense, (keys, values, lengths)).squeeze(-1)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, torch.ones(args.batch))
        loss.backward()
        opt.step()
        opt.zero_grad()
        model.wait_for_sparse_update()
        return time.perf_counter() - t0

    root = args.dir or tempfile.mkdtemp(prefix="hybridrec-ckpt-bench-")
    saver = AsyncCheckpointer()
    run_id = "benchmark"
    for _ in range(3):
        step()  # compile
    saver.save(
        os.path.join(root, "async"),
        step=0,
        model=model,
        dense_optimizer=opt,
        meta={},
        run_id=run_id,
    )
    saver.wait()  # Orbax's first save: its own set-up outside the timings
    plain, during, ratios, blocking, commit, npz = [], [], [], [], [], []
    for r in range(1, args.rounds + 1):
        quiet_steps = [step() for _ in range(args.steps)]
        t0 = time.perf_counter()
        saver.save(
            os.path.join(root, "async"),
            step=r,
            model=model,
            dense_optimizer=opt,
            meta={},
            run_id=run_id,
        )
        blocking.append(time.perf_counter() - t0)
        save_steps = []
        while saver.in_flight():
            save_steps.append(step())
        saver.wait()
        commit.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        save_checkpoint(
            os.path.join(root, "npz"), step=r, model=model, dense_optimizer=opt, run_id=run_id
        )
        npz.append(time.perf_counter() - t0)
        plain += quiet_steps
        if save_steps:
            during += save_steps
            ratios.append(np.median(save_steps) / np.median(quiet_steps))
    saver.close()
    newest = saver.last_committed
    size = sum(f.stat().st_size for f in newest.rglob("*") if f.is_file())
    if not args.dir:
        shutil.rmtree(root, ignore_errors=True)
    after = quietness_probe()

    def ms(xs):
        return f"{np.median(xs) * 1e3:.1f}" if xs else "-"

    print(quietness_line(before, after))
    print(
        f"{args.tables} tables x {args.rows} rows x {args.dim} (rowwise Adagrad) row-wise over {args.devices} "
        f"CPU device(s), batch {args.batch} x {args.ids} ids per table; {args.rounds} rounds; one "
        f"checkpoint {size / 2**20:.0f} MiB (orbax)"
    )
    print("| | ms |")
    print("|---|---|")
    print(f"| step, no save (median of {len(plain)}) | {ms(plain)} |")
    print(f"| step while an async save writes (median of {len(during)}) | {ms(during)} |")
    print(
        f"| step during / without, per round (median) | {np.median(ratios) if ratios else float('nan'):.2f}x |"
    )
    print(f"| `save()` blocks (host copy of the shards) | {ms(blocking)} |")
    print(f"| async save until committed (steps running meanwhile) | {ms(commit)} |")
    print(f"| synchronous npz save | {ms(npz)} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
