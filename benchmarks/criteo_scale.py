"""Criteo-Kaggle-scale run: synthetic data of Criteo's shape, DLRM with Kaggle-sized tables,
trained on 2 processes x 2 devices through `python -m hybrid.train --stream` vs TorchRec DMP
on 2 gloo ranks; memory, checkpoint and resume figures.

    python -m benchmarks.criteo_scale [--rows 10000000] [--steps 60] [--batch 2048] [--tiny]
        [--torchrec-scale 1.0] [--out DIR | --update-results]

- Data: `--rows` samples (2 train shards, one per process, and a held-out shard of
  `rows / 100` at most 65,536) in the binary format (`hybrid.data.preprocess`), 13 dense
  and 26 sparse features, the Kaggle set's cardinalities (`KAGGLE_CARDINALITIES`, ~33.8M
  rows in all), ids Zipf-like (a=1.1) scattered over each table, labels from a planted
  logistic signal. Deterministic in (rows, seed, sizes); generated once, cached under
  `data_cache/criteo_scale/<key>/` (`--data-dir`).
- Ours: DLRM (`configs/criteo.toml` with `model.arch = "DLRM"`, dim 16), mesh
  `--mesh` (default `data=1,model=4`: every table on one of the 4 devices, as TorchRec's
  table-wise plan over its 2 ranks; `data=2,model=2` holds each table twice) over 2
  processes (gloo + jax.distributed), the planner's plan, Orbax
  checkpoints at the middle and last step; samples/s is the median of the logged windows
  after the first, up to the first save (the windows after it, while the asynchronous save
  writes, are reported apart); peak RSS per process (VmHWM, polled); checkpoint save (the step's wait)
  and restore time, its size on disk; then a resume on 2 processes (`--resume`, its
  restore time) and a restore onto 1 process (`load_checkpoint` into the 1-process model).
- TorchRec: DLRM with the same tables (x `--torchrec-scale`: below 1 when the full tables
  do not fit), dense tower, batch and rowwise Adagrad, under DMP on 2 gloo ranks, fed the
  same shards; its peak RSS per rank.
- The quietness probe (`benchmarks.e2e_step`) runs before and after; a contended run is
  marked void. The two sides run one after the other, not interleaved.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import pathlib
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

from benchmarks import report
from hybrid.training._distributed import free_master_port

__all__ = ["KAGGLE_CARDINALITIES", "generate", "main", "run"]

ROOT = pathlib.Path(__file__).resolve().parent.parent
# Criteo Kaggle (Display Advertising Challenge) ids per categorical feature, as TorchRec's
# DLRM example lists them (torchrec_dlrm README: --num_embeddings_per_feature).
KAGGLE_CARDINALITIES = (
    1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593, 3194,
    27, 14992, 5461306, 10, 5652, 2173, 4, 7046547, 18, 15, 286181, 105, 142572,
)  # fmt: skip
_CHUNK = 1 << 18
_VERSION = 1  # bump when the generator changes: the cache key changes with it


def table_sizes(tiny: bool, scale: float = 1.0) -> tuple[int, ...]:
    if tiny:
        return tuple(min(c, 50) + 2 for c in KAGGLE_CARDINALITIES)
    return tuple(max(2, int(c * scale)) for c in KAGGLE_CARDINALITIES)


def _draw(rng, n: int, sizes) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    sizes = np.asarray(sizes, np.int64)
    rank = rng.zipf(1.1, (n, len(sizes))) - 1  # 0 most frequent
    ids = (rank % sizes) * 2_654_435_761 % sizes  # scatter the popular ids over the table
    counts = np.minimum(rng.exponential(20.0, (n, 13)), 1e6).astype(np.int64)
    dense = np.log1p(counts).astype(np.float32)
    logit = 0.6 * (dense[:, 0] - 2.5) + np.where(ids[:, 0] % 7 == 0, 1.5, -0.5)
    labels = (rng.random(n) < 1 / (1 + np.exp(-logit))).astype(np.uint8)
    return labels, dense, ids


def generate(root: str | os.PathLike, rows: int, sizes, seed: int = 0) -> dict:
    """Two train shards and an eval shard under `root/<key>/` (kept if already there)."""
    from hybrid.data import ShardWriter, read_header

    params = {"rows": rows, "sizes": list(sizes), "seed": seed, "version": _VERSION}
    key = hashlib.sha256(json.dumps(params, sort_keys=True).encode()).hexdigest()[:16]
    where = pathlib.Path(root) / key
    parts = {
        "part_0": rows // 2,
        "part_1": rows - rows // 2,
        "eval": min(65_536, max(rows // 100, 256)),
    }
    paths = {name: where / f"{name}.criteo" for name in parts}
    t0 = time.perf_counter()
    cached = True
    for i, (name, n) in enumerate(parts.items()):
        try:
            if read_header(paths[name])["source"] == {
                "generator": __name__,
                **params,
                "part": name,
            }:
                continue
        except ValueError:
            pass
        cached = False
        writer = ShardWriter(paths[name], sizes)
        for c, start in enumerate(range(0, n, _CHUNK)):
            rng = np.random.default_rng([seed, i, c])
            writer.append(*_draw(rng, min(_CHUNK, n - start), sizes))
        writer.commit({"generator": __name__, **params, "part": name})
    return {
        "paths": [str(paths["part_0"]), str(paths["part_1"]), str(paths["eval"])],
        "cached": cached,
        "seconds": time.perf_counter() - t0,
        "bytes": sum(f.stat().st_size for p in paths.values() for f in p.iterdir()),
    }


# -- processes -----------------------------------------------------------------------------


def _hwm_kib(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))
    except (OSError, StopIteration):
        return None


def _launch(commands: list[list[str]], envs: list[dict], timeout: float) -> list[dict]:
    """Run the processes together; their output and peak RSS (MiB, polled VmHWM)."""
    logs = [tempfile.TemporaryFile("w+") for _ in commands]  # a pipe could fill and block
    procs = [
        subprocess.Popen(c, env=e, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, text=True)
        for c, e, f in zip(commands, envs, logs, strict=True)
    ]
    peaks = [0] * len(procs)
    deadline = time.monotonic() + timeout
    while any(p.poll() is None for p in procs):
        for i, p in enumerate(procs):
            peaks[i] = max(peaks[i], _hwm_kib(p.pid) or 0)
        if time.monotonic() > deadline:
            for p in procs:
                p.kill()
        time.sleep(0.2)
    out = []
    for p, k, f in zip(procs, peaks, logs, strict=True):
        f.seek(0)
        out.append({"rc": p.returncode, "log": f.read(), "peak_rss_mib": k / 1024})
        f.close()
    for i, o in enumerate(out):
        if o["rc"] != 0:
            raise RuntimeError(
                f"process {i} of {commands[i][:4]} failed (rc {o['rc']}):\n{o['log'][-3000:]}"
            )
    return out


def _env(rank: int, world: int, port: int) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update(JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
    if world > 1:
        env.update(
            RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
            GROUP_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
        )  # fmt: skip
    return env


def _train_args(
    data: dict, run_dir: pathlib.Path, steps: int, batch: int, log_every: int, mesh: str
) -> list[str]:
    return [
        "--config=configs/criteo.toml",
        "--stream",
        f"--steps={steps}",
        f"--mesh={mesh}",
        '--set=model.arch="DLRM"',
        f"--set=train.batch_size={batch}",
        "--set=train.eval_every=0",
        f"--set=train.eval_batch_size={4 * batch}",
        f"--set=data.paths={json.dumps(data['paths'])}",
        "--set=data.max_rows=0",
        f"--set=checkpoint.dir='{run_dir / 'ckpt'}'",
        f"--set=checkpoint.every={max(1, steps // 2)}",
        f"--set=log.metrics_path='{run_dir / 'metrics.jsonl'}'",
        f"--set=log.every={log_every}",
    ]


def _records(path: pathlib.Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _ours(
    data: dict,
    run_dir: pathlib.Path,
    steps: int,
    batch: int,
    log_every: int,
    timeout: float,
    resume: bool,
    mesh: str,
) -> dict:
    args = _train_args(data, run_dir, steps, batch, log_every, mesh)
    port = free_master_port()
    cmd = [sys.executable, "-m", "hybrid.train", *args]
    t0 = time.perf_counter()
    procs = _launch([cmd, cmd], [_env(r, 2, port) for r in (0, 1)], timeout)
    wall = time.perf_counter() - t0
    records = _records(run_dir / "metrics.jsonl")
    saves = [r["save_s"] for r in records if r["kind"] == "checkpoint"]
    first_save = min(r["step"] for r in records if r["kind"] == "checkpoint")
    windows = [(r["step"], r["samples_per_s"]) for r in records if r["kind"] == "train"][1:]
    rates = [x for step, x in windows if step <= first_save]  # no save running yet
    during = [x for step, x in windows if step > first_save]  # the save commits meanwhile
    from hybrid.checkpoint import latest_checkpoint

    newest = latest_checkpoint(run_dir / "ckpt")
    size = sum(f.stat().st_size for f in newest.rglob("*") if f.is_file())
    result = {
        "samples_per_s": statistics.median(rates) if rates else None,
        "samples_per_s_after_first_save": statistics.median(during) if during else None,
        "samples_per_s_windows": windows,
        "wall_s": wall,
        "peak_rss_mib": [p["peak_rss_mib"] for p in procs],
        "checkpoint_save_s": saves,
        "checkpoint_bytes": size,
        "plan": next((line for line in procs[0]["log"].splitlines() if "plan" in line.lower()), ""),
    }
    if not resume:
        return result
    # resume on 2 processes: a few more steps from the last checkpoint
    port = free_master_port()
    more = [a if not a.startswith("--steps=") else f"--steps={steps + 2 * log_every}" for a in args]
    resumed = _launch(
        [[*cmd[:3], *more, "--resume"]] * 2, [_env(r, 2, port) for r in (0, 1)], timeout
    )
    restores = [
        r["restore_s"] for r in _records(run_dir / "metrics.jsonl") if r["kind"] == "restore"
    ]
    one = _launch(
        [[sys.executable, "-m", "benchmarks.criteo_scale", "--restore-one", json.dumps(args)]],
        [_env(0, 1, 0)],
        timeout,
    )[0]
    return {
        **result,
        "restore_2_processes_s": restores[-1] if restores else None,
        "resume_2_processes_peak_rss_mib": [p["peak_rss_mib"] for p in resumed],
        "restore_1_process": json.loads(one["log"].strip().splitlines()[-1]),
        "restore_1_process_peak_rss_mib": one["peak_rss_mib"],
    }


def _restore_one(args_json: str) -> None:
    """Child: build the run's model on 1 process (2 devices), load its newest checkpoint."""
    from hybrid import train
    from hybrid.checkpoint import latest_checkpoint, load_checkpoint
    from hybrid.training import load_config

    args = json.loads(args_json)
    overrides = [a.removeprefix("--set=") for a in args if a.startswith("--set=")]
    overrides += ['train.mesh="data=1,model=2"', "data.stream=true", "train.steps=1"]
    train._ensure_cpu_devices("data=1,model=2", 1)
    config = load_config("configs/criteo.toml", overrides)
    model, dense_opt, stream, _, _ = train.build(config, stream=True)
    latest = latest_checkpoint(config.checkpoint.dir)
    t0 = time.perf_counter()
    meta = load_checkpoint(latest, model=model, dense_optimizer=dense_opt)
    seconds = time.perf_counter() - t0
    stream.close()
    print(json.dumps({"checkpoint": latest.name, "step": int(meta["step"]), "restore_s": seconds}))


# -- TorchRec DMP on 2 gloo ranks ------------------------------------------------------------
def _torchrec_rank(rank: int, port: int, spec_json: str) -> None:
    import torch
    import torch.distributed as dist
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
    from torchrec.distributed import DistributedModelParallel
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology
    from torchrec.models.dlrm import DLRM

    from hybrid.data import ShardReader

    spec = json.loads(spec_json)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.set_num_threads(1)
    sizes = spec["sizes"]
    tables = [
        EmbeddingBagConfig(
            name=f"t_cat_{i}", embedding_dim=16, num_embeddings=n, feature_names=[f"cat_{i}"]
        )
        for i, n in enumerate(sizes)
    ]
    torch.manual_seed(0)
    dlrm = DLRM(
        embedding_bag_collection=EmbeddingBagCollection(tables=tables, device=torch.device("meta")),
        dense_in_features=13,
        dense_arch_layer_sizes=[64, 16],
        over_arch_layer_sizes=[64, 1],
    )
    sharder = EmbeddingBagCollectionSharder(
        fused_params={
            "optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD,
            "learning_rate": 0.05,
            "eps": 1e-8,
        }
    )
    plan = EmbeddingShardingPlanner(topology=Topology(world_size=2, compute_device="cpu")).plan(
        dlrm, [sharder]
    )
    dmp = DistributedModelParallel(dlrm, device=torch.device("cpu"), plan=plan, sharders=[sharder])
    dense = [p for n, p in dmp.named_parameters() if "embedding_bags" not in n]
    opt = torch.optim.Adam(dense, lr=0.001)
    half = spec["batch"] // 2
    reader = ShardReader(spec["paths"][rank])
    keys = [f"cat_{i}" for i in range(26)]
    times = []
    for step in range(spec["steps"]):
        t0 = time.perf_counter()  # the batch's read counts, as in ours (the stream)
        start = (step * half) % max(1, reader.rows - half)
        labels, x, ids = reader.read(start, start + half)
        ids = np.minimum(ids, np.asarray(sizes) - 1)  # tables scaled down: ids folded in
        kjt = KeyedJaggedTensor.from_lengths_sync(
            keys=keys,
            values=torch.from_numpy(np.ascontiguousarray(ids.T).reshape(-1)),
            lengths=torch.ones(26 * half, dtype=torch.int64),
        )
        logits = dmp(torch.from_numpy(x), kjt).squeeze(-1)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(
            logits, torch.from_numpy(labels)
        )
        opt.zero_grad()
        loss.backward()
        for p in dense:  # DMP on CPU leaves dense gradients per rank: average them
            if p.grad is not None:
                dist.all_reduce(p.grad)
                p.grad /= 2
        opt.step()
        times.append(time.perf_counter() - t0)
    reader.close()
    dist.destroy_process_group()
    print(json.dumps({"step_s": times}))


def _torchrec(data: dict, sizes, steps: int, batch: int, timeout: float) -> dict:
    spec = json.dumps(
        {"sizes": list(sizes), "paths": data["paths"], "steps": steps, "batch": batch}
    )
    port = free_master_port()
    cmd = [sys.executable, "-m", "benchmarks.criteo_scale", "--torchrec-rank"]
    procs = _launch(
        [[*cmd, str(r), str(port), spec] for r in (0, 1)], [_env(0, 1, 0), _env(0, 1, 0)], timeout
    )
    step_s = json.loads(procs[0]["log"].strip().splitlines()[-1])["step_s"][max(1, steps // 5) :]
    return {
        "table_rows": int(sum(sizes)),
        "samples_per_s": batch / statistics.median(step_s),
        "peak_rss_mib": [p["peak_rss_mib"] for p in procs],
    }


def run(args: argparse.Namespace, out: pathlib.Path) -> dict:
    from benchmarks.e2e_step import quietness_line, quietness_probe

    sizes = table_sizes(args.tiny)
    rows = 4000 if args.tiny else args.rows
    steps = 8 if args.tiny else args.steps
    batch = 64 if args.tiny else args.batch
    log_every = 1 if args.tiny else max(1, steps // 10)
    probe = quietness_probe
    if args.tiny:  # smoke sizes: their figures mean nothing, so no probe either
        probe = lambda: {"quiet": False, "ratio_2_over_1": float("nan")}  # noqa: E731
    before = probe()
    data = generate(args.data_dir, rows, sizes)
    run_dir = out / "run"
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    ours = _ours(
        data, run_dir, steps, batch, log_every, args.timeout, not args.no_resume, args.mesh
    )
    tr_sizes = table_sizes(args.tiny, args.torchrec_scale)
    theirs = None if args.no_torchrec else _torchrec(data, tr_sizes, steps, batch, args.timeout)
    after = probe()
    quiet = before["quiet"] and after["quiet"]
    result = {
        "tiny": args.tiny,
        "rows": rows,
        "table_rows": int(sum(sizes)),
        "batch": batch,
        "steps": steps,
        "mesh": args.mesh,
        "data": data,
        "ours": ours,
        "torchrec": theirs,
        "torchrec_scale": args.torchrec_scale,
        "quiet": quiet,
        "quietness": quietness_line(before, after),
        "loadavg": list(os.getloadavg()),
    }
    if not args.keep_checkpoints:
        shutil.rmtree(run_dir / "ckpt", ignore_errors=True)
    return result


def markdown(r: dict) -> str:
    o, t = r["ours"], r["torchrec"]
    mib = lambda xs: " / ".join(f"{x:.0f}" for x in xs)  # noqa: E731
    lines = [
        f"# Criteo-scale run{' (tiny)' if r['tiny'] else ''}",
        "",
        f"{r['rows']:,} synthetic rows, 26 tables ({r['table_rows']:,} rows, dim 16), batch {r['batch']}, "
        f"{r['steps']} steps; 2 processes x 2 CPU devices (mesh {r['mesh']}) vs TorchRec DMP on 2 gloo ranks.",
        "",
        r["quietness"] + ("" if r["quiet"] else " -- CONTENDED: every figure below is void"),
        "",
        "| | hybridrec | TorchRec DMP |",
        "|---|---|---|",
        f"| table rows | {r['table_rows']:,} | {t['table_rows']:,} |"
        if t
        else f"| table rows | {r['table_rows']:,} | - |",
        f"| samples/s | {o['samples_per_s']:.0f} | {t['samples_per_s']:.0f} |"
        if t
        else f"| samples/s | {o['samples_per_s']:.0f} | not run |",
        f"| peak RSS per process (MiB) | {mib(o['peak_rss_mib'])} | {mib(t['peak_rss_mib']) if t else '-'} |",
        "",
        f"- samples/s while the first asynchronous save commits (the steps after it): "
        f"{o['samples_per_s_after_first_save']:.0f}",
        f"- checkpoint (Orbax, every process writes its shards): {o['checkpoint_bytes'] / 2**20:.1f} MiB "
        f"(the newest); the step waits {', '.join(f'{s:.2f}' for s in o['checkpoint_save_s'])} s",
        f"- restore on 2 processes (`--resume`): {o['restore_2_processes_s']:.2f} s; onto 1 process: "
        f"{o['restore_1_process']['restore_s']:.2f} s (peak RSS {o['restore_1_process_peak_rss_mib']:.0f} MiB)"
        if "restore_1_process" in o
        else "- resume and restore: not run (--no-resume)",
        f"- data: {r['data']['bytes'] / 2**20:.0f} MiB of binary shards"
        + (" (cached)" if r["data"]["cached"] else f", generated in {r['data']['seconds']:.0f} s"),
    ]
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["--torchrec-rank"]:
        return _torchrec_rank(int(argv[1]), int(argv[2]), argv[3])
    if argv[:1] == ["--restore-one"]:
        return _restore_one(argv[1])
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--tiny", action="store_true", help="a few thousand rows, tiny tables (smoke test)"
    )
    parser.add_argument("--rows", type=int, default=10_000_000)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--batch", type=int, default=2048)
    parser.add_argument(
        "--torchrec-scale",
        type=float,
        default=1.0,
        help="TorchRec's tables at this fraction of Kaggle's",
    )
    parser.add_argument(
        "--mesh", default="data=1,model=4", help="ours: the mesh over the 2 processes' 4 devices"
    )
    parser.add_argument("--no-torchrec", action="store_true", help="skip the TorchRec side")
    parser.add_argument(
        "--no-resume",
        action="store_true",
        help="skip the resume (2 processes) and 1-process restore",
    )
    parser.add_argument("--data-dir", default=str(ROOT / "data_cache" / "criteo_scale"))
    parser.add_argument("--timeout", type=float, default=3600.0, help="per launched process group")
    parser.add_argument("--keep-checkpoints", action="store_true")
    report.add_output_args(parser, "criteo_scale")
    args = parser.parse_args(argv)
    out = pathlib.Path(report.output_dir(parser, args, "criteo_scale"))
    out.mkdir(parents=True, exist_ok=True)
    result = run(args, out)
    name = "criteo_scale_tiny" if args.tiny else "criteo_scale"
    (out / f"{name}.json").write_text(json.dumps(result, indent=2))
    (out / f"{name}.md").write_text(markdown(result))
    print(markdown(result))
    print(f"results: {out}")


if __name__ == "__main__":
    main()
