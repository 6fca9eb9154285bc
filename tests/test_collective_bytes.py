"""Collective bytes per step: `ShardedEmbeddingBagCollection.collective_bytes` equals what
the compiled programs (`apply`'s and `make_update`'s) move, read off their HLO; and the
planner's `estimate_collective_bytes` agrees with it for single-table plans."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sparse_jax import (
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    KeyedJaggedTensor,
    make_update,
    optim,
)
from sparse_jax.plan import _layout
from sparse_jax.planner import estimate_collective_bytes
from sparse_jax.planner._estimate import static_shapes
from sparse_jax.sharding import ShardingPlan, ShardingType, shard

PHASES = ("input_dist", "output_dist", "backward")
MESHES = {"8": ((8,), ("model",)), "2x4": ((2, 4), ("data", "model"))}

# -- reading the compiled HLO ---------------------------------------------------------------

_ITEMSIZE = {
    "pred": 1,
    "s8": 1,
    "u8": 1,
    "s16": 2,
    "u16": 2,
    "f16": 2,
    "bf16": 2,
    "s32": 4,
    "u32": 4,
    "f32": 4,
    "s64": 8,
    "u64": 8,
    "f64": 8,
}
_INSTRUCTION = re.compile(
    r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(?P<shape>.+?)\s+(?P<op>[a-z][\w\-]*)\("
)
_ARRAY = re.compile(r"\b([a-z]+\d*)\[([\d,]*)\]")
_COUNTED = {"all-gather", "all-to-all", "all-reduce"}
# Collectives this scheme never emits: seeing one means the count below would miss bytes.
_UNEXPECTED = {
    "reduce-scatter",
    "collective-permute",
    "collective-broadcast",
    "ragged-all-to-all",
    "all-gather-start",
    "all-to-all-start",
    "all-reduce-start",
    "collective-permute-start",
    "send",
    "recv",
}


def _group_size(line: str) -> int:
    if m := re.search(r"replica_groups=\{\{([\d,]*)\}", line):
        return len(m[1].split(","))
    if m := re.search(r"replica_groups=\[\d+,(\d+)\]<=", line):
        return int(m[1])
    raise AssertionError(f"no replica groups in: {line}")


def hlo_received_bytes(hlo: str) -> int:
    """Bytes one device receives through the all-gather / all-to-all / all-reduce ops of a
    compiled SPMD program: an all-gather's result is the group's n pieces and an
    all-to-all's result (array or tuple form) n chunks, of which n - 1 come from the other
    devices; an all-reduce needs the n - 1 other devices' whole vectors."""
    total = 0
    for line in hlo.splitlines():
        m = _INSTRUCTION.match(line)
        if m is None:
            continue
        assert m["op"] not in _UNEXPECTED, line
        if m["op"] not in _COUNTED:
            continue
        size = sum(
            _ITEMSIZE[dtype] * int(np.prod([int(d) for d in dims.split(",") if d]))
            for dtype, dims in _ARRAY.findall(m["shape"])
        )
        n = _group_size(line)
        if m["op"] == "all-reduce":
            total += size * (n - 1)
            continue
        assert size % n == 0, line
        total += size // n * (n - 1)
    return total


# -- setups ---------------------------------------------------------------------------------


def _mesh(name):
    shape, axes = MESHES[name]
    return jax.sharding.Mesh(np.array(jax.devices()[: int(np.prod(shape))]).reshape(shape), axes)


def _table(name="t", rows=1000, dim=16, features=2):
    return EmbeddingBagConfig(
        name=name,
        num_embeddings=rows,
        embedding_dim=dim,
        feature_names=[f"{name}_f{i}" for i in range(features)],
    )


def _kjt(tables, lengths, *, weighted, seed=0):
    """KJT over every feature of `tables`; `lengths(num_keys)` gives the key-major lengths."""
    rng = np.random.default_rng(seed)
    keys = [f for t in tables for f in t.feature_names]
    lens = np.asarray(lengths(len(keys)), np.int32)
    rows = min(t.num_embeddings for t in tables)
    values = rng.integers(0, rows, size=int(lens.sum())).astype(np.int32)
    weights = rng.random(values.size).astype(np.float32) if weighted else None
    return KeyedJaggedTensor(keys, values, weights=weights, lengths=lens)


def _hlo_bytes(sharded, kjt):
    """(local batches, forward bytes, update bytes): bytes received per device, read off
    the compiled programs `apply` and `make_update` run, with the inputs they are given."""
    params = sharded.init(jax.random.key(0))
    rule = optim.rowwise_adagrad(lr=0.1)
    update = make_update(sharded, rule)
    grad = jnp.zeros((kjt.stride(), sum(sharded.layout.output_dims)), jnp.float32)
    local = sharded.prepare(kjt)
    operands = sharded.update_operands(local, grad)  # as `update(...)` places them
    forward = sharded._apply_jit.lower(params, local).compile().as_text()
    step = update.jitted.lower(params, rule.init(params), operands).compile().as_text()
    return local, hlo_received_bytes(forward), hlo_received_bytes(step)


# -- analytic == HLO ------------------------------------------------------------------------

BATCH = 64


def _random_lengths(num_keys):
    return np.random.default_rng(1).integers(0, 6, size=num_keys * BATCH)


@pytest.mark.parametrize(
    ("kind", "mesh_name", "weighted", "input_dist"),
    [
        ("row_wise", "2x4", False, "all_gather"),
        ("table_wise", "8", True, "all_gather"),
        ("data_parallel", "2x4", True, "all_gather"),
        ("column_wise", "2x4", False, "all_gather"),
        ("row_wise", "2x4", True, "all_to_all"),
        ("table_wise", "8", False, "all_to_all"),
    ],
)
def test_analytic_bytes_equal_what_the_compiled_programs_move(
    kind, mesh_name, weighted, input_dist
):
    table = _table()
    ebc = EmbeddingBagCollection([table], is_weighted=weighted)
    sharded = shard(ebc, _mesh(mesh_name), {"t": kind}, input_dist=input_dist)
    local, forward, update = _hlo_bytes(sharded, _kjt([table], _random_lengths, weighted=weighted))
    got = sharded.collective_bytes(local, "rowwise_adagrad")
    split = kind in ("column_wise", "table_column_wise", "grid_shard")
    assert set(got) == {*(b.name for b in sharded.buffers), "total"} | (
        {"row_stat"} if split else set()
    )
    if split:  # by hand: one psum over the 8 devices of the table's rows, fp32
        assert got["row_stat"]["backward"] == 7 * table.num_embeddings * 4
    total = got["total"]
    assert forward == total["input_dist"] + total["output_dist"]
    assert update == total["backward"]
    assert update > 0
    if kind == "data_parallel":
        assert forward == 0
    if (
        input_dist == "all_to_all"
    ):  # by hand: (n_A - 1) blocks of capacity (row, bag, weight) triples
        (buf,) = sharded.buffers
        assert local.route_capacity > 0
        assert total["input_dist"] == (buf.group_size - 1) * local.route_capacity * 12
    elif kind == "row_wise":  # by hand: A = model (4), R = data (2), one buffer, M = 2 features
        (buf,) = sharded.buffers
        cap, b_l, k, m, w, lc = local.values.shape[1], BATCH // 8, 2, 2, 16, local.length_cap
        assert buf.max_items == m and buf.width == w
        kjt_bytes = 3 * (cap * 4 + k * b_l * 4)  # values + lengths; unweighted: no weights
        a2a = 3 * m * b_l * w * 4
        n_ids = m * 4 * b_l * lc
        assert total == {
            "input_dist": kjt_bytes,
            "output_dist": a2a,
            "backward": kjt_bytes + a2a + 1 * (n_ids * 12 + m * 4 * b_l * w * 4),
        }


def test_identical_gathers_of_several_buffers_count_once():
    # Column blocks of 8 and 4 columns, both on model coordinate 0: two shard buffers over
    # "model" with identical work items. XLA merges their identical all-gathers (the KJT
    # over "model"; the row, bag and scale streams over "data"), so they count once.
    table = _table("b", dim=12)
    mesh = _mesh("2x4")
    blocks = _layout.column_wise(1000, [8, 4], ("model",), [(0,), (0,)])
    plan = ShardingPlan.from_types([table], dict(mesh.shape), {"b": blocks})
    sharded = shard(EmbeddingBagCollection([table], is_weighted=True), mesh, plan)
    first, second = (buf.name for buf in sharded.buffers)
    local, forward, update = _hlo_bytes(sharded, _kjt([table], _random_lengths, weighted=True))
    got = sharded.collective_bytes(local, "rowwise_adagrad")
    assert got["row_stat"]["backward"] == 7 * 1000 * 4  # the two blocks' row statistic, one psum
    assert got[first]["input_dist"] > 0 and got[second]["input_dist"] == 0
    # the second buffer's update gathers only its own bag gradients over "data"
    assert got[second]["backward"] == got[second]["output_dist"] + 1 * 2 * 4 * (BATCH // 8) * 4 * 4
    total = got["total"]
    assert forward == total["input_dist"] + total["output_dist"]
    assert update == total["backward"]


# -- the planner's estimate -----------------------------------------------------------------

PLANNER_BATCH = 128  # 16 samples per device
MESH_AXES = {"data": 2, "model": 4}


def _alternating(num_keys):  # bags of 0 and 8 ids: average 4, longest 8 = 2 x average
    return np.tile([0, 8], num_keys * PLANNER_BATCH // 2)


def _fixed(num_keys):  # every bag 4 ids
    return np.full(num_keys * PLANNER_BATCH, 4)


@pytest.mark.parametrize("kind", [t.value for t in ShardingType])
@pytest.mark.parametrize(
    ("lengths", "weighted", "max_bag_length"), [(_alternating, False, None), (_fixed, True, 4)]
)
def test_planner_estimate_is_within_ten_percent_of_the_reported_bytes(
    kind, lengths, weighted, max_bag_length
):
    table = _table()  # 2 features, 4 ids per bag on average: pooling factor 8 ids per sample
    pooling = 8.0
    mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "model"))
    plan = ShardingPlan.from_types([table], MESH_AXES, {"t": kind})
    sharded = shard(EmbeddingBagCollection([table], is_weighted=weighted), mesh, plan)
    local = sharded.prepare(_kjt([table], lengths, weighted=weighted))
    # The batch matches the planner's documented assumptions (capacity rung, length cap).
    shapes = static_shapes(table, PLANNER_BATCH / 8, pooling, max_bag_length=max_bag_length)
    assert (local.values.shape[1], local.length_cap) == shapes
    got = sharded.collective_bytes(local)["total"]
    est = estimate_collective_bytes(
        table,
        plan["t"],
        MESH_AXES,
        PLANNER_BATCH,
        pooling,
        max_bag_length=max_bag_length,
        weighted=weighted,
    )
    for phase in PHASES:
        assert est[phase] == pytest.approx(got[phase], rel=0.10), (phase, est, got)
    assert got["backward"] > 0
