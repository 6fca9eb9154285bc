"""The row-rule interface: what a fused sparse optimizer is.

A `RowRule` knows how to create its state for one table buffer and how to step the rows a
batch touched. State leaves whose leading dim is the table's row count are per-row state
(gathered and scattered with the rows); other leaves (e.g. a step count) are global.
`opt.init(params)` gives a `SparseOptState` for a whole params dict.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

__all__ = ["NATIVE", "RowRule", "SparseOptState", "is_row_leaf"]

NATIVE = (None, "sgd", "adagrad", "rowwise_adagrad", "adam")  # RowRule.native


class SparseOptState(NamedTuple):
    count: jax.Array  # steps taken (int32 scalar); rules that need it (adam) read count + 1
    tables: dict[str, Any]  # group name -> the rule's state for that buffer


@dataclasses.dataclass(frozen=True)
class RowRule:
    """A fused sparse optimizer.

    init_table(table) -> state for one `[rows, dim]` buffer (fp32 leaves).
    update_rows(rows, state_rows, grads, step) -> (new_rows, new_state_rows): rows and grads
      are fp32 `[U, dim]` (deduplicated: one entry per touched row, grads summed); `step`
      is the 1-based step number (int32 scalar).
    stochastic_rounding: how stepped rows are written back into fp16 / bf16 tables
      (FBGEMM's `stochastic_rounding`, on by default as there; `False` rounds to nearest);
      `seed` picks the draw (`sparse_jax.optim._rounding`). fp32 tables are unaffected.
    native: the FBGEMM optimizer this rule is exactly ("sgd", "adagrad", "rowwise_adagrad",
      "adam"), declared by the rule's own factory: kernels that implement an optimizer
      natively (the C++ CPU kernels) take only rules that declare it, whatever the `name`.
      None (any other rule, e.g. `from_optax`): the generic path.
    row_step(state_rows, grads, step) -> (delta, new_state_rows), optional: for a rule whose
      step does not read the rows (`new_rows = rows + delta`, as `update_rows` computes
      it). An fp32 table then takes `delta` as one add over the unique rows, a
      read-modify-write of each row, instead of a gather of the rows, the rule and a set
      (`optim._apply.step_unique_rows`).
    """

    name: str
    init_table: Callable[[jax.Array], Any]
    update_rows: Callable[..., tuple[jax.Array, Any]]
    hyperparams: dict[str, float] = dataclasses.field(default_factory=dict)
    stochastic_rounding: bool = True
    seed: int = 0
    native: str | None = None
    row_step: Callable[..., tuple[jax.Array, Any]] | None = None

    def __post_init__(self):
        if not isinstance(self.stochastic_rounding, bool):
            raise ValueError(
                f"{self.name}: stochastic_rounding={self.stochastic_rounding!r} must be True or False"
            )
        if (
            isinstance(self.seed, bool)
            or not isinstance(self.seed, int)
            or not 0 <= self.seed < 2**32
        ):
            raise ValueError(f"{self.name}: seed={self.seed!r} must be an int in [0, 2**32)")
        if self.native not in NATIVE:
            raise ValueError(f"{self.name}: native={self.native!r} is not one of {NATIVE}")

    def write_back(self, rows, dtype, *, step, at):
        """fp32 stepped `rows` `[U, dim]` as the table's `dtype`, rounded as this rule says
        (`stochastic_rounding`, `seed`; `at`: the rows' indices in the table, the draw's
        counter). Every update form (XLA, Pallas, the column-split rowwise form) writes back
        through here."""
        from sparse_jax.optim._rounding import round_rows

        return round_rows(
            rows, dtype, stochastic=self.stochastic_rounding, seed=self.seed, step=step, rows=at
        )

    def init(self, params: dict[str, jax.Array]) -> SparseOptState:
        """Fresh state for every buffer of `params`, placed like the buffers (mesh-sharded
        buffers get row-sharded per-row state and replicated global leaves)."""
        tables = {
            g: jax.tree_util.tree_map(lambda x, t=t: _place_like(x, t), self.init_table(t))
            for g, t in params.items()
        }
        count = jnp.zeros((), jnp.int32)
        meshes = [
            t.sharding
            for t in params.values()
            if isinstance(getattr(t, "sharding", None), NamedSharding)
        ]
        if meshes:
            count = jax.device_put(count, NamedSharding(meshes[0].mesh, P()))
        return SparseOptState(count=count, tables=tables)


def _place_like(leaf, table):
    sharding = getattr(table, "sharding", None)
    if not isinstance(sharding, NamedSharding):
        return leaf
    rows = sharding.spec[0] if len(sharding.spec) else None
    spec = (
        P(rows, *[None] * (leaf.ndim - 1)) if is_row_leaf(leaf, table.shape[0]) else P()
    )  # full rank
    return jax.device_put(leaf, NamedSharding(sharding.mesh, spec))


def check_positive(name: str, **values: float) -> dict[str, float]:
    for k, v in values.items():
        if not isinstance(v, int | float) or v < 0:
            raise ValueError(f"{name}: {k}={v!r} must be a number >= 0")
    return {k: float(v) for k, v in values.items()}


def is_row_leaf(leaf, num_rows: int) -> bool:
    """State leaves shaped `[num_rows, ...]` are per-row; others (a step count) are global."""
    return hasattr(leaf, "ndim") and leaf.ndim >= 1 and leaf.shape[0] == num_rows
