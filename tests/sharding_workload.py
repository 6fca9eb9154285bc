"""The workload both sides of the multi-process test run: forward + 3 fused updates."""

import jax
import jax.numpy as jnp
import numpy as np

from sparse_jax import EmbeddingBagCollection, make_update, optim
from sparse_jax.sharding import shard
from tests.cases import random_case

PLAN = {"t0": "row_wise", "t1": "table_wise", "t2": "data_parallel", "t3": "column_wise"}


def run_workload(mesh) -> dict:
    n = mesh.size
    case = random_case(np.random.default_rng(11), dims=[8, 8, 4, 16], batch=2 * n, weighted=True, rows=(20, 60))
    ebc = EmbeddingBagCollection(case.tables, is_weighted=True)
    sharded = shard(ebc, mesh, PLAN)
    rule = optim.adagrad(lr=0.1)
    params = sharded.init(jax.random.key(0))
    state = rule.init(params)
    update = make_update(sharded, rule)
    pooled = sharded.apply(params, case.kjt).values()
    out = {"pooled": _host(pooled)}
    rng = np.random.default_rng(5)
    for step in range(3):
        kjt = random_case(np.random.default_rng(50 + step), dims=[8, 8, 4, 16], batch=2 * n, weighted=True,
                          rows=(20, 60), hot_rows=20, shuffle_keys=False).kjt
        grad = jnp.asarray(rng.normal(size=(2 * n, sum(ebc.layout.output_dims))).astype(np.float32))
        params, state = update(params, state, kjt, np.asarray(grad))
    for name, w in sharded.table_weights(params).items():
        out[f"table_{name}"] = w
    return out


def _host(array):
    from sparse_jax.sharding._placement import _host as host

    return host(array)
