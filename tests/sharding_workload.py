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
    case = random_case(
        np.random.default_rng(11), dims=[8, 8, 4, 16], batch=2 * n, weighted=True, rows=(20, 60)
    )
    ebc = EmbeddingBagCollection(case.tables, is_weighted=True)
    sharded = shard(ebc, mesh, PLAN)
    rule = optim.adagrad(lr=0.1)
    params = sharded.init(jax.random.key(0))
    state = rule.init(params)
    update = make_update(sharded, rule)
    pooled = sharded.apply(params, process_share(case.kjt, mesh)).values()
    out = {"pooled": _host(pooled)}
    rng = np.random.default_rng(5)
    for step in range(3):
        kjt = random_case(
            np.random.default_rng(50 + step),
            dims=[8, 8, 4, 16],
            batch=2 * n,
            weighted=True,
            rows=(20, 60),
            hot_rows=20,
            shuffle_keys=False,
        ).kjt
        grad = jnp.asarray(rng.normal(size=(2 * n, sum(ebc.layout.output_dims))).astype(np.float32))
        # each process prepares only its own samples; the gradient is the global value
        params, state = update(params, state, process_share(kjt, mesh), np.asarray(grad))
    for name, w in sharded.table_weights(params).items():
        out[f"table_{name}"] = w
    return out


def _host(array):
    from sparse_jax.sharding._placement import _host as host

    return host(array)


def process_share(kjt, mesh):
    """The samples of `kjt` this process's devices hold (mesh positions in order): the
    whole batch in one process."""
    from sparse_jax import KeyedJaggedTensor

    positions = [
        i for i, d in enumerate(mesh.devices.flat) if d.process_index == jax.process_index()
    ]
    stride, keys = kjt.stride(), kjt.keys()
    b_l = stride // mesh.devices.size
    lengths = np.asarray(kjt.lengths()).reshape(len(keys), stride)
    offsets = np.asarray(kjt.offsets())
    values = np.asarray(kjt.values())
    weights = kjt.weights_or_none()
    take_v, take_l = [], []
    for k in range(len(keys)):
        for p in positions:
            a, b = k * stride + p * b_l, k * stride + (p + 1) * b_l
            take_v.append(np.arange(offsets[a], offsets[b]))
            take_l.append(lengths[k, p * b_l : (p + 1) * b_l])
    idx = np.concatenate(take_v)
    return KeyedJaggedTensor(
        keys,
        values[idx],
        lengths=np.concatenate(take_l),
        weights=None if weights is None else np.asarray(weights)[idx],
    )
