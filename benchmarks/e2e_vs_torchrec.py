"""End-to-end training-step throughput: `hybrid.Model` vs TorchRec's DistributedModelParallel.

    python -m benchmarks.e2e_vs_torchrec [--tiny] [--out DIR | --update-results]

The same DLRM (TorchRec's `DLRM` dense/interaction/over arches; ours `dense_torch.DLRM`
with TorchRec's state-dict keys) with the same starting weights, the same batches and
the same optimizers on both sides: fused EXACT_ROWWISE_ADAGRAD for the tables, SGD for the
dense tower. TorchRec runs under `DistributedModelParallel` (gloo, one CPU rank, fused
optimizer in the backward); ours is `hybrid.Model` on one XLA CPU device. A step is
forward + BCE loss + backward (which applies the sparse update on both sides) + dense SGD
step. Before timing, the first steps' losses and the final tables must agree (the gate).
Timing is back to back with all work finished: each round runs `steps_per_round` steps on
one side and then waits for everything they started (ours: the asynchronous JAX sparse
update, `model.wait_for_sparse_update()`; TorchRec on CPU is synchronous); rounds
alternate between the sides, and the figure is the median per-step time over rounds.
`python -m benchmarks.e2e_step` is the fuller version (pipelines, breakdown, TorchRec alone).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import time

import numpy as np
import torch

from benchmarks import report

__all__ = ["main", "run"]


def _workload(tiny: bool) -> dict:
    if tiny:
        return dict(T=3, E=500, D=16, B=64, L=4, n_dense=13, steps=6, warmup=2, steps_per_round=2)
    return dict(
        T=8, E=100_000, D=64, B=2048, L=20, n_dense=13, steps=15, warmup=3, steps_per_round=5
    )


def _batches(w: dict, count: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    keys = [f"f{i}" for i in range(w["T"])]
    for _ in range(count):
        lengths = rng.integers(1, 2 * w["L"], size=w["T"] * w["B"])
        values = rng.integers(0, w["E"], size=int(lengths.sum()))
        dense = rng.normal(size=(w["B"], w["n_dense"])).astype(np.float32)
        labels = (rng.random(w["B"]) < 0.3).astype(np.float32)
        yield (
            keys,
            torch.from_numpy(values),
            torch.from_numpy(lengths),
            torch.from_numpy(dense),
            torch.from_numpy(labels),
        )


def torchrec_dmp(w: dict, lr: float, world_size: int):
    """TorchRec's DLRM (seed 0) under DistributedModelParallel with a fused
    EXACT_ROWWISE_ADAGRAD, in an initialized process group of `world_size` ranks.
    Returns (dmp, dense SGD optimizer, the starting state dict)."""
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
    from torchrec.distributed import DistributedModelParallel
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology
    from torchrec.models.dlrm import DLRM

    tables = [
        EmbeddingBagConfig(
            name=f"t{i}", embedding_dim=w["D"], num_embeddings=w["E"], feature_names=[f"f{i}"]
        )
        for i in range(w["T"])
    ]
    torch.manual_seed(0)
    dlrm = DLRM(
        embedding_bag_collection=EmbeddingBagCollection(tables=tables, device=torch.device("cpu")),
        dense_in_features=w["n_dense"],
        dense_arch_layer_sizes=[128, w["D"]],
        over_arch_layer_sizes=[128, 1],
    )
    start = {k: v.detach().clone() for k, v in dlrm.state_dict().items()}
    sharder = EmbeddingBagCollectionSharder(
        fused_params={
            "optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD,
            "learning_rate": lr,
            "eps": 1e-8,
        }
    )
    topology = Topology(world_size=world_size, compute_device="cpu")
    plan = EmbeddingShardingPlanner(topology=topology).plan(dlrm, [sharder])
    dmp = DistributedModelParallel(dlrm, device=torch.device("cpu"), plan=plan, sharders=[sharder])
    dmp.load_state_dict(
        dict(start), strict=False
    )  # a copy: DMP rewrites the keys of the dict it is given
    dense_params = [p for n, p in dmp.named_parameters() if "embedding_bags" not in n]
    return dmp, torch.optim.SGD(dense_params, lr=lr), start


def _torchrec_side(w: dict, lr: float):
    import torch.distributed as dist

    if not dist.is_initialized():
        # One process: an in-process store, so no port can be taken by another process
        # (a port from the pid collided under a busy `make test`: EADDRINUSE).
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    return torchrec_dmp(w, lr, 1)


def _our_side(w: dict, lr: float, start: dict):
    import dense_torch
    import hybrid
    from sparse_jax import EmbeddingBagConfig
    from sparse_jax.optim import rowwise_adagrad

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
    model = hybrid.Model(tables, dense, sparse_optimizer=rowwise_adagrad(lr=lr, eps=1e-8))
    model.load_state_dict(hybrid.from_torchrec_state_dict(start))
    return model, torch.optim.SGD(model.dense_parameters(), lr=lr)


def _step_torchrec(dmp, opt, batch):
    from torchrec import KeyedJaggedTensor

    keys, values, lengths, dense, labels = batch
    kjt = KeyedJaggedTensor.from_lengths_sync(keys=keys, values=values, lengths=lengths)
    logits = dmp(dense, kjt).squeeze(-1)
    loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, labels)
    opt.zero_grad()
    loss.backward()
    opt.step()
    return loss.detach()


def _step_ours(model, opt, batch):
    """One step; returns the loss unread. The sparse update it dispatched may still be
    running: `model.wait_for_sparse_update()` waits for it."""
    import hybrid

    keys, values, lengths, dense, labels = batch
    logits = model(dense, hybrid.torch_kjt(keys, values, lengths)).squeeze(-1)
    loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, labels)
    opt.zero_grad()
    loss.backward()
    opt.step()
    return loss.detach()


def _per_step_s(step, finish, batches) -> float:
    """Seconds per step of `batches` run back to back, until `finish()` has waited for all
    the work they started."""
    t0 = time.perf_counter()
    for batch in batches:
        step(batch)
    finish()
    return (time.perf_counter() - t0) / len(batches)


def _tables_of_dmp(dmp) -> dict[str, np.ndarray]:
    out = {}
    for name, tensor in dmp.state_dict().items():
        if "embedding_bags" in name:
            local = tensor.local_shards()[0].tensor if hasattr(tensor, "local_shards") else tensor
            out[name.split("embedding_bags.")[1].split(".")[0]] = local.detach().numpy().copy()
    return out


def run(tiny: bool = False, out_dir: str | os.PathLike | None = None) -> dict:
    """Gate and time both sides; `e2e[_tiny].json` / `.md` in `out_dir` (None: a fresh runs/bench/ directory)."""
    torch.set_num_threads(int(os.environ.get("HYBRIDREC_TORCH_THREADS", "2")))
    w = _workload(tiny)
    lr = 0.01
    dmp, opt_t, start = _torchrec_side(w, lr)
    model, opt_o = _our_side(w, lr, start)
    batches = list(_batches(w, 2 + w["warmup"] + w["steps"]))
    # the gate: two identical steps give the same losses and tables
    gate = []
    for batch in batches[:2]:
        gate.append(
            (float(_step_ours(model, opt_o, batch)), float(_step_torchrec(dmp, opt_t, batch)))
        )
    theirs = _tables_of_dmp(dmp)
    ours = {k: v.numpy() for k, v in model.table_weights().items()}
    table_err = max(
        float(np.abs(ours[k] - theirs[k]).max() / (np.abs(theirs[k]).max() + 1e-12)) for k in theirs
    )
    loss_err = max(abs(a - b) / max(abs(b), 1e-12) for a, b in gate)
    if table_err > 1e-4 or loss_err > 1e-4:
        raise RuntimeError(
            f"correctness gate failed: loss rel err {loss_err:.2e}, table rel err {table_err:.2e}"
        )
    sides = {
        "hybridrec": (lambda b: _step_ours(model, opt_o, b), model.wait_for_sparse_update),
        "torchrec": (lambda b: _step_torchrec(dmp, opt_t, b), lambda: None),
    }
    for step, finish in sides.values():  # warm-up, all work finished
        _per_step_s(step, finish, batches[2 : 2 + w["warmup"]])
    k = w["steps_per_round"]
    timed = batches[2 + w["warmup"] :]
    times: dict[str, list[float]] = {"hybridrec": [], "torchrec": []}
    for r, start in enumerate(range(0, len(timed) - k + 1, k)):
        order = list(sides) if r % 2 == 0 else list(reversed(sides))
        for name in order:
            times[name].append(_per_step_s(*sides[name], timed[start : start + k]))
    med = {k: float(np.median(v)) for k, v in times.items()}
    result = {
        "workload": w,
        "gate": {"loss_rel_err": loss_err, "table_rel_err": table_err},
        "median_step_s": med,
        "timing": f"rounds of {k} steps back to back per side, all work finished, sides alternating",
        "samples_per_s": {k: w["B"] / v for k, v in med.items()},
        "ratio_time_ours_over_torchrec": med["hybridrec"] / med["torchrec"],
        "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count()},
        "versions": {"torch": torch.__version__, "jax": __import__("jax").__version__},
    }
    out = pathlib.Path(out_dir or report.fresh_run_dir("e2e_vs_torchrec"))
    out.mkdir(parents=True, exist_ok=True)
    name = "e2e_tiny" if tiny else "e2e"
    (out / f"{name}.json").write_text(json.dumps(result, indent=2))
    (out / f"{name}.md").write_text(
        "| side | median step (ms) | samples/s | time ratio vs TorchRec |\n|---|---|---|---|\n"
        + "\n".join(
            f"| {k} | {med[k] * 1e3:.1f} | {w['B'] / med[k]:.0f} | {med[k] / med['torchrec']:.2f} |"
            for k in med
        )
        + "\n"
    )
    return result


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", help="a seconds-long smoke run")
    report.add_output_args(parser, "e2e_vs_torchrec")
    args = parser.parse_args(argv)
    out = report.output_dir(parser, args, "e2e_vs_torchrec")
    result = run(args.tiny, out)
    print(
        json.dumps(
            {k: result[k] for k in ("gate", "median_step_s", "ratio_time_ours_over_torchrec")},
            indent=2,
        )
    )
    print(f"results: {out}")


if __name__ == "__main__":
    main()
