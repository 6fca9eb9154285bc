"""`EmbeddingCollection`: unpooled (sequence) lookups, one row per id.

    ec = EmbeddingCollection(tables=[EmbeddingConfig(...), ...])
    params = ec.init(key)
    out = ec.apply(params, kjt)      # {feature: JaggedTensor of [num_ids, dim] rows}
    update = make_update(ec, rule)   # (params, state, kjt, {feature: [num_ids, dim] grads})

Unlike TorchRec (#294), tables of different dims may live in one collection (each dim is
its own stacked buffer). `apply` is eager per feature, like TorchRec's dict of
JaggedTensors; the row gather inside is jitted per buffer. The fused update streams every
id's gradient through the same generic row-rule apply as the pooled collection.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from sparse_jax import _capacity, _lookup
from sparse_jax._configs import EmbeddingConfig
from sparse_jax._jagged import JaggedTensor, KeyedJaggedTensor
from sparse_jax._layout import TableLayout
from sparse_jax._tables import TableCollection
from sparse_jax.optim._apply import apply_row_rule
from sparse_jax.optim._base import RowRule, SparseOptState

__all__ = ["EmbeddingCollection"]


@jax.jit
def _gather_rows(table, rows):
    return table.at[rows].get(mode="fill", fill_value=0).astype(jnp.float32)


class EmbeddingCollection(TableCollection):
    """Sequence embedding tables (TorchRec's `EmbeddingCollection`), functional."""

    is_weighted = False

    def __init__(self, tables: Sequence[EmbeddingConfig], *, bounds_check: str = "error", ladder=None):
        for t in tables:
            if not isinstance(t, EmbeddingConfig):
                raise ValueError(
                    f"EmbeddingCollection takes EmbeddingConfig tables; {getattr(t, 'name', t)!r} is a "
                    f"{type(t).__name__} (use EmbeddingBagCollection for pooled tables)"
                )
        self.layout = TableLayout.build(tables)
        self.bounds_check = _lookup.check_bounds_mode(bounds_check)
        self.ladder = ladder

    def _check(self, kjt: KeyedJaggedTensor) -> None:
        self.layout.key_indices(kjt.keys())
        if self.bounds_check == "error":
            _lookup.check_ids(kjt, self.layout)

    def _feature_rows(self, kjt: KeyedJaggedTensor) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        """{feature: (rows into its group buffer (sentinel for skipped ids), lengths)} (eager)."""
        out = {}
        for slot in self.layout.features:
            jt = kjt[slot.feature]
            ids = np.asarray(jt.values()).astype(np.int64)
            if self.bounds_check == "clamp":
                ids = np.clip(ids, 0, slot.num_rows - 1)
            inside = (ids >= 0) & (ids < slot.num_rows)
            rows = np.where(inside, ids + slot.row_offset, self.layout.groups[slot.group][0])
            out[slot.feature] = (rows.astype(np.int32), np.asarray(jt.lengths()))
        return out

    def apply(self, params, kjt: KeyedJaggedTensor) -> dict[str, JaggedTensor]:
        """{feature: JaggedTensor} whose values are the `[num_ids, dim]` rows (skipped ids: zeros)."""
        self._check(kjt)
        out = {}
        for slot in self.layout.features:
            rows, lengths = self._feature_rows(kjt)[slot.feature]
            cap = _capacity.capacity_for(len(rows), self.ladder, what=f"feature {slot.feature!r}")
            padded = np.full(cap, self.layout.groups[slot.group][0], np.int32)
            padded[: len(rows)] = rows
            emb = _gather_rows(params[slot.group], jnp.asarray(padded))[: len(rows)]
            out[slot.feature] = JaggedTensor.from_values_and_lengths(emb, lengths)
        return out

    # -- fused update (used by make_update) ----------------------------------------------------
    def prepare_update(self, kjt: KeyedJaggedTensor, grads: Mapping[str, jax.Array]):
        """Eager: per buffer the padded stream (rows, per-id grads), static capacity."""
        missing = [s.feature for s in self.layout.features if s.feature not in grads]
        if missing:
            raise ValueError(f"grads has no entry for feature(s) {missing}; give one [num_ids, dim] array per feature")
        rows_of = self._feature_rows(kjt)
        streams = {}
        for group, (total_rows, dim) in self.layout.groups.items():
            slots = self.layout.slots_of_group(group)
            rows = np.concatenate([rows_of[s.feature][0] for s in slots])
            gs = []
            for s in slots:
                g = jnp.asarray(grads[s.feature], jnp.float32)
                if g.shape != (len(rows_of[s.feature][0]), dim):
                    raise ValueError(
                        f"grads[{s.feature!r}] has shape {tuple(g.shape)}; expected [{len(rows_of[s.feature][0])}, {dim}] "
                        "(one row per id of the feature)"
                    )
                gs.append(g)
            cap = _capacity.capacity_for(max(len(rows), 1), self.ladder, what=f"update of buffer {group!r}")
            padded_rows = np.full(cap, total_rows, np.int32)
            padded_rows[: len(rows)] = rows
            grad = jnp.zeros((cap, dim), jnp.float32).at[: len(rows)].set(jnp.concatenate(gs) if gs else jnp.zeros((0, dim)))
            streams[group] = (jnp.asarray(padded_rows), grad)
        return streams, None

    def update_fn(self, rule: RowRule):
        def step(params, opt_state: SparseOptState, streams, _unused):
            count = opt_state.count + 1
            new_params, new_states = {}, {}
            for group, (rows, grad) in streams.items():
                n = rows.shape[0]
                new_params[group], new_states[group] = apply_row_rule(
                    rule, params[group], opt_state.tables[group], count, rows,
                    jnp.arange(n, dtype=jnp.int32), jnp.ones(n, jnp.float32), grad,
                )
            return new_params, SparseOptState(count=count, tables=new_states)

        return step
