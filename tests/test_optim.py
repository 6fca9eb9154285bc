"""Fused sparse optimizers: every row rule against the plain-loop oracle, in place, one compile."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from sparse_jax import (
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    KeyedJaggedTensor,
    make_update,
    optim,
)
from tests import reference
from tests.cases import random_case

# Hyper-parameters at which a planted bug shows: eps large next to sqrt(state) (sqrt(s + eps)
# or sqrt(s) + 2 eps are far off), betas far from 1 and from each other (a swapped beta or a
# bias correction by the wrong power moves every row), weight decay large enough to see.
RULES = {
    "sgd": dict(lr=0.1),
    "adagrad": dict(lr=0.1, eps=0.3),
    "rowwise_adagrad": dict(lr=0.1, eps=0.3),
    "adam": dict(lr=0.05, beta1=0.7, beta2=0.9, eps=0.2, weight_decay=0.1),
}


def _grad_blocks(case, grad):
    blocks, col = {}, 0
    for feature, table, _ in case.features:
        dim = next(t.embedding_dim for t in case.tables if t.name == table)
        blocks[feature] = grad[:, col : col + dim]
        col += dim
    return blocks


def _state_of_table(ebc, opt_state, table, key):
    group, off = ebc.layout.table_group[table]
    rows = next(t.num_embeddings for t in ebc.tables if t.name == table)
    return np.asarray(opt_state.tables[group][key])[off : off + rows]


@pytest.mark.parametrize("rule", sorted(RULES))
@pytest.mark.parametrize(("weighted", "kernel"), [(False, "xla"), (True, "xla"), (True, "ffi")])
def test_three_fused_steps_match_loops(rule, weighted, kernel):
    rng = np.random.default_rng(sum(map(ord, rule)) + weighted)
    ebc = EmbeddingBagCollection(
        random_case(np.random.default_rng(1)).tables, is_weighted=weighted, kernel=kernel
    )
    params = ebc.init(jax.random.key(0))
    opt = getattr(optim, rule)(**RULES[rule])
    opt_state = opt.init(params)
    update = make_update(ebc, opt)
    weights = {k: np.asarray(v, np.float64) for k, v in ebc.table_weights(params).items()}
    states: dict = {}
    for step in range(1, 4):
        # new bags each step, same tables; few hot rows -> duplicates within and across bags
        case = random_case(
            np.random.default_rng(step), weighted=weighted, hot_rows=5, batch=4, shuffle_keys=False
        )
        case.tables = list(ebc.tables)
        grad = rng.normal(size=(case.stride, sum(ebc.layout.output_dims))).astype(np.float32)
        params, opt_state = update(params, opt_state, case.kjt.pad(capacity=64), jnp.asarray(grad))
        row_grads = reference.row_gradients(
            case.features, case.bag_ids, _grad_blocks(case, grad), case.bag_weights
        )
        reference.fused_step(rule, RULES[rule], weights, states, row_grads, step)
    assert int(opt_state.count) == 3
    got = ebc.table_weights(params)
    for table, w in weights.items():
        np.testing.assert_allclose(
            np.asarray(got[table]), w, rtol=1e-5, atol=1e-6, err_msg=f"table {table}"
        )
        for key in reference.initial_row_state(rule, 1):
            expected = np.array(
                [
                    states.get(table, {}).get(i, reference.initial_row_state(rule, w.shape[1]))[key]
                    for i in range(w.shape[0])
                ]
            )
            np.testing.assert_allclose(
                _state_of_table(ebc, opt_state, table, key), expected, rtol=1e-5, atol=1e-7
            )


def test_untouched_rows_and_state_never_change():
    t = EmbeddingBagConfig(name="t", num_embeddings=6, embedding_dim=3, feature_names=["f"])
    ebc = EmbeddingBagCollection([t])
    params = ebc.init(jax.random.key(0))
    before = np.asarray(params["fp32_d3"]).copy()
    opt = optim.adam(lr=0.1)
    update = make_update(ebc, opt)
    kjt = KeyedJaggedTensor(["f"], np.array([2, 2, 4]), lengths=np.array([2, 1])).pad(capacity=8)
    params, state = update(params, opt.init(params), kjt, jnp.ones((2, 3), jnp.float32))
    after = np.asarray(params["fp32_d3"])
    untouched = [0, 1, 3, 5]
    np.testing.assert_array_equal(after[untouched], before[untouched])
    assert not np.allclose(after[[2, 4]], before[[2, 4]])
    assert not np.asarray(state.tables["fp32_d3"]["momentum1"])[untouched].any()


def test_update_is_in_place_and_compiles_once():
    tables = [
        EmbeddingBagConfig(
            name=f"t{i}", num_embeddings=1000, embedding_dim=16, feature_names=[f"f{i}"]
        )
        for i in range(2)
    ]
    ebc = EmbeddingBagCollection(tables)
    params = ebc.init(jax.random.key(0))
    opt = optim.rowwise_adagrad(lr=0.1)
    opt_state = opt.init(params)
    update = make_update(ebc, opt)
    rng = np.random.default_rng(0)
    pointer = params["fp32_d16"].unsafe_buffer_pointer()
    state_pointer = opt_state.tables["fp32_d16"]["momentum1"].unsafe_buffer_pointer()
    for _ in range(5):
        lengths = rng.integers(0, 4, size=2 * 8)
        kjt = KeyedJaggedTensor(
            ["f0", "f1"], rng.integers(0, 1000, size=lengths.sum()), lengths=lengths
        )
        old = params["fp32_d16"]
        params, opt_state = update(
            params, opt_state, kjt.pad(capacity=64), jnp.ones((8, 32), jnp.float32)
        )
        assert old.is_deleted()  # donated ...
        assert params["fp32_d16"].unsafe_buffer_pointer() == pointer  # ... and written in place
        assert opt_state.tables["fp32_d16"]["momentum1"].unsafe_buffer_pointer() == state_pointer
    # different length caps per step may exist; with caps not part of the update's shapes, one compile
    assert update.compile_count() == 1


def test_from_optax_adam_equals_builtin_adam_and_sgd():
    rng = np.random.default_rng(5)
    case = random_case(rng, weighted=True, hot_rows=4)
    ebc = EmbeddingBagCollection(case.tables, is_weighted=True)
    grad = jnp.asarray(
        rng.normal(size=(case.stride, sum(ebc.layout.output_dims))).astype(np.float32)
    )
    kjt = case.kjt.pad(capacity=128)
    pairs = [
        (optim.adam(lr=0.05, eps=1e-8), optim.from_optax(optax.adam(0.05, eps=1e-8))),
        (optim.sgd(lr=0.3), optim.from_optax(optax.sgd(0.3))),
    ]
    for ours, theirs in pairs:
        _assert_same_three_steps(ebc, ours, theirs, kjt, grad)


def _assert_same_three_steps(ebc, ours, theirs, kjt, grad):
    """Three updates from the same initial tables under each rule give the same tables."""
    results = []
    for rule in (ours, theirs):
        params = ebc.init(jax.random.key(1))
        state, update = rule.init(params), make_update(ebc, rule)
        dtypes = [x.dtype for x in jax.tree_util.tree_leaves(state)]
        for _ in range(3):
            params, state = update(params, state, kjt, grad)
        assert [x.dtype for x in jax.tree_util.tree_leaves(state)] == dtypes, (
            rule.name
        )  # optax's int32 count too
        assert update.compile_count() == 1, rule.name
        results.append(params)
    for g in results[0]:
        np.testing.assert_allclose(
            np.asarray(results[0][g]), np.asarray(results[1][g]), rtol=1e-5, atol=1e-6
        )


def test_bad_optimizer_arguments():
    with pytest.raises(ValueError, match="rowwise_adagrad: lr=-1"):
        optim.rowwise_adagrad(lr=-1)
    with pytest.raises(ValueError, match="beta1=1.0 must be below 1"):
        optim.adam(beta1=1.0)
    t = EmbeddingBagConfig(name="t", num_embeddings=6, embedding_dim=3, feature_names=["f"])
    with pytest.raises(ValueError, match="needs a sparse_jax.optim row rule"):
        make_update(EmbeddingBagCollection([t]), optax.sgd(0.1))
    ebc = EmbeddingBagCollection([t])
    params = ebc.init(jax.random.key(0))
    kjt = KeyedJaggedTensor(["f"], np.array([1]), lengths=np.array([1])).pad(capacity=8)
    with pytest.raises(
        ValueError,
        match=r"pooled_grad has shape \(1, 4\); expected \[batch, sum of dims\] = \[1, 3\]",
    ):
        make_update(ebc, optim.sgd())(
            params, optim.sgd().init(params), kjt, jnp.ones((1, 4), jnp.float32)
        )


@pytest.mark.parametrize("rule", sorted(RULES))
def test_three_fused_steps_on_fp16_tables_match_loops(rule):
    """Narrow tables take each rule's own row math (`update_rows`: fp32 tables take the
    scatter-add SGD and the C++ kernel instead); with `stochastic_rounding=False` rows are
    rounded to the nearest fp16 once per step: the loops (float64, rounded to fp16 after each
    step) agree to one fp16 ulp (fp32 vs float64 math can flip a rounding)."""
    rng = np.random.default_rng(7)
    case = random_case(np.random.default_rng(1), data_type="FP16")
    ebc = EmbeddingBagCollection(case.tables, kernel="auto")
    params = ebc.init(jax.random.key(0))
    assert all(v.dtype == jnp.float16 for v in params.values())
    opt = getattr(optim, rule)(**RULES[rule], stochastic_rounding=False)
    opt_state, update = opt.init(params), make_update(ebc, opt)
    weights = {k: np.asarray(v, np.float64) for k, v in ebc.table_weights(params).items()}
    states: dict = {}
    for step in range(1, 4):
        c = random_case(
            np.random.default_rng(step), hot_rows=5, batch=4, shuffle_keys=False, data_type="FP16"
        )
        c.tables = list(ebc.tables)
        grad = rng.normal(size=(c.stride, sum(ebc.layout.output_dims))).astype(np.float32)
        params, opt_state = update(params, opt_state, c.kjt.pad(capacity=64), jnp.asarray(grad))
        reference.fused_step(
            rule,
            RULES[rule],
            weights,
            states,
            reference.row_gradients(c.features, c.bag_ids, _grad_blocks(c, grad), c.bag_weights),
            step,
        )
        weights = {k: w.astype(np.float16).astype(np.float64) for k, w in weights.items()}
    got = ebc.table_weights(params)
    for table, w in weights.items():
        ulp = np.spacing(np.abs(w).astype(np.float16)).astype(np.float64)
        np.testing.assert_array_less(
            np.abs(np.asarray(got[table], np.float64) - w), ulp * 1.001, err_msg=f"table {table}"
        )
        assert not np.allclose(
            np.asarray(got[table], np.float64),
            np.asarray(ebc.table_weights(ebc.init(jax.random.key(0)))[table], np.float64),
        )


def test_rules_carry_their_names_and_documented_defaults():
    assert (optim.sgd().name, optim.sgd().hyperparams) == ("sgd", {"lr": 0.01})
    for name in ("adagrad", "rowwise_adagrad"):
        rule = getattr(optim, name)()
        assert (rule.name, rule.hyperparams) == (name, {"lr": 0.01, "eps": 1e-8})
    adam = optim.adam()
    assert (adam.name, adam.hyperparams) == (
        "adam",
        {"lr": 0.001, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.0},
    )
    tx = optim.from_optax(optax.sgd(0.1))
    assert (tx.name, tx.hyperparams) == ("optax", {})
    assert optim.from_optax(optax.sgd(0.1), name="my_sgd").name == "my_sgd"
    assert optim.sgd().init({"t": jnp.zeros((3, 2))}).tables == {"t": ()}


def test_refusals_name_the_optimizer_and_the_value():
    import re

    for name in ("sgd", "adagrad", "rowwise_adagrad", "adam"):
        with pytest.raises(ValueError, match=re.escape(f"{name}: lr=-1 must be a number >= 0")):
            getattr(optim, name)(lr=-1)
    with pytest.raises(ValueError, match=re.escape("adam: beta2=1.5 must be below 1")):
        optim.adam(beta2=1.5)
    with pytest.raises(ValueError, match=re.escape("adam: eps='x' must be a number >= 0")):
        optim.adam(eps="x")

    class OnlyInit:
        def init(self, params):
            return ()

    for bad in (OnlyInit(), object()):
        with pytest.raises(
            ValueError,
            match=re.escape(
                f"from_optax: expected an optax.GradientTransformation, got {type(bad).__name__}"
            ),
        ):
            optim.from_optax(bad)


def test_state_is_fp32_even_with_x64_on():
    with jax.enable_x64(True):
        params = {"t": jnp.zeros((5, 3), jnp.float32)}
        for rule in (
            optim.adagrad(),
            optim.rowwise_adagrad(),
            optim.adam(),
            optim.from_optax(optax.adam(0.1)),
        ):
            leaves = [x for x in jax.tree_util.tree_leaves(rule.init(params).tables) if x.ndim]
            assert leaves and all(x.dtype == jnp.float32 for x in leaves), rule.name


def test_from_optax_adamw_equals_builtin_adam_with_weight_decay():
    """optax's AdamW reads the params (the decay term): the rows must reach `tx.update`."""
    rng = np.random.default_rng(11)
    case = random_case(rng, hot_rows=4)
    ebc = EmbeddingBagCollection(case.tables, kernel="xla")
    grad = jnp.asarray(
        rng.normal(size=(case.stride, sum(ebc.layout.output_dims))).astype(np.float32)
    )
    kjt = case.kjt.pad(capacity=128)
    _assert_same_three_steps(
        ebc,
        optim.adam(lr=0.05, beta1=0.7, beta2=0.9, eps=0.2, weight_decay=0.3),
        optim.from_optax(optax.adamw(0.05, b1=0.7, b2=0.9, eps=0.2, weight_decay=0.3)),
        kjt,
        grad,
    )


def test_dedup_of_an_empty_and_a_one_id_stream():
    from sparse_jax.optim._apply import dedup_row_grads

    bag_grads = jnp.arange(15, dtype=jnp.float32).reshape(3, 5)
    empty = jnp.zeros(0, jnp.int32)
    unique, grads = dedup_row_grads(empty, empty, jnp.zeros(0, jnp.float32), bag_grads, num_rows=4)
    assert unique.shape == (0,) and grads.shape == (0, 5) and grads.dtype == jnp.float32
    unique, grads = dedup_row_grads(
        jnp.array([2], jnp.int32),
        jnp.array([1], jnp.int32),
        jnp.array([0.5], jnp.float32),
        bag_grads,
        num_rows=4,
    )
    assert unique.tolist() == [2]
    np.testing.assert_array_equal(np.asarray(grads), [[2.5, 3.0, 3.5, 4.0, 4.5]])


def test_dedup_drops_rows_and_bags_outside_their_range():
    """Rows outside [0, num_rows) add to no slot (every slot without a row sums to 0); a bag
    outside the gradient's bags reads 0 whatever its scale; grads are summed in fp32."""
    from sparse_jax.optim._apply import dedup_row_grads

    rows = jnp.array([2, 4, 0, 2, -1, 1, 1], jnp.int32)  # num_rows = 4: 4 and -1 are outside
    bag = jnp.array([0, 1, 2, 1, 0, 3, 2], jnp.int32)  # 3 bags: bag 3 is outside
    scale = jnp.array([1.0, 2.0, 1.0, 0.5, 1.0, 1.0, 3.0], jnp.float32)
    bag_grads = jnp.array([[1, 2], [3, 4], [5, 6]], jnp.bfloat16)
    unique, grads = dedup_row_grads(rows, bag, scale, bag_grads, num_rows=4)
    assert grads.dtype == jnp.float32 and unique.shape == (7,)
    unique, grads = np.asarray(unique), np.asarray(grads)
    got = {int(u): grads[i].tolist() for i, u in enumerate(unique) if u >= 0}
    assert got == {0: [5.0, 6.0], 1: [15.0, 18.0], 2: [2.5, 4.0]}
    assert not grads[unique < 0].any()


@pytest.mark.parametrize("spec", [("model",), (("data", "model"),), ()])
def test_state_is_placed_like_its_table(spec):
    """Per-row state leaves are sharded over the table's row axes, global leaves (optax's
    count, the step count) replicated on the same mesh; on one device nothing is moved."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = jax.make_mesh((2, 4), ("data", "model"))
    table = jax.device_put(jnp.zeros((16, 3), jnp.float32), NamedSharding(mesh, P(*spec)))
    for rule in (optim.rowwise_adagrad(), optim.adam(), optim.from_optax(optax.adam(0.1))):
        state = rule.init({"t": table})
        assert state.count.sharding == NamedSharding(mesh, P())
        leaves = jax.tree_util.tree_leaves(state.tables["t"])
        assert len(leaves) == len(jax.tree_util.tree_leaves(rule.init_table(table))) >= 1
        for leaf in leaves:
            rows = (
                spec[0] if spec else None
            )  # full rank, as the update returns it (one jit cache key)
            want = P(rows, *[None] * (leaf.ndim - 1)) if leaf.ndim and leaf.shape[0] == 16 else P()
            assert leaf.sharding == NamedSharding(mesh, want), (
                rule.name,
                leaf.shape,
                leaf.sharding,
            )
            assert not np.asarray(leaf).any()
    one = optim.adam().init({"t": jnp.zeros((4, 2), jnp.float32)})
    assert all(len(x.sharding.device_set) == 1 for x in jax.tree_util.tree_leaves(one))
    host = optim.rowwise_adagrad().init(
        {"t": np.zeros((4, 2), np.float32)}
    )  # host tables (e.g. pretrained)
    assert host.tables["t"]["momentum1"].shape == (4,)


@pytest.mark.parametrize("rule", ["sgd", "adagrad", "rowwise_adagrad"])
def test_the_id_stream_update_on_the_cpu_kernel_equals_xla(rule):
    """`update_rows` (the sharded programs' update) with kernel='auto' runs the C++ id-stream
    kernel on the buffer and its state leaf; kernel='xla' the XLA form: same numbers."""
    from sparse_jax import _kernels
    from sparse_jax._row_update import update_rows as apply_row_rule

    if not _kernels.available():
        pytest.skip("CPU kernels not built")
    rng = np.random.default_rng(3)
    r = getattr(optim, rule)(**RULES[rule])
    rows = jnp.asarray(rng.integers(0, 12, 40), jnp.int32).at[5].set(12)  # one id past the buffer
    bag = jnp.asarray(rng.integers(0, 6, 40), jnp.int32)
    scale = jnp.asarray(rng.random(40) + 0.5, jnp.float32)
    bag_grads = jnp.asarray(rng.normal(size=(6, 4)), jnp.float32)
    out = {}
    for kernel in ("auto", "xla"):
        table = jnp.asarray(np.random.default_rng(0).normal(size=(12, 4)), jnp.float32)
        state = r.init_table(table)
        if rule != "sgd":
            state = {"momentum1": state["momentum1"] + 0.25}  # a state that is not all zero
        out[kernel] = apply_row_rule(
            r, table, state, jnp.int32(1), rows, bag, scale, bag_grads, kernel=kernel
        )
        text = (
            jax.jit(
                lambda t, s, r=r, k=kernel: apply_row_rule(
                    r, t, s, jnp.int32(1), rows, bag, scale, bag_grads, kernel=k
                )
            )
            .lower(table, state)
            .as_text()
        )
        assert ("custom_call @HybridrecFusedUpdate" in text) == (kernel == "auto")
    for a, b in zip(
        jax.tree_util.tree_leaves(out["auto"]), jax.tree_util.tree_leaves(out["xla"]), strict=True
    ):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
    assert len(jax.tree_util.tree_leaves(out["auto"])) == (1 if rule == "sgd" else 2)
    assert jax.tree_util.tree_structure(out["auto"]) == jax.tree_util.tree_structure(
        out["xla"]
    )  # same state keys
