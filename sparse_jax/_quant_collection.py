"""`QuantEmbeddingBagCollection`: a trained `EmbeddingBagCollection` with row-wise quantized
tables, for inference (TorchRec's `torchrec.quant.embedding_modules.EmbeddingBagCollection`,
which TorchRec's own code imports as `QuantEmbeddingBagCollection`).

    qebc = QuantEmbeddingBagCollection.from_float(ebc, params, weight_type="int8")
    kt = qebc(kjt)                      # the KeyedTensor ebc.apply(params, kjt) gives, from
                                        # int8 rows (same keys, order, dims; fp32)
    qebc.packed_tables                  # {table: uint8 [num_embeddings, row_bytes]} (FBGEMM layout)
    qebc.table_bytes(), qebc.nbytes     # bytes per table, in all

Each table is packed by `quantize_rows` (FBGEMM's IntN TBE row layout: fp16 scale and bias
in front, then the values) and held as its own uint8 array on one device; features that
share a table read the same array. The forward pools every feature with
`quantized_pooled_lookup` (FBGEMM's CPU TBE forward: SUM or MEAN, per-id weights for a
weighted collection; the C++ kernel on CPU); a program lowered for CUDA, every dim a power of
two, pools every feature in one Pallas call instead (`_kernels._pallas_quant`, the same
operations per bag). There is no update: the collection is eval only.

Differences from TorchRec's module: the output keys follow the tables' config order (as
`EmbeddingBagCollection.apply`), where TorchRec groups them by pooling type first; rows are
aligned to `row_alignment` bytes, default 1 (FBGEMM's CPU TBE) where TorchRec pads to 16
(pass `row_alignment=16` for TorchRec's bytes).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from sparse_jax import _lookup
from sparse_jax._configs import EmbeddingBagConfig, PoolingType
from sparse_jax._embedding_bag import EmbeddingBagCollection
from sparse_jax._jagged import KeyedJaggedTensor
from sparse_jax._keyed_tensor import KeyedTensor
from sparse_jax._layout import TableLayout
from sparse_jax._module import LayoutFacts, PaddedBatch
from sparse_jax._prepare import LengthCaps, host_kjt, pad_host
from sparse_jax._quant import (
    WEIGHT_TYPES,
    dequantize_rows,
    quantize_rows,
    quantized_pooled_lookup,
    row_bytes,
)
from sparse_jax._validate import is_concrete, not_a_batch

__all__ = ["KERNELS", "QuantEmbeddingBagCollection"]

KERNELS = ("auto", "pallas", "xla")


def _weight_types(
    tables,
    weight_type: str,
    per_table: Mapping[str, str] | None,
    what: str = "per_table_weight_type",
) -> dict[str, str]:
    """{table: weight type}: `per_table` where it names the table, else `weight_type`."""
    names = [t.name for t in tables]
    per_table = dict(per_table or {})
    unknown = sorted(set(per_table) - set(names))
    if unknown:
        raise ValueError(f"{what} names tables {unknown} that do not exist; tables: {names}")
    out = {}
    for t in tables:
        wt = per_table.get(t.name, weight_type)
        if not isinstance(wt, str) or wt.lower() not in WEIGHT_TYPES:
            raise ValueError(f"table {t.name!r}: weight_type={wt!r} is not one of {WEIGHT_TYPES}")
        out[t.name] = wt.lower()
    return out


def _check_configs(tables) -> tuple[EmbeddingBagConfig, ...]:
    for t in tables:
        if not isinstance(t, EmbeddingBagConfig):
            raise ValueError(
                f"QuantEmbeddingBagCollection quantizes pooled tables; {getattr(t, 'name', t)!r} is a "
                f"{type(t).__name__} (a quantized EmbeddingCollection does not exist yet)"
            )
        if t.pooling not in (PoolingType.SUM, PoolingType.MEAN):
            raise ValueError(f"table {t.name!r}: pooling {t.pooling} is not SUM or MEAN")
    return tuple(tables)


class QuantEmbeddingBagCollection(LayoutFacts):
    """Pooled lookups over row-wise quantized tables (eval only). Build it with `from_float`.

    Args:
      tables: the `EmbeddingBagConfig`s, in the float collection's order.
      packed: `{table: uint8 [num_embeddings, row_bytes]}` as `quantize_rows` returns them
        (e.g. `qebc.packed_tables` saved by an exporter).
      weight_types: `{table: "fp16" | "int8" | "int4" | "int2"}`.
      is_weighted: pool with the KJT's per-id weights (TorchRec's weighted EBC).
      row_alignment: the bytes each packed row was padded to (1: FBGEMM's CPU TBE, 16:
        TorchRec's quantized modules); checked against the arrays.
      bounds_check: "error" (default: an id outside its table raises in `prepare`, naming
        feature, table and id), "clamp" or "skip" (as `EmbeddingBagCollection`).
      ladder: capacity rungs `prepare` pads a batch's ids to (default `DEFAULT_LADDER`).
      kernel: "auto" (default: the C++ kernel on CPU, one Pallas call for every feature when
        lowered for CUDA with power-of-two dims, else the XLA form), "pallas" (that call on
        CUDA, in interpret mode elsewhere: tests) or "xla" (the XLA form everywhere).
      device: where the tables and prepared batches live (default: this process's first local
        JAX device).
    """

    def __init__(
        self,
        tables: Sequence[EmbeddingBagConfig],
        packed: Mapping[str, jax.Array | np.ndarray],
        weight_types: Mapping[str, str],
        *,
        is_weighted: bool = False,
        row_alignment: int = 1,
        bounds_check: str = "error",
        ladder: Sequence[int] | None = None,
        kernel: str = "auto",
        device: jax.Device | None = None,
    ):
        self.layout = TableLayout.build(_check_configs(tables))
        names = [t.name for t in self.layout.tables]
        missing = sorted(set(names) - set(weight_types))
        if missing:
            raise ValueError(
                f"weight_types has no entry for tables {missing}; give one of {WEIGHT_TYPES} per table"
            )
        self.weight_types = _weight_types(self.layout.tables, "", weight_types, "weight_types")
        if set(packed) != set(names):
            raise ValueError(f"packed must hold one array per table {names}; got {sorted(packed)}")
        self.row_alignment = int(row_alignment)
        self.device = device if device is not None else jax.local_devices()[0]
        self.packed_tables: dict[str, jax.Array] = {}
        for t in self.layout.tables:
            width = _table_row_bytes(t, self.weight_types[t.name], self.row_alignment)
            arr = packed[t.name]
            if arr.dtype != np.uint8 or tuple(arr.shape) != (t.num_embeddings, width):
                raise ValueError(
                    f"table {t.name!r}: packed rows must be uint8 [{t.num_embeddings}, {width}] "
                    f"({self.weight_types[t.name]}, dim {t.embedding_dim}, row_alignment {self.row_alignment}); "
                    f"got {arr.dtype} {tuple(arr.shape)}: pass what quantize_rows returned for it"
                )
            self.packed_tables[t.name] = jax.device_put(arr, self.device)
        self._is_weighted = bool(is_weighted)
        self.bounds_check = _lookup.check_bounds_mode(bounds_check)
        if kernel not in KERNELS:
            raise ValueError(f"kernel={kernel!r} is not one of {KERNELS}")
        from sparse_jax._kernels._pallas import supports_dim

        odd = [t.name for t in self.layout.tables if not supports_dim(t.embedding_dim)]
        if kernel == "pallas" and odd:
            raise ValueError(
                f"kernel='pallas' needs power-of-two dims; tables {odd} are not: use kernel='auto' "
                "(the XLA form for them on a GPU)"
            )
        self.kernel = kernel
        self.ladder = None if ladder is None else tuple(ladder)
        self.prepare_count = 0
        self._caps = LengthCaps()
        self._apply_jit = jax.jit(self._apply)

    @classmethod
    def from_float(
        cls,
        module,
        params,
        weight_type: str = "int8",
        *,
        per_table_weight_type: Mapping[str, str] | None = None,
        row_alignment: int = 1,
        ladder: Sequence[int] | None = None,
        device: jax.Device | None = None,
        kernel: str = "auto",
    ) -> QuantEmbeddingBagCollection:
        """Quantize a trained pooled collection (TorchRec's `from_float`).

        module: an `EmbeddingBagCollection` or its sharded form (`sparse_jax.sharding.shard`);
          params: its params. `module.table_weights(params)` gives each full table (a sharded
          module assembles its shards on the host); every table lands on `device`.
        weight_type: "int8" (default), "int4", "int2" or "fp16"; `per_table_weight_type`
          overrides it per table (TorchRec's `QuantConfig.per_table_weight_dtype`).
        row_alignment: 1 (FBGEMM's CPU TBE, fewest bytes) or 16 (TorchRec's quantized modules).
        ladder: capacity rungs for `prepare` (default: the collection's own, when it is an
          unsharded `EmbeddingBagCollection`, else `DEFAULT_LADDER`).
        The weighting and the bounds check follow `module`."""
        tables = _check_configs(module.tables)
        types = _weight_types(tables, weight_type, per_table_weight_type)
        weights = module.table_weights(params)
        packed = {}
        for t in tables:
            try:
                packed[t.name] = quantize_rows(
                    weights[t.name], types[t.name], row_alignment=row_alignment
                )
            except ValueError as e:
                raise ValueError(f"table {t.name!r} (dim {t.embedding_dim}): {e}") from None
        if ladder is None and isinstance(module, EmbeddingBagCollection):
            ladder = module.ladder
        return cls(
            tables,
            packed,
            types,
            is_weighted=module.is_weighted(),
            row_alignment=row_alignment,
            bounds_check=module.bounds_check,
            ladder=ladder,
            device=device,
            kernel=kernel,
        )

    # -- facts ----------------------------------------------------------------------------------
    def is_weighted(self) -> bool:
        return self._is_weighted

    def embedding_bag_configs(self) -> list[EmbeddingBagConfig]:
        return list(self.layout.tables)

    def table_bytes(self) -> dict[str, int]:
        """{table: bytes of its packed rows}."""
        return {name: int(arr.nbytes) for name, arr in self.packed_tables.items()}

    @property
    def nbytes(self) -> int:
        """Bytes of every packed table together."""
        return sum(self.table_bytes().values())

    def dequantized_weights(self) -> dict[str, jax.Array]:
        """{table: fp32 [num_embeddings, dim]}: the values the lookup pools (`dequantize_rows`)."""
        return {
            t.name: dequantize_rows(
                self.packed_tables[t.name], self.weight_types[t.name], t.embedding_dim
            )
            for t in self.layout.tables
        }

    def __repr__(self) -> str:
        parts = ", ".join(
            f"{t.name} [{t.num_embeddings} x {t.embedding_dim}] {self.weight_types[t.name]}"
            for t in self.layout.tables
        )
        return f"QuantEmbeddingBagCollection({parts}; {self.nbytes} bytes)"

    # -- the batch ------------------------------------------------------------------------------
    def check_structure(self, kjt: KeyedJaggedTensor) -> None:
        """Keys, id dtype and weights fit this collection (no id is read)."""
        self.layout.key_indices(kjt.keys())
        if self._is_weighted and kjt.weights_or_none() is None:
            raise ValueError(
                "this QuantEmbeddingBagCollection is weighted (is_weighted=True) but the KJT has no weights"
            )
        if kjt.variable_stride_per_key():
            raise ValueError(
                "QuantEmbeddingBagCollection: a variable-batch KJT is expanded by prepare(); pass it to "
                "prepare() or apply() outside jit, or call expand_to_batch() first"
            )
        values = kjt.values()
        if values.ndim != 1 or not jnp.issubdtype(values.dtype, jnp.integer):
            raise ValueError(
                f"QuantEmbeddingBagCollection: the KJT's values must be integer ids of shape [N], got "
                f"{values.dtype} {tuple(values.shape)}"
            )

    def prepare(self, kjt: KeyedJaggedTensor, *, device: jax.Device | None = None) -> PaddedBatch:
        """Check the ids on the host (with bounds_check="error": an id outside its table
        raises, naming feature, table and id), pad to the ladder, place on `device` (default:
        the tables' device). Once per batch."""
        host = host_kjt(kjt).expand_to_batch()
        self.check_structure(host)
        if self.bounds_check == "error":
            _lookup.check_ids(host, self.layout)
        padded = pad_host(host, self.ladder, self._caps.observe(host))
        self.prepare_count += 1
        return PaddedBatch(jax.device_put(padded, device if device is not None else self.device))

    # -- forward --------------------------------------------------------------------------------
    def _apply(self, tables: Mapping[str, jax.Array], kjt: KeyedJaggedTensor) -> KeyedTensor:
        """One `quantized_pooled_lookup` per feature over the whole (padded) id array: the
        feature's slice of the offsets picks its bags, ids past them are never read. Lowered
        for CUDA with every dim a power of two: one Pallas call pools every feature and writes
        `[B, sum of dims]` once (`_kernels._pallas_quant`), the same operations per bag."""
        from sparse_jax._kernels import _pallas
        from sparse_jax._kernels._pallas_quant import QuantFeature, quant_pooled_sum
        from sparse_jax._kernels._platform import by_platform

        stride = kjt.stride()
        caps = kjt.length_caps()  # a padded KJT's bound on each key's bags: a static position loop
        names = [t.name for t in self.layout.tables]
        keys = self.layout.key_indices(kjt.keys())
        clamp = self.bounds_check == "clamp"

        def per_feature(*operands):
            *packed, values, offsets, weights = operands
            blocks = []
            for slot, ki in zip(self.layout.features, keys, strict=True):
                blocks.append(
                    quantized_pooled_lookup(
                        packed[names.index(slot.table)],
                        self.weight_types[slot.table],
                        slot.dim,
                        values,
                        offsets[ki * stride : (ki + 1) * stride + 1],
                        slot.pooling,
                        weights,
                        max_length=None if caps is None else caps[ki],
                        bounds_check="clamp" if clamp else "skip",
                        kernel="xla" if self.kernel == "xla" else "auto",
                    )
                )
            return jnp.concatenate(blocks, axis=1)

        def pallas(*operands, interpret=False):
            *packed, values, offsets, weights = operands
            features = [
                QuantFeature(
                    ki,
                    names.index(slot.table),
                    self.weight_types[slot.table],
                    slot.dim,
                    slot.pooling is PoolingType.MEAN,
                    None if caps is None else caps[ki],
                )
                for slot, ki in zip(self.layout.features, keys, strict=True)
            ]
            return quant_pooled_sum(
                packed, values, offsets, weights, stride=stride, features=features, clamp=clamp,
                interpret=interpret,
            )  # fmt: skip

        weights = kjt.weights() if self._is_weighted else None
        operands = [tables[n] for n in names] + [kjt.values(), kjt.offsets()]
        operands += [] if weights is None else [weights]

        def unweighted(fn):  # by_platform passes arrays only: no weights, None to `fn`
            return fn if weights is not None else (lambda *xs: fn(*xs, None))

        aval = jax.ShapeDtypeStruct((stride, sum(self.layout.output_dims)), jnp.float32)
        if self.kernel == "pallas":
            impls = dict(
                default=unweighted(functools.partial(pallas, interpret=True)),
                cuda=unweighted(pallas),
            )
            (pooled,) = by_platform(operands, [aval], **impls)
        elif self.kernel == "xla" or not all(
            _pallas.supports_dim(slot.dim) for slot in self.layout.features
        ):
            pooled = unweighted(per_feature)(*operands)  # each feature picks its own kernel
        else:
            impls = dict(default=unweighted(per_feature), cuda=unweighted(pallas))
            (pooled,) = by_platform(operands, [aval], **impls)
        return KeyedTensor(self.layout.feature_names, self.layout.output_dims, pooled)

    def apply(self, batch: PaddedBatch | KeyedJaggedTensor) -> KeyedTensor:
        """Pooled embeddings `[B, sum of feature dims]` (fp32 KeyedTensor): what the float
        collection's `apply` gives, from the quantized rows.

        `batch`: a `prepare`d batch, or a KJT (prepared here). Inside a user's `jit` a traced
        KJT is looked up as it is (pad it first for static shapes; ids are not checked there:
        with bounds_check="error" an out-of-range id then contributes nothing). One compiled
        program per capacity rung."""
        if isinstance(batch, KeyedJaggedTensor):
            if not is_concrete(*jax.tree_util.tree_leaves(batch)):
                self.check_structure(batch)
                return self._apply(self.packed_tables, batch)
            batch = self.prepare(batch)
        if not isinstance(batch, PaddedBatch):
            raise not_a_batch("QuantEmbeddingBagCollection", batch)
        # the length caps are unused here: dropping them keeps one program per capacity
        return self._apply_jit(self.packed_tables, batch.kjt.without_length_caps())

    __call__ = apply

    def forward(self, batch: PaddedBatch | KeyedJaggedTensor) -> KeyedTensor:
        """`apply` under TorchRec's name."""
        return self.apply(batch)

    def lookup_compile_count(self) -> int:
        return self._apply_jit._cache_size()


def _table_row_bytes(table: EmbeddingBagConfig, weight_type: str, row_alignment: int) -> int:
    try:
        return row_bytes(weight_type, table.embedding_dim, row_alignment)
    except ValueError as e:
        raise ValueError(f"table {table.name!r} (dim {table.embedding_dim}): {e}") from None
