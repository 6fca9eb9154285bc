"""`EmbeddingBagCollection`: pooled lookups of several tables, functional (init / apply).

    ebc = EmbeddingBagCollection(tables=[EmbeddingBagConfig(...), ...], is_weighted=False)
    params = ebc.init(jax.random.key(0))      # {group: [rows, dim] stacked buffer}
    kt = ebc.apply(params, kjt)               # KeyedTensor [B, sum of feature dims]

Tables of the same dim and dtype are stacked into one buffer (see `TableLayout`). Output
features are ordered as the tables' `feature_names` (tables in config order), as TorchRec.
`apply` checks ids eagerly (when the KJT is concrete) and runs a jitted program; it can
also be traced inside a user's `jit` (pad the KJT first so length caps are static).
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp

from sparse_jax import _lookup
from sparse_jax._configs import EmbeddingBagConfig
from sparse_jax._jagged import KeyedJaggedTensor
from sparse_jax._keyed_tensor import KeyedTensor
from sparse_jax._layout import TableLayout
from sparse_jax._validate import is_concrete

__all__ = ["EmbeddingBagCollection", "KERNELS"]

KERNELS = ("xla", "reference")


class EmbeddingBagCollection:
    """Pooled embedding tables (TorchRec's `EmbeddingBagCollection`), functional.

    Args:
      tables: `EmbeddingBagConfig`s; every feature name in exactly one table.
      is_weighted: use the KJT's per-id weights (TorchRec's weighted EBC).
      kernel: "xla" (default: the fused per-position lookup) or "reference"
        (gather + segment_sum). Both give the same numbers.
      bounds_check: "error" (default), "clamp" or "skip" for ids outside a table.
    """

    def __init__(
        self,
        tables: Sequence[EmbeddingBagConfig],
        is_weighted: bool = False,
        *,
        kernel: str = "xla",
        bounds_check: str = "error",
    ):
        for t in tables:
            if not isinstance(t, EmbeddingBagConfig):
                raise ValueError(
                    f"EmbeddingBagCollection takes EmbeddingBagConfig tables; {getattr(t, 'name', t)!r} is a "
                    f"{type(t).__name__} (use EmbeddingCollection for unpooled tables)"
                )
        if kernel not in KERNELS:
            raise ValueError(f"kernel={kernel!r} is not one of {KERNELS}")
        self.layout = TableLayout.build(tables)
        self.is_weighted = bool(is_weighted)
        self.kernel = kernel
        self.bounds_check = _lookup.check_bounds_mode(bounds_check)
        self._apply_jit = jax.jit(self._apply)

    # -- parameters ---------------------------------------------------------------------
    @property
    def tables(self):
        return self.layout.tables

    def init(self, key: jax.Array) -> dict[str, jax.Array]:
        """Uniform(weight_init_min, weight_init_max) per table, stacked per group (fresh buffers)."""
        parts: dict[str, list] = {g: [] for g in self.layout.groups}
        for i, t in enumerate(self.layout.tables):
            g, _ = self.layout.table_group[t.name]
            w = jax.random.uniform(
                jax.random.fold_in(key, i),
                (t.num_embeddings, t.embedding_dim),
                jnp.float32,
                t.weight_init_min,
                t.weight_init_max,
            )
            parts[g].append(w.astype(t.data_type.numpy_dtype))
        return {g: jnp.array(jnp.concatenate(ws), copy=True) for g, ws in parts.items()}

    def table_weights(self, params) -> dict[str, jax.Array]:
        """{table name: [num_embeddings, dim]} views of the stacked buffers (copies)."""
        out = {}
        for t in self.layout.tables:
            g, off = self.layout.table_group[t.name]
            out[t.name] = params[g][off : off + t.num_embeddings]
        return out

    def with_table_weights(self, params, weights: dict) -> dict[str, jax.Array]:
        """New params with the named tables replaced (e.g. pretrained weights)."""
        by_name = {t.name: t for t in self.layout.tables}
        params = dict(params)
        for name, w in weights.items():
            if name not in by_name:
                raise ValueError(f"with_table_weights: no table named {name!r} (tables: {list(by_name)})")
            t = by_name[name]
            w = jnp.asarray(w)
            if w.shape != (t.num_embeddings, t.embedding_dim):
                raise ValueError(
                    f"with_table_weights: table {name!r} is [{t.num_embeddings}, {t.embedding_dim}], "
                    f"got weights of shape {w.shape}"
                )
            g, off = self.layout.table_group[name]
            params[g] = params[g].at[off : off + t.num_embeddings].set(w.astype(params[g].dtype))
        return params

    # -- forward ---------------------------------------------------------------------------
    def _check(self, kjt: KeyedJaggedTensor) -> None:
        if self.is_weighted and kjt.weights_or_none() is None:
            raise ValueError("this EmbeddingBagCollection is weighted (is_weighted=True) but the KJT has no weights")
        self.layout.key_indices(kjt.keys())
        if self.bounds_check == "error":
            _lookup.check_ids(kjt, self.layout)

    def _apply(self, params, kjt: KeyedJaggedTensor) -> KeyedTensor:
        pool = _lookup.pooled_per_position if self.kernel == "xla" else _lookup.pooled_segment_sum
        blocks = pool(params, kjt, self.layout, weighted=self.is_weighted, bounds_check=self.bounds_check)
        return KeyedTensor(self.layout.feature_names, self.layout.output_dims, jnp.concatenate(blocks, axis=1))

    def apply(self, params, kjt: KeyedJaggedTensor) -> KeyedTensor:
        """Pooled embeddings `[B, sum of feature dims]` as a KeyedTensor (fp32)."""
        self._check(kjt)
        if is_concrete(*jax.tree_util.tree_leaves((params, kjt))):
            if kjt.capacity() == 0 or (self.kernel == "xla" and kjt.length_caps() is None):
                # static caps for the jitted program; at least one (padding) slot
                kjt = kjt.pad(capacity=max(kjt.capacity(), 8))
            return self._apply_jit(params, kjt)
        return self._apply(params, kjt)
