"""Managed-collision quality: MovieLens-100K raw-id eval AUC, hybridrec's eviction policies
against TorchRec's `MCHManagedCollisionModule` (issue 34 item 5).

    python -m benchmarks.mc_quality [--tiny] [--seeds 0 1 2] [--out DIR | --update-results]

The model is `configs/movielens_raw_ids.toml`'s (DLRM, dim 8, user / item / zip as raw
64-bit ids into managed-collision tables, rowwise Adagrad 0.05 for the tables, Adam 0.001
for the dense tower, batch 512, 2 epochs, eviction every batch). Each raw-id table gets
`fraction` of its distinct ids as rows (943 users, 1682 items, 795 zip codes; the zip table
scaled like the other two, not the config's 512), rounded, one row being the shared row of
ids not admitted.

- hybridrec: `hybrid.train.run` on that config with the size, policy and seed set.
- TorchRec: `torchrec.models.dlrm.DLRM` over TorchRec's `EmbeddingBagCollection`, its raw
  features remapped first by a TorchRec `ManagedCollisionCollection` of
  `MCHManagedCollisionModule`s (LRU, LFU, DistanceLFU), trained eagerly on one CPU process:
  the same starting weights (hybridrec's model of that seed, its state dict loaded into
  TorchRec's), the same batches in the same order (`hybrid.data.BatchLoader`, the seed's
  shuffle), TorchRec's `RowWiseAdagrad` (same lr and eps) for the tables and Adam for the
  dense tower, the same exact AUC over the same eval set. Unsharded TorchRec does not touch
  the rows its module evicts (`mc_embedding_modules.evict` is a no-op); its sharded module
  (`ShardedManagedCollisionEmbeddingBagCollection._evict`) resets their weights with the
  table's `init_fn` and their optimizer state to zero, which this side does by hand after
  every eviction (uniform +-sqrt(1/rows), TorchRec's default init, from a torch generator
  of the seed), as hybridrec's `reset_evicted` does (with its own draws).

First a gate (`gate`, `--gate-steps`, 20 by default, none with `--tiny`): with no fresh
rows on either side, both loops must give the same eval AUC (within 1e-5) on small tables
for every TorchRec policy; and per run the ids each table admitted are recorded, which are
the same on both sides (the remap is slot for slot TorchRec's). So the libraries' runs of a
policy differ only in the fresh rows' random draws and float summation order.

The table: per policy and size, the median eval AUC of the seeds and their min-max; the
verdict per size compares our best policy's median with TorchRec's best.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time

import numpy as np

from benchmarks import report

__all__ = ["POLICIES", "TORCHREC_POLICIES", "main", "run"]

CONFIG = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
    "configs",
    "movielens_raw_ids.toml",
)
RAW = ("user", "item", "zip")
SINGLE_TTL = 16  # training steps (about 8k samples, a tenth of an epoch)
# name -> (eviction_policy, extra [managed_collision] settings)
POLICIES = {
    "lru": ("lru", {}),
    "lfu": ("lfu", {}),
    "distance_lfu_1": ("distance_lfu", {"decay_exponent": 1.0}),
    "distance_lfu_2": ("distance_lfu", {"decay_exponent": 2.0}),
    "ttl": ("ttl", {"single_ttl": SINGLE_TTL}),
}
TORCHREC_POLICIES = ("lru", "lfu", "distance_lfu_1", "distance_lfu_2")  # TorchRec's MCH has no TTL
FULL = dict(
    fractions=(0.5, 0.25),
    seeds=(0, 1, 2),
    steps=0,
    raw=RAW,
    gate_steps=20,
    policies=tuple(POLICIES),
)
# the smoke run: one size, one seed, 3 steps, only the user ids raw, each eviction policy
# once (DistanceLFU with exponent 1): the XLA form of DistanceLFU's training remap takes
# seconds to compile, per table and per exponent
TINY = dict(
    fractions=(0.5,),
    seeds=(0,),
    steps=3,
    raw=("user",),
    gate_steps=0,
    policies=("lru", "lfu", "distance_lfu_1", "ttl"),
)
# the gate's tables: sizes no run of the table uses (hybridrec shares a remap program
# between modules of one static configuration, and the gate's is built without resets)
GATE_ROWS = {"user": 37, "item": 61, "zip": 29}
GATE_TOLERANCE = 1e-5


def distinct_ids(raw=RAW) -> tuple[dict[str, int], int]:
    """({raw-id feature: its distinct ids in the train and eval sets}, training samples)
    (MovieLens-100K: 943 users, 1682 items, 795 zip codes)."""
    from hybrid.data import load_movielens

    train, evaluation = load_movielens()
    out = {}
    for k in raw:
        ids = [d.values[d.keys.index(k)] for d in (train, evaluation)]
        out[k] = len(np.unique(np.concatenate(ids)))
    return out, len(train)


def table_rows(fraction: float, distinct: dict[str, int]) -> dict[str, int]:
    """Rows per managed table: `fraction` of its distinct ids, rounded half up."""
    return {f"t_{k}": max(2, int(fraction * n + 0.5)) for k, n in distinct.items()}


def config_for(policy: str, rows: dict[str, int], seed: int, steps: int):
    """`configs/movielens_raw_ids.toml` with these managed tables (`{"t_user": rows, ...}`:
    their features are the raw-id ones), policy and seed (no metrics file)."""
    from hybrid.training._train_config import load_config

    name, extra = POLICIES[policy]
    tables = "{" + ", ".join(f"{t} = {n}" for t, n in rows.items()) + "}"
    overrides = [
        f"seed={seed}",
        f"managed_collision.tables={tables}",
        "data.raw_ids=" + json.dumps([t[2:] for t in rows]),
        f'managed_collision.eviction_policy="{name}"',
        'log.metrics_path=""',
    ]
    overrides += [f"managed_collision.{k}={v}" for k, v in extra.items()]
    if steps:
        overrides.append(f"train.steps={steps}")
    return load_config(CONFIG, overrides)


def ours(config) -> tuple[float, dict[str, int]]:
    """hybridrec's eval AUC (`hybrid.train.run` on `config`) and per managed table the ids
    it admitted (the metrics file's device counters after the last step)."""
    import dataclasses
    import tempfile

    from hybrid.train import run as train_run

    with tempfile.TemporaryDirectory(prefix="mc_quality-") as tmp:
        path = os.path.join(tmp, "metrics.jsonl")
        log = dataclasses.replace(config.log, metrics_path=path, every=1 << 30)
        result = train_run(dataclasses.replace(config, log=log), echo=lambda *_: None)
        with open(path) as f:
            last = [r for r in map(json.loads, f) if r["kind"] == "train"][-1]
    stats = last.get("managed_collision", {})
    return float(result["eval"]["auc"]), {t: int(c["admissions"]) for t, c in stats.items()}


def _torchrec_policy(policy: str):
    from torchrec.modules import mc_modules

    name, extra = POLICIES[policy]
    if name == "lru":
        return mc_modules.LRU_EvictionPolicy()
    if name == "lfu":
        return mc_modules.LFU_EvictionPolicy()
    return mc_modules.DistanceLFU_EvictionPolicy(decay_exponent=extra["decay_exponent"])


def theirs(config, policy: str, resets: dict | None = None, *, reset_evicted: bool = True) -> float:
    """TorchRec's eval AUC for the same config (see the module docstring). `resets`, when
    given, gets per table the number of slots its module handed to new ids (each reset).
    `reset_evicted=False`: unsharded TorchRec's own behaviour (a new id takes the row, and
    the optimizer state, its slot's previous id left)."""
    import torch
    from torchrec.models.dlrm import DLRM
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.modules.embedding_modules import EmbeddingBagCollection
    from torchrec.modules.mc_modules import ManagedCollisionCollection, MCHManagedCollisionModule
    from torchrec.optim.rowwise_adagrad import RowWiseAdagrad
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    from hybrid.data import BatchLoader, eval_batches
    from hybrid.train import build
    from hybrid.training._metrics import eval_metrics

    threads = torch.get_num_threads()
    torch.set_num_threads(config.train.torch_threads)
    try:
        start_model, _, train, evaluation, _ = build(config)  # hybridrec's starting weights
        start = start_model.state_dict()
        del start_model
        m, t = config.model, config.train
        rows = dict(config.managed_collision.tables)
        tables = [
            EmbeddingBagConfig(
                name=f"t_{k}",
                embedding_dim=m.embedding_dim,
                num_embeddings=rows.get(f"t_{k}", n),
                feature_names=[k],
            )
            for k, n in zip(train.keys, train.num_embeddings, strict=True)
        ]
        dlrm = DLRM(
            embedding_bag_collection=EmbeddingBagCollection(tables=tables),
            dense_in_features=train.num_dense,
            dense_arch_layer_sizes=list(m.dense_arch_layer_sizes),
            over_arch_layer_sizes=list(m.over_arch_layer_sizes),
        )
        prefix = "sparse_arch.embedding_bag_collection."
        dlrm.load_state_dict(
            {
                (prefix + k if k.startswith("embedding_bags.") else k[len("dense.") :]): v
                for k, v in start.items()
                if k.startswith(("embedding_bags.", "dense."))
            }
        )
        raw_tables = [tb for tb in tables if tb.name in rows]
        mcc = ManagedCollisionCollection(
            {
                tb.name: MCHManagedCollisionModule(
                    zch_size=tb.num_embeddings,
                    device=torch.device("cpu"),
                    eviction_policy=_torchrec_policy(policy),
                    eviction_interval=config.managed_collision.eviction_interval,
                )
                for tb in raw_tables
            },
            raw_tables,
        )
        bags = dlrm.sparse_arch.embedding_bag_collection.embedding_bags
        so = config.sparse_optimizer
        sparse_opt = RowWiseAdagrad(list(bags.parameters()), lr=so.lr, eps=so.eps)
        dense_params = [p for n, p in dlrm.named_parameters() if "embedding_bags" not in n]
        dense_opt = torch.optim.Adam(dense_params, lr=config.dense_optimizer.lr)
        reset_draws = torch.Generator().manual_seed(config.seed)

        def kjt(sparse, training: bool):
            keys, values, lengths = sparse
            whole = KeyedJaggedTensor.from_lengths_sync(keys=keys, values=values, lengths=lengths)
            mcc.train(training)
            remapped = mcc(whole).to_dict()  # the raw features only, as slots
            if training:
                for table, gone in mcc.evict().items():
                    if gone is not None and gone.numel():
                        reset(table, gone.long())
            jts = whole.to_dict()
            return KeyedJaggedTensor.from_jt_dict({k: remapped.get(k, jts[k]) for k in keys})

        def reset(table: str, slots):  # the sharded module's _evict: init_fn rows, zero state
            if resets is not None:
                resets[table] = resets.get(table, 0) + len(slots)
            if not reset_evicted:
                return
            weight = bags[table].weight
            bound = (1.0 / weight.shape[0]) ** 0.5
            with torch.no_grad():
                fresh = torch.empty(len(slots), weight.shape[1])
                fresh.uniform_(-bound, bound, generator=reset_draws)
                weight[slots] = fresh
                state = sparse_opt.state.get(weight)
                if state and "sum" in state:
                    state["sum"][slots] = 0

        loader = BatchLoader(train, t.batch_size, seed=config.seed)
        total = t.steps or t.epochs * loader.steps_per_epoch
        dlrm.train()
        for step in range(total):
            dense, sparse, labels = loader.batch(step)
            logits = dlrm(dense, kjt(sparse, True)).reshape(-1)
            loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, labels)
            sparse_opt.zero_grad()
            dense_opt.zero_grad()
            loss.backward()
            sparse_opt.step()
            dense_opt.step()
        dlrm.eval()
        logits = []
        with torch.no_grad():
            for (dense, sparse, _), valid in eval_batches(evaluation, t.eval_batch_size):
                logits.append(dlrm(dense, kjt(sparse, False)).reshape(-1)[:valid])
        return float(eval_metrics(torch.cat(logits), torch.from_numpy(evaluation.labels))["auc"])
    finally:
        torch.set_num_threads(threads)


def gate(policies, raw=RAW, steps: int = 20, seed: int = 1) -> dict[str, dict]:
    """Both training loops matched: with no fresh rows on either side (hybridrec's reset of
    admitted slots switched off, TorchRec's unsharded behaviour), `steps` steps on small
    tables (evictions every step) must give the same eval AUC within GATE_TOLERANCE. What
    then differs in the table is only the fresh rows' random draws (and float order)."""
    from unittest import mock

    from sparse_jax.managed import _unsharded

    rows = {f"t_{k}": GATE_ROWS[k] for k in raw}
    out = {}
    with mock.patch.object(_unsharded, "reset_by_plan", lambda plan, p, o, e, k: (p, o)):
        for policy in policies:
            config = config_for(policy, rows, seed, steps)
            mine, _ = ours(config)
            other = theirs(config, policy, reset_evicted=False)
            out[policy] = {"hybridrec": mine, "torchrec": other, "diff": mine - other}
            if abs(mine - other) > GATE_TOLERANCE:
                raise AssertionError(
                    f"gate: {policy}, no fresh rows, {steps} steps: AUC {mine:.7f} (hybridrec) vs "
                    f"{other:.7f} (TorchRec); the two training loops are not the same"
                )
    return out


def _summary(aucs: list[float]) -> dict:
    return {
        "median": float(statistics.median(aucs)),
        "min": float(min(aucs)),
        "max": float(max(aucs)),
        "seeds": aucs,
    }


def _verdicts(results: dict) -> list[dict]:
    out = []
    for size in results["sizes"]:
        cells = results["table"][size["label"]]
        best = {}
        for lib in ("hybridrec", "torchrec"):
            name = max(cells[lib], key=lambda p: cells[lib][p]["median"])
            best[lib] = (name, cells[lib][name]["median"])
        out.append(
            {
                "size": size["label"],
                "ours_best": best["hybridrec"][0],
                "ours_median": best["hybridrec"][1],
                "torchrec_best": best["torchrec"][0],
                "torchrec_median": best["torchrec"][1],
                "ours_above": best["hybridrec"][1] > best["torchrec"][1],
            }
        )
    return out


def markdown(results: dict) -> str:
    lines = [
        "# Managed-collision quality: MovieLens-100K raw-id eval AUC, hybridrec vs TorchRec",
        "",
        f"Machine: {results['machine']['cpu']}, {results['machine']['cores']} cores; "
        f"{results['date']}; hybridrec {results['versions']['hybridrec_commit']}, torchrec "
        f"{results['versions']['torchrec']}, torch {results['versions']['torch']}, jax "
        f"{results['versions']['jax']}. Command: `{results['command']}`; "
        f"{results['elapsed_s']:.0f} s.",
        f"Seeds {results['seeds']}; {results['steps']} steps a run; median AUC [min-max] over the "
        f"seeds. TTL: single_ttl = {SINGLE_TTL} steps. distance_lfu_N: decay_exponent N. "
        "TorchRec's MCH has no TTL policy.",
        "",
        "| library policy | "
        + " | ".join(
            f"{size['label']} ("
            + ", ".join(f"{t[2:]} {n}" for t, n in size["rows"].items())
            + " rows)"
            for size in results["sizes"]
        )
        + " |",
        "|---|" + "---|" * len(results["sizes"]),
    ]
    for lib in ("hybridrec", "torchrec"):
        for policy in POLICIES:
            cells = []
            for s in results["sizes"]:
                c = results["table"][s["label"]][lib].get(policy)
                cells.append(
                    "-" if c is None else f"{c['median']:.4f} [{c['min']:.4f}-{c['max']:.4f}]"
                )
            if any(c != "-" for c in cells):
                lines.append(f"| {lib} {policy} | " + " | ".join(cells) + " |")
    differ = [
        f"{size['label']} {p}"
        for size in results["sizes"]
        for p, c in results["table"][size["label"]]["torchrec"].items()
        if c["admitted"] != results["table"][size["label"]]["hybridrec"][p]["admitted"]
    ]
    lines += [
        "",
        "Ids admitted per table (each one a fresh row): "
        + (
            "the same on both sides for every shared policy, size and seed (the remap is slot "
            "for slot TorchRec's; the libraries differ in the fresh rows' random draws and in "
            "float summation order)."
            if not differ
            else f"**differ** for {', '.join(differ)}."
        ),
    ]
    g = results.get("gate", {})
    if g.get("policies"):
        worst = max(abs(x["diff"]) for x in g["policies"].values())
        lines += [
            "",
            f"Gate: with no fresh rows on either side (hybridrec's reset of admitted slots off, "
            f"as unsharded TorchRec), {g['steps']} steps on tables of "
            + ", ".join(f"{k} {n}" for k, n in g["rows"].items())
            + f" rows give the same eval AUC for {', '.join(g['policies'])} (largest difference "
            f"{worst:.1e}).",
        ]
    lines += ["", "Verdict (best policy's median per library):", ""]
    for v in results["verdicts"]:
        word = "above" if v["ours_above"] else "NOT above"
        lines.append(
            f"- {v['size']}: hybridrec {v['ours_best']} {v['ours_median']:.4f} is {word} "
            f"TorchRec {v['torchrec_best']} {v['torchrec_median']:.4f} "
            f"({v['ours_median'] - v['torchrec_median']:+.4f})"
        )
    return "\n".join(lines) + "\n"


def _commit() -> str:
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            cwd=os.path.dirname(CONFIG),
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "?"


def run(
    fractions=FULL["fractions"],
    seeds=FULL["seeds"],
    steps: int = 0,
    policies=tuple(POLICIES),
    raw=RAW,
    gate_steps: int = 0,
    echo=print,
) -> dict:
    """Train every (library, policy, size, seed); the results dict (see `markdown`).
    `gate_steps`: run `gate` first (0: not)."""
    import torch
    import torchrec

    t0 = time.perf_counter()
    distinct, train_samples = distinct_ids(raw)
    checked = gate(TORCHREC_POLICIES, raw, gate_steps) if gate_steps else {}
    for policy, g in checked.items():
        echo(f"gate {policy}: AUC difference {g['diff']:+.2e} with no fresh rows on either side")
    sizes = []
    table: dict = {}
    for fraction in fractions:
        rows = table_rows(fraction, distinct)
        label = f"{fraction:.0%}"
        sizes.append({"label": label, "fraction": fraction, "rows": rows})
        cells = table[label] = {"hybridrec": {}, "torchrec": {}}
        for policy in policies:
            for lib in ("hybridrec", "torchrec"):
                if lib == "torchrec" and policy not in TORCHREC_POLICIES:
                    continue
                aucs, admitted = [], []
                for seed in seeds:
                    config = config_for(policy, rows, seed, steps)
                    t = time.perf_counter()
                    if lib == "hybridrec":
                        auc, counts = ours(config)
                    else:
                        counts = {}
                        auc = theirs(config, policy, counts)
                    aucs.append(auc)
                    admitted.append(dict(sorted(counts.items())))
                    echo(
                        f"{label} {lib} {policy} seed {seed}: AUC {auc:.4f}, admitted {admitted[-1]} "
                        f"({time.perf_counter() - t:.0f} s)"
                    )
                cells[lib][policy] = {**_summary(aucs), "admitted": admitted}
    config = config_for("lru", sizes[0]["rows"], seeds[0], steps)
    results = {
        "benchmark": "mc_quality",
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "command": "python -m benchmarks.mc_quality " + " ".join(sys.argv[1:]),
        "machine": {"cpu": _cpu(), "cores": os.cpu_count()},
        "versions": {
            "torch": torch.__version__,
            "torchrec": getattr(torchrec, "__version__", "?"),
            "jax": __import__("jax").__version__,
            "numpy": np.__version__,
            "python": platform.python_version(),
            "hybridrec_commit": _commit(),
        },
        "distinct_ids": distinct,
        "sizes": sizes,
        "seeds": list(seeds),
        "steps": steps or config.train.epochs * (train_samples // config.train.batch_size),
        "single_ttl": SINGLE_TTL,
        "policies": {k: {"eviction_policy": p, **e} for k, (p, e) in POLICIES.items()},
        "torchrec_policies": list(TORCHREC_POLICIES),
        "table": table,
        "gate": {
            "steps": gate_steps,
            "rows": {k: GATE_ROWS[k] for k in raw},
            "policies": checked,
        },
        "config": config.to_dict(),
    }
    results["verdicts"] = _verdicts(results)
    results["elapsed_s"] = time.perf_counter() - t0
    return results


def _cpu() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def write(results: dict, out_dir: str, stem: str = "mc_quality") -> dict[str, str]:
    os.makedirs(out_dir, exist_ok=True)
    paths = {
        "json": os.path.join(out_dir, f"{stem}.json"),
        "md": os.path.join(out_dir, f"{stem}.md"),
    }
    results["files"] = dict(paths)
    with open(paths["json"], "w") as f:
        json.dump(results, f, indent=1)
    with open(paths["md"], "w") as f:
        f.write(markdown(results))
    return paths


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--tiny",
        action="store_true",
        help="one seed, one size (50%%), 3 steps, each eviction policy once: a smoke run",
    )
    parser.add_argument("--seeds", type=int, nargs="+", default=None)
    parser.add_argument("--fractions", type=float, nargs="+", default=None)
    parser.add_argument("--steps", type=int, default=None, help="training steps (0: 2 epochs)")
    parser.add_argument(
        "--gate-steps",
        type=int,
        default=None,
        help="steps of the matched-loop gate, run first (0: none; default 20, --tiny 0)",
    )
    report.add_output_args(parser, "mc_quality")
    args = parser.parse_args(argv)
    out = report.output_dir(parser, args, "mc_quality")
    base = TINY if args.tiny else FULL
    results = run(
        fractions=tuple(args.fractions or base["fractions"]),
        seeds=tuple(args.seeds if args.seeds is not None else base["seeds"]),
        steps=base["steps"] if args.steps is None else args.steps,
        raw=base["raw"],
        policies=base["policies"],
        gate_steps=base["gate_steps"] if args.gate_steps is None else args.gate_steps,
        echo=lambda line: print(line, flush=True),
    )
    paths = write(results, out, "mc_quality_tiny" if args.tiny else "mc_quality")
    print(markdown(results))
    print(f"results: {paths['md']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
