"""The sparse-module contract: what `hybrid` (and any trainer) may call on a sparse module.

`EmbeddingBagCollection`, `EmbeddingCollection`, their sharded forms and the
managed-collision modules implement `SparseModule`; the managed ones also
`ManagedSparseModule`. One training step uses it in this order:

    batch = module.prepare(kjt)                    # once per batch, off the critical path
    out = module.apply(params, batch)              # forward on the prepared batch
    params, state = update(params, state, batch, grad)   # update = make_update(module, rule):
    #   jit(module.update_step(rule))(params, state, module.update_operands(batch, grad))

`prepare` validates the ids once (on the host, before anything is placed), pads once to
the capacity ladder, splits once per device and places the result on the tables' devices;
the returned `PreparedBatch` is a pytree that `apply` and the update consume as it is, so
nothing re-checks, re-pads or re-splits it and no device value is read on the host.
`stored_blocks()` says where each table's rows live in the stacked buffers (checkpoints
walk it instead of the modules' internals).

`managed()` says whether a module maps raw ids through managed-collision id maps: it
returns the module as a `ManagedSparseModule` (the managed forms), or None (the plain
collections and their sharded forms). A trainer asks it, never the module's type:

    managed = module.managed()
    if managed is not None and managed.needs_remap(batch):
        params, opt_state, batch = managed.remap(params, opt_state, batch)   # training
        # (eval: batch = managed.remap_eval(batch))
    out = module.apply(params, batch)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Mapping
from typing import Any, NamedTuple, Protocol, runtime_checkable

import jax
import numpy as np

from sparse_jax._jagged import KeyedJaggedTensor

__all__ = [
    "LayoutFacts",
    "ManagedSparseModule",
    "PaddedBatch",
    "PreparedBatch",
    "SparseModule",
    "StoredBlock",
    "UpdateStep",
]


class LayoutFacts:
    """The contract's table and output facts, read off the module's `layout`."""

    layout: Any  # a TableLayout

    @property
    def tables(self):
        return self.layout.tables

    @property
    def feature_names(self) -> list[str]:
        return self.layout.feature_names

    @property
    def output_dims(self) -> list[int]:
        return self.layout.output_dims


class PreparedBatch:
    """Base of every module's prepared batch: the marker `apply` and the update look for."""

    stride: int  # samples in the (global) batch


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PaddedBatch(PreparedBatch):
    """An unsharded collection's prepared batch: the KJT padded to a ladder rung, with
    static length caps, on the tables' device; with `sorted_ids` (group name ->
    `sparse_jax._sorted_ids.SortedIds`), the id stream sorted by row on the host, which the
    pure-XLA update reads instead of sorting in the program (None: not sorted); with
    `positions` (group name -> `sparse_jax._position_rows.position_rows`' matrices), the
    pure-XLA lookup's rows and weights per position, built on the host (None: not built).
    Both describe `kjt`'s ids: a batch whose ids are replaced (a managed remap) drops them."""

    kjt: KeyedJaggedTensor
    sorted_ids: dict | None = None
    positions: dict | None = None

    @property
    def stride(self) -> int:
        return self.kjt.stride()


class StoredBlock(NamedTuple):
    """Rows `row_offset : row_offset + num_rows` and columns `col_offset : col_offset +
    num_cols` of `table`, stored in params buffer `buffer` from row `buffer_row` on."""

    buffer: str
    table: str
    buffer_row: int
    row_offset: int
    num_rows: int
    col_offset: int
    num_cols: int


UpdateStep = Callable[[Any, Any, Any], tuple[Any, Any]]  # (params, opt_state, operands)


@runtime_checkable
class SparseModule(Protocol):
    """The declared interface of the sparse modules (see the module docstring).

    Attributes: `tables` (configs, in order), `feature_names` and `output_dims` (the
    output's features and widths), `plan` (a `ShardingPlan`, None unsharded), `mesh_axes`
    (`{axis: size}`, None unsharded), `prepare_count` (batches prepared so far).
    """

    tables: Any
    feature_names: list[str]
    output_dims: list[int]
    plan: Any
    mesh_axes: Mapping[str, int] | None
    prepare_count: int

    def init(self, key: jax.Array) -> dict[str, jax.Array]:
        """Fresh stacked buffers (placed like the tables)."""

    def prepare(self, kjt: KeyedJaggedTensor, *, device: jax.Device | None = None) -> PreparedBatch:
        """Validate, pad, split and place `kjt` once. `device`: where an unsharded module
        places it (default: JAX's default device); sharded modules place on their mesh."""

    def apply(self, params, batch):
        """The forward on a prepared batch (a raw KJT is prepared first)."""

    def update_operands(self, batch: PreparedBatch, grad) -> Any:
        """The fused update's device operands: the prepared batch's arrays and `grad` (the
        gradient of `apply`'s output) in the static layout the step takes. Device work
        only: nothing is read on the host."""

    def update_step(self, rule) -> UpdateStep:
        """The traceable fused update `(params, opt_state, operands) -> (params, opt_state)`;
        `make_update` jits it with params and state donated."""

    def table_weights(self, params) -> Mapping[str, Any]:
        """`{table: [num_embeddings, dim]}` full weights (copies)."""

    def with_table_weights(self, params, weights: Mapping) -> dict[str, jax.Array]:
        """New params with the named tables replaced (resharded as the module stores them)."""

    def stored_blocks(self) -> Iterator[StoredBlock]:
        """Every stored block of every table (see `StoredBlock`)."""

    def lookup_compile_count(self) -> int:
        """Programs the jitted lookup has compiled (constant in a steady loop)."""

    def managed(self) -> ManagedSparseModule | None:
        """This module as a `ManagedSparseModule` if it manages raw ids, else None."""


@runtime_checkable
class ManagedSparseModule(SparseModule, Protocol):
    """A `SparseModule` whose managed tables take raw 64-bit ids and map them to rows through
    id maps it holds on the device (`sparse_jax.ManagedCollisionSparseModule`, and
    `sparse_jax.sharding.ShardedManagedCollisionModule` on a mesh); `managed()` returns it.

    Its `prepare` returns a batch of raw ids; `remap` (training: the id maps advance and the
    rows they gave to new ids are reset) or `remap_eval` (read only) turns it into the batch
    of table rows that `apply` and the fused update take.

    Attributes: `mc` (the `ManagedCollisionCollection`: `mc.modules` is `{table:
    MCHManagedCollisionModule}` for the whole table), `managed_tables` (their names,
    sorted), `mc_state` (`{table: MCHState}` on the device; leaves stacked `[shards, ...]`
    on a mesh, one map per shard).
    """

    mc: Any
    managed_tables: list[str]
    mc_state: Mapping[str, Any]

    def place_maps(self, device: jax.Device | None) -> None:
        """Commit the id maps, counters and draw key to `device` (where the tables are)."""

    def needs_remap(self, batch) -> bool:
        """Whether `batch` is this module's prepared batch of raw ids, not yet remapped."""

    def remap(self, params, opt_state, batch) -> tuple[Any, Any, PreparedBatch]:
        """A training batch's remap: `(params, opt_state, batch of rows)`; `params` and
        `opt_state` are donated (the rows given to new ids are reset in them)."""

    def remap_eval(self, batch) -> PreparedBatch:
        """An eval batch's rows (ids not resident read the default row); nothing changes."""

    def remap_compile_count(self) -> int:
        """Programs the remap has compiled (constant in a steady loop)."""

    def stats(self) -> dict[str, jax.Array]:
        """`{table: int32[3]}` device counters: slots in use, ids admitted, resident ids evicted."""

    def frozen_maps(self) -> dict[str, Any]:
        """`{table: FrozenIdMap}`: the id maps frozen on the host, for serving."""

    def host_state(self) -> tuple[dict[str, Any], dict[str, np.ndarray], np.ndarray]:
        """(`{table: MCHState}`, `{table: counters}`, draw key data) as host arrays (a
        collective on a multi-process mesh: every process calls it)."""

    def load_mc_state(
        self,
        state: Mapping[str, Any],
        counters: Mapping | None = None,
        key: jax.Array | None = None,
    ) -> None:
        """Replace the id maps (and counters, draw key), e.g. from a checkpoint."""
