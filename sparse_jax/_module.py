"""The sparse-module contract: what `hybrid` (and any trainer) may call on a sparse module.

`EmbeddingBagCollection`, `EmbeddingCollection` and their sharded forms implement
`SparseModule`. One training step uses it in this order:

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
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Mapping
from typing import Any, NamedTuple, Protocol, runtime_checkable

import jax

from sparse_jax._jagged import KeyedJaggedTensor

__all__ = ["LayoutFacts", "PaddedBatch", "PreparedBatch", "SparseModule", "StoredBlock", "UpdateStep"]


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
    static length caps, on the tables' device."""

    kjt: KeyedJaggedTensor

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
