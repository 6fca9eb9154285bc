"""Sharded end-to-end step throughput: `hybrid.Model` on an 8-device mesh vs TorchRec DMP
with 2 ranks (gloo, CPU), same DLRM, tables, global batch and optimizers.

    python -m benchmarks.e2e_sharded [--tiny] [--out DIR | --update-results]

Each side runs in its own processes (ours: one process with 8 XLA CPU devices; TorchRec:
two ranks, each feeding half the global batch), one after the other, so the pair is not
interleaved: read the ratio with that in mind. TorchRec's planner picks its CPU sharding;
ours is `{table: "table_wise"}` over the `model` axis of `data=2,model=4`. Both sides train
the same batches; the gate compares the first step's loss (the mean over the global batch).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import subprocess
import sys
import tempfile

import numpy as np

from benchmarks import report

__all__ = ["main", "run"]

HERE = pathlib.Path(__file__).resolve().parent
# the TorchRec ranks' gloo timeout (set-up and collectives)
RANK_TIMEOUT = datetime.timedelta(seconds=300)


def _torchrec_rank(rank: int, world: int, port: int, tiny: bool, out: str) -> None:
    import time

    import torch
    import torch.distributed as dist
    from torchrec import KeyedJaggedTensor

    from benchmarks import e2e_vs_torchrec as e2e

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    # a peer that never comes (rank 0 failed to start) ends this rank in minutes, not after
    # gloo's 30-minute default
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=RANK_TIMEOUT)
    torch.set_num_threads(1)
    w = e2e._workload(tiny)
    dmp, opt, _ = e2e.torchrec_dmp(w, 0.01, world)
    half = w["B"] // world
    times, losses = [], []
    for i, (keys, values, lengths, dense, labels) in enumerate(e2e._batches(w, w["steps"])):
        lengths2 = lengths.reshape(len(keys), w["B"])[:, rank * half : (rank + 1) * half]
        offsets = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(lengths, 0)])
        pieces = [
            values[offsets[k * w["B"] + rank * half] : offsets[k * w["B"] + (rank + 1) * half]]
            for k in range(len(keys))
        ]
        kjt = KeyedJaggedTensor.from_lengths_sync(
            keys=keys, values=torch.cat(pieces), lengths=lengths2.reshape(-1)
        )
        dist.barrier()
        t0 = time.perf_counter()
        logits = dmp(dense[rank * half : (rank + 1) * half], kjt).squeeze(-1)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(
            logits, labels[rank * half : (rank + 1) * half]
        )
        opt.zero_grad()
        loss.backward()
        opt.step()
        dist.barrier()
        if i >= w["warmup"]:
            times.append(time.perf_counter() - t0)
        both = torch.tensor([float(loss.detach())])
        dist.all_reduce(both)
        losses.append(float(both) / world)
    if rank == 0:
        pathlib.Path(out).write_text(json.dumps({"times": times, "losses": losses}))
    # this rank's work is complete (rank 0's results written before): from here on, only
    # teardown, which `_check_ranks` forgives once this file is there
    _done_path(out, rank).write_text(json.dumps({"rank": rank, "steps": len(losses)}))
    dist.destroy_process_group()
    # leave without the interpreter's teardown, where a gloo or TorchRec background thread
    # still joinable at exit sometimes aborts the rank ("terminate called without an active
    # exception") and turned a finished run into a failed one
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _done_path(out: str | os.PathLike, rank: int) -> pathlib.Path:
    """The file a TorchRec rank writes once all its steps ran (and, for rank 0, its results
    were written): what follows is teardown only."""
    return pathlib.Path(f"{out}.rank{rank}.done")


def _check_ranks(codes: list[int], out: str | os.PathLike, steps: int) -> list[str]:
    """Accept the TorchRec ranks' exits, or raise. A rank that exited non-zero AFTER writing
    its done file (all `steps` run, results written) died in teardown: accepted, and the
    returned notes say so. One that exited non-zero without it failed: RuntimeError."""
    notes, failed = [], []
    for rank, code in enumerate(codes):
        if code == 0:
            continue
        done = _done_path(out, rank)
        record = json.loads(done.read_text()) if done.exists() else None
        if record == {"rank": rank, "steps": steps}:
            notes.append(
                f"TorchRec rank {rank} exited with code {code} in teardown, after all {steps} "
                "steps ran and its results were written: accepted"
            )
        else:
            failed.append(
                f"rank {rank} exited with code {code} before finishing its {steps} steps "
                f"(done file: {record})"
            )
    if failed:
        raise RuntimeError(
            f"a TorchRec rank failed (exit codes {codes}): {'; '.join(failed)}; its traceback "
            "is in the output above"
        )
    return notes


def _ours(tiny: bool, out: str) -> None:
    import torch

    import dense_torch
    import hybrid
    from benchmarks import e2e_vs_torchrec as e2e
    from sparse_jax import EmbeddingBagConfig
    from sparse_jax.optim import rowwise_adagrad

    torch.set_num_threads(2)
    w = e2e._workload(tiny)
    tables = [
        EmbeddingBagConfig(
            name=f"t{i}", embedding_dim=w["D"], num_embeddings=w["E"], feature_names=[f"f{i}"]
        )
        for i in range(w["T"])
    ]
    dense = dense_torch.DLRM(
        embedding_dim=w["D"],
        num_sparse_features=w["T"],
        dense_in_features=w["n_dense"],
        dense_arch_layer_sizes=[128, w["D"]],
        over_arch_layer_sizes=[128, 1],
    )
    model = hybrid.Model(
        tables,
        dense,
        mesh=hybrid.make_mesh("data=2,model=4"),
        plan={t.name: "table_wise" for t in tables},
        sparse_optimizer=rowwise_adagrad(lr=0.01, eps=1e-8),
    )
    _, _, start = e2e._torchrec_side(
        w, 0.01
    )  # TorchRec's starting weights (same seed as the ranks)
    model.load_state_dict(hybrid.from_torchrec_state_dict(start))
    opt = torch.optim.SGD(model.dense_parameters(), lr=0.01)
    batches = list(e2e._batches(w, w["steps"]))
    losses = []
    step = lambda b: losses.append(e2e._step_ours(model, opt, b))  # noqa: E731
    e2e._per_step_s(step, model.wait_for_sparse_update, batches[: w["warmup"]])
    # back to back, until the last sparse update has finished (every step's work counted)
    per_step = e2e._per_step_s(step, model.wait_for_sparse_update, batches[w["warmup"] :])
    times = [per_step] * (len(batches) - w["warmup"])
    pathlib.Path(out).write_text(json.dumps({"times": times, "losses": [float(x) for x in losses]}))


def run(tiny: bool = False, out_dir: str | os.PathLike | None = None) -> dict:
    """Both sides, then `e2e_sharded[_tiny].json` in `out_dir` (None: a fresh runs/bench/ directory)."""
    # each side sets up its own process group: no inherited MASTER_* (this process may hold one)
    env = {
        k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT", "XLA_FLAGS")
    }
    env.update(PYTHONPATH=str(HERE.parent), JAX_PLATFORMS="cpu")
    with tempfile.TemporaryDirectory() as tmp:
        ours_out, theirs_out = pathlib.Path(tmp, "ours.json"), pathlib.Path(tmp, "theirs.json")
        code = f"from benchmarks.e2e_sharded import _ours; _ours({tiny}, {str(ours_out)!r})"
        subprocess.run(
            [sys.executable, "-c", code],
            check=True,
            cwd=HERE.parent,
            env=dict(env, XLA_FLAGS="--xla_force_host_platform_device_count=8"),
            timeout=1800,
        )
        from hybrid.training._distributed import free_master_port

        port = free_master_port()
        ranks = [
            subprocess.Popen(
                [
                    sys.executable,
                    "-c",
                    f"from benchmarks.e2e_sharded import _torchrec_rank; "
                    f"_torchrec_rank({r}, 2, {port}, {tiny}, {str(theirs_out)!r})",
                ],
                cwd=HERE.parent,
                env=env,
            )
            for r in range(2)
        ]
        try:
            codes = [p.wait(timeout=900) for p in ranks]  # every rank waited for
        finally:  # (a rank past the wait, or the wait interrupted: none is left running)
            for p in ranks:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        w = __import__("benchmarks.e2e_vs_torchrec", fromlist=["_workload"])._workload(tiny)
        teardown = _check_ranks(codes, theirs_out, w["steps"])
        for note in teardown:
            print(f"e2e_sharded: {note}", file=sys.stderr, flush=True)
        ours, theirs = json.loads(ours_out.read_text()), json.loads(theirs_out.read_text())
        if len(theirs["losses"]) != w["steps"] or len(theirs["times"]) != w["steps"] - w["warmup"]:
            raise RuntimeError(
                f"TorchRec rank 0's results are incomplete: {len(theirs['losses'])} losses and "
                f"{len(theirs['times'])} times for {w['steps']} steps ({w['warmup']} warm-up)"
            )
    med = {
        "hybridrec (8-device mesh)": float(np.median(ours["times"])),
        "torchrec (2 ranks)": float(np.median(theirs["times"])),
    }
    loss_err = abs(ours["losses"][0] - theirs["losses"][0]) / max(abs(theirs["losses"][0]), 1e-12)
    if loss_err > 1e-4:
        raise RuntimeError(
            f"correctness gate failed: first-step losses differ by {loss_err:.2e} (relative)"
        )
    result = {
        "workload": w,
        "first_step_loss": {
            "hybridrec": ours["losses"][0],
            "torchrec": theirs["losses"][0],
            "rel_err": loss_err,
        },
        "median_step_s": med,
        "ratio_time_ours_over_torchrec": med["hybridrec (8-device mesh)"]
        / med["torchrec (2 ranks)"],
        "note": "sides run one after the other (separate processes), not interleaved",
        "torchrec_teardown": teardown,
    }
    out = pathlib.Path(out_dir or report.fresh_run_dir("e2e_sharded"))
    out.mkdir(parents=True, exist_ok=True)
    name = "e2e_sharded_tiny" if tiny else "e2e_sharded"
    (out / f"{name}.json").write_text(json.dumps(result, indent=2))
    return result


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true")
    report.add_output_args(parser, "e2e_sharded")
    args = parser.parse_args(argv)
    out = report.output_dir(parser, args, "e2e_sharded")
    print(json.dumps(run(args.tiny, out), indent=2))
    print(f"results: {out}")


if __name__ == "__main__":
    main()
