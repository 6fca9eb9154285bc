"""Quantized pooled lookup (`sparse_jax.quantized_pooled_lookup`: its default, the C++ kernel on
CPU, and its XLA form) against FBGEMM's IntN TBE (`IntNBitTableBatchedEmbeddingBagsCodegen`,
HOST, CPU), on the same packed rows.

    python -m benchmarks.quant_lookup                       # ~2 min here
    python -m benchmarks.quant_lookup --rows 20000 --repeats 5 --alone-repeats 5   # smoke

Per weight type (int8, int4, fp16; fp32 XLA pooled sum as the unquantized reference): one
table, `--batch` bags of `--pooling` ids each (uniform ids), SUM pooling, fp32 output. The
outputs are checked equal first (1e-6 relative); then both sides are timed interleaved
(medians, per-round ratios; every JAX result waited for), and FBGEMM is timed again alone in a
fresh process (`--side fbgemm`), so its time in this harness can be compared with its time
alone. Also printed: bytes per table for each precision (`row_bytes`).
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np

TYPES = ("int8", "int4", "fp16")
LEAD_IN_S = 0.05  # each timed run follows untimed runs of its own case (benchmarks/timing.py)


def workload(rows: int, dim: int, batch: int, pooling: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    table = rng.standard_normal((rows, dim)).astype(np.float32)
    ids = rng.integers(0, rows, batch * pooling).astype(np.int32)
    offsets = np.arange(0, batch * pooling + 1, pooling, dtype=np.int32)
    return table, ids, offsets


def fbgemm_case(packed: np.ndarray, weight_type: str, dim: int, ids, offsets):
    """(run, output) of FBGEMM's IntN TBE holding exactly `packed`."""
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

    tbe = IntNBitTableBatchedEmbeddingBagsCodegen(
        embedding_specs=[
            ("t", packed.shape[0], dim, SparseType(weight_type), EmbeddingLocation.HOST)
        ],
        pooling_mode=PoolingMode.SUM,
        device="cpu",
        output_dtype=SparseType.FP32,
        row_alignment=1,
        bounds_check_mode=BoundsCheckMode.NONE,
    )
    tbe.initialize_weights()
    tbe.split_embedding_weights(split_scale_shifts=False)[0][0].copy_(
        torch.from_numpy(np.array(packed))
    )
    t_ids, t_off = (
        torch.from_numpy(ids.astype(np.int64)),
        torch.from_numpy(offsets.astype(np.int64)),
    )

    def run():
        with torch.no_grad():
            return tbe(t_ids, t_off)

    return run, run().numpy()


def xla_case(packed, weight_type: str, dim: int, ids, offsets, pooling: int, kernel: str = "xla"):
    """(run, output) of `quantized_pooled_lookup` with `kernel` ("auto": the default, C++ on CPU)."""
    import jax

    from sparse_jax import quantized_pooled_lookup

    p, i, o = jax.device_put(packed), jax.device_put(ids), jax.device_put(offsets)
    # max_length: the bags' bound, as QuantEmbeddingBagCollection passes a padded KJT's length cap
    f = jax.jit(
        lambda p, i, o: quantized_pooled_lookup(
            p, weight_type, dim, i, o, max_length=pooling, kernel=kernel
        )
    )
    out = np.asarray(f(p, i, o))
    return (lambda: f(p, i, o)), out


def fp32_case(table, ids, offsets, pooling: int):
    """The unquantized XLA pooled sum over the same bags (the library's per-position form)."""
    import jax
    import jax.numpy as jnp

    from sparse_jax import _lookup

    t = jax.device_put(table)
    rows = jax.device_put(ids.reshape(-1, pooling))
    w = jnp.ones(rows.shape, jnp.float32)
    f = jax.jit(_lookup._sum_positions)
    return lambda: f(t, rows, w)


def alone(args) -> dict:
    """FBGEMM timed by itself in this (fresh) process: {weight_type: median ms}."""
    from benchmarks.timing import clocked, interleaved, summarize
    from sparse_jax import quantize_rows

    table, ids, offsets = workload(args.rows, args.dim, args.batch, args.pooling)
    out = {}
    for wt in TYPES:
        run, _ = fbgemm_case(np.asarray(quantize_rows(table, wt)), wt, args.dim, ids, offsets)
        samples = interleaved(
            {wt: clocked(lambda c, run=run: run())}, repeats=args.alone_repeats, lead_in_s=LEAD_IN_S
        )
        out[wt] = summarize(samples[wt]["total"])["median_ms"]
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--batch", type=int, default=2048)
    ap.add_argument("--pooling", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=25)
    ap.add_argument("--alone-repeats", type=int, default=15)
    ap.add_argument("--side", choices=["both", "fbgemm"], default="both", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.side == "fbgemm":
        print(json.dumps(alone(args)))
        return 0

    from benchmarks.e2e_step import competitor_alone, quietness_line, quietness_probe
    from benchmarks.timing import clocked, interleaved, paired_ratio, summarize
    from sparse_jax import _kernels, quantize_rows, row_bytes

    before = quietness_probe()
    table, ids, offsets = workload(args.rows, args.dim, args.batch, args.pooling)
    cases = {}
    for wt in TYPES:
        packed = np.asarray(quantize_rows(table, wt))
        ours, got = xla_case(packed, wt, args.dim, ids, offsets, args.pooling, kernel="auto")
        xla, got_xla = xla_case(packed, wt, args.dim, ids, offsets, args.pooling)
        theirs, want = fbgemm_case(packed, wt, args.dim, ids, offsets)
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6, err_msg=f"{wt}: outputs differ")
        np.testing.assert_array_equal(
            got, got_xla, err_msg=f"{wt}: the default and the XLA form differ"
        )
        cases[f"ours {wt}"] = clocked(lambda c, f=ours: f())
        cases[f"xla {wt}"] = clocked(lambda c, f=xla: f())
        cases[f"fbgemm {wt}"] = clocked(lambda c, f=theirs: f())
    fp32 = fp32_case(table, ids, offsets, args.pooling)
    cases["xla fp32"] = clocked(lambda c: fp32())
    samples = interleaved(cases, repeats=args.repeats, lead_in_s=LEAD_IN_S)
    med = {k: summarize(v["total"])["median_ms"] for k, v in samples.items()}
    fresh = competitor_alone("benchmarks.quant_lookup", "fbgemm", argv)
    after = quietness_probe()
    print(quietness_line(before, after))
    print(
        f"rows {args.rows}, dim {args.dim}, batch {args.batch}, pooling {args.pooling} (SUM, fp32 out), "
        f"{args.repeats} interleaved rounds, medians"
    )
    print(
        f"default path: {'C++ kernel (HybridrecQuantPooled)' if _kernels.available() else 'XLA (kernel unavailable)'}"
    )
    print(
        "| weights | bytes/row | table MiB | default ms | XLA form ms | FBGEMM ms (here) | FBGEMM ms (alone) "
        "| default / FBGEMM (paired) | XLA / FBGEMM (paired) |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for wt in TYPES:
        r = paired_ratio(samples[f"ours {wt}"]["total"], samples[f"fbgemm {wt}"]["total"])
        rx = paired_ratio(samples[f"xla {wt}"]["total"], samples[f"fbgemm {wt}"]["total"])
        b = row_bytes(wt, args.dim)
        print(
            f"| {wt} | {b} | {b * args.rows / 2**20:.1f} | {med[f'ours {wt}']:.2f} | {med[f'xla {wt}']:.2f} "
            f"| {med[f'fbgemm {wt}']:.2f} | {fresh[wt]:.2f} | {r['paired_median']:.2f}x | {rx['paired_median']:.2f}x |"
        )
    print(
        f"| fp32 (XLA pooled sum, unquantized) | {4 * args.dim} | {4 * args.dim * args.rows / 2**20:.1f} "
        f"| | {med['xla fp32']:.2f} | | | | |"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
