"""A table's uniform initial rows (`sparse_jax._uniform_init.uniform_rows`, what
`initial_weights`, `init` and the sharded `init` draw): bit for bit `jax.random.uniform`'s
whole-table draw, row ranges included, on CPU without compiling threefry."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sparse_jax import EmbeddingBagConfig
from sparse_jax._kernels import _ffi
from sparse_jax._uniform_init import draws_rows_alone, uniform_rows
from tests import reference

KEYS = {
    "typed": lambda: jax.random.key(3),
    "folded": lambda: jax.random.fold_in(jax.random.key(2**31 + 5), 7),
    "raw": lambda: jax.random.PRNGKey(11),
}


@pytest.fixture(params=["kernel", "xla"])
def form(request, monkeypatch):
    """The CPU kernel's program, or the XLA program a host without the built kernels runs."""
    if request.param == "xla":
        monkeypatch.setattr(_ffi, "_register", lambda: "kernels switched off by the test")
    jax.clear_caches()  # the draw's programs are cached per shape: lower them again
    yield request.param
    jax.clear_caches()


@pytest.mark.parametrize("key", sorted(KEYS))
@pytest.mark.parametrize(
    ("rows", "dim", "first", "count"),
    [(1, 1, 0, 1), (5, 3, 0, 5), (500, 6, 0, 500), (500, 6, 17, 100), (257, 16, 256, 1)],
)
def test_uniform_rows_are_the_rows_of_jax_random_uniform(form, key, rows, dim, first, count):
    k = KEYS[key]()
    want = np.asarray(jax.random.uniform(k, (rows, dim), jnp.float32, -0.3, 0.7))
    got = np.asarray(uniform_rows(k, rows, dim, -0.3, 0.7, first, count))
    assert got.dtype == np.float32 and got.shape == (count, dim)
    np.testing.assert_array_equal(got.view(np.uint32), want[first : first + count].view(np.uint32))


def test_rows_past_two_to_the_32_elements_match_the_threefry_loop():
    """Flat indices with a nonzero high word (a table of more than 2^32 elements), checked
    against the plain loop: a kernel keeping the index in 32 bits would repeat the first rows.
    (The kernel only: the XLA form draws the whole 64 GB table.)"""
    assert draws_rows_alone(jax.random.key(5))
    key = jax.random.key(5)
    dim, first = 8, 2**32 // 8 + 3  # element n = first * dim > 2^32
    got = np.asarray(uniform_rows(key, first + 4, dim, -1.0, 1.0, first, 2))
    want = reference.uniform_table_loop(
        np.asarray(jax.random.key_data(key)), first, 2, dim, -1.0, 1.0
    )
    np.testing.assert_array_equal(got, want)
    assert not np.array_equal(got[0], np.asarray(uniform_rows(key, 8, dim, -1.0, 1.0, 3, 1))[0])


def test_the_loop_oracle_is_jax_random_uniform():
    key = jax.random.key(9)
    want = np.asarray(jax.random.uniform(key, (6, 5), jnp.float32, -0.5, 0.25))
    got = reference.uniform_table_loop(np.asarray(jax.random.key_data(key)), 2, 3, 5, -0.5, 0.25)
    np.testing.assert_array_equal(got, want[2:5])


def test_the_cpu_draw_is_the_kernel_and_compiles_no_threefry(monkeypatch):
    """Built, the CPU program is one custom call and the float step (no threefry rounds for
    XLA to compile); not built, it is jax's own draw."""
    from sparse_jax._uniform_init import _draw

    key, bounds = jax.random.key_data(jax.random.key(1)), np.array([-0.1, 0.1], np.float32)
    built = _draw.trace(key, bounds, 1000, 16, 0, 1000).lower().as_text()
    assert "HybridrecTableBits" in built and "threefry" not in built.lower()
    monkeypatch.setattr(_ffi, "_register", lambda: "kernels switched off by the test")
    jax.clear_caches()  # the lowering above is cached
    plain = _draw.trace(key, bounds, 1000, 16, 0, 1000).lower().as_text()
    jax.clear_caches()
    assert "HybridrecTableBits" not in plain and "threefry" in plain.lower()


def test_initial_weights_draws_through_uniform_rows_and_init_fn_is_kept():
    config = EmbeddingBagConfig(name="t", num_embeddings=40, embedding_dim=4, feature_names=["f"])
    key = jax.random.key(2)
    want = jax.random.uniform(
        key, (40, 4), jnp.float32, config.weight_init_min, config.weight_init_max
    )
    np.testing.assert_array_equal(np.asarray(config.initial_weights(key)), np.asarray(want))

    def ones(key, shape, dtype):
        return jnp.ones(shape, dtype)

    custom = EmbeddingBagConfig(
        name="t", num_embeddings=40, embedding_dim=4, feature_names=["f"], init_fn=ones
    )
    np.testing.assert_array_equal(np.asarray(custom.initial_weights(key)), np.ones((40, 4)))


def test_a_row_range_outside_the_draw_is_refused():
    with pytest.raises(ValueError, match="rows 8:12 are not inside a draw of 10 rows"):
        uniform_rows(jax.random.key(0), 10, 4, -1.0, 1.0, 8, 4)
