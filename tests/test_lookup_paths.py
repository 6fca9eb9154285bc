"""Which path a pooled lookup takes, and the eager id check at the table's edge.

`kernel="xla"` is the path a GPU runs: its program must hold no C++ custom call; `"auto"`
takes the fused C++ kernel for fp32 tables on CPU when it is built and XLA otherwise (a
bf16 table); `"ffi"` refuses to fall back. `bounds_check="error"` refuses an id equal to
num_embeddings (the first row past the table) and -1, and accepts 0 and num_embeddings - 1 (clamp and skip at the edges: tests/test_kernel_update.py)."""

import re

import jax
import numpy as np
import pytest

from sparse_jax import (
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    KeyedJaggedTensor,
    _kernels,
    _lookup,
)
from sparse_jax._configs import DataType

E = 10
TABLES = [
    EmbeddingBagConfig(E, 4, "t", feature_names=["f"]),
    EmbeddingBagConfig(7, 4, "u", feature_names=["g"]),
]


def _kjt(ids_f, ids_g=(1,)):
    values = np.array([*ids_f, *ids_g], np.int32)
    return KeyedJaggedTensor(["f", "g"], values, lengths=np.array([len(ids_f), len(ids_g)]))


def _program(ebc, kjt) -> str:
    params = ebc.init(jax.random.key(0))
    batch = ebc.prepare(kjt)
    return jax.jit(ebc.apply).lower(params, batch).as_text()


def _has_custom_call(text: str) -> bool:
    """The program calls one of hybridrec's C++ kernels (`HybridrecPooledSum`, ...)."""
    return re.search(r"custom_call @Hybridrec", text) is not None


def test_the_xla_path_holds_no_custom_call_and_auto_takes_the_kernel():
    kjt = _kjt([0, 3])
    assert not _has_custom_call(_program(EmbeddingBagCollection(TABLES, kernel="xla"), kjt))
    assert not _has_custom_call(_program(EmbeddingBagCollection(TABLES, kernel="reference"), kjt))
    bf16 = [EmbeddingBagConfig(E, 4, "t", data_type=DataType.BF16, feature_names=["f", "g"])]
    assert not _has_custom_call(_program(EmbeddingBagCollection(bf16, kernel="auto"), kjt))
    if _kernels.available():
        assert _has_custom_call(_program(EmbeddingBagCollection(TABLES, kernel="auto"), kjt))
        assert _has_custom_call(_program(EmbeddingBagCollection(TABLES, kernel="ffi"), kjt))


def test_ffi_refuses_to_fall_back_and_auto_falls_back(monkeypatch):
    monkeypatch.setattr(_kernels, "available", lambda: False)
    table = np.zeros((2, 2), np.float32)
    assert _lookup.use_ffi("auto", table) is False
    assert _lookup.use_ffi("xla", table) is False
    with pytest.raises(
        ValueError,
        match="^"
        + re.escape(
            "kernel='ffi' was asked for but the CPU kernels are unavailable here (see the log); "
            "use kernel='auto' or 'xla'"
        )
        + "$",
    ):
        _lookup.use_ffi("ffi", table)
    monkeypatch.setattr(_kernels, "available", lambda: True)
    assert _lookup.use_ffi("auto", table) is True and _lookup.use_ffi("ffi", table) is True
    assert _lookup.use_ffi("xla", table) is False and _lookup.use_ffi("reference", table) is False
    assert _lookup.use_ffi("auto", table.astype(np.float16)) is False


@pytest.mark.parametrize("kernel", ["xla", "auto", "reference"])
def test_bounds_error_at_the_edges_of_the_table(kernel):
    ebc = EmbeddingBagCollection(TABLES, kernel=kernel)
    params = ebc.init(jax.random.key(0))
    out = ebc.apply(params, _kjt([0, E - 1], [6])).to_dict()
    w = ebc.table_weights(params)
    np.testing.assert_allclose(
        out["f"][0], np.asarray(w["t"])[0] + np.asarray(w["t"])[E - 1], rtol=1e-6
    )
    np.testing.assert_allclose(out["g"][0], np.asarray(w["u"])[6], rtol=1e-6)
    for ids_f, ids_g, message in [
        (
            [0, E],
            [1],
            f"feature 'f' (table 't', num_embeddings={E}): id {E} at batch position 0, index 1 in the bag "
            f"is outside [0, {E}) (1 such ids); fix the ids, or pass bounds_check='clamp' or 'skip'",
        ),
        (
            [-1],
            [1],
            "feature 'f' (table 't', num_embeddings=10): id -1 at batch position 0, index 0 in the bag",
        ),
        (
            [1],
            [0, 7, 8],
            "feature 'g' (table 'u', num_embeddings=7): id 7 at batch position 0, index 1 in the bag "
            "is outside [0, 7) (2 such ids)",
        ),
    ]:
        with pytest.raises(ValueError, match="^" + re.escape(message)):
            ebc.apply(params, _kjt(ids_f, ids_g))
    with pytest.raises(
        ValueError, match=re.escape("bounds_check='wrap' is not one of ('error', 'clamp', 'skip')")
    ):
        EmbeddingBagCollection(TABLES, bounds_check="wrap")


@pytest.mark.parametrize(
    "plan", [{"t": "row_wise", "u": "table_wise"}, {"t": "data_parallel", "u": "column_wise"}]
)
def test_sharded_lookup_takes_the_same_path(plan):
    from sparse_jax.sharding import shard

    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("model",))
    kjt = KeyedJaggedTensor(
        ["f", "g"], np.array([0, 3, 1, 2, 5, 6], np.int32), lengths=np.array([2, 0, 1, 3])
    )
    kinds = {"xla": False, "auto": _kernels.available()}
    for kernel, custom in kinds.items():
        sharded = shard(EmbeddingBagCollection(TABLES, kernel=kernel), mesh, plan)
        params = sharded.init(jax.random.key(0))
        text = jax.jit(sharded.apply).lower(params, sharded.prepare(kjt)).as_text()
        assert _has_custom_call(text) == custom, (kernel, plan)


def test_the_per_position_path_refuses_a_kjt_without_length_caps():
    """(`ebc.apply` pads a raw KJT first; the lookup itself refuses one.)"""
    ebc = EmbeddingBagCollection(TABLES, kernel="xla")
    params = ebc.init(jax.random.key(0))
    with pytest.raises(
        ValueError,
        match="^"
        + re.escape(
            "the per-position lookup needs static bag-length caps: prepare the batch (module.prepare(kjt)) "
            "or call kjt.pad(...) first, or use kernel='reference'"
        )
        + "$",
    ):
        _lookup.pooled_per_position(
            params, _kjt([0, 3]), ebc.layout, weighted=False, bounds_check="error", kernel="xla"
        )


def test_a_kjt_filled_to_its_capacity_reads_its_last_id():
    """No padding slot at all: the last bag's last id sits at index capacity - 1 (the lookup
    itself: `ebc.apply` would prepare the batch onto a ladder rung with padding)."""
    ebc = EmbeddingBagCollection(TABLES, kernel="xla")
    params = ebc.init(jax.random.key(0))
    kjt = KeyedJaggedTensor(
        ["f", "g"], np.array([2, 5, 1, 3, 4, 6], np.int32), lengths=np.array([2, 1, 1, 2], np.int32)
    ).pad(capacity=6)
    assert kjt.capacity() == 6
    w = {k: np.asarray(v) for k, v in ebc.table_weights(params).items()}
    f, g = _lookup.pooled_per_position(
        params, kjt, ebc.layout, weighted=False, bounds_check="error", kernel="xla"
    )
    np.testing.assert_allclose(np.asarray(f), [w["t"][2] + w["t"][5], w["t"][1]], rtol=1e-6)
    np.testing.assert_allclose(np.asarray(g), [w["u"][3], w["u"][4] + w["u"][6]], rtol=1e-6)


@pytest.mark.parametrize("data_type", [DataType.BF16, DataType.FP16, DataType.FP32])
def test_a_narrow_table_is_never_widened_whole(data_type):
    """The XLA pooled sum converts only the gathered rows to fp32: no temporary the size of
    the table (XLA hoisted a whole-table bf16 -> fp32 convert out of the position loop,
    5-13x slower than fp32; benchmarks/NOTES.md)."""
    rows_n, dim = 50_000, 16
    table = jax.numpy.zeros((rows_n, dim), data_type.numpy_dtype)
    rows = jax.numpy.zeros((64, 8), jax.numpy.int32)
    w = jax.numpy.ones((64, 8), jax.numpy.float32)
    compiled = jax.jit(_lookup._sum_positions).lower(table, rows, w).compile()
    assert compiled.memory_analysis().temp_size_in_bytes < rows_n * dim * 4 // 100
