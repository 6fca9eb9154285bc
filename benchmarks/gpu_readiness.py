"""`python -m benchmarks.gpu_readiness`: what each GPU program would do, read on a CPU host.

Every program a GPU runs is traced here and lowered for `cuda`
(`jax.jit(f).trace(...).lower(lowering_platforms=("cuda",))`, no GPU needed; the reading
helpers are `tests/test_gpu_lowering.py`'s). Programs: the W1 forward (T8 E1e5 D64 B2048
L20, uniform ids) and the W1 guarded training update for sgd, rowwise_adagrad and adam, each
with the default kernel (Pallas on CUDA) and with kernel="xla" (the pure-XLA fallback,
host-sorted runs); the quantized forward (int8 rows, FBGEMM's IntN layout), default (Pallas
on CUDA) and kernel="xla"; a sharded step (T4 E4096 B256 L8, row_wise and table_wise on a 2 x 4
mesh; needs 8 XLA devices); the managed-collision training remap. Per program:

- launches: the custom calls (Triton kernels counted apart) and the heavy ops in the CUDA
  StableHLO (gather, scatter, sort, reduce, dot_general, while): each roots at least one
  kernel on XLA:GPU, elementwise work fuses into them. Counted before XLA's GPU passes
  (fusion needs the CUDA compiler): an estimate, not the compiled count.
  A `while` body is read once: its trip count is not multiplied in.
- syncs: `case` / `if` and `while` loops whose trip count is data-dependent (a GPU copies
  their predicate to the host and waits).
- float scatter-adds over non-unique indices (atomics on a GPU), and how many of them have
  sorted indices.
- bytes (est.): what the heavy ops touch, elementwise work taken as fused into them
  (`heavy_op_bytes`: a gather reads and writes its rows, a scatter reads its updates and
  reads and writes their rows, a sort one pass); and, unfused, XLA's HloCostAnalysis of the
  CUDA program before fusion (every op's touched operands and results: an upper bound). XLA
  cannot see inside a custom call, so a Pallas kernel's row traffic is added to both by its
  design: the jagged forward reads every id's row, the sorted-run update reads and writes
  each unique row and its state once.
  Against FBGEMM's minimum for the same batch: the forward reads ids and offsets and each
  touched row once and writes `[B, sum D]`; the update reads ids, offsets and the pooled
  gradient, and reads and writes each unique row and its state once.

    python -m benchmarks.gpu_readiness           # W1 (seconds: nothing is compiled)
    python -m benchmarks.gpu_readiness --tiny    # tiny shapes (the suite runs it)
Writes `gpu_readiness.json` and `.md` into `--out` (default `runs/bench/gpu_readiness-<time>/`).
"""

from __future__ import annotations

import os
import sys

if "jax" not in sys.modules:  # the sharded step needs 8 devices (tests set this in conftest)
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()

import argparse  # noqa: E402
import json  # noqa: E402
import pathlib  # noqa: E402
import re  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks import report  # noqa: E402
from sparse_jax import (  # noqa: E402
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    KeyedJaggedTensor,
    make_update,
    optim,
)
from tests.test_gpu_lowering import TRITON, audit  # noqa: E402

__all__ = ["fbgemm_bytes", "main", "read_program", "run"]

W1 = dict(T=8, E=100_000, D=64, B=2048, L=20)
TINY = dict(T=2, E=1000, D=16, B=64, L=4)
SHARDED = dict(T=4, E=4096, D=64, B=256, L=8)
SHARDED_TINY = dict(T=2, E=256, D=16, B=32, L=2)
RULES = ("sgd", "rowwise_adagrad", "adam")
STATE_BYTES_PER_ROW = {"sgd": lambda d: 0, "rowwise_adagrad": lambda d: 4, "adam": lambda d: 8 * d}
# an op, not its attribute (`#stablehlo.gather<...>` names the dimension numbers)
HEAVY = r'(?<![#\w])"?stablehlo\.(gather|scatter|sort|reduce|dot_general|while)\b(?!<)'
NOT_KERNELS = {"Sharding", "SPMDFullToShardShape", "SPMDShardToFullShape"}


_ITEMSIZE = {"f32": 4, "i32": 4, "ui32": 4, "f16": 2, "bf16": 2, "i1": 1, "i8": 1, "i64": 8}


def _tensor_bytes(t: str) -> int:
    """Bytes of a `tensor<AxBxf32>` type string (0 for what it cannot read)."""
    m = re.fullmatch(r"tensor<((?:\d+x)*)(\w+)>", t.strip())
    if not m or m.group(2) not in _ITEMSIZE:
        return 0
    return (
        int(np.prod([int(d) for d in m.group(1).split("x") if d], dtype=np.int64))
        * _ITEMSIZE[m.group(2)]
    )


def _signature(text: str, start: int) -> tuple[list[int], list[int]]:
    """Operand and result bytes of the op at `start` (its `: (...) -> ...` signature; an op
    with a region carries it after the region's `})`)."""
    line_end = text.find("\n", start)
    line = text[start:line_end]
    if line.rstrip().endswith("({") or "({" in line and ": (" not in line:
        close = re.compile(r"\n\s*}\) : \(([^\n]*)\) -> ([^\n]*)").search(text, start)
        operands, results = (close.group(1), close.group(2)) if close else ("", "")
    else:
        sig = re.search(r": \(([^\n]*)\) -> ([^\n]*)$", line)
        operands, results = (sig.group(1), sig.group(2)) if sig else ("", "")
    split = lambda x: [_tensor_bytes(t) for t in re.findall(r"tensor<[^>]*>", x)]  # noqa: E731
    return split(operands), split(results)


def heavy_op_bytes(text: str) -> int:
    """Bytes the heavy ops touch, elementwise work taken as fused into them: a gather reads
    its rows and writes them (2x its result), a scatter reads its updates and reads and
    writes the rows they land on (3x the updates; 2x for a `set` of unique rows), a sort
    reads and writes its operands once (one pass: a lower bound), a reduce reads its input,
    a dot reads its operands and writes its result."""
    total = 0
    for m in re.finditer(HEAVY, text):
        kind = m.group(1)
        if kind == "while":
            continue  # its body's ops are counted (once: trip counts are not read)
        operands, results = _signature(text, m.start())
        if kind == "gather":
            total += 2 * sum(results[:1])
        elif kind == "scatter":
            head = text[m.start() : text.find("}>", m.start())]
            updates = operands[2] if len(operands) > 2 else 0
            unique_set = "unique_indices = true" in head
            total += (2 if unique_set else 3) * updates + (operands[1] if len(operands) > 1 else 0)
        elif kind == "sort":
            total += 2 * sum(operands)
        elif kind == "reduce":
            total += sum(operands[: max(1, len(operands) // 2)])
        else:
            total += sum(operands) + sum(results)
    return total


def read_program(lowered) -> dict:
    """The counts of one program lowered for CUDA (see the module docstring)."""
    text = lowered.as_text()
    got = audit(text)
    calls = [t for t in re.findall(r"custom_call @([\w.$]+)", text) if t not in NOT_KERNELS]
    heavy = re.findall(HEAVY, text)
    sorted_adds = sum(
        1
        for m in re.finditer(r'"stablehlo\.scatter"\(', text)
        if "indices_are_sorted = true" in text[m.start() : text.find("}>", m.start())]
        and "unique_indices = true" not in text[m.start() : text.find("}>", m.start())]
    )
    try:
        cost = lowered.cost_analysis() or {}
    except Exception:  # a backend without cost analysis: leave it out
        cost = {}
    return {
        "custom_calls": sum(TRITON not in c for c in calls),
        "custom_call_targets": sorted(set(calls)),
        "triton_kernels": got["triton_kernels"],
        "heavy_ops": len(heavy),
        "heavy_by_kind": {k: heavy.count(k) for k in sorted(set(heavy))},
        "launch_estimate": len(calls) + len(heavy),
        "syncs": got["case_or_if"] + got["dynamic_loops"],
        "float_scatter_add_non_unique": got["float_scatter_add_non_unique"],
        "of_which_sorted": min(sorted_adds, got["float_scatter_add_non_unique"]),
        "cpu_custom_calls": got["cpu_custom_calls"],
        "sorts": text.count("stablehlo.sort"),
        "bytes_hlo_cost": int(cost.get("bytes accessed", 0)) or None,
        "bytes_heavy_ops": heavy_op_bytes(text),
    }


def fbgemm_bytes(kind: str, *, n_ids, unique, T, D, B, rule=None, itemsize=4, row=None) -> int:
    """FBGEMM's minimum bytes for the batch: `kind` "forward" or "update" (see the module
    docstring); int32 ids and offsets; `row`: bytes per table row (default `itemsize * D`)."""
    ids = 4 * n_ids + 4 * (T * B + 1)
    pooled = 4 * B * T * D
    row = itemsize * D if row is None else row
    if kind == "forward":
        return ids + unique * row + pooled
    return ids + pooled + 2 * unique * (row + STATE_BYTES_PER_ROW[rule](D))


def _collection(shape, kernel):
    tables = [
        EmbeddingBagConfig(
            name=f"t{t}",
            num_embeddings=shape["E"],
            embedding_dim=shape["D"],
            feature_names=[f"f{t}"],
        )
        for t in range(shape["T"])
    ]
    # sorted on the host, as `prepare` does by default on a GPU host (on this CPU host the
    # default would leave the sort to the update program)
    return EmbeddingBagCollection(tables, kernel=kernel, sort_ids=True)


def _kjt(shape, seed=0):
    T, E, B, L = shape["T"], shape["E"], shape["B"], shape["L"]
    ids = np.random.default_rng(seed).integers(0, E, T * B * L)
    table = np.repeat(np.arange(T), B * L)
    kjt = KeyedJaggedTensor([f"f{t}" for t in range(T)], ids, lengths=np.full(T * B, L))
    return kjt, T * B * L, int(np.unique(table * E + ids).size)


def _update_lowered(module, batch, params, state, rule, B, sum_d):
    update = make_update(module, rule, skip_nonfinite=True)  # as hybrid.Model builds it
    operands = module.update_operands(batch, jnp.zeros((B, sum_d), jnp.float32))
    return update.jitted.trace(
        params, state, operands, jnp.ones((1,), bool), (jnp.int32(0), jnp.int32(-1)), jnp.int32(0)
    ).lower(lowering_platforms=("cuda",))


def _dense_programs(shape) -> list[dict]:
    """Forward and training update of the one-device collection, default and "xla"."""
    kjt, n_ids, unique = _kjt(shape)
    T, D, B = shape["T"], shape["D"], shape["B"]
    facts = dict(n_ids=n_ids, unique=unique, T=T, D=D, B=B)
    out = []
    for kernel in ("auto", "xla"):
        module = _collection(shape, kernel)
        batch = module.prepare(kjt)
        params = jax.eval_shape(module.init, jax.random.key(0))  # a table is never allocated
        forward = (
            jax.jit(lambda p, b, m=module: m.apply(p, b).values())
            .trace(params, batch)
            .lower(lowering_platforms=("cuda",))
        )
        row = 4 * D
        fwd = {"program": f"forward ({kernel})", **read_program(forward)}
        fwd |= {"fbgemm_bytes": fbgemm_bytes("forward", **facts)}
        fwd["kernel_row_bytes"] = fwd["triton_kernels"] and n_ids * row
        out.append(fwd)
        for name in RULES:
            rule = getattr(optim, name)(lr=0.05)
            state = jax.eval_shape(rule.init, params)
            lowered = _update_lowered(module, batch, params, state, rule, B, T * D)
            step = {"program": f"train {name} ({kernel})", **read_program(lowered)}
            step |= {"fbgemm_bytes": fbgemm_bytes("update", rule=name, **facts)}
            per_row = row + STATE_BYTES_PER_ROW[name](D)
            step["kernel_row_bytes"] = step["triton_kernels"] and 2 * unique * per_row
            out.append(step)
    return out


def _quant_programs(shape) -> list[dict]:
    """The quantized collection's forward (`QuantEmbeddingBagCollection`, int8 rows in
    FBGEMM's IntN layout, one table per feature) on a prepared batch, the default kernel (one
    Pallas call on CUDA) and kernel="xla" (per feature, a static bag loop from the batch's
    length caps)."""
    from sparse_jax import QuantEmbeddingBagCollection, row_bytes

    kjt, n_ids, unique = _kjt(shape)
    T, E, D, B = (shape[k] for k in ("T", "E", "D", "B"))
    width = row_bytes("int8", D)
    configs = _collection(shape, "auto").tables
    packed = {c.name: np.zeros((E, width), np.uint8) for c in configs}
    tables = {c.name: jax.ShapeDtypeStruct((E, width), jnp.uint8) for c in configs}
    out = []
    for kernel in ("auto", "xla"):
        qebc = QuantEmbeddingBagCollection(
            configs, packed, {c.name: "int8" for c in configs}, kernel=kernel
        )
        batch = qebc.prepare(kjt)
        lowered = qebc._apply_jit.trace(tables, batch.kjt).lower(lowering_platforms=("cuda",))
        row = {"program": f"quantized forward int8 ({kernel})", **read_program(lowered)}
        row["fbgemm_bytes"] = fbgemm_bytes(
            "forward", n_ids=n_ids, unique=unique, T=T, D=D, B=B, row=width
        )
        row["kernel_row_bytes"] = row["triton_kernels"] and n_ids * width
        out.append(row)
    return out


def _sharded_program(shape) -> dict:
    from sparse_jax.sharding import shard

    mesh = jax.make_mesh((2, 4), ("data", "model"))
    T, D, B = shape["T"], shape["D"], shape["B"]
    module = shard(
        _collection(shape, "auto"),
        mesh,
        {f"t{t}": "row_wise" if t % 2 else "table_wise" for t in range(T)},
    )
    kjt, n_ids, unique = _kjt(shape)
    batch = module.prepare(kjt)
    params = module.init(jax.random.key(0))
    rule = optim.rowwise_adagrad(lr=0.05)
    lowered = _update_lowered(module, batch, params, rule.init(params), rule, B, T * D)
    facts = dict(n_ids=n_ids, unique=unique, T=T, D=D, B=B)
    step = {"program": "sharded train rowwise_adagrad (auto, 2x4 mesh)", **read_program(lowered)}
    step |= {"fbgemm_bytes": fbgemm_bytes("update", rule="rowwise_adagrad", **facts)}
    step["kernel_row_bytes"] = step["triton_kernels"] and 2 * unique * (4 * D + 4)
    return step


def managed_remap_case(history_capacity: int = 256):
    """A tiny managed-collision training remap's operands (32 slots, 40 raw ids in 8 bags):
    `(module, batch, arrays, args)`, `args` being what `module._program.train` takes. The
    lowering audits (`tests/test_gpu_lowering.py`, `tests/test_managed_kernel.py`) read
    the same program."""
    from sparse_jax import MCHManagedCollisionModule, RawIds
    from sparse_jax.managed import (
        ManagedCollisionEmbeddingBagCollection,
        ManagedCollisionSparseModule,
    )

    tables = [EmbeddingBagConfig(name="u", num_embeddings=32, embedding_dim=8, feature_names=["u"])]
    module = ManagedCollisionSparseModule(
        ManagedCollisionEmbeddingBagCollection(
            EmbeddingBagCollection(tables),
            {"u": MCHManagedCollisionModule(32, history_capacity=history_capacity)},
        )
    )
    ids = np.random.default_rng(0).integers(-(2**62), 2**62, 40)
    batch = module.prepare(
        KeyedJaggedTensor(["u"], RawIds.from_int64(ids).words(), lengths=np.full(8, 5))
    )
    params = module.init(jax.random.key(0))
    arrays = module._targets(batch.inner)
    args = (
        params,
        optim.rowwise_adagrad(lr=0.1).init(params),
        module.mc_state,
        module.mc_counters,
        module._key,
        batch.words,
        batch.positions,
        {"u": np.int32(arrays[""].shape[0])},
    )
    return module, batch, arrays, args


def _managed_programs() -> list[dict]:
    """The managed-collision training remap (profile + eviction) and its scatter into the
    batch (`managed_remap_case`)."""
    module, batch, arrays, args = managed_remap_case()
    program = module._program
    slots = jax.eval_shape(program.train, *args)[-1]
    train = program.train.trace(*args).lower(lowering_platforms=("cuda",))
    scatter = program.scatter.trace(arrays, batch.positions, slots).lower(
        lowering_platforms=("cuda",)
    )
    return [
        {"program": "managed remap: train (profile + evict)", **read_program(train)},
        {"program": "managed remap: scatter into the batch", **read_program(scatter)},
    ]


def run(*, tiny: bool) -> dict:
    shape = TINY if tiny else W1
    rows = _dense_programs(shape) + _quant_programs(shape)
    if jax.device_count() >= 8:
        rows.append(_sharded_program(SHARDED_TINY if tiny else SHARDED))
    rows += _managed_programs()
    for r in rows:
        fb, kernel = r.get("fbgemm_bytes"), r.get("kernel_row_bytes", 0)
        r["bytes_estimate"] = r["bytes_heavy_ops"] + kernel
        r["bytes_unfused"] = r["bytes_hlo_cost"] and r["bytes_hlo_cost"] + kernel
        r["bytes_vs_fbgemm"] = None if not fb else r["bytes_estimate"] / fb
    return {
        "workload": shape,
        "sharded": SHARDED_TINY if tiny else SHARDED,
        "devices": jax.device_count(),
        "programs": rows,
    }


def _mb(x) -> str:
    return "-" if not x else f"{x / 1e6:.1f}"


def markdown(results: dict) -> str:
    w = results["workload"]
    lines = [
        f"# GPU readiness: programs lowered for CUDA on a CPU host (T{w['T']} E{w['E']} "
        f"D{w['D']} B{w['B']} L{w['L']}, uniform ids)",
        "",
        "launches = custom calls + heavy ops (gather/scatter/sort/reduce/dot/while) in the "
        "CUDA StableHLO, before XLA's GPU fusion: an estimate. MB (est.) = bytes the heavy ops "
        "touch, elementwise work taken as fused into them, plus the Pallas kernels' row traffic "
        "by design; MB unfused = XLA's HloCostAnalysis before fusion (an upper bound) plus the "
        "same kernel traffic; x FBGEMM = MB (est.) / FBGEMM's minimum for the same batch. A "
        "`while` body is counted once (the XLA forward loops over bag positions: its launches "
        "and bytes are undercounts).",
        "",
        "| program | custom calls (Triton) | heavy ops | launches (est.) | syncs | float "
        "scatter-adds, non-unique (sorted) | sorts | MB (est.) | MB unfused | MB FBGEMM | x FBGEMM |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results["programs"]:
        ratio = "-" if r["bytes_vs_fbgemm"] is None else f"{r['bytes_vs_fbgemm']:.2f}x"
        lines.append(
            f"| {r['program']} | {r['custom_calls'] + r['triton_kernels']} ({r['triton_kernels']}) "
            f"| {r['heavy_ops']} | {r['launch_estimate']} | {r['syncs']} "
            f"| {r['float_scatter_add_non_unique']} ({r['of_which_sorted']}) | {r['sorts']} "
            f"| {_mb(r['bytes_estimate'])} | {_mb(r['bytes_unfused'])} "
            f"| {_mb(r.get('fbgemm_bytes'))} | {ratio} |"
        )
    if results["devices"] < 8:
        lines += ["", f"(sharded step left out: {results['devices']} XLA devices, it needs 8)"]
    return "\n".join(lines) + "\n"


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tiny", action="store_true", help="tiny shapes (seconds)")
    report.add_output_args(p, "gpu_readiness")
    args = p.parse_args(argv)
    out = pathlib.Path(report.output_dir(p, args, "gpu_readiness"))
    results = run(tiny=args.tiny)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_readiness.json").write_text(json.dumps(results, indent=1))
    md = markdown(results)
    (out / "gpu_readiness.md").write_text(md)
    print(md)
    print(f"results: {out} (gpu_readiness.json, gpu_readiness.md)")
    return results


if __name__ == "__main__":
    main()
