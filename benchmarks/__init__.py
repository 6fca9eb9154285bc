"""Benchmarks: hybridrec's sparse side (JAX/XLA) against FBGEMM's CPU table-batched embedding.

Run `python -m benchmarks.xla_vs_fbgemm` (see its --help). One concept per module:

* `workloads`   - the FBGEMM-style workload knobs (T, E, D, B, L, alpha, weighted, dtype) and
                  the one batch (ids, offsets, weights, initial tables, pooled gradient) both
                  sides consume.
* `timing`      - interleaved repeats and medians / paired ratios.
* `roofline`    - the machine's stream-copy and random-row-gather GB/s, measured in the run.
* `gate`        - the correctness gate (pooled outputs and updated weights must match).
* `fbgemm_side` - FBGEMM `SplitTableBatchedEmbeddingBagsCodegen` (HOST / CPU).
* `xla_side`    - hybridrec `EmbeddingBagCollection` + `make_update` (kernel "xla" / "reference").
* `memory`      - peak RSS of each side, each in its own subprocess.
* `report`      - JSON, Markdown table and PNG.
* `xla_vs_fbgemm` - the CLI that runs all of it.
* `explore_update` - measurements of candidate formulations for our side (issue 9).

Nothing here is collected by pytest (testpaths = tests); `tests/test_benchmarks.py` drives
the CLI at tiny sizes.
"""
