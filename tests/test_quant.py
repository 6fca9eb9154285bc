"""Row-wise quantized tables (`sparse_jax._quant`) against FBGEMM and against plain loops.

Bytes: `quantize_rows` equals, row padding included, what FBGEMM's IntN TBE holds once a
table is loaded the way TorchRec loads it (`FloatOrHalfToFusedNBitRowwiseQuantizedSBHalf`,
then `assign_embedding_weights`), and the loop oracle; the tables have all-zero, one-valued,
two-valued, one-sided rows, rows whose bias and scale overflow fp16, an fp16 tie for the
minimum, and spans that round to zero, to a subnormal or below zero. Values:
`dequantize_rows` equals the loop oracle and FBGEMM's dequantization ops bit for bit.
Lookup: `quantized_pooled_lookup` equals the TBE's CPU forward (bit for bit unweighted,
1e-6 weighted) and the loop oracle: SUM and MEAN, empty bags, repeated and pruned (-1) ids,
dims that are not multiples of 8, rows padded for the GPU TBE, inside `jit`.
"""

import functools
import re
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sparse_jax._quant import dequantize_rows, quantize_rows, quantized_pooled_lookup, row_bytes
from tests import reference

TYPES = ("int8", "int4", "int2", "fp16")
# FBGEMM's AVX2 int4/int2 quantizer takes 32 values a step, then one at a time: below 32
# only the scalar path runs, 64 only the vector path, 100 both
DIMS = (4, 8, 12, 16, 64, 100)
# (weight_type, dim); int2 on fewer dims: every case costs two or three XLA compiles
CASES = [(t, d) for t in TYPES for d in DIMS if t != "int2" or d in (4, 12, 100)]
BITS = {"int8": 8, "int4": 4, "int2": 2}
ROWS = 24
CAPACITY = 48  # ids per batch, the tail past offsets[-1] is padding
KERNELS = ("ffi", "xla")  # the C++ kernel asked for by name, and the XLA form


def _need_kernel():
    from sparse_jax import _kernels

    if not _kernels.available():
        pytest.skip("the CPU kernels are not built here (no compiler, or not a CPU backend)")


@functools.cache
def _division_trap(levels):
    """A span s whose fp16 scale is wrong if s / levels is computed as s * (1 / levels), as
    XLA computes a division by a constant."""
    s = np.random.default_rng(levels).uniform(1.0, 100.0, 1_000_000).astype(np.float32)
    right = (s / np.float32(levels)).astype(np.float16)
    wrong = (s * (np.float32(1.0) / np.float32(levels))).astype(np.float16)
    return s[np.flatnonzero(right != wrong)[0]]


def _table(rng, dim):
    """Random rows from 1e-6 to 1e5 in size, then one row at each corner of the rounding rules."""
    x = rng.normal(size=(ROWS, dim)) * 10.0 ** rng.uniform(-6, 5, size=(ROWS, 1))
    x += rng.normal(size=(ROWS, 1)) * 10.0 ** rng.uniform(-3, 4, size=(ROWS, 1))
    special = [
        np.zeros(dim),
        np.full(dim, -3.25),  # one value: span 0, scale 1
        np.where(np.arange(dim) % 3 == 0, 7.0, -1.5),  # two values
        rng.uniform(1.0, 2.0, dim),
        -rng.uniform(1.0, 2.0, dim),
        rng.uniform(-1e6, 1e6, dim),  # fp16 bias -inf, scale inf
        rng.uniform(65000.0, 65600.0, dim),  # around fp16's largest finite value
        2049.0 + (np.arange(dim) % 3) * 2.0**-10,  # min 2049 is an fp16 tie: bias 2048
        rng.uniform(1.0006, 1.0009, dim),  # fp16(min) rounds above max: span < 0
        rng.uniform(-1e-7, 1e-7, dim),  # scale an fp16 subnormal
        1e-9 * rng.normal(size=dim),  # scale rounds to fp16 0, becomes 1
        np.r_[5.0001, np.full(dim - 1, 5.0)],  # one value but one element
        *[np.where(np.arange(dim) % 2 == 0, 0.0, _division_trap(2**b - 1)) for b in (2, 4, 8)],
    ]
    x[: len(special)] = special
    return x.astype(np.float32)


def _bags(rng):
    """ids [CAPACITY], offsets [10], weights [CAPACITY]: empty bags, a repeated id, a
    pruned (-1) id, a long bag, and padding after the last bag."""
    lengths = np.array([3, 0, 8, 1, 0, 5, 2, 7, 4])
    offsets = np.r_[0, np.cumsum(lengths)]
    ids = rng.integers(0, ROWS, size=CAPACITY)
    ids[offsets[2] : offsets[2] + 3] = 5  # bag 2 holds row 5 three times
    ids[offsets[5] + 1] = -1
    ids[offsets[-1] :] = -7  # padding: never read
    weights = rng.uniform(-2.0, 2.0, size=CAPACITY).astype(np.float32)
    return ids.astype(np.int32), offsets.astype(np.int32), weights


def _lookup_table(rng, dim):
    """Rows for lookups: finite values (a NaN would hide every error), sizes and offsets from
    1e-3 to 1e3 so that a bag's sums round and the order of its additions shows."""
    x = rng.normal(size=(ROWS, dim)) * 10.0 ** rng.uniform(-3, 3, size=(ROWS, 1))
    x += rng.normal(size=(ROWS, 1)) * 10.0 ** rng.uniform(-3, 3, size=(ROWS, 1))
    x[3] = 1.5  # constant row
    return x.astype(np.float32)


def _tolerance(packed, weight_type, dim, offsets, weights):
    """1e-6 of the largest sum of |w| * |row| a bag can reach."""
    rows = np.abs(reference.dequantize_rows_loop(np.asarray(packed), weight_type, dim)).max()
    w = np.ones(CAPACITY) if weights is None else np.abs(weights)
    return 1e-6 * rows * max([w[a:b].sum() for a, b in zip(offsets[:-1], offsets[1:], strict=True)])


# ---------------------------------------------------------------- FBGEMM


@pytest.fixture(scope="module")
def fbgemm():
    pytest.importorskip("fbgemm_gpu")
    import torch
    from fbgemm_gpu.split_embedding_configs import SparseType
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import (
        BoundsCheckMode,
        EmbeddingLocation,
        PoolingMode,
    )
    from fbgemm_gpu.split_table_batched_embeddings_ops_inference import (
        IntNBitTableBatchedEmbeddingBagsCodegen,
    )

    def empty_tbe(weight_type, rows, dim, pooling, row_alignment):
        module = IntNBitTableBatchedEmbeddingBagsCodegen(
            embedding_specs=[("t", rows, dim, SparseType(weight_type), EmbeddingLocation.HOST)],
            pooling_mode=PoolingMode.SUM if pooling == "SUM" else PoolingMode.MEAN,
            device="cpu",
            output_dtype=SparseType.FP32,
            row_alignment=row_alignment,
            bounds_check_mode=BoundsCheckMode.NONE,  # keep -1 (pruned) ids as they are
        )
        module.initialize_weights()
        return module

    def stored_rows(module):
        """The TBE's weight buffer as [rows, row_bytes], padding included."""
        return module.split_embedding_weights(split_scale_shifts=False)[0][0]

    def torchrec_rows(table, weight_type, row_alignment):
        """The rows the TBE holds once `table` is loaded as TorchRec's quantize_state_dict does."""
        rows, dim = table.shape
        module = empty_tbe(weight_type, rows, dim, "SUM", row_alignment)
        t = torch.from_numpy(table)
        if weight_type == "fp16":
            module.assign_embedding_weights([(t.half().view(torch.uint8), None)])
            return stored_rows(module).numpy()
        bits = BITS[weight_type]
        # the op wants dim * bits to be a multiple of 16 bits: copies of a row's own values
        # leave its min and max, and so the bytes of its first `dim` values, unchanged
        extra = (-dim) % (16 // bits)
        fused = torch.ops.fbgemm.FloatOrHalfToFusedNBitRowwiseQuantizedSBHalf(
            torch.cat([t, t[:, :extra]], 1), bits
        )
        # the op puts fp16 scale and bias at the END of a row; the TBE keeps them in front
        module.assign_embedding_weights(
            [(fused[:, : dim * bits // 8].contiguous(), fused[:, -4:].contiguous())]
        )
        return stored_rows(module).numpy()

    def tbe(packed, weight_type, dim, pooling="SUM", row_alignment=1):
        """A TBE whose weight buffer holds exactly `packed`."""
        module = empty_tbe(weight_type, packed.shape[0], dim, pooling, row_alignment)
        stored_rows(module).copy_(torch.from_numpy(np.array(packed)))
        return module

    def forward(module, ids, offsets, weights=None):
        n = int(offsets[-1])
        w = None if weights is None else torch.from_numpy(weights[:n])
        return module(
            torch.from_numpy(ids[:n].astype(np.int64)),
            torch.from_numpy(offsets.astype(np.int64)),
            w,
        ).numpy()

    def dequantize_op(packed, weight_type, dim):
        """FBGEMM's dequantization op (it reads scale and bias at the END of a row; its
        scale_bias_last=False form ignores the flag on AVX2 machines, so rows are rotated)."""
        if weight_type == "fp16":
            return (
                torch.from_numpy(np.array(packed[:, : 2 * dim])).view(torch.float16).float().numpy()
            )
        bits = BITS[weight_type]
        front = packed[:, : 4 + dim * bits // 8]
        last = np.ascontiguousarray(np.concatenate([front[:, 4:], front[:, :4]], axis=1))
        return torch.ops.fbgemm.FusedNBitRowwiseQuantizedSBHalfToFloat(
            torch.from_numpy(last), bits
        ).numpy()

    return SimpleNamespace(
        torchrec_rows=torchrec_rows, tbe=tbe, forward=forward, dequantize_op=dequantize_op
    )


@pytest.mark.parity
@pytest.mark.parametrize("weight_type, dim", CASES)
def test_bytes_are_the_rows_fbgemm_tbe_holds(fbgemm, weight_type, dim):
    table = _table(np.random.default_rng([dim, TYPES.index(weight_type)]), dim)
    for row_alignment in (1, 16):  # FBGEMM's CPU and GPU TBE
        want = fbgemm.torchrec_rows(table, weight_type, row_alignment)
        got = np.asarray(quantize_rows(table, weight_type, row_alignment=row_alignment))
        assert got.shape == want.shape == (ROWS, row_bytes(weight_type, dim, row_alignment))
        for r in range(ROWS):
            np.testing.assert_array_equal(got[r], want[r], err_msg=f"row {r}: {table[r][:4]}")


@pytest.mark.parity
@pytest.mark.parametrize("weight_type, dim", CASES)
def test_dequantize_is_fbgemm_ops_bit_for_bit(fbgemm, weight_type, dim):
    table = _table(np.random.default_rng([dim, 7]), dim)
    packed = np.asarray(quantize_rows(table, weight_type, row_alignment=16))
    got = np.asarray(dequantize_rows(packed, weight_type, dim))
    # NaN (0 times an inf scale) where FBGEMM has NaN
    np.testing.assert_array_equal(got, fbgemm.dequantize_op(packed, weight_type, dim))
    # the TBE's own kernel on bags of one row: 0 + bias, then fma(scale, q, bias)
    module = fbgemm.tbe(packed, weight_type, dim, row_alignment=16)
    np.testing.assert_array_equal(got, fbgemm.forward(module, np.arange(ROWS), np.arange(ROWS + 1)))


@pytest.mark.parity
@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("weight_type, dim", CASES)
def test_pooled_lookup_is_fbgemm_tbe_forward(fbgemm, weight_type, dim, kernel):
    if kernel == "ffi":
        _need_kernel()
    rng = np.random.default_rng([dim, TYPES.index(weight_type), 1])
    table = _lookup_table(rng, dim)
    packed = quantize_rows(table, weight_type)
    ids, offsets, weights = _bags(rng)
    for pooling in ("SUM", "MEAN"):
        module = fbgemm.tbe(np.asarray(packed), weight_type, dim, pooling)
        want = fbgemm.forward(module, ids, offsets)
        got = np.asarray(
            quantized_pooled_lookup(packed, weight_type, dim, ids, offsets, pooling, kernel=kernel)
        )
        np.testing.assert_array_equal(got, want, err_msg=f"{pooling}, unweighted")
        assert not got[[1, 4]].any()  # the empty bags
        want = fbgemm.forward(module, ids, offsets, weights)
        got = np.asarray(
            quantized_pooled_lookup(
                packed, weight_type, dim, ids, offsets, pooling, weights, kernel=kernel
            )
        )
        np.testing.assert_allclose(
            got,
            want,
            rtol=1e-6,
            atol=_tolerance(packed, weight_type, dim, offsets, weights),
            err_msg=f"{pooling}, weighted",
        )


@pytest.mark.parity
@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("weight_type", TYPES)
def test_pooled_lookup_reads_rows_padded_for_the_gpu_tbe(fbgemm, weight_type, kernel):
    if kernel == "ffi":
        _need_kernel()
    rng = np.random.default_rng([TYPES.index(weight_type), 2])
    table = _lookup_table(rng, 12)
    packed = quantize_rows(table, weight_type, row_alignment=16)
    assert packed.shape[1] == (32 if weight_type == "fp16" else 16)
    ids, offsets, weights = _bags(rng)
    module = fbgemm.tbe(np.asarray(packed), weight_type, 12, "MEAN", row_alignment=16)
    got = np.asarray(
        quantized_pooled_lookup(packed, weight_type, 12, ids, offsets, "MEAN", kernel=kernel)
    )
    np.testing.assert_array_equal(got, fbgemm.forward(module, ids, offsets))


# ---------------------------------------------------------------- loops (no FBGEMM needed)


@pytest.mark.parametrize("weight_type, dim", CASES)
def test_quantize_and_dequantize_equal_loops(weight_type, dim):
    table = _table(np.random.default_rng([dim, TYPES.index(weight_type)]), dim)
    for row_alignment in (1, 16):
        packed = np.asarray(quantize_rows(table, weight_type, row_alignment=row_alignment))
        np.testing.assert_array_equal(
            packed, reference.quantize_rows_loop(table, weight_type, row_alignment)
        )
    got = np.asarray(dequantize_rows(packed, weight_type, dim))
    np.testing.assert_array_equal(got, reference.dequantize_rows_loop(packed, weight_type, dim))


# row, and its bytes after scale and bias, worked out by hand from FBGEMM's formulas
BY_HAND = {
    # scale fp16(7.5 / 255) = 0.02941895: q = rint(x / scale)
    "int8": ([0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.5], [0, 34, 68, 102, 136, 170, 204, 255]),
    # scale 0.5: x / scale = 0, 0.5, 1.5, 2.5 round half to even to 0, 0, 2, 2; low nibble first
    "int4": ([0.0, 0.25, 0.75, 1.25, 4.0, 5.0, 6.0, 7.5], [0x00, 0x22, 0xA8, 0xFC]),
    # scale 2.5: q = 0 0 1 1 | 2 2 2 3, lowest bits first
    "int2": ([0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.5], [0b01010000, 0b11101010]),
}


@pytest.mark.parametrize("weight_type", TYPES)
def test_rounding_cases_by_hand(weight_type):
    """Values independent of both implementations (rows repeated to ROWS to reuse compiles)."""
    if weight_type == "fp16":
        packed = np.asarray(quantize_rows(np.tile([1.0, -2.0, 2049.0, 1e6], (ROWS, 1)), "fp16"))
        np.testing.assert_array_equal(packed[0].view(np.float16), [1.0, -2.0, 2048.0, np.inf])
        return
    row, want = BY_HAND[weight_type]
    packed = np.asarray(quantize_rows(np.tile(np.array(row, np.float32), (ROWS, 1)), weight_type))
    scale, bias = packed[0, :4].view(np.float16)
    assert bias == 0.0 and scale == np.float16(
        np.float32(7.5) / np.float32(2 ** BITS[weight_type] - 1)
    )
    np.testing.assert_array_equal(packed[0, 4:], want)


@pytest.mark.parametrize("weight_type, dim", CASES)
def test_pooled_lookup_equals_loops(weight_type, dim):
    rng = np.random.default_rng([dim, TYPES.index(weight_type), 1])
    table = _lookup_table(rng, dim)
    packed = quantize_rows(table, weight_type)
    ids, offsets, weights = _bags(rng)
    for pooling in ("SUM", "MEAN"):
        for w in (None, weights):
            want = reference.quantized_pooled_loop(
                np.asarray(packed), weight_type, dim, ids, offsets, pooling, w
            )
            got = np.asarray(
                quantized_pooled_lookup(packed, weight_type, dim, ids, offsets, pooling, w)
            )
            np.testing.assert_allclose(
                got,
                want,
                rtol=1e-6,
                atol=_tolerance(packed, weight_type, dim, offsets, w),
                err_msg=f"{pooling}, weights {w is not None}",
            )


def test_under_jit_results_match_eager_and_bad_ids_add_nothing():
    rng = np.random.default_rng(3)
    table = _lookup_table(rng, 12)
    packed = quantize_rows(table, "int4")
    quantize = jax.jit(quantize_rows, static_argnames=("weight_type", "row_alignment"))
    np.testing.assert_array_equal(quantize(table, "int4"), packed)
    ids, offsets, weights = _bags(rng)
    lookup = jax.jit(quantized_pooled_lookup, static_argnames=("weight_type", "dim", "pooling"))
    eager = quantized_pooled_lookup(packed, "int4", 12, ids, offsets, "MEAN", weights)
    np.testing.assert_array_equal(lookup(packed, "int4", 12, ids, offsets, "MEAN", weights), eager)
    # under jit nothing can raise: an id past the table adds nothing, like -1
    bad = ids.copy()
    bad[offsets[5] + 1] = ROWS + 3
    np.testing.assert_array_equal(lookup(packed, "int4", 12, bad, offsets, "MEAN", weights), eager)


def test_empty_batches_and_empty_ids():
    packed = quantize_rows(np.ones((ROWS, 8), np.float32), "int8")
    assert quantized_pooled_lookup(
        packed, "int8", 8, np.zeros(0, np.int32), np.zeros(1, np.int32)
    ).shape == (0, 8)
    out = quantized_pooled_lookup(
        packed, "int8", 8, np.zeros(0, np.int32), np.zeros(4, np.int32), "MEAN"
    )
    np.testing.assert_array_equal(out, np.zeros((3, 8)))
    no_rows = np.zeros((0, 12), np.uint8)  # a table of 0 rows: only pruned ids can be asked for
    out = quantized_pooled_lookup(
        no_rows, "int8", 8, np.array([-1, -1], np.int32), np.array([0, 2, 2], np.int32)
    )
    np.testing.assert_array_equal(out, np.zeros((2, 8)))


def test_row_bytes_is_fbgemms_formula():
    assert row_bytes("int8", 12) == 16 and row_bytes("int8", 13, 16) == 32
    assert row_bytes("int4", 100) == 54 and row_bytes("int4", 100, 16) == 64
    assert row_bytes("int2", 12) == 7 and row_bytes("fp16", 12, 16) == 32
    assert row_bytes("INT4", 8) == 8


# ---------------------------------------------------------------- the C++ kernel


# every type at dims of the kernel's compiled widths (16, 64) and at dims it loops over (12,
# 100, not multiples of 8); with row_alignment 16 the rows are padded after their values
# (e.g. int4 x 12: 10 bytes -> 16, int8 x 100: 104 -> 112)
KERNEL_DIMS = ((12, 16), (16, 1), (64, 1), (100, 16))
KERNEL_CASES = [(t, d, a) for t in TYPES for d, a in KERNEL_DIMS]
# Every case runs both poolings, weighted or not, each with both bounds checks (8 pairs of
# programs, the kernel's and the XLA form's) and one of the two length bounds, alternating
# (the bags hold at most 8 ids: the bound changes the programs, not the sums): a case meets
# each bound 4 times, and a type's dims meet every combination with each bound. 16
# compiles a case instead of 32, most of this file's time.
LOOKUP_OPTIONS = [
    (p, weighted, b)
    for p in ("SUM", "MEAN")
    for weighted in (False, True)
    for b in ("skip", "clamp")
]


@pytest.mark.parametrize("weight_type, dim, row_alignment", KERNEL_CASES)
def test_kernel_equals_the_xla_form_bit_for_bit_and_the_loops(weight_type, dim, row_alignment):
    """SUM and MEAN, weighted or not, empty bags, a repeated and a pruned id; out-of-range
    ids (under jit: nothing raises) added nothing (skip) or clamped (clamp); a length bound.
    The C++ kernel rounds as XLA:CPU's compiled XLA form (fma of `(w * scale) * q` into the
    sum): bit for bit, weighted too."""
    _need_kernel()
    rng = np.random.default_rng([dim, TYPES.index(weight_type), 5])
    packed = quantize_rows(_lookup_table(rng, dim), weight_type, row_alignment=row_alignment)
    ids, offsets, weights = _bags(rng)
    bad = ids.copy()
    bad[offsets[0]] = ROWS  # just past the table
    bad[offsets[7] + 2] = -5
    bad[offsets[7] + 4] = 1 << 30
    lookup = jax.jit(
        quantized_pooled_lookup,
        static_argnames=("weight_type", "dim", "pooling", "max_length", "bounds_check", "kernel"),
    )
    rotation = [d for d, _ in KERNEL_DIMS].index(dim)
    for j, (pooling, weighted, bounds_check) in enumerate(LOOKUP_OPTIONS):
        w = weights if weighted else None
        max_length = (None, 8)[(j + rotation) % 2]
        args = (packed, weight_type, dim, bad, offsets, pooling, w)
        opts = dict(max_length=max_length, bounds_check=bounds_check)
        got = np.asarray(lookup(*args, **opts, kernel="ffi"))
        what = f"{pooling}, weighted {w is not None}, {bounds_check}, max_length {max_length}"
        np.testing.assert_array_equal(got, lookup(*args, **opts, kernel="xla"), err_msg=what)
        oracle_ids = reference.bounded_ids(bad, ROWS, bounds_check)
        want = reference.quantized_pooled_loop(
            np.asarray(packed), weight_type, dim, oracle_ids, offsets, pooling, w
        )
        np.testing.assert_allclose(
            got,
            want,
            rtol=1e-6,
            atol=_tolerance(packed, weight_type, dim, offsets, w),
            err_msg=what,
        )
        assert not got[[1, 4]].any()  # the empty bags
        if bounds_check == "skip" or rotation % 2 == 0:
            continue  # (once per pooling and weighting, on dims 16 and 100:)
        # eager: the ids are checked (skip) or clamped, the result is the jitted one. The eager
        # call's own code (its host-side id check or clamp, then the same kernel and XLA forms
        # the jitted call runs) depends on the dim only through the row alignment and the
        # width: dims 16 (align 1, a compiled width) and 100 (align 16, a looped width) meet
        # both of each, for every type; dims 12 and 64 run the same forms under jit above.
        np.testing.assert_array_equal(
            quantized_pooled_lookup(*args, bounds_check="clamp", kernel="ffi"),
            lookup(*args, bounds_check="clamp", kernel="xla"),
        )
        np.testing.assert_array_equal(
            quantized_pooled_lookup(packed, weight_type, dim, ids, offsets, pooling, w),
            quantized_pooled_lookup(
                packed, weight_type, dim, ids, offsets, pooling, w, kernel="xla"
            ),
        )


def test_kernel_on_batches_of_every_size_and_on_a_table_of_no_rows():
    """Bag counts around the thread split (one bag, a few, thousands; bags that start deep in
    the ids, as a served feature's do), all bags empty, and a table of 0 rows (under jit:
    every id is outside, so every bag is zeros or clamped to none)."""
    _need_kernel()
    rng = np.random.default_rng(11)
    packed = quantize_rows(_lookup_table(rng, 16), "int4")
    for bags, start in ((1, 0), (3, 0), (5000, 0), (3, 9000), (5000, 9000)):
        lengths = rng.integers(0, 6, bags)
        offsets = np.r_[0, np.cumsum(lengths)].astype(np.int32) + start
        ids = rng.integers(0, ROWS, offsets[-1] + 3).astype(np.int32)
        np.testing.assert_array_equal(
            quantized_pooled_lookup(packed, "int4", 16, ids, offsets, "MEAN", kernel="ffi"),
            quantized_pooled_lookup(packed, "int4", 16, ids, offsets, "MEAN", kernel="xla"),
        )
    zeros = quantized_pooled_lookup(
        packed, "int4", 16, np.zeros(3, np.int32), np.zeros(5, np.int32), kernel="ffi"
    )
    np.testing.assert_array_equal(zeros, np.zeros((4, 16)))
    lookup = jax.jit(quantized_pooled_lookup, static_argnames=("weight_type", "dim", "kernel"))
    no_rows = np.zeros((0, 12), np.uint8)
    np.testing.assert_array_equal(
        lookup(
            no_rows,
            "int8",
            8,
            np.array([-1, 4], np.int32),
            np.array([0, 2, 2], np.int32),
            kernel="ffi",
        ),
        np.zeros((2, 8)),
    )


def _lowered(kernel: str, platform: str = "cpu", weighted: bool = False) -> str:
    packed = jnp.zeros((ROWS, row_bytes("int8", 16)), jnp.uint8)
    ids, offsets = jnp.zeros(40, jnp.int32), jnp.arange(0, 41, 4, dtype=jnp.int32)
    w = jnp.ones(40, jnp.float32) if weighted else None

    def f(p, i, o, w):
        return quantized_pooled_lookup(p, "int8", 16, i, o, "MEAN", w, kernel=kernel)

    return jax.jit(f).trace(packed, ids, offsets, w).lower(lowering_platforms=(platform,)).as_text()


def test_the_kernel_is_chosen_on_cpu_and_only_there():
    """The default CPU program calls the C++ kernel (decided when the program is lowered);
    the CUDA program the Pallas kernel (a Triton call, no bag loop); kernel="xla" and
    programs lowered for TPU hold the XLA form (no custom call)."""
    _need_kernel()
    for weighted in (False, True):
        assert "custom_call @HybridrecQuantPooled" in _lowered("auto", weighted=weighted)
        assert "custom_call @HybridrecQuantPooled" in _lowered("ffi", weighted=weighted)
        cuda = _lowered("auto", "cuda", weighted=weighted)
        assert "HybridrecQuantPooled" not in cuda and "stablehlo.while" not in cuda
        assert cuda.count("xla.gpu.triton") == 1
    assert "HybridrecQuantPooled" not in _lowered("xla")
    for kernel, platform in (("auto", "tpu"), ("xla", "cuda")):
        text = _lowered(kernel, platform)
        assert "custom_call" not in text and "while" in text, platform


def test_the_quantized_collection_takes_the_kernel_on_cpu():
    _need_kernel()
    from sparse_jax import (
        EmbeddingBagCollection,
        EmbeddingBagConfig,
        KeyedJaggedTensor,
        QuantEmbeddingBagCollection,
    )

    kjt = KeyedJaggedTensor(
        ["f"], np.array([1, 2, 3, ROWS + 2], np.int32), lengths=np.array([3, 1])
    )
    for bounds_check in ("skip", "clamp"):
        ebc = EmbeddingBagCollection(
            [EmbeddingBagConfig(ROWS, 16, "t", feature_names=["f"])], bounds_check=bounds_check
        )
        params = ebc.init(jax.random.key(0))
        qebc = QuantEmbeddingBagCollection.from_float(ebc, params, weight_type="int4")
        batch = qebc.prepare(kjt)
        text = jax.jit(qebc._apply).lower(qebc.packed_tables, batch.kjt).as_text()
        assert "custom_call @HybridrecQuantPooled" in text
    rows = np.asarray(qebc.dequantized_weights()["t"])
    np.testing.assert_array_equal(
        np.asarray(qebc.apply(kjt).values())[1], rows[ROWS - 1]
    )  # clamped


def test_ffi_refuses_to_fall_back(monkeypatch):
    from sparse_jax import _kernels

    monkeypatch.setattr(_kernels, "available", lambda: False)
    packed = quantize_rows(np.ones((ROWS, 8), np.float32), "int8")
    with pytest.raises(
        ValueError,
        match="^"
        + re.escape(
            "kernel='ffi' was asked for but the CPU kernels are "
            "unavailable here (see the log); use kernel='auto' or 'xla'"
        ),
    ):
        quantized_pooled_lookup(packed, "int8", 8, [0], [0, 1], kernel="ffi")
    for bad, message in (
        ({"kernel": "triton"}, "kernel='triton' is not one of ('auto', 'ffi', 'xla', 'pallas')"),
        ({"bounds_check": "error"}, "bounds_check='error' is not one of ('skip', 'clamp')"),
    ):
        with pytest.raises(ValueError, match="^" + re.escape(message) + "$"):
            quantized_pooled_lookup(packed, "int8", 8, [0], [0, 1], **bad)
    packed = quantize_rows(np.ones((ROWS, 12), np.float32), "int8")
    with pytest.raises(ValueError, match=re.escape("kernel='pallas' needs a power-of-two dim")):
        quantized_pooled_lookup(packed, "int8", 12, [0], [0, 1], kernel="pallas")


# ---------------------------------------------------------------- errors


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: row_bytes("int3", 8), "is not one of ('fp16', 'int8', 'int4', 'int2')"),
        (
            lambda: row_bytes("int4", 7),
            "dim must be a multiple of 2; got dim=7. Pad the table to 8",
        ),
        (lambda: row_bytes("int2", 6), "dim must be a multiple of 4; got dim=6"),
        (lambda: row_bytes("int8", 0), "dim must be an integer >= 1, got 0"),
        (lambda: row_bytes("int8", 8, 0), "row_alignment must be an integer >= 1"),
        (
            lambda: quantize_rows(np.ones(8), "int8"),
            "table must be 2-D [rows, dim], got shape (8,)",
        ),
        (
            lambda: quantize_rows(np.array([[1.0, np.nan]]), "int8"),
            "table[0, 1] is nan: int8 row-wise",
        ),
        (
            lambda: dequantize_rows(np.zeros((2, 7), np.uint8), "int8", 4),
            "packed must be uint8 [rows, >= 8]",
        ),
        (lambda: dequantize_rows(np.zeros((2, 8), np.int32), "int8", 4), "got int32 (2, 8)"),
        (
            lambda: quantized_pooled_lookup(
                np.zeros((2, 8), np.uint8), "int8", 4, [0, 2], [0, 2], "NONE"
            ),
            "pooling='NONE' is not 'SUM' or 'MEAN'",
        ),
        (
            lambda: quantized_pooled_lookup(np.zeros((2, 8), np.uint8), "int8", 4, [0, 2], [0, 2]),
            "id 2 at ids[1] (bag 0) is outside [0, 2)",
        ),
        (
            lambda: quantized_pooled_lookup(np.zeros((2, 8), np.uint8), "int8", 4, [0, 1], [0, 3]),
            "offsets must rise from >= 0 to at most len(ids)=2",
        ),
        (
            lambda: quantized_pooled_lookup(
                np.zeros((2, 8), np.uint8), "int8", 4, [0, 1], [0, 2], "SUM", [1.0]
            ),
            "per_sample_weights has shape (1,), ids (2,)",
        ),
    ],
)
def test_errors_name_the_value_and_the_fix(call, message):
    with pytest.raises(ValueError) as err:
        call()
    assert message in str(err.value)


@pytest.mark.parametrize(
    "weight_type, dim", [("int8", 12), ("int4", 12), ("int4", 16), ("fp16", 6), ("int2", 16)]
)
def test_a_static_length_bound_gives_the_same_sums_and_is_checked(weight_type, dim):
    """`max_length` (a padded KJT's length cap) unrolls a static loop: bit for bit the
    data-dependent loop's result, on rows read as words (int4 x 16, fp16 x 6, int2 x 16) and
    as bytes (int8 x 12 rows are 16 bytes: words too; int4 x 12 rows are 10: bytes)."""
    rng = np.random.default_rng([dim, 7])
    packed = quantize_rows(_lookup_table(rng, dim), weight_type)
    ids, offsets, weights = _bags(rng)
    free = quantized_pooled_lookup(packed, weight_type, dim, ids, offsets, "MEAN", weights)
    for bound in (8, 9, 16):
        got = quantized_pooled_lookup(
            packed, weight_type, dim, ids, offsets, "MEAN", weights, max_length=bound
        )
        np.testing.assert_array_equal(got, free)
    jitted = jax.jit(
        quantized_pooled_lookup, static_argnames=("weight_type", "dim", "pooling", "max_length")
    )
    np.testing.assert_array_equal(
        jitted(packed, weight_type, dim, ids, offsets, "MEAN", weights, max_length=8), free
    )
    with pytest.raises(
        ValueError,
        match="^"
        + re.escape(
            "max_length=7 but a bag holds 8 ids: pass a bound >= 8, or None to loop to the longest bag"
        )
        + "$",
    ):
        quantized_pooled_lookup(packed, weight_type, dim, ids, offsets, max_length=7)
    for bad in (-1, 2.0, True):
        with pytest.raises(ValueError, match=re.escape(f"max_length={bad!r} must be an int >= 0")):
            quantized_pooled_lookup(packed, weight_type, dim, ids, offsets, max_length=bad)
    empty = np.zeros(4, np.int32)  # 3 empty bags: a bound of 0 runs no position
    np.testing.assert_array_equal(
        quantized_pooled_lookup(packed, weight_type, dim, ids, empty, max_length=0),
        np.zeros((3, dim)),
    )


@pytest.mark.parametrize("weight_type", ["int8", "fp16"])
def test_the_lookup_never_copies_the_table(weight_type):
    """Only gathered rows are reinterpreted as words: the compiled lookup holds no temporary
    near the table's size (a word view of the whole table was a copy per call)."""
    from sparse_jax import _quant

    packed = jnp.zeros((50_000, row_bytes(weight_type, 64)), jnp.uint8)
    ids, offsets = jnp.zeros(400, jnp.int32), jnp.arange(0, 401, 20, dtype=jnp.int32)
    for max_length in (None, 20):
        compiled = _quant._pooled.lower(
            packed,
            ids,
            offsets,
            jnp.ones(400, jnp.float32),
            weight_type,
            64,
            jnp.bool_(False),
            max_length,
        ).compile()
        assert compiled.memory_analysis().temp_size_in_bytes < packed.nbytes // 10
