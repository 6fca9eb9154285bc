"""Row-wise quantized tables for inference, byte for byte FBGEMM's IntN TBE layout.

`quantize_rows` packs an fp32 `[rows, dim]` table into uint8 `[rows, row_bytes]` rows as
FBGEMM's `IntNBitTableBatchedEmbeddingBagsCodegen` stores them, `dequantize_rows` unpacks
them, and `quantized_pooled_lookup` pools bags of packed rows as that TBE's CPU forward does.

One packed row (bytes, little-endian; scale and bias in FRONT, as the TBE keeps them):

    int8 / int4 / int2:
      0       2       4                          4 + dim*bits/8         row_bytes
      | scale | bias  | q[0] q[1] ... q[dim-1]   | zeros (alignment)   |
        fp16    fp16    int8: one byte each
                        int4: byte 4+k = q[2k] | q[2k+1] << 4          (low nibble first)
                        int2: byte 4+k = q[4k] | q[4k+1] << 2 | ... << 6
    fp16:
      0                              2*dim         row_bytes
      | x[0] x[1] ... x[dim-1] (fp16) | zeros       |

    row_bytes = round_up(unpadded, row_alignment): 1 on FBGEMM's CPU TBE, 16 on its GPU TBE.

Quantization of a row x, in fp32 (FBGEMM's `FloatOrHalfToFusedNBitRowwiseQuantizedSBHalf`,
src/QuantUtils.cc and src/QuantUtilsAvx2.cc; TorchRec quantizes INT8 tables with it too,
while FBGEMM's own `quantize_embs` rounds the fp32 scale and bias of
`FloatToFused8BitRowwiseQuantized` to fp16 afterwards, which gives other INT8 bytes):

    bias  = fp16(min x)                        round half to even; past the fp16 range: +-inf
    lo    = fp32(bias)
    span  = max x - lo
    scale = fp16(span / (2**bits - 1)), or 1 if span == 0 or the fp16 scale is 0
    q     = clip(rint((x - lo) * (1 / scale)), 0, 2**bits - 1)   rint: half to even; NaN -> 0

Dequantized value: `scale * q + bias` in fp32 (the product is exact, so this is FBGEMM's
fma bit for bit). Pooling (FBGEMM's `GenerateEmbeddingSpMDM[NBit]` kernels) walks each bag
in order: `acc = (acc + w * bias) + (w * scale) * q` (fp16 rows: `acc + w * x`), then MEAN
multiplies by `fp32(1 / len)`; an empty bag gives zeros. XLA:CPU fuses the `(w * scale) * q`
product into that add (an fma, as FBGEMM does); the C++ kernel (`HybridrecQuantPooled`, the
CPU default) does the same operations in the same order, so both forms agree bit for bit.
The Pallas kernel (`_kernels._pallas_quant`, the CUDA default for power-of-two dims) does
them in the same order too: bit for bit the XLA form in interpret mode (tested); compiled by
Triton, whether the product is fused into an fma is the compiler's choice (as it is XLA:GPU's
for the XLA form), so on a GPU the forms agree within one rounding of that product per id.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from sparse_jax._configs import PoolingType
from sparse_jax._validate import is_concrete

__all__ = [
    "BOUNDS_CHECKS",
    "KERNELS",
    "WEIGHT_TYPES",
    "dequantize_rows",
    "quantize_rows",
    "quantized_pooled_lookup",
    "row_bytes",
]

WEIGHT_TYPES = ("fp16", "int8", "int4", "int2")
_BITS = {"int8": 8, "int4": 4, "int2": 2}
_SCALE_BIAS_BYTES = 4  # fp16 scale, fp16 bias


def _check_type(weight_type: str) -> str:
    if not isinstance(weight_type, str) or weight_type.lower() not in WEIGHT_TYPES:
        raise ValueError(f"weight_type={weight_type!r} is not one of {WEIGHT_TYPES}")
    return weight_type.lower()


def _check_dim(weight_type: str, dim: int) -> int:
    if not isinstance(dim, int | np.integer) or isinstance(dim, bool) or dim < 1:
        raise ValueError(f"dim must be an integer >= 1, got {dim!r}")
    per_byte = 8 // _BITS.get(weight_type, 8)
    if dim % per_byte:
        raise ValueError(
            f"weight_type={weight_type!r} packs {per_byte} values per byte, so dim must be a multiple "
            f"of {per_byte}; got dim={dim}. Pad the table to {dim + per_byte - dim % per_byte} columns, "
            "or use 'int8' or 'fp16'"
        )
    return int(dim)


def _unpadded_bytes(weight_type: str, dim: int) -> int:
    if weight_type == "fp16":
        return 2 * dim
    return dim * _BITS[weight_type] // 8 + _SCALE_BIAS_BYTES


def row_bytes(weight_type: str, dim: int, row_alignment: int = 1) -> int:
    """Bytes per packed row: values, fp16 scale and bias, padding to `row_alignment` (FBGEMM's
    `rounded_row_size_in_bytes`; its CPU TBE aligns rows to 1 byte, its GPU TBE to 16)."""
    weight_type = _check_type(weight_type)
    dim = _check_dim(weight_type, dim)
    if (
        not isinstance(row_alignment, int | np.integer)
        or isinstance(row_alignment, bool)
        or row_alignment < 1
    ):
        raise ValueError(
            f"row_alignment must be an integer >= 1 (1 for FBGEMM's CPU TBE, 16 for its GPU TBE), "
            f"got {row_alignment!r}"
        )
    return int(-(-_unpadded_bytes(weight_type, dim) // row_alignment) * row_alignment)


def _fp16_bytes(x):
    """fp16 array -> its bytes, little-endian, as a trailing axis of 2."""
    bits = jax.lax.bitcast_convert_type(x, jnp.uint16)
    return jnp.stack([bits & 0xFF, bits >> 8], axis=-1).astype(jnp.uint8)


def _fp16_from_bytes(b):
    """uint8 `[..., 2]` little-endian -> fp32 of the fp16 they hold."""
    bits = b[..., 0].astype(jnp.uint16) | (b[..., 1].astype(jnp.uint16) << 8)
    return jax.lax.bitcast_convert_type(bits, jnp.float16).astype(jnp.float32)


@functools.partial(jax.jit, static_argnames=("weight_type",))
def _quantize(table, weight_type: str):
    """(unpadded rows, whether every value is finite); one compiled function serves every
    row alignment."""
    rows, dim = table.shape
    finite = jnp.all(jnp.isfinite(table))
    if weight_type == "fp16":
        return _fp16_bytes(table.astype(jnp.float16)).reshape(rows, 2 * dim), finite
    bits = _BITS[weight_type]
    levels = (1 << bits) - 1
    bias = jnp.min(table, axis=1).astype(jnp.float16)
    lo = bias.astype(jnp.float32)
    span = jnp.max(table, axis=1) - lo
    # XLA rewrites `x / constant` and `x / broadcast(y)` as `x * (1 / y)`, which rounds
    # differently from FBGEMM's division: divide by a full array it cannot see through
    divisor = jax.lax.optimization_barrier(jnp.full_like(span, levels))
    scale = jnp.where(span == 0, 1.0, span / divisor).astype(jnp.float16).astype(jnp.float32)
    # FBGEMM then also sets scale = 1 where 1 / scale is inf: only a zero scale gives that
    scale = jnp.where(scale == 0, 1.0, scale)
    v = (table - lo[:, None]) * (1.0 / scale)[:, None]
    q = jnp.where(v >= 0, jnp.minimum(jnp.round(v), levels), 0).astype(jnp.uint8)  # NaN -> 0
    per_byte = 8 // bits
    q = q.reshape(rows, dim // per_byte, per_byte)
    packed = q[..., 0]
    for i in range(1, per_byte):
        packed = packed | (q[..., i] << (i * bits))
    return jnp.concatenate(
        [_fp16_bytes(scale.astype(jnp.float16)), _fp16_bytes(bias), packed], axis=1
    ), finite


def quantize_rows(table, weight_type: str, *, row_alignment: int = 1) -> jax.Array:
    """Pack `table` (`[rows, dim]`, numpy or jax, converted to fp32 first) into uint8
    `[rows, row_bytes(weight_type, dim, row_alignment)]` rows, FBGEMM's layout and rounding
    (module docstring). int8/int4/int2 need finite values. Jittable with `weight_type` and
    `row_alignment` static."""
    weight_type = _check_type(weight_type)
    table = jnp.asarray(table, jnp.float32)
    if table.ndim != 2:
        raise ValueError(f"table must be 2-D [rows, dim], got shape {table.shape}")
    width = row_bytes(weight_type, table.shape[1], row_alignment)
    body, finite = _quantize(table, weight_type)
    if weight_type != "fp16" and is_concrete(finite) and not bool(finite):
        values = np.asarray(table)
        r, c = np.argwhere(~np.isfinite(values))[0]
        raise ValueError(
            f"table[{r}, {c}] is {values[r, c]}: {weight_type} row-wise quantization needs finite "
            f"values (FBGEMM's result for this row is undefined); replace or clip inf/NaN first"
        )
    if width == body.shape[1]:
        return body
    return jnp.pad(body, ((0, 0), (0, width - body.shape[1])))


def _check_packed(packed, weight_type: str, dim: int):
    packed = jnp.asarray(packed)
    need = _unpadded_bytes(weight_type, dim)
    if packed.ndim != 2 or packed.dtype != jnp.uint8 or packed.shape[1] < need:
        raise ValueError(
            f"packed must be uint8 [rows, >= {need}] for weight_type={weight_type!r}, dim={dim}; got "
            f"{packed.dtype} {packed.shape}: pass what quantize_rows returned, with its weight_type and dim"
        )
    return packed


def _unpack(rows, weight_type: str, dim: int):
    """Packed rows `[n, row_bytes]` -> (scale `[n, 1]`, bias `[n, 1]`, values `[n, dim]`),
    all fp32; fp16 rows have no scale and bias (None)."""
    if weight_type == "fp16":
        return None, None, _fp16_from_bytes(rows[:, : 2 * dim].reshape(-1, dim, 2))
    bits = _BITS[weight_type]
    per_byte = 8 // bits
    scale = _fp16_from_bytes(rows[:, 0:2])[:, None]
    bias = _fp16_from_bytes(rows[:, 2:4])[:, None]
    body = rows[:, _SCALE_BIAS_BYTES : _SCALE_BIAS_BYTES + dim // per_byte]
    shifts = jnp.arange(0, 8, bits, dtype=jnp.uint8)
    q = (body[:, :, None] >> shifts) & jnp.uint8((1 << bits) - 1)
    return scale, bias, q.reshape(-1, dim).astype(jnp.float32)


@functools.partial(jax.jit, static_argnames=("weight_type", "dim"))
def _dequantize(packed, weight_type: str, dim: int):
    scale, bias, values = _unpack(packed, weight_type, dim)
    return values if scale is None else scale * values + bias


def dequantize_rows(packed, weight_type: str, dim: int) -> jax.Array:
    """fp32 `[rows, dim]` of packed rows (`[rows, row_bytes]` uint8, any row alignment):
    `scale * q + bias`, bit for bit FBGEMM's `FusedNBitRowwiseQuantizedSBHalf*ToFloat`.
    Jittable with `weight_type` and `dim` static."""
    weight_type = _check_type(weight_type)
    dim = _check_dim(weight_type, dim)
    return _dequantize(_check_packed(packed, weight_type, dim), weight_type, dim)


def _unpack_words(words, weight_type: str, dim: int):
    """`_unpack` of rows gathered as little-endian uint32 words (byte `4j + k` of a row is
    bits `8k..8k+7` of word j): the same fp32 values, shifted out of whole words instead of
    reassembled from bytes (measured ~2.5x faster on CPU). Needs the values to fill whole
    words (`_word_aligned`)."""

    def half(bits):
        return jax.lax.bitcast_convert_type(bits.astype(jnp.uint16), jnp.float16).astype(
            jnp.float32
        )

    if weight_type == "fp16":
        halves = (words[:, : dim // 2, None] >> jnp.array([0, 16], jnp.uint32)) & jnp.uint32(0xFFFF)
        return None, None, half(halves.reshape(-1, dim))
    bits = _BITS[weight_type]
    head = words[:, 0]
    body = words[:, 1 : 1 + dim * bits // 32]
    shifts = jnp.arange(0, 32, bits, dtype=jnp.uint32)
    q = (body[:, :, None] >> shifts) & jnp.uint32((1 << bits) - 1)
    return (
        half(head & 0xFFFF)[:, None],
        half(head >> 16)[:, None],
        q.reshape(-1, dim).astype(jnp.float32),
    )


def _word_aligned(weight_type: str, dim: int, width: int) -> bool:
    """Rows `width` bytes wide can be read as uint32 words, and the values fill whole words."""
    bits = 16 if weight_type == "fp16" else _BITS[weight_type]
    return width % 4 == 0 and (dim * bits) % 32 == 0


@functools.partial(jax.jit, static_argnames=("weight_type", "dim", "max_length"))
def _pooled(
    packed, ids, offsets, weights, weight_type: str, dim: int, mean, max_length: int | None
):
    """Unweighted bags come with weights of 1 and SUM bags with a final factor of 1: both
    products are exact, so one compiled loop serves SUM and MEAN, weighted or not. With
    `max_length` the loop has a static trip count (unrolled by 4); else it runs to the
    batch's longest bag."""
    starts = offsets[:-1]
    lengths = offsets[1:] - starts
    (num_rows, width), last = packed.shape, ids.shape[0] - 1
    words = _word_aligned(weight_type, dim, width)

    def add(pos, acc):
        at = jnp.minimum(starts + pos, last)
        row = ids[at]
        hit = (pos < lengths) & (row >= 0) & (row < num_rows)
        got = packed.at[jnp.clip(row, 0, num_rows - 1)].get(mode="promise_in_bounds")
        if words:  # the gathered rows only: a word view of the whole table is a table-sized copy
            got = jax.lax.bitcast_convert_type(got.reshape(-1, width // 4, 4), jnp.uint32)
        scale, bias, values = (_unpack_words if words else _unpack)(got, weight_type, dim)
        w = weights[at][:, None]
        new = acc + w * values if scale is None else (acc + w * bias) + (w * scale) * values
        return jnp.where(hit[:, None], new, acc)

    acc = jnp.zeros((lengths.shape[0], dim), jnp.float32)
    if max_length is None:
        acc = jax.lax.fori_loop(0, jnp.max(lengths), add, acc)
    elif max_length > 0:
        acc = jax.lax.fori_loop(0, max_length, add, acc, unroll=min(max_length, 4))
    inv_len = 1.0 / jnp.maximum(lengths, 1).astype(jnp.float32)
    return acc * jnp.where(mean, inv_len, 1.0)[:, None]


KERNELS = ("auto", "ffi", "xla", "pallas")
BOUNDS_CHECKS = ("skip", "clamp")


def _xla_form(weight_type: str, dim: int, mean: bool, clamp: bool, max_length: int | None):
    """The pure-XLA lookup over operands (packed, ids, offsets[, weights]), as a list."""

    def run(packed, ids, offsets, weights=None):
        if clamp:
            ids = jnp.clip(ids, 0, packed.shape[0] - 1)
        if weights is None:  # weights of 1: exact products, so one loop serves weighted or not
            weights = jnp.ones(ids.shape, jnp.float32)
        return [
            _pooled(
                packed,
                ids,
                offsets.astype(ids.dtype),
                weights,
                weight_type,
                dim,
                jnp.bool_(mean),
                max_length,
            )
        ]

    return run


def _kernel_form(weight_type: str, dim: int, mean: bool, clamp: bool, max_length: int | None):
    """The fused C++ lookup (`HybridrecQuantPooled`) over the same operands."""

    def run(packed, ids, offsets, weights=None):
        from sparse_jax import _kernels

        if ids.dtype.itemsize > 4:  # int32 for the kernel without wrapping ids into the table
            ids = jnp.clip(ids, -1, packed.shape[0])
        return [
            _kernels.quant_pooled(
                packed,
                ids,
                offsets,
                weights,
                weight_type=weight_type,
                dim=dim,
                mean=mean,
                clamp=clamp,
                max_length=max_length,
            )
        ]

    return run


def _pallas_form(
    weight_type: str,
    dim: int,
    mean: bool,
    clamp: bool,
    max_length: int | None,
    interpret: bool = False,
):
    """The Pallas (Triton) jagged lookup (`_kernels._pallas_quant`) over the same operands."""

    def run(packed, ids, offsets, weights=None):
        from sparse_jax._kernels._pallas_quant import QuantFeature, quant_pooled_sum

        feature = QuantFeature(0, 0, weight_type, dim, mean, max_length)
        return [
            quant_pooled_sum(
                [packed],
                ids,
                offsets,
                weights,
                stride=offsets.shape[0] - 1,
                features=[feature],
                clamp=clamp,
                interpret=interpret,
            )
        ]

    return run


@functools.partial(
    jax.jit, static_argnames=("weight_type", "dim", "mean", "clamp", "max_length", "kernel")
)
def _lookup(
    packed,
    ids,
    offsets,
    weights,
    weight_type: str,
    dim: int,
    mean: bool,
    clamp: bool,
    max_length: int | None,
    kernel: str,
):
    """The lookup, its implementation chosen when the program is lowered (`by_platform`):

    | kernel | CPU | CUDA | other |
    |---|---|---|---|
    | "auto" | C++ kernel (built), else XLA | Pallas (power-of-two dim), else XLA | XLA |
    | "ffi" | C++ kernel | as "auto" | as "auto" |
    | "pallas" | Pallas, interpret mode | Pallas | Pallas, interpret mode |
    | "xla" | XLA | XLA | XLA |
    """
    from sparse_jax._kernels import _pallas, when_built
    from sparse_jax._kernels._platform import by_platform

    operands = (packed, ids, offsets) if weights is None else (packed, ids, offsets, weights)
    form = (weight_type, dim, mean, clamp, max_length)
    xla = _xla_form(*form)
    if kernel == "xla":
        return xla(*operands)[0]
    aval = jax.ShapeDtypeStruct((offsets.shape[0] - 1, dim), jnp.float32)
    if kernel == "pallas":
        impls = dict(default=_pallas_form(*form, interpret=True), cuda=_pallas_form(*form))
    else:
        cuda = _pallas_form(*form) if _pallas.supports_dim(dim) else None
        impls = dict(default=xla, cpu=when_built(_kernel_form(*form), xla), cuda=cuda)
    return by_platform(operands, [aval], **impls)[0]


def quantized_pooled_lookup(
    packed,
    weight_type: str,
    dim: int,
    ids,
    offsets,
    pooling="SUM",
    per_sample_weights=None,
    *,
    max_length: int | None = None,
    bounds_check: str = "skip",
    kernel: str = "auto",
) -> jax.Array:
    """Pooled fp32 `[B, dim]` over bags of packed rows, FBGEMM's IntN TBE CPU forward.

    packed: uint8 `[rows, row_bytes]` from `quantize_rows` (any row alignment).
    ids `[N]`, offsets `[B + 1]` (int): bag b is `ids[offsets[b]:offsets[b + 1]]`; ids past
    `offsets[B]` are padding. Id -1 (FBGEMM's pruned row) contributes nothing; MEAN still
    counts it in the bag's length. Any other id outside `[0, rows)` raises here (under `jit`
    it contributes nothing, like -1). bounds_check="clamp" instead clamps every id (-1
    included) into `[0, rows)`, and nothing raises.
    pooling: "SUM" or "MEAN" (or a `PoolingType`); per_sample_weights: fp32 `[N]` or None.
    max_length: a bound on every bag's length, if the caller knows one (a padded KJT's length
    cap): the position loop then has that static trip count; checked when the offsets are
    concrete, trusted under `jit` (a longer bag would lose its ids past the bound).

    kernel: "auto" (default) runs the fused C++ kernel (`HybridrecQuantPooled`: rows read
    from the packed bytes and dequantized in registers, bags split over threads) when the
    program is lowered for CPU and the kernel is built, the XLA form otherwise (other
    platforms, no compiler), and when lowered for CUDA the Pallas (Triton) jagged kernel
    (`_kernels._pallas_quant`: one program per bag, power-of-two dims; others the XLA
    form); "ffi" the same, but an error when the C++ kernel is unavailable; "pallas" the
    Pallas kernel on CUDA and in interpret mode elsewhere (tests; power-of-two dims); "xla"
    always the XLA form (what `hybrid.export` serializes: no custom call). The choice is made when the program is lowered, not traced: a
    program traced on a CPU host and lowered for CUDA holds the Triton call and no CPU call.

    Jittable with `weight_type`, `dim`, `pooling`, `bounds_check` and `kernel` static. All
    forms add every bag's rows in FBGEMM's order (the XLA form loops over positions up to
    the longest bag, gathering one row per bag each step) with FBGEMM's operations
    (`acc = fma(w * scale, q, acc + w * bias)`): unweighted results are bit for bit
    FBGEMM's and each other's; weighted ones are bit for bit each other's where XLA fuses
    the same product into an fma as the kernel does, and within the rounding of one product
    per id of FBGEMM's.
    """
    weight_type = _check_type(weight_type)
    dim = _check_dim(weight_type, dim)
    packed = _check_packed(packed, weight_type, dim)
    mean = _is_mean(pooling)
    ids, offsets = jnp.asarray(ids), jnp.asarray(offsets)
    if ids.ndim != 1 or offsets.ndim != 1 or offsets.shape[0] < 1:
        raise ValueError(
            f"ids must be 1-D [N] and offsets 1-D [B + 1]; got shapes {ids.shape} and {offsets.shape}"
        )
    if not (jnp.issubdtype(ids.dtype, jnp.integer) and jnp.issubdtype(offsets.dtype, jnp.integer)):
        raise ValueError(f"ids and offsets must be integers, got {ids.dtype} and {offsets.dtype}")
    if per_sample_weights is not None:
        per_sample_weights = jnp.asarray(per_sample_weights, jnp.float32)
    if per_sample_weights is not None and per_sample_weights.shape != ids.shape:
        raise ValueError(
            f"per_sample_weights has shape {per_sample_weights.shape}, ids {ids.shape}: "
            "pass one weight per id"
        )
    if max_length is not None and (
        isinstance(max_length, bool)
        or not isinstance(max_length, int | np.integer)
        or max_length < 0
    ):
        raise ValueError(
            f"max_length={max_length!r} must be an int >= 0 (a bound on every bag's length) or None"
        )
    if bounds_check not in BOUNDS_CHECKS:
        raise ValueError(f"bounds_check={bounds_check!r} is not one of {BOUNDS_CHECKS}")
    if kernel not in KERNELS:
        raise ValueError(f"kernel={kernel!r} is not one of {KERNELS}")
    if kernel == "ffi":
        from sparse_jax import _kernels

        if not _kernels.available():
            raise ValueError(
                "kernel='ffi' was asked for but the CPU kernels are unavailable here (see the log); "
                "use kernel='auto' or 'xla'"
            )
    from sparse_jax._kernels._pallas import supports_dim

    if kernel == "pallas" and not supports_dim(dim):
        raise ValueError(
            f"kernel='pallas' needs a power-of-two dim (Triton blocks), got {dim}; use kernel='auto' "
            "(the XLA form for this dim on a GPU)"
        )
    if is_concrete(ids, offsets):
        _check_bags(
            np.asarray(ids), np.asarray(offsets), packed.shape[0], ids_too=bounds_check == "skip"
        )
        longest = int(np.diff(np.asarray(offsets)).max(initial=0))
        if max_length is not None and longest > max_length:
            raise ValueError(
                f"max_length={max_length} but a bag holds {longest} ids: pass a bound >= {longest}, "
                "or None to loop to the longest bag"
            )
    batch = offsets.shape[0] - 1
    if batch == 0 or ids.shape[0] == 0 or packed.shape[0] == 0:  # nothing to add
        return jnp.zeros((batch, dim), jnp.float32)
    return _lookup(
        packed,
        ids,
        offsets,
        per_sample_weights,
        weight_type,
        dim,
        mean,
        bounds_check == "clamp",
        None if max_length is None else int(max_length),
        kernel,
    )


def _is_mean(pooling) -> bool:
    mode = pooling
    if isinstance(pooling, str) and pooling.upper() in PoolingType.__members__:
        mode = PoolingType[pooling.upper()]
    if mode not in (PoolingType.SUM, PoolingType.MEAN):
        raise ValueError(f"pooling={pooling!r} is not 'SUM' or 'MEAN'")
    return mode is PoolingType.MEAN


def _check_bags(ids: np.ndarray, offsets: np.ndarray, num_rows: int, ids_too: bool = True) -> None:
    steps = np.diff(offsets)
    if offsets[0] < 0 or (steps < 0).any() or offsets[-1] > ids.shape[0]:
        raise ValueError(
            f"offsets must rise from >= 0 to at most len(ids)={ids.shape[0]}; got {offsets.tolist()[:16]}"
            f"{' ...' if offsets.shape[0] > 16 else ''}: build them as [0, cumsum(bag lengths)]"
        )
    if not ids_too:
        return
    used = ids[offsets[0] : offsets[-1]]
    bad = np.flatnonzero((used < -1) | (used >= num_rows))
    if bad.size:
        i = int(offsets[0]) + int(bad[0])
        bag = int(np.searchsorted(offsets, i, side="right")) - 1
        raise ValueError(
            f"id {int(ids[i])} at ids[{i}] (bag {bag}) is outside [0, {num_rows}) ({bad.size} such ids); "
            "fix the ids (-1 marks a pruned row and contributes nothing)"
        )
