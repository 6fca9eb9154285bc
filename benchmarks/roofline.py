"""The machine's memory roofline, measured in the same run (torch, 2 threads), interleaved.

* stream copy: `dst.copy_(src)` of a large fp32 buffer; GB/s counts bytes read + written
  (STREAM's copy convention).
* pooled random-row gather: `torch.nn.functional.embedding_bag(mode="sum")` over random
  256-byte rows (fp32, D=64) of a table much larger than the last-level cache, bags of L
  rows; GB/s with FBGEMM's convention (rows read + pooled output written). This is the
  practical roofline for pooled lookups (PERF_NOTES): every figure is also reported as a
  percentage of it.
* unpooled random-row gather: `index_select` of the same rows (read + written), for context.
"""

from __future__ import annotations

import numpy as np
import torch

from benchmarks.timing import interleaved, summarize

__all__ = ["measure", "gbps", "percent_of"]

ROW_DIM = 64  # 64 fp32 = 256-byte rows


def gbps(nbytes: float, seconds: float) -> float:
    return nbytes / seconds / 1e9


def percent_of(value_gbps: float, roof_gbps: float) -> float:
    return 100.0 * value_gbps / roof_gbps


def measure(
    *,
    copy_mib: int = 256,
    table_rows: int = 800_000,
    bags: int = 16384,
    L: int = 20,
    repeats: int = 15,
    warmup: int = 2,
    seed: int = 0,
) -> dict:
    rng = np.random.default_rng(seed)
    src = torch.ones(copy_mib * (1 << 20) // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    table = torch.from_numpy(rng.standard_normal((table_rows, ROW_DIM), dtype=np.float32))
    ids = torch.from_numpy(rng.integers(0, table_rows, bags * L))
    offsets = torch.arange(0, bags * L, L)
    flat = ids[: min(ids.numel(), bags * L)]

    def timed(fn):
        def case():
            import time

            t0 = time.perf_counter()
            fn()
            return {"total": time.perf_counter() - t0}

        return case

    samples = interleaved(
        {
            "copy": timed(lambda: dst.copy_(src)),
            "gather_pooled": timed(
                lambda: torch.nn.functional.embedding_bag(flat, table, offsets, mode="sum")
            ),
            "gather_rows": timed(lambda: torch.index_select(table, 0, flat)),
        },
        warmup=warmup,
        repeats=repeats,
    )
    row_bytes = ROW_DIM * 4
    nbytes = {
        "copy": 2 * src.numel() * 4,
        "gather_pooled": bags * L * row_bytes + bags * row_bytes,
        "gather_rows": 2 * bags * L * row_bytes,
    }
    out = {
        "threads": torch.get_num_threads(),
        "copy_bytes": nbytes["copy"],
        "gather_table_bytes": table_rows * row_bytes,
        "gather_bags": bags,
        "gather_L": L,
        "row_bytes": row_bytes,
    }
    for k, xs in samples.items():
        s = summarize(xs["total"])
        out[k] = {**s, "gbps": gbps(nbytes[k], s["median_ms"] / 1e3)}
    out["roofline_gbps"] = out["gather_pooled"]["gbps"]
    return out
