"""Host-side preparation facts against plain loops: the all_to_all route need (which sizes
the buffers, so an undercount would drop ids) and the length caps' high-water mark."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from sparse_jax import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
from sparse_jax.sharding import shard
from sparse_jax.sharding._input_dist import route_need
from sparse_jax.sharding._local_batch import split_batch


def _plain_need(buffers, layout, parts, clamp):
    """Per (device, buffer, destination): ids sent, one per work item whose rows hold the id."""
    keys = list(parts["keys"])
    b_l = parts["local_batch"]
    best = 0
    for d in range(parts["values"].shape[0]):
        lengths = parts["lengths"][d]
        ids_of_key, pos = {}, 0
        for k in range(len(keys)):
            n = int(lengths[k * b_l : (k + 1) * b_l].sum())
            ids_of_key[k] = [int(x) for x in parts["values"][d, pos : pos + n]]
            pos += n
        for buf in buffers:
            if not buf.axes:
                continue
            for items in buf.items:
                sent = 0
                for it in items:
                    key = keys.index(layout.features[it.feature].feature)
                    for i in ids_of_key[key]:
                        if clamp:
                            i = min(max(i, 0), it.num_rows - 1)
                        if it.row_offset <= i < it.row_offset + it.row_size and i < it.num_rows:
                            sent += 1
                best = max(best, sent)
    return best


@pytest.mark.parametrize(
    "plan",
    [
        {"a": "row_wise", "b": "table_wise"},
        {"a": "table_row_wise", "b": "column_wise"},
        {"a": "grid_shard", "b": "row_wise"},
    ],
)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_route_need_equals_a_plain_count(plan, seed):
    tables = [
        EmbeddingBagConfig(name="a", num_embeddings=40, embedding_dim=8, feature_names=["fa"]),
        EmbeddingBagConfig(
            name="b", num_embeddings=24, embedding_dim=8, feature_names=["fb", "fc"]
        ),
    ]
    sharded = shard(
        EmbeddingBagCollection(tables),
        jax.make_mesh((2, 4), ("data", "model")),
        plan,
        input_dist="all_to_all",
    )
    rng = np.random.default_rng(seed)
    lengths = rng.integers(0, 6, size=3 * 16)
    # ids at every shard boundary (row offsets and their neighbours) and in between
    values = np.concatenate([rng.integers(0, 24, size=lengths.sum())])
    values[: min(len(values), 24)] = np.arange(min(len(values), 24))
    kjt = KeyedJaggedTensor(["fa", "fb", "fc"], values, lengths=lengths)
    parts = split_batch(kjt, 8)
    for clamp in (False, True):
        got = route_need(sharded.buffers, sharded.layout, parts, clamp=clamp)
        assert got == _plain_need(sharded.buffers, sharded.layout, parts, clamp)


def test_length_caps_only_grow():
    ebc = EmbeddingBagCollection(
        [EmbeddingBagConfig(name="t", num_embeddings=10, embedding_dim=4, feature_names=["f"])]
    )
    long = KeyedJaggedTensor(["f"], np.zeros(9, np.int32), lengths=np.array([9, 0]))
    short = KeyedJaggedTensor(["f"], np.zeros(2, np.int32), lengths=np.array([1, 1]))
    assert ebc.prepare(short).kjt.length_caps() == (1,)
    assert ebc.prepare(long).kjt.length_caps() == (12,)  # length_cap(9)
    assert ebc.prepare(short).kjt.length_caps() == (12,)  # a shorter batch keeps the program
