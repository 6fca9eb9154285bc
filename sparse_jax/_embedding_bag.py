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
from sparse_jax._configs import EmbeddingBagConfig, as_table_configs
from sparse_jax._jagged import KeyedJaggedTensor
from sparse_jax._keyed_tensor import KeyedTensor
from sparse_jax._layout import TableLayout
from sparse_jax._module import PaddedBatch
from sparse_jax._position_rows import position_rows
from sparse_jax._prepare import LengthCaps, pad_host
from sparse_jax._sorted_ids import BucketCaps, sort_host
from sparse_jax._tables import TableCollection
from sparse_jax._update import fused_update
from sparse_jax._validate import is_concrete, not_a_batch
from sparse_jax.optim._base import RowRule

__all__ = ["EmbeddingBagCollection", "KERNELS"]

KERNELS = _lookup.KERNELS


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
      ladder: capacity rungs `prepare` pads a batch's ids to (default `DEFAULT_LADDER`).
      sort_ids: whether `prepare` also sorts each buffer's ids by row on the host (the
        stream the pure-XLA and Pallas updates read instead of sorting in the program:
        `sparse_jax._sorted_ids`); None (default): on for kernel="xla", and for "auto" and
        "pallas" when JAX's default backend is a GPU; off otherwise (the C++ update does
        not read it).
    """

    def __init__(
        self,
        tables: Sequence[EmbeddingBagConfig],
        is_weighted: bool = False,
        *,
        kernel: str = "auto",
        bounds_check: str = "error",
        ladder: Sequence[int] | None = None,
        sort_ids: bool | None = None,
    ):
        tables = as_table_configs(tables)  # TorchRec's configs too
        for t in tables:
            if not isinstance(t, EmbeddingBagConfig):
                raise ValueError(
                    f"EmbeddingBagCollection takes EmbeddingBagConfig tables; {getattr(t, 'name', t)!r} is a "
                    f"{type(t).__module__}.{type(t).__name__} (use EmbeddingCollection for unpooled tables)"
                )
        _lookup.check_kernel(kernel)
        self.layout = TableLayout.build(tables)
        self._is_weighted = bool(is_weighted)
        self.kernel = kernel
        self.bounds_check = _lookup.check_bounds_mode(bounds_check)
        self.ladder = None if ladder is None else tuple(ladder)
        on_gpu = jax.default_backend() in ("gpu", "cuda", "rocm")
        default_sort = kernel == "xla" or (kernel in ("auto", "pallas") and on_gpu)
        self.sort_ids = default_sort if sort_ids is None else bool(sort_ids)
        # the XLA lookup's position matrices, built on the host where that form runs
        self.position_rows = kernel == "xla"
        self.prepare_count = 0
        self._caps = LengthCaps()
        self._run_caps = BucketCaps()  # the sorted streams' bucket rungs, only growing
        self._apply_jit = jax.jit(self._apply)

    # -- preparation (once per batch) ----------------------------------------------------------
    def check_structure(self, kjt: KeyedJaggedTensor) -> None:
        """Keys and weights fit this collection (no id is read)."""
        if self._is_weighted and kjt.weights_or_none() is None:
            raise ValueError(
                "this EmbeddingBagCollection is weighted (is_weighted=True) but the KJT has no weights"
            )
        super().check_structure(kjt)

    def prepare(
        self,
        kjt: KeyedJaggedTensor,
        *,
        device: jax.Device | None = None,
        sort_ids: bool | None = None,
        positions: bool | None = None,
    ) -> PaddedBatch:
        """Validate (on the host), pad to the ladder with growing length caps, sort each
        buffer's ids by row when `sort_ids` (default: the collection's `sort_ids`), build the
        XLA lookup's position matrices when `positions` (default: the collection's
        `position_rows`, kernel "xla"), place on `device` (default: JAX's default device).
        Once per batch; see `SparseModule`."""
        host = self.check_host(kjt)
        padded = pad_host(host, self.ladder, self._caps.observe(host))
        self.prepare_count += 1
        streams = rows = None
        if self.sort_ids if sort_ids is None else sort_ids:
            streams = sort_host(
                padded,
                self.layout,
                weighted=self._is_weighted,
                bounds_check=self.bounds_check,
                ladder=self.ladder,
                caps=self._run_caps,
            )
        if self.position_rows if positions is None else positions:
            rows = position_rows(
                padded, self.layout, weighted=self._is_weighted, bounds_check=self.bounds_check
            )
        padded, streams, rows = jax.device_put((padded, streams, rows), device)
        return PaddedBatch(padded, streams, rows)

    # -- forward ---------------------------------------------------------------------------
    def _apply(self, params, kjt: KeyedJaggedTensor, positions=None) -> KeyedTensor:
        opts = dict(weighted=self._is_weighted, bounds_check=self.bounds_check)
        if self.kernel == "reference":
            blocks = _lookup.pooled_segment_sum(params, kjt, self.layout, **opts)
        else:
            blocks = _lookup.pooled_per_position(
                params, kjt, self.layout, kernel=self.kernel, positions=positions, **opts
            )
        return KeyedTensor(
            self.layout.feature_names, self.layout.output_dims, jnp.concatenate(blocks, axis=1)
        )

    def apply(self, params, batch: PaddedBatch | KeyedJaggedTensor) -> KeyedTensor:
        """Pooled embeddings `[B, sum of feature dims]` as a KeyedTensor (fp32).

        `batch`: a `prepare`d batch (nothing is checked again), or a KJT (prepared here;
        inside a user's `jit` a traced KJT is looked up as it is: pad it first)."""
        if isinstance(batch, KeyedJaggedTensor):
            if not is_concrete(*jax.tree_util.tree_leaves(batch)):
                self.check_structure(batch)
                return self._apply(params, batch)
            batch = self.prepare(batch)
        if not isinstance(batch, PaddedBatch):
            raise not_a_batch("EmbeddingBagCollection", batch)
        if is_concrete(*jax.tree_util.tree_leaves(params)):
            return self._apply_jit(params, batch.kjt, batch.positions)
        return self._apply(params, batch.kjt, batch.positions)

    def lookup_compile_count(self) -> int:
        return self._apply_jit._cache_size()

    # -- TorchRec's accessors --------------------------------------------------------------------
    def is_weighted(self) -> bool:
        return self._is_weighted

    def embedding_bag_configs(self) -> list[EmbeddingBagConfig]:
        return list(self.layout.tables)

    def forward(self, params, batch) -> KeyedTensor:
        """`apply` under TorchRec's name (the module is functional: params come first)."""
        return self.apply(params, batch)

    # -- fused update (make_update) ------------------------------------------------------------
    def update_operands(self, batch: PaddedBatch, grad):
        """(padded KJT without length caps, pooled grad values, host-sorted streams or None):
        the update reads no caps, so it keeps one program per capacity."""
        if isinstance(grad, KeyedTensor):
            grad = grad.values()
        return batch.kjt.without_length_caps(), grad, batch.sorted_ids

    def update_step(self, rule: RowRule):
        def step(params, opt_state, operands):
            kjt, pooled_grad, sorted_ids = operands
            return fused_update(
                self.layout,
                rule,
                params,
                opt_state,
                kjt,
                pooled_grad,
                weighted=self._is_weighted,
                bounds_check=self.bounds_check,
                kernel=self.kernel,
                sorted_ids=sorted_ids,
            )

        return step
