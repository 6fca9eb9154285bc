"""Write-back rounding of fp16 / bf16 tables (`sparse_jax.optim._rounding`): round-to-nearest
is `astype`; stochastic rounding picks one of the two narrow neighbours with the probability
that makes it unbiased, from a hash of (seed, step, row, column), against the plain loop in
tests/reference.py; the fused update writes narrow rows through it."""

import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from sparse_jax import (
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    KeyedJaggedTensor,
    make_update,
    optim,
)
from sparse_jax._configs import DataType
from sparse_jax.optim._rounding import round_rows, uniform_bits
from tests import reference

# the inputs include values past fp16's largest: numpy's casts and nextafter warn on them
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
NARROW = {"fp16": np.float16, "bf16": ml_dtypes.bfloat16}


def _values(rng, n, dim):
    """Ordinary values, values the narrow types hold exactly, fp16 subnormals, values past
    fp16's largest finite value, zeros and non-finite ones."""
    x = rng.normal(size=(n, dim)).astype(np.float32) * np.float32(3)
    x[0, :4] = [1.0, -0.5, 0.0, 65504.0]
    x[1, :4] = [3e-6, -7e-7, 65510.0, 70000.0]
    x[2, :3] = [np.inf, -np.inf, np.nan]
    x[3] = rng.normal(size=dim).astype(np.float32) * np.float32(1e-3)
    return x


@pytest.mark.parametrize("name", sorted(NARROW))
def test_stochastic_rounding_equals_the_loop_and_lands_on_a_neighbour(name):
    dtype = NARROW[name]
    rng = np.random.default_rng(3)
    x = _values(rng, 12, 7)
    rows = rng.permutation(1000)[:12].astype(np.int32)
    got = np.asarray(
        round_rows(
            jnp.asarray(x),
            dtype,
            stochastic=True,
            seed=11,
            step=jnp.int32(5),
            rows=jnp.asarray(rows),
        )
    )
    want = reference.stochastic_round_loop(x, dtype, 11, 5, rows)
    assert got.dtype == dtype
    np.testing.assert_array_equal(got.view(np.uint16), want.view(np.uint16))
    finite = np.isfinite(x)
    near = x.astype(dtype)
    other = np.nextafter(near, np.where(near.astype(np.float32) > x, -np.inf, np.inf).astype(dtype))
    assert np.all((got[finite] == near[finite]) | (got[finite] == other[finite]))
    exact = near.astype(np.float32) == x
    np.testing.assert_array_equal(got[exact], near[exact])
    assert np.isnan(got[2, 2]) and got[2, 0] == np.inf and got[2, 1] == -np.inf
    assert (got != near).any(), "stochastic rounding never left the nearest value"


@pytest.mark.parametrize("name", sorted(NARROW))
def test_round_to_nearest_is_astype_and_fp32_tables_are_untouched(name):
    x = _values(np.random.default_rng(4), 6, 5)
    rows = jnp.arange(6, dtype=jnp.int32)
    for stochastic in (False, True):
        got = round_rows(
            jnp.asarray(x), jnp.float32, stochastic=stochastic, seed=0, step=jnp.int32(1), rows=rows
        )
        np.testing.assert_array_equal(np.asarray(got), x)
    got = round_rows(
        jnp.asarray(x), NARROW[name], stochastic=False, seed=0, step=jnp.int32(1), rows=rows
    )
    np.testing.assert_array_equal(
        np.asarray(got).view(np.uint16), x.astype(NARROW[name]).view(np.uint16)
    )


@pytest.mark.parametrize("name", sorted(NARROW))
@pytest.mark.parametrize("fraction", [0.25, 0.5, 0.875])
def test_stochastic_rounding_is_unbiased(name, fraction):
    """x a quarter, half or seven eighths of the way from lo to hi: over 40000 draws
    (rows x steps) the mean is x within 5 standard errors, and the share rounded up is the
    fraction; round-to-nearest is off by the whole distance."""
    dtype = NARROW[name]
    lo = np.asarray(1.0, dtype)
    hi = np.nextafter(lo, np.asarray(2.0, dtype))
    gap = float(hi) - float(lo)
    x = np.float32(float(lo) + fraction * gap)
    n_rows, n_steps, dim = 500, 20, 4
    rows = jnp.arange(n_rows, dtype=jnp.int32)
    ups = []
    for step in range(n_steps):
        got = round_rows(
            jnp.full((n_rows, dim), x),
            dtype,
            stochastic=True,
            seed=9,
            step=jnp.int32(step),
            rows=rows,
        )
        ups.append(np.asarray(got, np.float64) == float(hi))
    share = np.mean(ups)
    se = np.sqrt(fraction * (1 - fraction) / (n_rows * n_steps * dim))
    assert abs(share - fraction) < 5 * se, (share, fraction)
    nearest_error = abs(float(x.astype(dtype)) - float(x)) / gap
    assert nearest_error >= min(fraction, 1 - fraction) - 1e-6


def test_the_draw_is_a_function_of_seed_step_row_and_column():
    rows = jnp.array([3, 17, 400, 9], jnp.int32)
    a = np.asarray(uniform_bits(1, jnp.int32(2), rows, 6))
    np.testing.assert_array_equal(a, np.asarray(uniform_bits(1, jnp.int32(2), rows, 6)))
    np.testing.assert_array_equal(
        a[::-1], np.asarray(uniform_bits(1, jnp.int32(2), rows[::-1], 6))
    )  # per row, not position
    for other in (
        uniform_bits(2, jnp.int32(2), rows, 6),
        uniform_bits(1, jnp.int32(3), rows, 6),
        uniform_bits(1, jnp.int32(2), rows + 1, 6),
    ):
        assert (np.asarray(other) != a).mean() > 0.9
    assert len(np.unique(a)) == a.size  # columns and rows draw distinct bits
    bits = np.asarray(uniform_bits(0, jnp.int32(1), jnp.arange(4096, dtype=jnp.int32), 16)) >> 8
    assert abs(bits.mean() / 2**24 - 0.5) < 0.005  # uniform's mean 1/2: se 0.0011


def _one_table(data_type):
    return EmbeddingBagCollection(
        [EmbeddingBagConfig(8, 4, "t", feature_names=["f"], data_type=data_type)], kernel="xla"
    )


def _run(rule, data_type, steps):
    """SGD steps with a tiny gradient on rows 1 and 5 of a table of ones (fp16's ulp at 1 is
    2^-10; each step moves a row by 1e-4, under half an ulp)."""
    ebc = _one_table(data_type)
    params = {g: jnp.ones_like(v) for g, v in ebc.init(jax.random.key(0)).items()}
    state, update = rule.init(params), make_update(ebc, rule)
    kjt = KeyedJaggedTensor(["f"], np.array([1, 5], np.int32), lengths=np.array([1, 1])).pad(
        capacity=4
    )
    for _ in range(steps):
        params, state = update(params, state, kjt, jnp.full((2, 4), 1e-3, jnp.float32))
    return np.asarray(ebc.table_weights(params)["t"], np.float64)


def test_fp16_sgd_keeps_updates_below_half_an_ulp_only_with_stochastic_rounding():
    steps = 200
    nearest = _run(optim.sgd(lr=0.1, stochastic_rounding=False), DataType.FP16, steps)
    np.testing.assert_array_equal(nearest, 1.0)  # every step rounded back to 1
    sr = _run(optim.sgd(lr=0.1, seed=4), DataType.FP16, steps)
    fp32 = _run(optim.sgd(lr=0.1), DataType.FP32, steps)
    np.testing.assert_array_equal(sr[[0, 2, 3, 4, 6, 7]], 1.0)  # untouched rows
    # fp32 moved rows by 200 * 1e-4 = 0.02. Below 1 fp16's ulp is 2^-11, so each step moves
    # an element down one ulp with p ~ 0.2: after 200 steps its sd is ~12 draws' worth of
    # sqrt(200 * 0.2 * 0.8) * 2^-11 = 2.8e-3, and the 8 touched elements' mean has sd 1e-3
    np.testing.assert_allclose(sr[[1, 5]], fp32[[1, 5]], atol=0.014)  # 5 sd
    assert abs(sr[[1, 5]].mean() - fp32[[1, 5]].mean()) < 0.005  # 5 sd
    np.testing.assert_array_equal(
        sr, _run(optim.sgd(lr=0.1, seed=4), DataType.FP16, steps)
    )  # same seed, same bits
    assert not np.array_equal(sr, _run(optim.sgd(lr=0.1, seed=5), DataType.FP16, steps))


def test_rounding_settings_are_checked_and_carried():
    rule = optim.rowwise_adagrad(lr=0.1, stochastic_rounding=False, seed=3)
    assert (rule.stochastic_rounding, rule.seed) == (False, 3)
    assert optim.adam().stochastic_rounding is True and optim.adam().seed == 0
    tx = __import__("optax").sgd(0.1)
    for factory in (
        optim.sgd,
        optim.adagrad,
        optim.rowwise_adagrad,
        optim.adam,
        lambda **kw: optim.from_optax(tx, **kw),
    ):
        assert (
            factory(seed=7).seed == 7
            and factory(stochastic_rounding=False).stochastic_rounding is False
        )
        assert (factory().stochastic_rounding, factory().seed) == (True, 0)  # FBGEMM's default
        assert factory(seed=2**32 - 1).seed == 2**32 - 1
    assert optim.from_optax(tx, seed=2).seed == 2
    assert optim.sgd().init({"t": jnp.zeros((4, 2), jnp.float32)}).count.dtype == jnp.int32
    with pytest.raises(
        ValueError, match=re.escape("sgd: stochastic_rounding='yes' must be True or False")
    ):
        optim.sgd(stochastic_rounding="yes")
    for seed in (-1, 2**32, 1.5, True):
        with pytest.raises(
            ValueError, match=re.escape(f"adagrad: seed={seed!r} must be an int in [0, 2**32)")
        ):
            optim.adagrad(seed=seed)


def test_an_exact_value_stays_even_when_the_draw_is_zero():
    """u = 0 is the one draw at which "go up when u * gap < x - lo" and "<=" differ: for a
    value already on the fp16 grid (x == lo) only the strict test keeps it. (seed 0, step 1,
    row 108916, column 61 draw u = 0, found by search.)"""
    rows = jnp.array([108916], jnp.int32)
    assert int(np.asarray(uniform_bits(0, jnp.int32(1), rows, 64))[0, 61]) >> 8 == 0
    x = jnp.full((1, 64), 1.5, jnp.float32)  # exact in fp16 and bf16
    for dtype in (jnp.float16, jnp.bfloat16):
        got = round_rows(x, dtype, stochastic=True, seed=0, step=jnp.int32(1), rows=rows)
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(x))
