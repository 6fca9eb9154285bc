"""`make_update`'s contract beyond its numbers (those are in test_optim / test_kernel_update):
which path its program takes, what it donates, how often it compiles, what its skip
counters say, and its refusals, each matched in full."""

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
    _lookup,
    make_update,
    optim,
)
from sparse_jax._update import all_finite
from tests.host_reads import count_eager_ops

TABLES = [
    EmbeddingBagConfig(16, 4, "t", feature_names=["f"]),
    EmbeddingBagConfig(8, 4, "u", feature_names=["g"]),
]


def _setup(kernel="xla", rule=None, skip_nonfinite=False):
    ebc = EmbeddingBagCollection(TABLES, kernel=kernel)
    rule = rule or optim.rowwise_adagrad(lr=0.1)
    params = ebc.init(jax.random.key(0))
    kjt = KeyedJaggedTensor(
        ["f", "g"], np.array([1, 2, 15, 0, 7, 3], np.int32), lengths=np.array([2, 1, 1, 2])
    )
    return (
        ebc,
        rule,
        params,
        rule.init(params),
        ebc.prepare(kjt),
        make_update(ebc, rule, skip_nonfinite=skip_nonfinite),
    )


def _grad(value=1.0):
    return jnp.full((2, 8), value, jnp.float32)


def test_a_kernel_name_outside_the_list_is_refused_not_taken_for_xla():
    msg = "kernel='XLA' is not one of ('auto', 'ffi', 'xla', 'reference', 'pallas')"
    with pytest.raises(ValueError, match=re.escape(msg)):
        _lookup.use_ffi("XLA", np.zeros((2, 2), np.float32))
    with pytest.raises(ValueError, match=re.escape(msg)):
        EmbeddingBagCollection(TABLES, kernel="XLA")
    with pytest.raises(ValueError, match=re.escape("kernel=None is not one of")):
        _lookup.use_ffi(None, np.zeros((2, 2), np.float32))


@pytest.mark.parametrize("rule", ["sgd", "adagrad", "rowwise_adagrad", "adam"])
def test_the_update_program_takes_the_path_its_kernel_names(rule):
    """kernel='xla' (the GPU path): no C++ call in the update; 'auto' on CPU: the fused C++
    update for the rules it knows, XLA for the others (adam)."""
    for kernel in ("xla", "reference", "auto"):
        ebc, r, params, state, batch, update = _setup(kernel, getattr(optim, rule)(lr=0.1))
        text = update.jitted.lower(params, state, ebc.update_operands(batch, _grad())).as_text()
        custom = re.search(r"custom_call @Hybridrec\w*Update", text) is not None
        want = kernel == "auto" and _kernels.available() and rule in _kernels.RULES
        assert custom == want, (kernel, rule)


@pytest.mark.parametrize(
    "rule, adds", [("sgd", True), ("adagrad", True), ("rowwise_adagrad", True), ("adam", False)]
)
def test_an_additive_rule_adds_its_step_to_the_rows_without_reading_them(rule, adds):
    """kernel='xla', fp32: a rule whose step does not read the rows (`row_step`) is one add
    over the unique rows (a read-modify-write of each), no gather of the table's rows; adam
    (weight decay reads them) gathers, steps and sets. Both equal the reference update."""
    ebc, r, params, state, batch, update = _setup("xla", getattr(optim, rule)(lr=0.1))
    text = update.jitted.lower(params, state, ebc.update_operands(batch, _grad())).as_text()
    # %arg0: the stacked buffer of both tables (params' one leaf)
    reads_rows = re.search(r'"stablehlo.gather"\(%arg0,', text) is not None
    at = text.index('"stablehlo.scatter"(%arg0,')
    body = text[at : text.index("stablehlo.return", at)]
    assert reads_rows != adds and ("stablehlo.add" in body) == adds, rule
    ref_ebc, *_ = _setup("reference", getattr(optim, rule)(lr=0.1))
    copy = jax.tree.map(jnp.copy, params)  # each update donates the tables it takes
    want_params, _ = make_update(ref_ebc, getattr(optim, rule)(lr=0.1))(
        copy, r.init(copy), batch, _grad()
    )
    got_params, _ = update(params, state, batch, _grad())
    for g in got_params:
        np.testing.assert_allclose(got_params[g], want_params[g], rtol=1e-6, atol=1e-7)


def test_a_rule_takes_a_native_kernel_by_declaration_never_by_its_name():
    """`from_optax(optax.sgd(...), name="sgd")` is named like SGD but declares no native
    optimizer: its update is the generic XLA form on CPU (no C++ call, which would read a
    learning rate it does not have) and on CUDA (no Pallas kernel), and it trains as SGD."""
    import optax

    custom = optim.from_optax(optax.sgd(0.1), name="sgd")
    assert custom.native is None and optim.sgd(lr=0.1).native == "sgd"
    ebc, r, params, state, batch, update = _setup("auto", custom)
    operands = ebc.update_operands(batch, _grad())
    traced = update.jitted.trace(params, state, operands)
    assert "custom_call @Hybridrec" not in traced.lower(lowering_platforms=("cpu",)).as_text()
    assert "xla.gpu.triton" not in traced.lower(lowering_platforms=("cuda",)).as_text()
    new, _ = update(params, state, batch, _grad())
    ebc2, r2, params2, state2, batch2, update2 = _setup("xla", optim.sgd(lr=0.1))
    want, _ = update2(params2, state2, batch2, _grad())
    for a, b in zip(jax.tree_util.tree_leaves(new), jax.tree_util.tree_leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("skip_nonfinite", [False, True])
def test_the_update_donates_tables_and_state_and_compiles_once(skip_nonfinite):
    ebc, rule, params, state, batch, update = _setup("xla", skip_nonfinite=skip_nonfinite)
    for _ in range(3):
        old_table, old_state = params["t_u" if "t_u" in params else next(iter(params))], state
        params, state = update(params, state, batch, _grad())
        assert old_table.is_deleted(), "the tables were not donated"
        assert all(x.is_deleted() for x in jax.tree_util.tree_leaves(old_state.tables)), (
            "the state was not donated"
        )
    assert update.compile_count() == 1


def test_skip_counters_start_empty_and_keep_the_first_skipped_call():
    ebc, rule, params, state, batch, update = _setup("xla", skip_nonfinite=True)
    count, first = update.nonfinite()
    assert (int(count), int(first)) == (0, -1) and count.dtype == first.dtype == jnp.int32
    for g in (_grad(np.nan), _grad(), _grad(np.inf), _grad()):  # calls 0 and 2 are skipped
        params, state = update(params, state, batch, g)
    count, first = update.nonfinite()
    assert (int(count), int(first)) == (2, 0)
    assert int(state.count) == 2
    assert update.compile_count() == 1  # the counters' dtype never changes the program


def test_refusals_name_what_to_do():
    ebc, rule, params, state, batch, update = _setup("xla")
    with pytest.raises(
        ValueError,
        match="^" + re.escape("make_update needs a sparse_jax.optim row rule, got str") + "$",
    ):
        make_update(ebc, "sgd")
    with pytest.raises(
        ValueError, match="^" + re.escape("ok= needs make_update(..., skip_nonfinite=True)") + "$"
    ):
        update(params, state, batch, _grad(), ok=jnp.ones((), bool))
    for plain in (update, make_update(ebc, rule)):  # skip_nonfinite is off unless asked for
        with pytest.raises(
            ValueError,
            match="^" + re.escape("this update was made without skip_nonfinite=True") + "$",
        ):
            plain.nonfinite()


def test_all_finite_reads_only_floating_leaves():
    for tree, want in [
        ({}, True),
        ({"ids": jnp.array([1, 2**31 - 1], jnp.int32)}, True),
        ((jnp.array([1.0, 2.0]), jnp.array([3], jnp.int32)), True),
        ((jnp.array([1.0, np.nan]), jnp.array([3], jnp.int32)), False),
        ([jnp.zeros(3, jnp.bfloat16), jnp.array([-np.inf], jnp.float32)], False),
    ]:
        got = all_finite(tree)
        assert got.shape == () and got.dtype == jnp.bool_ and bool(got) is want, tree


def test_a_guarded_update_of_tables_committed_to_another_device_stays_there_and_compiles_once():
    ebc, rule, params, state, batch, update = _setup("xla", skip_nonfinite=True)
    other = jax.devices()[1]
    params, state = jax.device_put((params, state), other)
    for g in (_grad(), _grad(np.nan), _grad()):
        params, state = update(params, state, jax.device_put(batch, other), g)
    assert all(x.devices() == {other} for x in jax.tree_util.tree_leaves((params, state)))
    assert int(update.nonfinite()[0]) == 1 and update.compile_count() == 1


def test_a_guarded_sharded_update_compiles_once_with_and_without_ok():
    """On a mesh the skip counters are placed like the state before the first call, and a
    missing `ok` is the same boolean as a given one: one program for every call."""
    from sparse_jax.sharding import shard

    mesh = jax.make_mesh((2, 4), ("data", "model"))
    ebc = EmbeddingBagCollection(TABLES, kernel="xla")
    sharded = shard(ebc, mesh, {"t": "row_wise", "u": "table_wise"})
    rule = optim.rowwise_adagrad(lr=0.1)
    params = sharded.init(jax.random.key(0))
    state = rule.init(params)
    update = make_update(sharded, rule, skip_nonfinite=True)
    kjt = KeyedJaggedTensor(
        ["f", "g"], np.arange(16, dtype=np.int32) % 8, lengths=np.ones(16, np.int32)
    )
    for ok in (None, jnp.ones((), bool), None, jnp.zeros((), bool)):
        params, state = update(params, state, kjt, jnp.ones((8, 8), jnp.float32), ok=ok)
    assert int(update.nonfinite()[0]) == 1 and update.compile_count() == 1


def test_a_guarded_call_dispatches_one_program_and_no_eager_op():
    # each eager op is a round of host dispatch; on a GPU two of them per call (the flag's
    # reshape, the call index's transfer) took longer than the update itself
    ebc, rule, params, state, batch, update = _setup("xla", skip_nonfinite=True)
    keep = [params, state]
    ok, grad = jnp.ones((), bool), _grad()

    def call(**kw):
        keep[:] = update(*keep, batch, grad, **kw)

    call()
    call(ok=ok)  # both compiled
    with count_eager_ops() as eager:
        for _ in range(3):
            call()
            call(ok=ok)
    assert eager.sites == []
    assert update.compile_count() == 1  # with and without ok=: one program
    keep[:] = update(
        *keep, batch, _grad(np.nan)
    )  # call 8 is skipped: the index is counted on the device
    count, first = update.nonfinite()
    assert (int(count), int(first)) == (1, 8)
