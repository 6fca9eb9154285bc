"""A managed-collision training workload on a mesh, for one process or several
(tests/test_managed_multiprocess.py runs it both ways and compares): a row-wise managed
table of raw 64-bit ids and a table-wise plain table, six steps of remap, lookup and fused
update; each process prepares only its own samples. The managed table has 32 rows, or
`$HYBRIDREC_TEST_MANAGED_ROWS` (set by a test, inherited by its worker processes: 31 rows
over 2 shards are blocks of 16 and 15, maps of two sizes)."""

import os

import jax
import numpy as np

from sparse_jax import (
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    EmbeddingCollection,
    EmbeddingConfig,
    KeyedJaggedTensor,
    MCHManagedCollisionModule,
    RawIds,
    make_update,
)
from sparse_jax.optim import rowwise_adagrad
from sparse_jax.sharding import ShardedManagedCollisionModule, shard
from sparse_jax.sharding._placement import _host

ROWS, ITEMS, DIM, BATCH, STEPS = 32, 12, 4, 8, 6


def run_managed_workload(mesh) -> dict[str, np.ndarray]:
    me, n = jax.process_index(), jax.process_count()
    size = int(os.environ.get("HYBRIDREC_TEST_MANAGED_ROWS", ROWS))
    tables = [
        EmbeddingBagConfig(
            name="users", num_embeddings=size, embedding_dim=DIM, feature_names=["user"]
        ),
        EmbeddingBagConfig(
            name="items", num_embeddings=ITEMS, embedding_dim=DIM, feature_names=["item"]
        ),
    ]
    sharded = shard(
        EmbeddingBagCollection(tables), mesh, {"users": "row_wise", "items": "table_wise"}
    )
    module = ShardedManagedCollisionModule(
        sharded, {"users": MCHManagedCollisionModule(size, history_capacity=256)}
    )
    rule = rowwise_adagrad(lr=0.3)
    update = make_update(module, rule)
    params = module.init(jax.random.key(3))
    opt = rule.init(params)
    rng = np.random.default_rng(0)
    pool = rng.integers(-(2**62), 2**62, size=40)
    first, last = me * BATCH // n, (me + 1) * BATCH // n  # this process's samples
    out = {}
    for step in range(STEPS):
        # the first half of the batch (process 0's) carries many more ids: the id capacities the
        # processes would pick alone differ, so they must agree
        users = [
            pool[rng.integers(0, 40, rng.integers(0, 12 if b < BATCH // 2 else 3))]
            for b in range(BATCH)
        ]
        items = rng.integers(0, ITEMS, BATCH)
        grad = rng.normal(size=(BATCH, 2 * DIM)).astype(np.float32)
        mine = users[first:last]
        values = np.concatenate([*mine, items[first:last]]).astype(np.int64)
        lengths = np.array([len(u) for u in mine] + [1] * (last - first), np.int32)
        batch = module.prepare(
            KeyedJaggedTensor(["user", "item"], RawIds.from_int64(values).words(), lengths=lengths)
        )
        params, opt, rows = module.remap(params, opt, batch)
        out[f"pooled/{step}"] = _host(module.apply(params, rows).values())
        params, opt = update(params, opt, rows, grad)
    out.update({f"weight/{k}": np.asarray(v) for k, v in module.table_weights(params).items()})
    states, counters, key = module.host_state()
    out.update(
        {
            f"mc/{field}": np.asarray(leaf)
            for field, leaf in zip(states["users"]._fields, states["users"], strict=True)
        }
    )
    out["mc/counters"], out["mc/key"] = counters["users"], key
    out["stats"] = np.asarray(module.stats()["users"])
    ec = EmbeddingCollection(
        [
            EmbeddingConfig(
                name="users", num_embeddings=size, embedding_dim=DIM, feature_names=["user"]
            )
        ]
    )
    try:  # a sequence collection's managed tables: one process only
        ShardedManagedCollisionModule(
            shard(ec, mesh, {"users": "row_wise"}),
            {"users": MCHManagedCollisionModule(size, history_capacity=256)},
        )
        out["sequence_refused"] = np.array(False)
    except NotImplementedError as e:
        out["sequence_refused"] = np.array("several processes are not supported" in str(e))
    return out
