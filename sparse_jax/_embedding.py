"""`EmbeddingCollection`: unpooled (sequence) lookups, one row per id.

    ec = EmbeddingCollection(tables=[EmbeddingConfig(...), ...])
    params = ec.init(key)
    batch = ec.prepare(kjt)            # checked on the host, rows padded and placed, once
    out = ec.apply(params, batch)      # {feature: JaggedTensor of [num_ids, dim] rows}
    update = make_update(ec, rule)     # (params, state, batch, {feature: [num_ids, dim] grads})

Unlike TorchRec (#294), tables of different dims may live in one collection (each dim is
its own stacked buffer). `apply` is eager per feature, like TorchRec's dict of
JaggedTensors; the row gather inside is jitted per buffer. The fused update streams every
id's gradient through the same generic row-rule apply as the pooled collection.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from sparse_jax import _capacity, _guard, _lookup
from sparse_jax._configs import EmbeddingConfig, as_table_configs
from sparse_jax._jagged import JaggedTensor, KeyedJaggedTensor
from sparse_jax._layout import TableLayout
from sparse_jax._module import PreparedBatch
from sparse_jax._row_update import update_rows
from sparse_jax._tables import TableCollection
from sparse_jax.optim._base import RowRule, SparseOptState

__all__ = ["EmbeddingCollection", "with_indices"]


def with_indices(jt: JaggedTensor, batch: SequenceBatch, name: str) -> JaggedTensor:
    """`jt` with the output's ids as weights when the batch carries them (need_indices)."""
    if batch.indices is None:
        return jt
    return JaggedTensor.tree_unflatten(
        None, (jt.values(), jax.device_put(batch.indices[name]), jt.lengths(), jt.offsets())
    )


@jax.jit
def _gather_rows(table, rows):
    return table.at[rows].get(mode="fill", fill_value=0).astype(jnp.float32)


@dataclasses.dataclass(frozen=True)
class SequenceBatch(PreparedBatch):
    """A sequence collection's prepared batch.

    `rows`: what the tables' devices read (unsharded: per group, the rows of the group's
    ids, padded to a capacity with an out-of-range row; sharded: the per-id bag batch).
    `lengths`: per output, the host lengths the output JaggedTensors are cut by.
    `indices`: per output, its ids (the outputs' weights with `need_indices=True`)."""

    rows: object
    lengths: Mapping[str, np.ndarray]
    stride: int
    indices: Mapping[str, np.ndarray] | None = None  # per output its ids (need_indices=True)

    def count(self, feature: str) -> int:
        return int(self.lengths[feature].sum())


class EmbeddingCollection(TableCollection):
    """Sequence embedding tables (TorchRec's `EmbeddingCollection`), functional."""

    expands_variable_stride = False

    def __init__(
        self,
        tables: Sequence[EmbeddingConfig],
        need_indices: bool = False,
        *,
        bounds_check: str = "error",
        ladder=None,
    ):
        tables = as_table_configs(tables)  # TorchRec's configs too
        for t in tables:
            if not isinstance(t, EmbeddingConfig):
                raise ValueError(
                    f"EmbeddingCollection takes EmbeddingConfig tables; {getattr(t, 'name', t)!r} is a "
                    f"{type(t).__module__}.{type(t).__name__} (use EmbeddingBagCollection for pooled tables)"
                )
        self.layout = TableLayout.build(tables)
        self._need_indices = bool(need_indices)
        self.bounds_check = _lookup.check_bounds_mode(bounds_check)
        self.ladder = ladder
        self.prepare_count = 0
        self._programs: set = set()

    def _group_rows(self, kjt: KeyedJaggedTensor):
        """Per group the rows of its features' ids, concatenated (an out-of-range row,
        dropped by every scatter and read as zeros, for skipped ids); per output its lengths
        and its ids (a variable-batch KJT keeps each feature's own bags)."""
        rows: dict[str, list] = {g: [] for g in self.layout.groups}
        lengths, indices = {}, {}
        values, all_lengths = np.asarray(kjt.values()), np.asarray(kjt.lengths())
        for slot, ki in zip(self.layout.features, self.layout.key_indices(kjt.keys()), strict=True):
            a, b = kjt._key_slice(ki)
            first, last = kjt._bag_range(ki)
            ids = values[a:b].astype(np.int64)
            if self.bounds_check == "clamp":
                ids = np.clip(ids, 0, slot.num_rows - 1)
            inside = (ids >= 0) & (ids < slot.num_rows)
            rows[slot.group].append(
                np.where(inside, ids + slot.row_offset, self.layout.groups[slot.group][0])
            )
            lengths[slot.name] = all_lengths[first:last].astype(np.int32)
            indices[slot.name] = values[a:b]
        return (
            {g: np.concatenate(r) if r else np.zeros(0, np.int64) for g, r in rows.items()},
            lengths,
            indices,
        )

    def prepare(self, kjt: KeyedJaggedTensor, *, device: jax.Device | None = None) -> SequenceBatch:
        """Check on the host, build each group's padded row stream, place it (once per batch)."""
        rows, lengths, indices = self._group_rows(self.check_host(kjt))
        placed = {}
        for group, r in rows.items():
            cap = _capacity.capacity_for(
                max(len(r), 1), self.ladder, what=f"ids of buffer {group!r}"
            )
            padded = np.full(cap, self.layout.groups[group][0], np.int32)
            padded[: len(r)] = r
            placed[group] = jax.device_put(padded, device)
        self.prepare_count += 1
        return SequenceBatch(
            rows=placed,
            lengths=lengths,
            stride=kjt.stride(),
            indices=indices if self._need_indices else None,
        )

    def apply(self, params, batch) -> dict[str, JaggedTensor]:
        """{feature: JaggedTensor} whose values are the `[num_ids, dim]` rows (skipped ids: zeros)."""
        if not isinstance(batch, SequenceBatch):
            batch = self.prepare(batch)
        out = {}
        for group, rows in batch.rows.items():
            self._programs.add(rows.shape)
            emb = _gather_rows(params[group], rows)
            start = 0
            for slot in self.layout.slots_of_group(group):
                n = batch.count(slot.name)
                out[slot.name] = with_indices(
                    JaggedTensor.from_values_and_lengths(
                        emb[start : start + n], batch.lengths[slot.name]
                    ),
                    batch,
                    slot.name,
                )
                start += n
        return {f: out[f] for f in self.layout.feature_names}

    def lookup_compile_count(self) -> int:
        return len(self._programs)

    # -- TorchRec's accessors --------------------------------------------------------------------
    def need_indices(self) -> bool:
        """Whether `apply`'s JaggedTensors carry each row's id as its weight (TorchRec)."""
        return self._need_indices

    def is_weighted(self) -> bool:
        return False

    def forward(self, params, batch) -> dict[str, JaggedTensor]:
        """`apply` under TorchRec's name (the module is functional: params come first)."""
        return self.apply(params, batch)

    def embedding_configs(self) -> list[EmbeddingConfig]:
        return list(self.layout.tables)

    def embedding_dim(self) -> int:
        """The tables' common dim (TorchRec's EC has one); an error when dims differ."""
        dims = sorted({t.embedding_dim for t in self.layout.tables})
        if len(dims) != 1:
            raise ValueError(
                f"EmbeddingCollection.embedding_dim: the tables have dims {dims} (hybridrec allows "
                "several; read each table's embedding_dim)"
            )
        return dims[0]

    def embedding_names_by_table(self) -> list[list[str]]:
        return self.layout.embedding_names_by_table()

    # -- fused update (used by make_update) ----------------------------------------------------
    def update_operands(self, batch: SequenceBatch, grads: Mapping[str, jax.Array]):
        """Per buffer (rows, per-id grads padded to the rows' capacity); device ops only."""
        missing = [s.name for s in self.layout.features if s.name not in grads]
        if missing:
            raise ValueError(
                f"grads has no entry for feature(s) {missing}; give one [num_ids, dim] array per feature"
            )
        streams = {}
        for group, rows in batch.rows.items():
            dim = self.layout.groups[group][1]
            gs = []
            for s in self.layout.slots_of_group(group):
                g = jnp.asarray(grads[s.name], jnp.float32)
                if g.shape != (batch.count(s.name), dim):
                    raise ValueError(
                        f"grads[{s.name!r}] has shape {tuple(g.shape)}; expected [{batch.count(s.name)}, {dim}] "
                        "(one row per id of the feature)"
                    )
                gs.append(g)
            flat = jnp.concatenate(gs) if gs else jnp.zeros((0, dim), jnp.float32)
            streams[group] = (
                rows,
                jnp.zeros((rows.shape[0], dim), jnp.float32).at[: flat.shape[0]].set(flat),
            )
        return streams

    def update_step(self, rule: RowRule):
        def step(params, opt_state: SparseOptState, streams):
            count = opt_state.count + 1  # the rule's step number
            new_params, new_states = dict(params), dict(opt_state.tables)
            for group, (rows, grad) in streams.items():
                n = rows.shape[0]
                new_params[group], new_states[group] = update_rows(  # C++ on CPU, Pallas on CUDA
                    rule,
                    params[group],
                    opt_state.tables[group],
                    count,
                    rows,
                    jnp.arange(n, dtype=jnp.int32),
                    jnp.ones(n, jnp.float32),
                    grad,
                    kernel="auto",
                )
            return new_params, SparseOptState(
                count=_guard.next_count(opt_state.count), tables=new_states
            )

        return step
