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
from sparse_jax._embedding_bag import EmbeddingBagCollection
from sparse_jax._jagged import JaggedTensor, KeyedJaggedTensor

__all__ = ["ShardedEmbeddingCollection"]


class ShardedEmbeddingCollection:
    """Build with `shard(ec, mesh, plan)`; `apply` returns `{feature: JaggedTensor}` as the
    unsharded `EmbeddingCollection` does, and `make_update` takes `{feature: [ids, dim]}`."""

    is_weighted = False

    def __init__(self, ec, mesh, plan=None, **shard_kw):
        from sparse_jax.sharding._sharded import ShardedEmbeddingBagCollection

        self.ec = ec
        self.layout = ec.layout
        bags = [
            EmbeddingBagConfig(
                name=t.name, num_embeddings=t.num_embeddings, embedding_dim=t.embedding_dim,
                feature_names=list(t.feature_names), data_type=t.data_type,
                weight_init_min=t.weight_init_min, weight_init_max=t.weight_init_max,
            )
            for t in ec.tables
        ]
        self.bags = ShardedEmbeddingBagCollection(
            EmbeddingBagCollection(bags, bounds_check=ec.bounds_check), mesh, plan, **shard_kw
        )
        self.plan, self.mesh = self.bags.plan, mesh

    @property
    def tables(self):
        return self.ec.tables

    def init(self, key):
        return self.bags.init(key)

    def table_weights(self, params):
        return self.bags.table_weights(params)

    def with_table_weights(self, params, weights: Mapping):
        return self.bags.with_table_weights(params, weights)

    def table_state(self, opt_state, key: str):
        return self.bags.table_state(opt_state, key)

    def _check(self, kjt: KeyedJaggedTensor) -> None:
        self.ec._check(kjt)

    def _per_id(self, kjt: KeyedJaggedTensor) -> tuple[KeyedJaggedTensor, dict[str, np.ndarray]]:
        """The per-id KJT (one id per bag, features padded to one batch) and each feature's lengths."""
        features = self.layout.feature_names
        per_feature = {f: kjt[f] for f in features}
        counts = [int(np.asarray(per_feature[f].values()).shape[0]) for f in features]
        n = self.bags.num_devices
        stride = max(n, -(-max(counts, default=0) // n) * n)
        values, lengths = [], []
        for f, c in zip(features, counts, strict=True):
            values.append(np.asarray(per_feature[f].values()))
            lengths.append(np.concatenate([np.ones(c, np.int32), np.zeros(stride - c, np.int32)]))
        per_id = KeyedJaggedTensor(features, np.concatenate(values), lengths=np.concatenate(lengths), stride=stride)
        return per_id, {f: np.asarray(per_feature[f].lengths()) for f in features}

    def apply(self, params, kjt: KeyedJaggedTensor) -> dict[str, JaggedTensor]:
        self._check(kjt)
        per_id, lengths = self._per_id(kjt)
        rows = np.asarray(self.bags.apply(params, per_id).values())
        out = {}
        for slot in self.layout.features:
            n = int(lengths[slot.feature].sum())
            emb = jnp.asarray(rows[:n, slot.out_offset : slot.out_offset + slot.dim])
            out[slot.feature] = JaggedTensor.from_values_and_lengths(emb, lengths[slot.feature])
        return out

    # -- fused update (used by make_update) ----------------------------------------------------
    def prepare_update(self, kjt: KeyedJaggedTensor, grads: Mapping[str, jax.Array]):
        missing = [s.feature for s in self.layout.features if s.feature not in grads]
        if missing:
            raise ValueError(f"grads has no entry for feature(s) {missing}; give one [num_ids, dim] array per feature")
        per_id, lengths = self._per_id(kjt)
        pooled = np.zeros((per_id.stride(), sum(self.layout.output_dims)), np.float32)
        for slot in self.layout.features:
            g = np.asarray(grads[slot.feature], np.float32)
            n = int(lengths[slot.feature].sum())
            if g.shape != (n, slot.dim):
                raise ValueError(
                    f"grads[{slot.feature!r}] has shape {g.shape}; expected [{n}, {slot.dim}] (one row per id of the feature)"
                )
            pooled[:n, slot.out_offset : slot.out_offset + slot.dim] = g
        from sparse_jax._update import _batch_sharded

        return self.bags.batch(per_id), _batch_sharded(self.bags, pooled)

    def update_fn(self, rule):
        return self.bags.update_fn(rule)
