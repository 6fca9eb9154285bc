"""A sharded `EmbeddingCollection` (unpooled rows per id) on a device mesh.

A sequence lookup is a pooled lookup in which every id is its own bag. So the sharded
sequence collection keeps a sharded *bag* collection of the same tables (SUM pooling) and
feeds it a per-id KJT: feature f's i-th id becomes bag i of f, every feature padded with
empty bags to one batch size (a multiple of the device count). Its pooled output `[S, sum of
dims]` holds each id's row; the per-id gradients go back in the same layout, so the fused
update, every sharding type, 2D replication and both input dists are the bag collection's.
"""

from __future__ import annotations

from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np

from sparse_jax._configs import EmbeddingBagConfig
from sparse_jax._embedding import SequenceBatch, with_indices
from sparse_jax._embedding_bag import EmbeddingBagCollection
from sparse_jax._jagged import JaggedTensor, KeyedJaggedTensor
from sparse_jax._module import LayoutFacts

__all__ = ["ShardedEmbeddingCollection"]


class ShardedEmbeddingCollection(LayoutFacts):
    """Build with `shard(ec, mesh, plan)`; `apply` returns `{feature: JaggedTensor}` as the
    unsharded `EmbeddingCollection` does, and `make_update` takes `{feature: [ids, dim]}`."""

    def is_weighted(self) -> bool:
        return False

    def __init__(self, ec, mesh, plan=None, **shard_kw):
        from sparse_jax.sharding._sharded import ShardedEmbeddingBagCollection

        self.ec = ec
        self.layout = ec.layout
        bags = [
            EmbeddingBagConfig(
                name=t.name,
                num_embeddings=t.num_embeddings,
                embedding_dim=t.embedding_dim,
                # the per-id batch is keyed by output names (`feature@table` when shared)
                feature_names=names,
                data_type=t.data_type,
                weight_init_min=t.weight_init_min,
                weight_init_max=t.weight_init_max,
                init_fn=t.init_fn,
            )
            for t, names in zip(ec.tables, ec.layout.embedding_names_by_table(), strict=True)
        ]
        self.bags = ShardedEmbeddingBagCollection(
            # ids are checked once, by the sequence collection's prepare ("skip" computes what
            # "error" does on checked ids)
            EmbeddingBagCollection(
                bags, bounds_check="skip" if ec.bounds_check == "error" else ec.bounds_check
            ),
            mesh,
            plan,
            **shard_kw,
        )
        self.plan, self.mesh = self.bags.plan, mesh
        self.prepare_count = 0

    def init(self, key):
        return self.bags.init(key)

    def table_weights(self, params):
        return self.bags.table_weights(params)

    def with_table_weights(self, params, weights: Mapping):
        return self.bags.with_table_weights(params, weights)

    def table_state(self, opt_state, key: str):
        return self.bags.table_state(opt_state, key)

    @property
    def mesh_axes(self):
        return self.bags.mesh_axes

    def stored_blocks(self):
        return self.bags.stored_blocks()

    def lookup_compile_count(self) -> int:
        return self.bags.lookup_compile_count()

    def managed(self) -> None:
        """A plain sharded collection manages no ids (`SparseModule.managed`)."""
        return None

    def _per_id(self, kjt: KeyedJaggedTensor) -> tuple[KeyedJaggedTensor, dict[str, np.ndarray]]:
        """The per-id host KJT (one id per bag, features padded to one batch) and each
        feature's lengths."""
        features = self.layout.feature_names
        all_values, all_lengths = np.asarray(kjt.values()), np.asarray(kjt.lengths())
        per_feature = {}
        for f, ki in zip(features, self.layout.key_indices(kjt.keys()), strict=True):
            a, b = kjt._key_slice(ki)
            first, last = kjt._bag_range(ki)
            per_feature[f] = (all_values[a:b], all_lengths[first:last].astype(np.int32))
        counts = [len(per_feature[f][0]) for f in features]
        n = self.bags.num_devices
        bags = max(n, -(-max(counts, default=0) // n) * n)
        values = (
            np.concatenate([per_feature[f][0] for f in features])
            if features
            else np.zeros(0, np.int32)
        )
        lengths = np.concatenate(
            [np.concatenate([np.ones(c, np.int32), np.zeros(bags - c, np.int32)]) for c in counts]
        )
        offsets = np.zeros(len(lengths) + 1, np.int32)
        np.cumsum(lengths, out=offsets[1:])
        per_id = KeyedJaggedTensor.tree_unflatten(
            (tuple(features), bags, None), (values, None, lengths, offsets)
        )
        return per_id, {f: per_feature[f][1] for f in features}

    def prepare(self, kjt: KeyedJaggedTensor, *, device=None) -> SequenceBatch:  # noqa: ARG002 (on the mesh)
        """Checked on the host, turned into the per-id bag batch, split and placed once."""
        if jax.process_count() > 1:
            raise NotImplementedError(
                "a sharded EmbeddingCollection across several processes is not supported yet: each "
                "process's share of ids gives a different per-id batch size; use one process "
                "(any number of devices), or an EmbeddingBagCollection"
            )
        host = self.ec.check_host(kjt)
        per_id, lengths = self._per_id(host)
        self.prepare_count += 1
        indices = None
        if self.ec.need_indices():
            indices = {
                f: np.asarray(host.values())[slice(*host._key_slice(ki))]
                for f, ki in zip(
                    self.layout.feature_names, self.layout.key_indices(host.keys()), strict=True
                )
            }
        return SequenceBatch(
            rows=self.bags.prepare(per_id), lengths=lengths, stride=kjt.stride(), indices=indices
        )

    def apply(self, params, batch) -> dict[str, JaggedTensor]:
        if not isinstance(batch, SequenceBatch):
            batch = self.prepare(batch)
        # replicated on the mesh (a device-side all-gather) so per-feature slices need no
        # output sharding, also on explicit-axis meshes
        rows = jax.device_put(
            self.bags.apply(params, batch.rows).values(),
            jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec()),
        )
        out = {}
        for slot in self.layout.features:
            emb = rows[: batch.count(slot.name), slot.out_offset : slot.out_offset + slot.dim]
            out[slot.name] = with_indices(
                JaggedTensor.from_values_and_lengths(emb, batch.lengths[slot.name]),
                batch,
                slot.name,
            )
        return out

    # -- fused update (used by make_update) ----------------------------------------------------
    def update_operands(self, batch: SequenceBatch, grads: Mapping[str, jax.Array]):
        """The per-id gradients laid out as the bag batch's pooled gradient (device ops)."""
        missing = [s.name for s in self.layout.features if s.name not in grads]
        if missing:
            raise ValueError(
                f"grads has no entry for feature(s) {missing}; give one [num_ids, dim] array per feature"
            )
        pooled = jnp.zeros((batch.rows.stride, sum(self.layout.output_dims)), jnp.float32)
        for slot in self.layout.features:
            g = jnp.asarray(grads[slot.name], jnp.float32)
            n = batch.count(slot.name)
            if g.shape != (n, slot.dim):
                raise ValueError(
                    f"grads[{slot.name!r}] has shape {tuple(g.shape)}; expected [{n}, {slot.dim}] (one row per id of the feature)"
                )
            pooled = pooled.at[:n, slot.out_offset : slot.out_offset + slot.dim].set(g)
        return self.bags.update_operands(batch.rows, pooled)

    def update_step(self, rule):
        return self.bags.update_step(rule)
