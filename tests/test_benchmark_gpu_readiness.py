"""`python -m benchmarks.gpu_readiness --tiny`: every GPU program lowered for CUDA on this
host and counted. Its counts are checked where they are known: no host syncs anywhere, the
Pallas kernels in the default programs (the quantized forward's too), no sort in the pure-XLA update (the host sorted the
runs) and its one sorted scatter-add, and FBGEMM's bytes by hand."""

from __future__ import annotations

import json

from benchmarks import gpu_readiness


def test_the_tiny_readiness_table_counts_what_the_programs_hold(tmp_path, capsys):
    results = gpu_readiness.main(["--tiny", "--out", str(tmp_path)])
    rows = {r["program"]: r for r in results["programs"]}
    assert json.loads((tmp_path / "gpu_readiness.json").read_text()) == results
    assert "| train rowwise_adagrad (xla) |" in (tmp_path / "gpu_readiness.md").read_text()
    assert "launches (est.)" in capsys.readouterr().out
    names = {"forward", *(f"train {r}" for r in gpu_readiness.RULES)}
    assert {f"{n} ({k})" for n in names for k in ("auto", "xla")} <= set(rows)
    assert any(p.startswith("sharded train") for p in rows)  # conftest gives 8 devices
    assert any(p.startswith("managed remap") for p in rows)
    for name, r in rows.items():
        assert r["syncs"] == 0 and r["cpu_custom_calls"] == 0, (name, r)
        assert r["launch_estimate"] == r["custom_calls"] + r["triton_kernels"] + r["heavy_ops"]
    for n in names:
        assert rows[f"{n} (auto)"]["triton_kernels"] >= 1, n
        assert rows[f"{n} (auto)"]["sorts"] == 0, n  # the Pallas update reads the host's runs
        assert rows[f"{n} (xla)"]["triton_kernels"] == 0, n
    quant, quant_xla = rows["quantized forward int8 (auto)"], rows["quantized forward int8 (xla)"]
    w = results["workload"]
    assert quant["triton_kernels"] == 1 and quant["heavy_ops"] == 0, quant  # one call, no loop
    assert quant_xla["triton_kernels"] == 0 and quant_xla["heavy_ops"] >= w["T"]  # gathers
    assert quant["fbgemm_bytes"] < rows["forward (auto)"]["fbgemm_bytes"]  # D + 4 bytes a row
    for rule in gpu_readiness.RULES:
        xla = rows[f"train {rule} (xla)"]
        assert xla["sorts"] == 0, xla  # sorted on the host by prepare
        # the runs summed by buckets on the host's sorted stream: no scatter-add over repeated rows
        assert xla["float_scatter_add_non_unique"] == xla["of_which_sorted"] == 0, xla
        assert xla["bytes_hlo_cost"] > 0 and xla["bytes_vs_fbgemm"] > 0
    # FBGEMM's bytes for the tiny batch, by hand: T2 E1000 D16 B64 L4
    w = results["workload"]
    n, unique = w["T"] * w["B"] * w["L"], rows["forward (xla)"]["fbgemm_bytes"]
    ids = 4 * n + 4 * (w["T"] * w["B"] + 1)
    pooled = 4 * w["B"] * w["T"] * w["D"]
    unique = (unique - ids - pooled) // (4 * w["D"])
    assert 0 < unique <= n
    assert rows["train rowwise_adagrad (xla)"]["fbgemm_bytes"] == ids + pooled + 2 * unique * (
        4 * w["D"] + 4
    )
    assert rows["train adam (auto)"]["fbgemm_bytes"] == ids + pooled + 2 * unique * (
        4 * w["D"] + 8 * w["D"]
    )


def test_heavy_op_bytes_counts_rows_touched_not_tables():
    import jax
    import jax.numpy as jnp

    table = jax.ShapeDtypeStruct((100_000, 64), jnp.float32)
    idx = jax.ShapeDtypeStruct((10,), jnp.int32)
    rows = jax.ShapeDtypeStruct((10, 64), jnp.float32)

    def text(f):
        return jax.jit(f).trace(table, idx, rows).lower(lowering_platforms=("cuda",)).as_text()

    row_bytes = 10 * 64 * 4
    assert gpu_readiness.heavy_op_bytes(text(lambda t, i, r: t[i])) == 2 * row_bytes
    got = gpu_readiness.heavy_op_bytes(text(lambda t, i, r: t.at[i].set(r, unique_indices=True)))
    assert got == 2 * row_bytes + 10 * 4  # rows read and written, and the indices
    got = gpu_readiness.heavy_op_bytes(text(lambda t, i, r: t.at[i].add(r)))
    assert got == 3 * row_bytes + 10 * 4
