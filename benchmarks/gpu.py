"""`python -m benchmarks.gpu`: the GPU comparison in one command.

On a GPU it times, side by side (interleaved rounds, medians), on FBGEMM's workloads (W1:
T8 E1e5 D64 B2048 L20, uniform and Zipf(1.15) ids):
- the pooled forward: the Pallas jagged kernel, the pure-XLA per-position form, the XLA
  gather + segment_sum reference, torch's `embedding_bag` on the same GPU, and FBGEMM's GPU
  TBE when `fbgemm_gpu` (the CUDA build) is installed;
- the fused update (rowwise Adagrad, SGD): the Pallas sorted-run kernel (sort included) and
  the pure-XLA update (the dedup form, no scatter-add, on a GPU); FBGEMM's TBE backward + fused optimizer when installed;
- the quantized pooled forward (int8, int4 rows in FBGEMM's IntN layout, 16-byte aligned):
  the Pallas kernel, its XLA form, and FBGEMM's IntN GPU TBE when installed (the same bytes);
- the HBM roofline: a device copy of 1 GiB (bytes read + written per second).
It checks first that the Pallas results equal the XLA ones (forward to fp32 rounding; the
update's rows and state) and that two Pallas updates from the same start are bitwise equal
(no atomics). For each program it reports the launches XLA compiled (fusions + custom
calls) and GB/s in FBGEMM's byte convention with % of the measured copy roofline.

On a machine without a GPU, `--tiny` runs the same code on tiny shapes with the Pallas
kernels in interpret mode (the suite runs it so that it cannot rot); its times mean nothing.

    python -m benchmarks.gpu                  # on the GPU: W1 uniform + Zipf, ~1-2 min
    python -m benchmarks.gpu --tiny           # anywhere: a smoke run
Writes `gpu.json` and `gpu.md` into `--out` (default `runs/bench/gpu-<time>/`;
`--update-results`: `benchmarks/results/gpu/`, the figures the README quotes).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import report
from benchmarks.workloads import Workload, make_batch, tiny_set
from sparse_jax._kernels import _pallas
from sparse_jax._lookup import _sum_positions
from sparse_jax.optim import rowwise_adagrad, sgd
from sparse_jax.optim._apply import apply_row_rule, apply_sorted_runs

__all__ = ["main", "run"]


def on_gpu() -> bool:
    return jax.default_backend() in ("gpu", "cuda", "rocm")


def _timeit(cases: dict, rounds: int, reps: int) -> dict[str, dict]:
    """Interleaved rounds: each round runs every case `reps` times; per case the median
    (and min/max) of the per-call times over rounds, in ms."""
    times: dict[str, list[float]] = {k: [] for k in cases}
    for fn in cases.values():  # warm-up / compile
        jax.block_until_ready(fn())
    for _ in range(rounds):
        for name, fn in cases.items():
            t0 = time.perf_counter()
            for _ in range(reps):
                out = fn()
            jax.block_until_ready(out)
            times[name].append((time.perf_counter() - t0) / reps * 1e3)
    return {
        k: {"median_ms": statistics.median(v), "min_ms": min(v), "max_ms": max(v)}
        for k, v in times.items()
    }


def _launches(jitted, *args) -> dict[str, int]:
    """Kernels XLA compiled for the program: fusions and custom calls of the entry
    computation (each is a launch), sorts, and whether any float scatter-add is left."""
    text = jitted.lower(*args).compile().as_text()
    entry = text[text.find("ENTRY") :]
    return {
        "fusions": entry.count(" fusion("),
        "custom_calls": entry.count("custom-call("),
        "sorts": text.count(" sort("),
        "scatters": text.count(" scatter("),
    }


def _roofline_gbs(interpret: bool) -> float:
    n = (1 << 20) if interpret else (1 << 28)  # 4 MiB or 1 GiB of fp32
    x = jnp.ones((n,), jnp.float32)
    copy = jax.jit(lambda a: a + 0.0)
    res = _timeit({"copy": lambda: copy(x)}, rounds=5, reps=3 if interpret else 20)
    return 2 * n * 4 / (res["copy"]["median_ms"] * 1e-3) / 1e9


class _Case:
    """One workload's operands on the device: a stacked table (features key-major) and its
    jagged batch, the per-position matrices of the XLA form, the id stream of the update."""

    def __init__(self, w: Workload):
        b = make_batch(w)
        self.w = w
        self.table = jnp.asarray(b.tables.reshape(w.T * w.E, w.D))
        self.values = jnp.asarray(b.ids.astype(np.int32))
        self.offsets = jnp.asarray(b.offsets.astype(np.int32))
        rows = (
            (b.ids.reshape(w.T, w.B * w.L) + (np.arange(w.T) * w.E)[:, None])
            .reshape(-1)
            .astype(np.int32)
        )
        self.pos_rows = jnp.asarray(rows.reshape(w.T * w.B, w.L))
        self.pos_w = jnp.ones((w.T * w.B, w.L), jnp.float32)
        self.rows = jnp.asarray(rows)
        bag = np.repeat(np.arange(w.T * w.B, dtype=np.int32), w.L)
        self.bag = jnp.asarray(bag)
        self.scale = jnp.ones(rows.shape, jnp.float32)
        grad = b.pooled_grad.reshape(w.B, w.T, w.D).transpose(1, 0, 2).reshape(w.T * w.B, w.D)
        self.bag_grads = jnp.asarray(grad)
        # the same stream sorted by row on the host, as `prepare` hands it to the updates
        # (`sparse_jax._sorted_ids`: one buffer, rows t * E + id, bags t * B + b)
        ebc = _collection(w, kernel="xla")
        (self.sorted,) = ebc.prepare(_kjt(w, b), sort_ids=True).sorted_ids.values()
        self.static = dict(
            stride=w.B,
            keys=list(range(w.T)),
            row_offsets=[t * w.E for t in range(w.T)],
            num_rows=[w.E] * w.T,
            mean=[False] * w.T,
            clamp=False,
        )


def _collection(w: Workload, **kwargs):
    from sparse_jax import EmbeddingBagCollection, EmbeddingBagConfig

    tables = [
        EmbeddingBagConfig(
            name=f"t{t}", num_embeddings=w.E, embedding_dim=w.D, feature_names=[f"f{t}"]
        )
        for t in range(w.T)
    ]
    return EmbeddingBagCollection(tables, **kwargs)


def _kjt(w: Workload, b):
    from sparse_jax import KeyedJaggedTensor

    return KeyedJaggedTensor([f"f{t}" for t in range(w.T)], b.ids, lengths=b.lengths)


def _forward_cases(c: _Case, interpret: bool):
    w = c.w
    pallas = jax.jit(
        lambda t, v, o: _pallas.jagged_pooled_sum(t, v, o, None, interpret=interpret, **c.static)
    )

    def per_position(t, rows, wts):
        pooled = _sum_positions(t, rows, wts)  # [T*B, D] key-major
        return pooled.reshape(w.T, w.B, w.D).transpose(1, 0, 2).reshape(w.B, w.T * w.D)

    def seg_sum(t, rows, bag):
        pooled = jax.ops.segment_sum(t[rows], bag, num_segments=w.T * w.B, indices_are_sorted=True)
        return pooled.reshape(w.T, w.B, w.D).transpose(1, 0, 2).reshape(w.B, w.T * w.D)

    xla_pp, xla_seg = jax.jit(per_position), jax.jit(seg_sum)
    pallas1 = jax.jit(
        lambda t, v, o: _pallas.jagged_pooled_sum(
            t, v, o, None, interpret=interpret, unroll=1, **c.static
        )
    )
    cases = {
        "pallas": (pallas, (c.table, c.values, c.offsets)),
        "pallas_unroll1": (pallas1, (c.table, c.values, c.offsets)),
        "xla_per_position": (xla_pp, (c.table, c.pos_rows, c.pos_w)),
        "xla_segment_sum": (xla_seg, (c.table, c.rows, c.bag)),
    }
    return cases


QUANT_TYPES = ("int8", "int4")  # the quantized lookup's rows: FBGEMM's IntN layout
QUANT_ALIGNMENT = 16  # the GPU TBE's row alignment: every side reads the same bytes


class _QuantCase:
    """One weight type's packed rows of the workload's tables (one table per feature, aligned
    to 16 bytes as FBGEMM's GPU TBE holds them) and the forms of the lookup, each
    `[B, T * D]` fp32: the Pallas kernel (every feature in one call, one program per bag,
    offsets read as they are) and the XLA form per feature with the batch's bag length as its
    static bound (as a padded batch's caps), side by side."""

    def __init__(self, c: _Case, weight_type: str, interpret: bool):
        from sparse_jax._kernels._pallas_quant import QuantFeature, quant_pooled_sum
        from sparse_jax._quant import _xla_form, quantize_rows, row_bytes

        w = c.w
        self.c, self.weight_type = c, weight_type
        self.row_bytes = row_bytes(weight_type, w.D, QUANT_ALIGNMENT)
        packed = quantize_rows(c.table, weight_type, row_alignment=QUANT_ALIGNMENT)
        self.tables = [packed[t * w.E : (t + 1) * w.E] for t in range(w.T)]
        features = [QuantFeature(t, t, weight_type, w.D, False, w.L) for t in range(w.T)]
        xla = _xla_form(weight_type, w.D, False, False, w.L)

        def per_feature(tables, ids, offsets):
            return jnp.concatenate(
                [
                    xla(t, ids, offsets[k * w.B : (k + 1) * w.B + 1])[0]
                    for k, t in enumerate(tables)
                ],
                axis=1,
            )

        self.forms = {
            "pallas": jax.jit(
                lambda tables, ids, offsets: quant_pooled_sum(
                    tables,
                    ids,
                    offsets,
                    None,
                    stride=w.B,
                    features=features,
                    clamp=False,
                    interpret=interpret,
                )  # fmt: skip
            ),
            "xla": jax.jit(per_feature),
        }
        self.args = (self.tables, c.values, c.offsets)

    def fwd_bytes(self) -> int:
        """FBGEMM's convention: packed rows read, pooled fp32 output written."""
        w = self.c.w
        return w.B * w.T * w.L * self.row_bytes + w.B * w.T * w.D * 4

    def fbgemm_tbe(self):
        """FBGEMM's IntN GPU TBE (`IntNBitTableBatchedEmbeddingBagsCodegen`, DEVICE) holding
        the same packed rows, one table per feature: `(run, output)`, or None without a GPU
        build of fbgemm_gpu."""
        try:
            import torch
            from fbgemm_gpu.split_embedding_configs import SparseType
            from fbgemm_gpu.split_table_batched_embeddings_ops_common import (
                BoundsCheckMode,
                EmbeddingLocation,
                PoolingMode,
            )
            from fbgemm_gpu.split_table_batched_embeddings_ops_inference import (
                IntNBitTableBatchedEmbeddingBagsCodegen,
            )

            if not torch.cuda.is_available():
                return None
            w = self.c.w
            tbe = IntNBitTableBatchedEmbeddingBagsCodegen(
                embedding_specs=[
                    (f"t{t}", w.E, w.D, SparseType(self.weight_type), EmbeddingLocation.DEVICE)
                    for t in range(w.T)
                ],
                pooling_mode=PoolingMode.SUM,
                device=torch.device("cuda"),
                output_dtype=SparseType.FP32,
                row_alignment=QUANT_ALIGNMENT,
                bounds_check_mode=BoundsCheckMode.NONE,
            )
            tbe.initialize_weights()
            for t, (rows, _) in enumerate(tbe.split_embedding_weights(split_scale_shifts=False)):
                rows.copy_(torch.from_numpy(np.asarray(self.tables[t])))
            ids = np.asarray(self.c.values).astype(np.int64)  # per-table ids
            t_ids = torch.from_numpy(ids).cuda()
            t_off = torch.from_numpy(np.asarray(self.c.offsets).astype(np.int64)).cuda()

            def run():
                with torch.no_grad():
                    return tbe(t_ids, t_off)

            return run, run().cpu().numpy()
        except Exception:  # noqa: BLE001 - absent, a CPU-only build, or no IntN GPU kernel
            return None


def _quant_entry(c: _Case, interpret: bool, rounds: int, reps: int) -> dict:
    """Per weight type: the Pallas kernel against the XLA form (and FBGEMM's IntN GPU TBE when
    installed): checks (Pallas equals XLA: bit for bit in interpret mode; compiled, within an
    fma's rounding per id), median times, GB/s and launches."""
    out = {}
    for weight_type in QUANT_TYPES:
        q = _QuantCase(c, weight_type, interpret)
        outs = {k: np.asarray(fn(*q.args)) for k, fn in q.forms.items()}
        cases = {k: (lambda fn=fn, a=q.args: fn(*a)) for k, fn in q.forms.items()}
        checks = {
            "max_abs_diff": float(np.abs(outs["pallas"] - outs["xla"]).max()),
            "bitwise_equal": bool(np.array_equal(outs["pallas"], outs["xla"])),
            "reproducible": bool(
                np.array_equal(np.asarray(q.forms["pallas"](*q.args)), outs["pallas"])
            ),
        }
        timed = _timeit(cases, rounds, reps)
        tbe = q.fbgemm_tbe()
        if tbe is not None:
            run_tbe, got = tbe
            checks["fbgemm_max_abs_diff"] = float(np.abs(got - outs["pallas"]).max())
            timed.update(_time_torch({"fbgemm_intn_tbe": run_tbe}, rounds, reps))
        out[weight_type] = {
            "row_bytes": q.row_bytes,
            "fwd_bytes": q.fwd_bytes(),
            "checks": checks,
            "forward": timed,
            "launches": {k: _launches(fn, *q.args) for k, fn in q.forms.items()},
        }
    return out


def _torch_forward(c: _Case):
    """torch's `embedding_bag` (and FBGEMM's GPU TBE when installed) on the same GPU, or {}."""
    try:
        import torch
    except ImportError:
        return {}
    if not torch.cuda.is_available():
        return {}
    w = c.w
    dev = torch.device("cuda")
    weight = torch.from_numpy(np.asarray(c.table)).to(dev)
    rows = torch.from_numpy(np.asarray(c.rows)).to(dev).long()
    offsets = torch.arange(0, w.T * w.B * w.L, w.L, device=dev)
    out = {}

    def eb():
        return torch.nn.functional.embedding_bag(rows, weight, offsets, mode="sum")

    out["torch_embedding_bag"] = eb
    try:
        from fbgemm_gpu.split_table_batched_embeddings_ops_training import (  # noqa: F401
            SplitTableBatchedEmbeddingBagsCodegen,
        )

        out["fbgemm_tbe"] = None  # installed: timed below
    except Exception:  # noqa: BLE001 - absent or a CPU-only build
        pass
    return out


def _time_torch(fns: dict, rounds: int, reps: int) -> dict:
    import torch

    res = {}
    for name, fn in fns.items():
        if fn is None:
            continue
        fn()
        torch.cuda.synchronize()
        ts = []
        for _ in range(rounds):
            t0 = time.perf_counter()
            for _ in range(reps):
                fn()
            torch.cuda.synchronize()
            ts.append((time.perf_counter() - t0) / reps * 1e3)
        res[name] = {"median_ms": statistics.median(ts), "min_ms": min(ts), "max_ms": max(ts)}
    return res


def _update_fns(c: _Case, rule, interpret: bool):
    """The update programs, each `(table, state, rows, bag, scale, bag_grads, ids)` with
    `ids` the host-sorted stream: the Pallas kernels sorting in the program (per id with a
    search for the run's end, "pallas"; runs found and long ones chunked in the program, as
    a batch prepared without `sort_ids` and a sharded step run) and reading the host's runs,
    the pure-XLA in-program form and the XLA sorted-run form (`apply_sorted_runs`)."""
    num_rows = c.table.shape[0]

    def pallas_form(unroll: int, host_sorted: bool = False, chunked: bool = False):
        def run(table, state, rows, bag, scale, bag_grads, ids):
            if host_sorted:  # the library's form: one program per host run
                runs = ids if chunked else ids._replace(chunks=None, run_chunks=None)
                return _pallas.host_runs_update(
                    rule, table, state, jnp.int32(1), runs, bag_grads, interpret=interpret
                )
            rows_s, perm = _pallas.sorted_runs(rows, num_rows)
            return _pallas.sorted_run_update(
                rule, table, state, jnp.int32(1), rows_s, perm, bag, scale, bag_grads,
                interpret=interpret, unroll=unroll,
            )  # fmt: skip

        return run

    def pallas_per_id(table, state, rows, bag, scale, bag_grads, ids):
        """The host's sorted stream through the per-id kernel (each run's first id finds
        the run's end by a search; the other programs exit): the form `run_update` replaced."""
        perm = jnp.arange(ids.row.shape[0], dtype=jnp.int32)
        return _pallas.sorted_run_update(
            rule, table, state, jnp.int32(1), ids.row, perm, ids.bag, ids.scale, bag_grads,
            interpret=interpret,
        )  # fmt: skip

    def xla(table, state, rows, bag, scale, bag_grads, ids):
        return apply_row_rule(
            rule, table, state, jnp.int32(1), rows, bag, scale, bag_grads, scatter_add=not on_gpu()
        )

    def xla_runs(table, state, rows, bag, scale, bag_grads, ids):
        return apply_sorted_runs(rule, table, state, jnp.int32(1), ids, bag_grads)

    def pallas_chunked(table, state, rows, bag, scale, bag_grads, ids):
        """The library's form without host runs: runs found, long ones chunked, in the program."""
        return _pallas.chunked_run_update(
            rule, table, state, jnp.int32(1), rows, bag, scale, bag_grads, interpret=interpret
        )

    fns = {
        "pallas": pallas_form(_pallas.UNROLL),
        "pallas_in_program_runs": pallas_chunked,
        "xla": xla,
        "pallas_unroll1": pallas_form(1),
        "pallas_host_sorted": pallas_form(_pallas.UNROLL, host_sorted=True),
        "pallas_host_per_id": pallas_per_id,
        "xla_sorted_runs": xla_runs,
    }
    if c.sorted.chunks is not None:  # the batch has long runs: the library's Pallas form
        fns["pallas_host_chunked"] = pallas_form(_pallas.UNROLL, host_sorted=True, chunked=True)
    return {k: jax.jit(fn, donate_argnums=(0, 1)) for k, fn in fns.items()}


def _update_args(c: _Case) -> tuple:
    return (c.rows, c.bag, c.scale, c.bag_grads, c.sorted)


def _check(c: _Case, interpret: bool) -> dict:
    fwd = _forward_cases(c, interpret)
    outs = {k: np.asarray(fn(*args)) for k, (fn, args) in fwd.items()}
    checks = {
        "forward_max_abs_diff": float(max(np.abs(outs["pallas"] - o).max() for o in outs.values()))
    }
    for rule in (rowwise_adagrad(lr=0.05), sgd(lr=0.05)):
        fns = _update_fns(c, rule, interpret)
        res = {}
        for k, fn in fns.items():
            t = jnp.array(c.table, copy=True)
            s = rule.init_table(t)
            res[k] = np.asarray(fn(t, s, *_update_args(c))[0])
        diff = float(np.abs(res["pallas"] - res["xla"]).max())
        checks[f"{rule.name}_max_abs_diff"] = diff
        checks[f"{rule.name}_in_program_runs_max_abs_diff"] = float(
            np.abs(res["pallas_in_program_runs"] - res["xla"]).max()
        )
        again_of = [
            ("pallas", ""),
            ("pallas_in_program_runs", "in_program_runs_"),
            ("xla_sorted_runs", "xla_sorted_runs_"),
        ]
        if "pallas_host_chunked" in res:
            again_of.append(("pallas_host_chunked", "chunked_"))
        for k, label in again_of:
            t2 = jnp.array(c.table, copy=True)
            again = fns[k](t2, rule.init_table(t2), *_update_args(c))
            checks[f"{rule.name}_{label}bitwise_reproducible"] = bool(
                np.array_equal(np.asarray(again[0]), res[k])
            )
        # the host's runs hold each run's ids in batch order, as the in-program sort does
        checks[f"{rule.name}_host_sorted_bitwise_equal"] = bool(
            np.array_equal(res["pallas_host_sorted"], res["pallas"])
        )
        checks[f"{rule.name}_xla_sorted_runs_max_abs_diff"] = float(
            np.abs(res["xla_sorted_runs"] - res["xla"]).max()
        )
        if "pallas_host_chunked" in res:
            checks[f"{rule.name}_chunked_max_abs_diff"] = float(
                np.abs(res["pallas_host_chunked"] - res["xla"]).max()
            )
    return checks


def _library_steps(w: Workload, interpret: bool, rounds: int, reps: int) -> dict:
    """The path users run: `EmbeddingBagCollection.apply` and the guarded fused update
    (`make_update(..., skip_nonfinite=True)`, as `hybrid.Model` builds it) on a prepared batch,
    kernel "auto" (Pallas on a GPU) against "xla", each with the batch's ids sorted on the
    host (the default on a GPU) and without (`sort_ids=False`: the Pallas update sorts in the
    program, the XLA one takes its in-program form); the "auto" step's forward and update
    alone; rowwise Adagrad. Also the host's `prepare` time with and without the sort."""
    from sparse_jax import make_update

    b = make_batch(w)
    kjt = _kjt(w, b)
    grad = jnp.asarray(b.pooled_grad)
    rule = rowwise_adagrad(lr=0.05)
    cases, keep, prepare_ms = {}, {}, {}
    main = "pallas" if interpret else "auto"
    for kernel in (main, "xla"):
        for sort in (True, False):
            name = f"{kernel}{'' if sort else '_insort'}"
            module = _collection(w, kernel=kernel, sort_ids=sort)
            batch = module.prepare(kjt)
            t0 = time.perf_counter()
            for _ in range(3):
                jax.block_until_ready(module.prepare(kjt))
            prepare_ms[name] = (time.perf_counter() - t0) / 3 * 1e3
            params = module.init(jax.random.key(0))
            keep[name] = [params, rule.init(params)]
            update = make_update(module, rule, skip_nonfinite=True)
            fwd = jax.jit(lambda p, bt, m=module: m.apply(p, bt).values())

            def step(name=name, update=update, fwd=fwd, batch=batch):
                params, state = keep[name]
                out = fwd(params, batch)
                keep[name] = list(update(params, state, batch, grad))
                return out, keep[name][0]

            cases[f"step_{name}"] = step
            if name == main:

                def fwd_only(name=name, fwd=fwd, batch=batch):
                    return fwd(keep[name][0], batch)

                def update_only(name=name, update=update, batch=batch):
                    keep[name] = list(update(*keep[name], batch, grad))
                    return keep[name][0]

                cases[f"forward_{name}"], cases[f"update_{name}"] = fwd_only, update_only
    timed = _timeit(cases, rounds, reps)
    timed["host_prepare_ms"] = prepare_ms
    return timed


def run(workloads: list[Workload], *, interpret: bool, rounds: int, reps: int) -> dict:
    results = {
        "device": str(jax.devices()[0].device_kind),
        "backend": jax.default_backend(),
        "jax": jax.__version__,
        "interpret": interpret,
        "workloads": [],
    }
    results["copy_roofline_gbs"] = _roofline_gbs(interpret)
    for w in workloads:
        c = _Case(w)
        entry = {"workload": w.as_dict(), "checks": _check(c, interpret)}
        fwd = _forward_cases(c, interpret)
        entry["forward"] = _timeit(
            {k: (lambda fn=fn, a=a: fn(*a)) for k, (fn, a) in fwd.items()}, rounds, reps
        )
        entry["forward_launches"] = {k: _launches(fn, *a) for k, (fn, a) in fwd.items()}
        torch_fns = _torch_forward(c)
        if torch_fns:
            entry["forward"].update(_time_torch(torch_fns, rounds, reps))
        entry["update"] = {}
        entry["update_launches"] = {}
        for rule in (rowwise_adagrad(lr=0.05), sgd(lr=0.05)):
            fns = _update_fns(c, rule, interpret)
            state = {k: [jnp.array(c.table, copy=True)] for k in fns}
            opt = {k: [rule.init_table(state[k][0])] for k in fns}

            def step(k, fn, state=state, opt=opt, c=c):
                def go():
                    state[k][0], opt[k][0] = fn(state[k][0], opt[k][0], *_update_args(c))
                    return state[k][0]

                return go

            timed = _timeit({k: step(k, fn) for k, fn in fns.items()}, rounds, reps)
            entry["update"][rule.name] = timed
            probe = jnp.array(c.table, copy=True)
            entry["update_launches"][rule.name] = {
                k: _launches(fn, probe, rule.init_table(probe), *_update_args(c))
                for k, fn in fns.items()
            }
        entry["quantized"] = _quant_entry(c, interpret, rounds, reps)
        entry["library_step"] = _library_steps(w, interpret, rounds, reps)
        results["workloads"].append(entry)
    return results


def markdown(results: dict) -> str:
    roof = results["copy_roofline_gbs"]
    lines = [
        f"# GPU comparison on {results['device']} ({results['backend']}, jax {results['jax']}"
        f"{', INTERPRET MODE: times mean nothing' if results['interpret'] else ''})",
        "",
        f"Copy roofline: {roof:.0f} GB/s (bytes read + written).",
        "",
    ]
    for e in results["workloads"]:
        w = e["workload"]
        fwd_bytes = w["B"] * w["T"] * w["L"] * w["D"] * 4 + w["B"] * w["T"] * w["D"] * 4
        lines += [
            f"## {w['name']}",
            "",
            f"Checks: {json.dumps(e['checks'])}",
            "",
            "| program | median ms | vs Pallas | GB/s (FBGEMM bytes) | % roofline | launches |",
            "|---|---|---|---|---|---|",
        ]
        base = e["forward"]["pallas"]["median_ms"]
        for k, v in e["forward"].items():
            gbs = fwd_bytes / (v["median_ms"] * 1e-3) / 1e9
            launch = e["forward_launches"].get(k, {})
            lines.append(
                f"| forward {k} | {v['median_ms']:.3f} | {v['median_ms'] / base:.2f}x | {gbs:.0f} | "
                f"{100 * gbs / roof:.0f}% | {launch.get('fusions', '-')}f+{launch.get('custom_calls', '-')}c |"
            )
        for rule, timed in e["update"].items():
            base = timed["pallas"]["median_ms"]
            for k, v in timed.items():
                gbs = 2 * fwd_bytes / (v["median_ms"] * 1e-3) / 1e9
                launch = e["update_launches"][rule][k]
                lines.append(
                    f"| update {rule} {k} | {v['median_ms']:.3f} | {v['median_ms'] / base:.2f}x | {gbs:.0f} | "
                    f"{100 * gbs / roof:.0f}% | {launch['fusions']}f+{launch['custom_calls']}c, "
                    f"{launch['sorts']} sort, {launch['scatters']} scatter |"
                )
        for weight_type, q in e.get("quantized", {}).items():
            base = q["forward"]["pallas"]["median_ms"]
            for k, v in q["forward"].items():
                gbs = q["fwd_bytes"] / (v["median_ms"] * 1e-3) / 1e9
                launch = q["launches"].get(k, {})
                lines.append(
                    f"| quantized forward {weight_type} {k} | {v['median_ms']:.3f} | "
                    f"{v['median_ms'] / base:.2f}x | {gbs:.0f} | {100 * gbs / roof:.0f}% | "
                    f"{launch.get('fusions', '-')}f+{launch.get('custom_calls', '-')}c |"
                )
        steps = dict(e.get("library_step", {}))
        prepare = steps.pop("host_prepare_ms", {})
        if steps:
            base = next(iter(steps.values()))["median_ms"]
            for k, v in steps.items():
                what = "forward + guarded update" if k.startswith("step_") else "alone"
                lines.append(
                    f"| library {what}, {k} | {v['median_ms']:.3f} | "
                    f"{v['median_ms'] / base:.2f}x | | | |"
                )
        if prepare:
            lines += [
                "",
                "Host `prepare` per batch (ms; the sort is off the critical path under "
                "`TrainPipeline`): " + ", ".join(f"{k} {v:.1f}" for k, v in prepare.items()),
            ]
        lines.append("")
    return "\n".join(lines)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--tiny", action="store_true", help="tiny shapes, Pallas in interpret mode off a GPU"
    )
    report.add_output_args(p, "gpu")
    p.add_argument("--rounds", type=int, default=None)
    p.add_argument("--reps", type=int, default=None)
    args = p.parse_args(argv)
    if not on_gpu() and not args.tiny:
        p.error(
            f"no GPU here (jax.default_backend() is {jax.default_backend()!r}): run with --tiny for the "
            "interpret-mode smoke run"
        )
    interpret = not on_gpu()
    workloads = tiny_set() if args.tiny else [Workload(), Workload(alpha=1.15)]
    rounds = args.rounds or (2 if args.tiny else 15)
    reps = args.reps or (1 if args.tiny else 10)
    results = run(workloads, interpret=interpret, rounds=rounds, reps=reps)
    out = pathlib.Path(report.output_dir(p, args, "gpu"))
    if args.update_results:
        out = out / "gpu"
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu.json").write_text(json.dumps(results, indent=1))
    md = markdown(results)
    (out / "gpu.md").write_text(md)
    print(md)
    print(f"\nresults: {out} (gpu.json, gpu.md)")
    return results


if __name__ == "__main__":
    main()
