"""The programs a GPU runs, lowered for CUDA on this CPU machine and read.

`jax.jit(f).trace(...).lower(lowering_platforms=("cuda",))` needs no GPU. The W1 training
step (T8 E1e5 D64 B2048 L20: the guarded fused update and the pooled forward) and a sharded
step must hold: no `case`/`if` (a GPU conditional copies its predicate to the host and
waits), no float scatter-add over non-unique indices (atomics, run-to-run sums), no CPU-only
custom call (the C++ kernels), the Pallas kernels present, and no `[ids, dim]` temporary.
The same trace lowered for CPU holds the C++ kernels instead: the choice is the lowering
platform's, not the host's."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sparse_jax import (
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    KeyedJaggedTensor,
    _kernels,
    make_update,
    optim,
)
from sparse_jax.sharding import shard

TRITON = "xla.gpu.triton"


def _scatters(text: str) -> list[dict]:
    """Every `stablehlo.scatter` with its combiner and result type."""
    out = []
    for m in re.finditer(r'"stablehlo\.scatter"\(', text):
        end = text.find("\n    }) ", m.end())
        end = text.find("\n", text.find("}) ", m.end()))
        body = text[m.start() : end]
        result = body[body.rfind("->") :]
        out.append(
            {
                "adds": "stablehlo.add" in body,
                "unique": "unique_indices = true" in body,
                "float": bool(re.search(r"x(f32|f16|bf16)>", result)),
            }
        )
    return out


def _dynamic_loops(text: str) -> int:
    """`stablehlo.while` loops whose condition is not a counter against a constant (a GPU
    copies such a predicate to the host every iteration; a static trip count it does not)."""
    count = 0
    for m in re.finditer(r"stablehlo\.while\(", text):
        cond = text[text.find("cond {", m.end()) : text.find("} do {", m.end())]
        ops = re.findall(r"= (stablehlo\.\w+)", cond)
        if (
            sorted(set(ops)) != ["stablehlo.compare", "stablehlo.constant"]
            or ops.count("stablehlo.compare") != 1
        ):
            count += 1
    return count


def audit(text: str) -> dict:
    scatters = _scatters(text)
    return {
        "dynamic_loops": _dynamic_loops(text),
        "case_or_if": text.count("stablehlo.case") + text.count("stablehlo.if"),
        "float_scatter_add_non_unique": sum(
            s["adds"] and s["float"] and not s["unique"] for s in scatters
        ),
        "cpu_custom_calls": len(re.findall(r"custom_call @Hybridrec", text)),
        "triton_kernels": text.count(TRITON),
    }


def _w1(T=8, E=100_000, D=64, B=2048, L=20, rule="rowwise_adagrad", mesh=None):
    tables = [
        EmbeddingBagConfig(name=f"t{t}", num_embeddings=E, embedding_dim=D, feature_names=[f"f{t}"])
        for t in range(T)
    ]
    module = EmbeddingBagCollection(tables)  # kernel="auto", the default
    if mesh is not None:
        module = shard(
            module, mesh, {f"t{t}": "row_wise" if t % 2 else "table_wise" for t in range(T)}
        )
    rng = np.random.default_rng(0)
    kjt = KeyedJaggedTensor(
        [f"f{t}" for t in range(T)], rng.integers(0, E, T * B * L), lengths=np.full(T * B, L)
    )
    batch = module.prepare(kjt)
    r = getattr(optim, rule)(lr=0.05)
    if mesh is not None:
        params = module.init(jax.random.key(0))  # placed on the mesh (small tables)
        return module, batch, params, r.init(params), r, T * B * L
    params = jax.eval_shape(
        module.init, jax.random.key(0)
    )  # abstract: a W1 table is never allocated
    state = jax.eval_shape(r.init, params)
    return module, batch, params, state, r, T * B * L


def _lowered_step(module, batch, params, state, r, platform):
    update = make_update(module, r, skip_nonfinite=True)  # as hybrid.Model builds it
    operands = module.update_operands(
        batch, jnp.zeros((batch_size(module, batch), sum(module.layout.output_dims)))
    )
    flag, skipped = jnp.ones((1,), bool), (jnp.int32(0), jnp.int32(-1))
    return (
        update.jitted.trace(params, state, operands, flag, skipped, jnp.int32(0))
        .lower(lowering_platforms=(platform,))
        .as_text()
    )


def batch_size(module, batch):
    return batch.kjt.stride() if hasattr(batch, "kjt") else batch.local_batch * module.num_devices


@pytest.mark.parametrize("rule", ["rowwise_adagrad", "sgd", "adam"])
def test_the_w1_training_step_lowered_for_cuda_is_gpu_right(rule):
    module, batch, params, state, r, n_ids = _w1(rule=rule)
    text = _lowered_step(module, batch, params, state, r, "cuda")
    got = audit(text)
    assert got["case_or_if"] == 0 and got["dynamic_loops"] == 0, got
    assert got["float_scatter_add_non_unique"] == 0, got
    assert got["cpu_custom_calls"] == 0, got
    assert got["triton_kernels"] >= 1, got
    big = [int(n) for n in re.findall(r"tensor<(\d+)x64xf32>", text) if int(n) >= n_ids]
    buffers = {
        rows for rows, _ in module.layout.groups.values()
    }  # the stacked tables and their state
    assert set(big) <= buffers, (
        f"[ids, dim] temporaries in the update: {sorted(set(big) - buffers)}"
    )
    forward = (
        jax.jit(lambda p, b: module.apply(p, b).values())
        .trace(params, batch)
        .lower(lowering_platforms=("cuda",))
        .as_text()
    )
    fwd = audit(forward)
    assert fwd["triton_kernels"] >= 1 and fwd["cpu_custom_calls"] == 0 and fwd["case_or_if"] == 0, (
        fwd
    )
    assert "stablehlo.while" not in forward  # no per-position loop: the jagged kernel reads offsets


def test_the_same_step_lowered_for_cpu_takes_the_cpu_kernels():
    from sparse_jax import _kernels

    if not _kernels.available():
        pytest.skip("CPU kernels not built")
    module, batch, params, state, r, _ = _w1(T=2, E=1000, B=64, L=4)
    text = _lowered_step(module, batch, params, state, r, "cpu")
    got = audit(text)
    assert got["cpu_custom_calls"] == 1 and got["triton_kernels"] == 0 and got["case_or_if"] == 0, (
        got
    )
    forward = jax.jit(lambda p, b: module.apply(p, b).values()).trace(params, batch)
    assert audit(forward.lower(lowering_platforms=("cpu",)).as_text())["cpu_custom_calls"] == 1
    assert (
        audit(forward.lower(lowering_platforms=("cuda",)).as_text())["triton_kernels"] == 1
    )  # one trace, both


def test_a_sharded_step_lowered_for_cuda_is_gpu_right():
    mesh = jax.make_mesh((2, 4), ("data", "model"))
    module, batch, params, state, r, _ = _w1(T=4, E=4096, B=256, L=8, mesh=mesh)
    got = audit(_lowered_step(module, batch, params, state, r, "cuda"))
    assert got["case_or_if"] == 0 and got["cpu_custom_calls"] == 0, got
    assert got["float_scatter_add_non_unique"] == 0, got
    assert got["triton_kernels"] >= 1, got


def test_the_audit_sees_what_it_forbids():
    """The audit itself: a lax.cond, a float scatter-add and the C++ kernels are counted."""
    x = jnp.zeros((8, 4), jnp.float32)
    cond = (
        jax.jit(lambda a, p: jax.lax.cond(p, lambda a: a + 1, lambda a: a, a))
        .trace(x, True)
        .lower(lowering_platforms=("cuda",))
        .as_text()
    )
    assert audit(cond)["case_or_if"] >= 1
    add = (
        jax.jit(lambda a, i: a.at[i].add(1.0))
        .trace(x, jnp.zeros(3, jnp.int32))
        .lower(lowering_platforms=("cuda",))
        .as_text()
    )
    assert audit(add)["float_scatter_add_non_unique"] == 1
    unique = (
        jax.jit(lambda a, i: a.at[i].set(1.0, unique_indices=True))
        .trace(x, jnp.zeros(3, jnp.int32))
        .lower(lowering_platforms=("cuda",))
        .as_text()
    )
    assert audit(unique)["float_scatter_add_non_unique"] == 0
    loop = (
        jax.jit(
            lambda a: jax.lax.while_loop(
                lambda c: c[1] < jnp.max(c[0]), lambda c: (c[0] - 1, c[1] + 1), (a, 0.0)
            )
        )
        .trace(x)
        .lower(lowering_platforms=("cuda",))
        .as_text()
    )
    assert audit(loop)["dynamic_loops"] == 1
    fixed = (
        jax.jit(lambda a: jax.lax.fori_loop(0, 5, lambda i, c: c + 1, a))
        .trace(x)
        .lower(lowering_platforms=("cuda",))
        .as_text()
    )
    assert audit(fixed)["dynamic_loops"] == 0
    module, batch, params, state, r, _ = _w1(T=2, E=1000, B=64, L=4)
    old = jax.jit(lambda p, b: module.apply(p, b).values()).trace(params, batch)
    assert audit(old.lower(lowering_platforms=("cpu",)).as_text())["triton_kernels"] == 0


def test_a_sequence_collection_step_lowered_for_cuda_is_gpu_right():
    from sparse_jax import EmbeddingCollection, EmbeddingConfig

    tables = [
        EmbeddingConfig(name="t", num_embeddings=5000, embedding_dim=32, feature_names=["f", "g"])
    ]
    module = EmbeddingCollection(tables)
    kjt = KeyedJaggedTensor(["f", "g"], np.arange(96) % 5000, lengths=np.full(32, 3))
    batch = module.prepare(kjt)
    params = module.init(jax.random.key(0))
    r = optim.adam(lr=0.01)
    update = make_update(module, r, skip_nonfinite=True)
    grads = {k: jnp.zeros((48, 32), jnp.float32) for k in ("f", "g")}
    operands = module.update_operands(batch, grads)
    text = (
        update.jitted.trace(
            params,
            r.init(params),
            operands,
            jnp.ones((1,), bool),
            (jnp.int32(0), jnp.int32(-1)),
            jnp.int32(0),
        )
        .lower(lowering_platforms=("cuda",))
        .as_text()
    )
    got = audit(text)
    assert got == {
        "dynamic_loops": 0,
        "case_or_if": 0,
        "float_scatter_add_non_unique": 0,
        "cpu_custom_calls": 0,
        "triton_kernels": 2,  # the long runs' chunk sums, then the update of every run
    }, got


@pytest.mark.parametrize(
    "policy,interval,threshold,settings",
    [
        ("lru", 1, 1, {}),
        ("lfu", 3, 2, {}),
        ("distance_lfu", 2, 1, {"decay_exponent": 1.0}),
        ("ttl", 1, 1, {"single_ttl": 2}),
    ],
)
def test_the_managed_remaps_gpu_form_gives_the_same_maps(policy, interval, threshold, settings):
    """`profile` on a GPU (fixed trip counts, the eviction computed every call and kept when
    due) equals the CPU form (loops that stop early, a `cond`) bit for bit, step by step."""
    from sparse_jax import MCHManagedCollisionModule, RawIds
    from sparse_jax.managed._id_map import _static_loops

    mch = MCHManagedCollisionModule(
        24,
        history_capacity=64 * interval,
        eviction_policy=policy,
        eviction_interval=interval,
        threshold=threshold,
        **settings,
    )

    # lru, lfu, ttl: integer programs only, whose results LLVM's optimizations cannot change:
    # both forms compiled at -O0 (the same HLO, ~40% less compile time, most of this test's);
    # distance_lfu's float scores keep the default
    options = None if policy == "distance_lfu" else {"xla_backend_optimization_level": 0}

    def form(static):
        def run(state, ids, valid):
            with _static_loops(static):
                return mch._profile(state, ids, valid)

        return jax.jit(run, compiler_options=options)

    cpu, gpu = form(False), form(True)
    rng = np.random.default_rng(4)
    pool = rng.integers(-(2**62), 2**62, 60)
    state = mch.init()
    for _ in range(3 * interval + 2):
        ids = RawIds.from_int64(pool[(rng.zipf(1.3, 64) - 1) % 60])
        valid = jnp.asarray(rng.random(64) < 0.9)
        a, b = cpu(state, ids, valid), gpu(state, ids, valid)
        for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b), strict=True):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
        state = a[0]
    assert int(jnp.sum(state.sorted_hi != jnp.iinfo(jnp.int32).max)) > 0  # ids were admitted
    text = (
        jax.jit(mch.profile).trace(state, ids, valid).lower(lowering_platforms=("cuda",)).as_text()
    )
    assert audit(text)["case_or_if"] == 0 and audit(text)["dynamic_loops"] == 0, audit(text)
    cpu_text = jax.jit(mch.profile).trace(state, ids, valid).lower(lowering_platforms=("cpu",))
    cpu_text = cpu_text.as_text()
    if _kernels.available() and policy != "distance_lfu":  # the fused kernel (test_managed_kernel)
        assert "custom_call @HybridrecMchProfile" in cpu_text and "stablehlo.case" not in cpu_text
    else:  # the CPU XLA form keeps its cond
        assert "stablehlo.case" in cpu_text or interval == 1


def test_a_managed_training_remap_lowered_for_cuda_has_no_conditional():
    from benchmarks.gpu_readiness import managed_remap_case

    module, batch, arrays, args = managed_remap_case()
    program = module._program  # the training remap, then the scatter of its rows into the batch
    slots = jax.eval_shape(program.train, *args)[-1]
    for text in (
        program.train.trace(*args).lower(lowering_platforms=("cuda",)).as_text(),
        program.scatter.trace(arrays, batch.positions, slots)
        .lower(lowering_platforms=("cuda",))
        .as_text(),
    ):
        got = audit(text)
        assert (
            got["case_or_if"] == 0
            and got["cpu_custom_calls"] == 0
            and got["float_scatter_add_non_unique"] == 0
        ), got
        assert got["dynamic_loops"] == 0, got


# the quantized collection: one table per weight type; int2 x 12 is not a power of two (the
# XLA form on a GPU), the others are (the Pallas kernel)
QUANT_TABLES = (("int8", 16), ("int4", 32), ("fp16", 8), ("int2", 12))


def quantized_lookup_case(weighted: bool = False, tables=QUANT_TABLES):
    """A quantized collection's forward traced once on this host: `(trace, qebc)`, the trace
    of `QuantEmbeddingBagCollection.apply`'s program on a prepared batch, and the collection."""
    from sparse_jax import PoolingType, QuantEmbeddingBagCollection

    configs = [
        EmbeddingBagConfig(
            name=f"t{i}",
            num_embeddings=1000,
            embedding_dim=dim,
            feature_names=[f"f{i}"],
            pooling=PoolingType.MEAN if i % 2 else PoolingType.SUM,
        )
        for i, (_, dim) in enumerate(tables)
    ]
    ebc = EmbeddingBagCollection(configs, is_weighted=weighted)
    qebc = QuantEmbeddingBagCollection.from_float(
        ebc,
        ebc.init(jax.random.key(0)),
        per_table_weight_type={f"t{i}": t for i, (t, _) in enumerate(tables)},
    )
    rng = np.random.default_rng(0)
    lengths = rng.integers(0, 9, len(tables) * 64)
    ids = rng.integers(0, 1000, lengths.sum())
    weights = rng.uniform(size=ids.size).astype(np.float32) if weighted else None
    kjt = KeyedJaggedTensor(
        [c.feature_names[0] for c in configs], ids, lengths=lengths, weights=weights
    )
    batch = qebc.prepare(kjt)
    trace = qebc._apply_jit.trace(qebc.packed_tables, batch.kjt.without_length_caps())
    return trace, qebc


@pytest.mark.parametrize("weighted", [False, True])
def test_the_quantized_lookup_lowered_for_cuda_takes_the_pallas_kernel(weighted):
    """One trace on this CPU host: lowered for CUDA, a collection whose dims are all powers of
    two is one Triton call (every feature, `[B, sum of dims]` written once) and no bag loop;
    with an int2 x 12 table, one Triton call per power-of-two feature and that table's XLA
    form. Never a CPU-only call or a conditional. Lowered for CPU: the C++ kernel per feature
    (when built) and no Triton call."""
    for tables, n_triton in ((QUANT_TABLES[:3], 1), (QUANT_TABLES, 3)):
        trace, _ = quantized_lookup_case(weighted, tables)
        text = trace.lower(lowering_platforms=("cuda",)).as_text()
        cuda = audit(text)
        assert cuda["triton_kernels"] == n_triton, (tables, cuda)
        assert cuda["cpu_custom_calls"] == 0 and cuda["case_or_if"] == 0, cuda
        assert cuda["float_scatter_add_non_unique"] == 0, cuda
        assert ("stablehlo.while" in text) == (n_triton > 1)  # the int2 table's bag loop
        cpu = audit(trace.lower(lowering_platforms=("cpu",)).as_text())
        assert cpu["triton_kernels"] == 0, cpu
        if _kernels.available():
            assert cpu["cpu_custom_calls"] == len(tables), cpu


def test_the_exported_quantized_lookup_keeps_the_xla_form_for_cuda():
    """`hybrid.export`'s lookup program (a symbolic id count) lowered for CPU and CUDA holds no
    custom call at all: Pallas's Triton lowering takes no symbolic shapes (jax 0.10) and
    `jax.export` guarantees no compatibility for the Triton call, so the exported CUDA
    program is the XLA form; the Triton kernel runs in programs traced and lowered in the
    serving process's own JAX (QuantEmbeddingBagCollection.apply)."""
    from hybrid.inference._export_lookup import OutputSlot, export_lookup, lookup_program
    from sparse_jax import row_bytes

    slots = [OutputSlot(0, 0, 16, False, "int8"), OutputSlot(1, 1, 32, True, "int4")]
    program = lookup_program(slots, 2, 8, weighted=True, bounds_check="skip")
    tables = [
        jax.ShapeDtypeStruct((100, row_bytes(t, d)), jnp.uint8)
        for t, d in (("int8", 16), ("int4", 32))
    ]
    exported = export_lookup(program, tables, 2, 8, weighted=True, platforms=("cpu", "cuda"))
    got = audit(exported.mlir_module())
    assert got["triton_kernels"] == 0 and got["cpu_custom_calls"] == 0, got
