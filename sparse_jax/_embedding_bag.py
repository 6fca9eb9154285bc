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
from sparse_jax._tables import TableCollection
from sparse_jax._validate import is_concrete

__all__ = ["EmbeddingBagCollection", "KERNELS"]

KERNELS = ("auto", "ffi", "xla", "reference")


class EmbeddingBagCollection(TableCollection):
    """Pooled embedding tables (TorchRec's `EmbeddingBagCollection`), functional.

    Args:
      tables: `EmbeddingBagConfig`s; every feature name in exactly one table.
      is_weighted: use the KJT's per-id weights (TorchRec's weighted EBC).
      kernel: "auto" (default: the fused C++ CPU kernels for fp32 tables on CPU when they
        are built, else "xla"), "ffi" (those kernels, or an error), "xla" (the fused
        per-position lookup in pure XLA) or "reference" (gather + segment_sum). All give
        the same numbers; the fused update follows the same choice (C++ for sgd, adagrad
        and rowwise_adagrad on fp32 buffers).
      bounds_check: "error" (default), "clamp" or "skip" for ids outside a table.
    """

    def __init__(
        self,
        tables: Sequence[EmbeddingBagConfig],
        is_weighted: bool = False,
        *,
        kernel: str = "auto",
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

    # -- forward ---------------------------------------------------------------------------
    def _check(self, kjt: KeyedJaggedTensor) -> None:
        if self.is_weighted and kjt.weights_or_none() is None:
            raise ValueError("this EmbeddingBagCollection is weighted (is_weighted=True) but the KJT has no weights")
        self.layout.key_indices(kjt.keys())
        if self.bounds_check == "error":
            _lookup.check_ids(kjt, self.layout)

    def _apply(self, params, kjt: KeyedJaggedTensor) -> KeyedTensor:
        opts = dict(weighted=self.is_weighted, bounds_check=self.bounds_check)
        if self.kernel == "reference":
            blocks = _lookup.pooled_segment_sum(params, kjt, self.layout, **opts)
        else:
            blocks = _lookup.pooled_per_position(params, kjt, self.layout, kernel=self.kernel, **opts)
        return KeyedTensor(self.layout.feature_names, self.layout.output_dims, jnp.concatenate(blocks, axis=1))

    def apply(self, params, kjt: KeyedJaggedTensor) -> KeyedTensor:
        """Pooled embeddings `[B, sum of feature dims]` as a KeyedTensor (fp32)."""
        self._check(kjt)
        if is_concrete(*jax.tree_util.tree_leaves((params, kjt))):
            if kjt.capacity() == 0 or (self.kernel != "reference" and kjt.length_caps() is None):
                # static caps for the jitted program; at least one (padding) slot
                kjt = kjt.pad(capacity=max(kjt.capacity(), 8))
            return self._apply_jit(params, kjt)
        return self._apply(params, kjt)
