"""Benchmarks: hybridrec against FBGEMM's CPU table-batched embedding and TorchRec.

Run `python -m benchmarks.xla_vs_fbgemm` (kernel level, see its --help) and
`python -m benchmarks.e2e_vs_torchrec` (end to end). Each run writes a fresh
`runs/bench/<name>-<time>/` (git-ignored); `--update-results` writes the committed
`benchmarks/results/` instead (`report.output_dir`). Findings: `benchmarks/NOTES.md`.
One concept per module:

* `workloads`   - the FBGEMM-style workload knobs (T, E, D, B, L, alpha, weighted, dtype) and
                  the one batch (ids, offsets, weights, initial tables, pooled gradient) both
                  sides consume.
* `timing`      - interleaved repeats and medians / paired ratios.
* `roofline`    - the machine's stream-copy and random-row-gather GB/s, measured in the run.
* `gate`        - the correctness gate (pooled outputs and updated weights must match).
* `fbgemm_side` - FBGEMM `SplitTableBatchedEmbeddingBagsCodegen` (HOST / CPU).
* `xla_side`    - hybridrec `EmbeddingBagCollection` + `make_update` (kernel "auto" / "xla" /
                  "reference" / "ffi").
* `memory`      - peak RSS of each side, each in its own subprocess.
* `report`      - JSON, Markdown table and PNG.
* `xla_vs_fbgemm` - the CLI that runs all of it.
* `explore_update` - measurements of candidate formulations for our side (issue 9).
* `explore_malloc` - whether allocator settings change our per-step page faults (issue 9).
* `e2e_vs_torchrec` - end-to-end training steps against TorchRec's DistributedModelParallel.
* `quant_lookup` - the row-wise quantized pooled lookup (int8/int4/fp16) against FBGEMM's
                  IntN TBE on the same packed rows, and bytes per table per precision.
* `serving_latency` - an exported int8 DLRM (`hybrid.serving`) against TorchRec's quantized
                  inference DLRM at batch 1, 64 and 512.

Nothing here is collected by pytest (testpaths = tests); `tests/test_benchmarks.py` and
`tests/test_benchmark_e2e.py` drive the CLIs at tiny sizes.
"""
