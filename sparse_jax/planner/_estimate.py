"""Cost model: per shard, memory and time per step; per table, collective bytes per step.

Notation (one training step): B global batch, N devices, b = B / N the local batch (the
batch is always split over every device). A table has E rows of D columns and s bytes per
element (its data type); L = its pooling factor (average ids per sample, summed over its
features); F = its features (pooled outputs per sample). A shard holds R rows and C
columns and serves f = R / E of the ids (ids assumed uniform over rows). The table is
sharded over `axes`, a group of n = prod(axis sizes) devices, and replicated over the other
axes: r = N / n copies.

    ids_served = n * b * L * f     ids the shard looks up per step (its group's batch)
    O = F (pooled tables) or L * f (sequence tables: one row back per id)

Collective bytes per step, received by every device of the mesh (one SPMD program), for
the scheme `sparse_jax.sharding` runs (`ShardedEmbeddingBagCollection.collective_bytes`
counts the same terms from a real batch's static shapes). A table's non-empty shards with
the same column count form one shard buffer (`_work.build_buffers`); per buffer, W = its
columns and M = F * (most of its shards on one coordinate) work items. n = group size
over `axes`, r = N / n replicas, cap = local capacity (ids), Lc = length cap (both below);
ids, lengths and the update's row / bag indices are int32, weights, scales, pooled outputs
and their gradients fp32 (4 bytes):

    input_dist  = (n - 1) * (cap * 4 + F * b * 4 [+ cap * 4 if weighted])
                  all_gather of the local KJT (values, lengths [, weights]) over `axes`;
                  once per table (XLA merges the buffers' identical gathers)
    output_dist = (n - 1) * sum_buffers M * b * Q * W * 4
                  all_to_all over `axes` of the fp32 [M, n, b, Q * W] pooled blocks
    backward    = input_dist                       the update recomputes positions: KJT again
                + output_dist                      mirror all_to_all of the pooled gradient
                + (r - 1) * sum_buffers M * n * b * (Lc * 12 + Q * W * 4)
                  all_gather over the replica axes of the per-id stream (row, bag, scale:
                  M * n * b * Lc entries each) and the bag gradients, so replicas stay equal
    Q = 1 (pooled tables) or Lc (sequence tables, by analogy: no sharded sequence
        collection exists; one row per padded position)
    data_parallel (n = 1): no forward comm; backward = (N - 1) * F * b * (Lc * 12 + Q * D * 4).

Assumptions (the planner sees no batch): the local capacity is the smallest rung of the
capacity ladder (`sparse_jax._capacity.capacity_for`; ceil(b * L) above the top rung)
holding the table's b * L ids; the longest bag is twice the average bag L / F, so Lc =
`length_cap(ceil(2 * L / F))` (or of `max_bag_length` when given); unweighted
unless `weighted=True`. Per table, as if it had its own buffers and KJT (K = F keys):
in a plan with several tables the implementation gathers the whole KJT once per distinct
set of axes and pads M to the fullest coordinate of a shared buffer, so per-table figures
are the table's share, not exact; identical index streams of two buffers (same M, same
coordinates) are merged by XLA but counted here per buffer (an upper bound).

Which link carries it: a peer is reached over the first mesh axis (mesh order) along which
its coordinate differs, so among n - 1 peers, group axis a_i carries
(size(a_i) - 1) * prod(sizes of the group axes after a_i) (the replica gather likewise
over the replica axes). The two-level types (table_row_wise, table_column_wise,
grid_shard) run the same scheme over both of their axes: there is no hierarchical
reduce, so they put the same bytes on the inter-host axis as a one-level type over the
same axes.

Time per step on the device holding the shard, in ms:

    compute = (ids_served * C * s                         gather rows
               + n * b * O * C * s                        write outputs
               + bwd_multiplier * B * L * f * C * s)       update: every replica applies all ids
              / memory_bandwidth
    comms   = sum over the three phases and the axes of bytes / axis_bandwidth; every
              device of the group spends it, but only holders can be charged, so the group's
              n devices' worth is split evenly over the coordinates holding a non-empty shard
              (then over the shards each holds): exact per device when every coordinate holds
              a shard, exact in sum always (a table_wise owner is charged its group's n x)

Memory per shard, on every device holding it:

    weights    R * C * s
    optimizer  R * per_row + R * C * per_element           (OPTIMIZER_STATE_BYTES, fp32 state)
    buffers    capacity_factor * ids_served * (4 + (r - 1) * (4 + C * s))
               + 2 * n * b * O * C * s                     outputs and their gradients

TorchRec's `shard_estimators.py` counts the same terms (input read, lookup, output write;
backward = 2 x forward compute, its BWD_COMPUTE_MULTIPLIER; a2a / reduce-scatter volumes).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence

import numpy as np

from sparse_jax._capacity import DEFAULT_LADDER, capacity_for, length_cap
from sparse_jax._configs import EmbeddingBagConfig
from sparse_jax.plan import ParameterSharding, ShardingEstimate
from sparse_jax.plan._layout import devices_holding, group_size

from ._topology import Topology

__all__ = ["OPTIMIZER_STATE_BYTES", "CostModel", "estimate_collective_bytes"]

# optimizer name -> (state bytes per row, state bytes per element), fp32 state.
OPTIMIZER_STATE_BYTES: dict[str, tuple[int, int]] = {
    "sgd": (0, 0),
    "adagrad": (0, 4),
    "rowwise_adagrad": (4, 0),
    "adam": (0, 8),
}
ID_BYTES = 4  # ids, lengths and the update's row / bag indices: int32
FLOAT_BYTES = 4  # weights, scales, pooled outputs and their gradients: fp32
STREAM_BYTES = 2 * ID_BYTES + FLOAT_BYTES  # per id of the update's stream: row, bag, scale
PHASES = ("input_dist", "output_dist", "backward")


def _peers_per_axis(axes, mesh_axes: Mapping[str, int]) -> dict[str, int]:
    out = {}
    for i, a in enumerate(axes):
        out[a] = (mesh_axes[a] - 1) * math.prod(mesh_axes[x] for x in axes[i + 1 :])
    return out


def static_shapes(
    table,
    local_batch: float,
    pooling: float,
    *,
    max_bag_length: int | None = None,
    ladder: Sequence[int] | None = None,
) -> tuple[int, int]:
    """(local capacity, length cap) the planner assumes for one table's own KJT.

    Capacity: the smallest ladder rung holding the `local_batch * pooling` ids of a device
    (ceil of that above the top rung). Length cap: `length_cap` of the longest
    bag, `max_bag_length` or, when not given, twice the average bag `pooling / F`.
    """
    ids = max(0, math.ceil(local_batch * pooling - 1e-9))
    rungs = tuple(DEFAULT_LADDER if ladder is None else ladder)
    cap = ids if rungs and ids > rungs[-1] else capacity_for(ids, rungs)
    longest = (
        max_bag_length
        if max_bag_length is not None
        else math.ceil(2 * pooling / table.num_features - 1e-9)
    )
    return cap, length_cap(longest)


def _buffers(ps: ParameterSharding) -> dict[int, int]:
    """The table's shard buffers as `sharding._work.build_buffers` stacks them: column
    count -> the most non-empty shards of that width on one coordinate."""
    per_coord: dict[int, dict[tuple, int]] = {}
    for shard in ps.shards:
        if shard.row_size:  # build_buffers skips empty row blocks
            held = per_coord.setdefault(shard.col_size, {})
            held[shard.device] = held.get(shard.device, 0) + 1
    return {width: max(held.values()) for width, held in per_coord.items()}


def _table_traffic(
    table,
    ps: ParameterSharding,
    mesh_axes,
    batch_size: int,
    pooling: float,
    *,
    max_bag_length: int | None = None,
    weighted: bool = False,
    ladder: Sequence[int] | None = None,
) -> dict[str, dict[str, float]]:
    """Phase -> axis -> bytes per step received by every device, as documented above."""
    order = list(mesh_axes)
    n = group_size(ps.axes, mesh_axes)
    b = batch_size / group_size(order, mesh_axes)
    cap, lc = static_shapes(table, b, pooling, max_bag_length=max_bag_length, ladder=ladder)
    per_bag = 1 if isinstance(table, EmbeddingBagConfig) else lc  # rows back per (sample, item)
    group = _peers_per_axis(ps.axes, mesh_axes)
    replicas = _peers_per_axis(tuple(a for a in order if a not in ps.axes), mesh_axes)
    out: dict[str, dict[str, float]] = {p: {} for p in PHASES}

    def add(phase: str, peers: dict[str, int], per_peer: float) -> None:
        for a, p in peers.items():
            out[phase][a] = out[phase].get(a, 0.0) + p * per_peer

    kjt = (
        cap * ID_BYTES + table.num_features * b * ID_BYTES + (cap * FLOAT_BYTES if weighted else 0)
    )
    add("input_dist", group, kjt)
    add("backward", group, kjt)
    for width, most in _buffers(ps).items():
        m = table.num_features * most
        pooled = m * b * per_bag * width * FLOAT_BYTES  # one peer's [M, b, Q * W] block
        add("output_dist", group, pooled)
        add("backward", group, pooled)
        add("backward", replicas, n * (m * b * lc * STREAM_BYTES + pooled))
    return out


def _shard_traffic(table, ps: ParameterSharding, mesh_axes, batch_size: int, pooling: float):
    """Per shard: phase -> axis -> bytes per step (floats), for the time model.

    Every device of the table's group moves `_table_traffic`, but only devices holding a
    shard are charged: the group's n devices' worth is split evenly over the coordinates
    holding a non-empty shard, and over the shards each of them holds. Exact per device
    when every coordinate holds a shard (data_parallel, row_wise, full column_wise), exact
    in sum always; a table on fewer coordinates (table_wise) charges them the whole group's.
    """
    mesh_axes = dict(mesh_axes)
    traffic = _table_traffic(table, ps, mesh_axes, batch_size, pooling)
    held: dict[tuple, int] = {}
    for shard in ps.shards:
        if shard.row_size:
            held[shard.device] = held.get(shard.device, 0) + 1
    n = group_size(ps.axes, mesh_axes)
    out = []
    for shard in ps.shards:
        share = n / (len(held) * held[shard.device]) if shard.row_size else 0.0
        out.append({p: {a: v * share for a, v in t.items()} for p, t in traffic.items()})
    return out


def estimate_collective_bytes(
    table,
    parameter_sharding: ParameterSharding,
    mesh_axes: Mapping[str, int],
    batch_size: int,
    pooling_factor: float,
    *,
    max_bag_length: int | None = None,
    weighted: bool = False,
    ladder: Sequence[int] | None = None,
) -> dict[str, int]:
    """Collective bytes per step for one table: {"input_dist", "output_dist", "backward"}.

    Bytes every device receives per step (the SPMD program moves the same on each), for
    the scheme `sparse_jax.sharding` runs: what `ShardedEmbeddingBagCollection.
    collective_bytes` reports for a single-table plan whose batch matches the assumptions.
    `pooling_factor`: average ids per sample, summed over the table's features;
    `max_bag_length`: the longest bag (default: twice the average bag); `weighted`: the
    KJT carries weights; `ladder`: the collection's capacity ladder (default: the default
    ladder). Formulas and assumptions in the module docstring. Pure: no devices are touched.
    """
    traffic = _table_traffic(
        table,
        parameter_sharding,
        dict(mesh_axes),
        batch_size,
        pooling_factor,
        max_bag_length=max_bag_length,
        weighted=weighted,
        ladder=ladder,
    )
    return {p: math.ceil(sum(traffic[p].values()) - 1e-9) for p in PHASES}


@dataclasses.dataclass(frozen=True, kw_only=True)
class CostModel:
    """The planner's estimates for one (topology, batch size, optimizer) setting.

    `optimizer` is a name in OPTIMIZER_STATE_BYTES or (bytes per row, bytes per element);
    `capacity_factor` scales the id buffers (static-shape padding headroom);
    `bwd_compute_multiplier` is backward compute over forward lookup bytes.
    """

    topology: Topology
    batch_size: int
    optimizer: str | tuple[int, int] = "rowwise_adagrad"
    capacity_factor: float = 1.0
    bwd_compute_multiplier: float = 2.0

    def __post_init__(self) -> None:
        bs = self.batch_size
        if isinstance(bs, bool) or not isinstance(bs, int) or bs < 1:
            raise ValueError(
                f"batch_size must be a positive integer (the global batch), got {bs!r}"
            )
        opt = self.optimizer
        if isinstance(opt, str) and opt not in OPTIMIZER_STATE_BYTES:
            raise ValueError(
                f"optimizer {opt!r} is not one of {sorted(OPTIMIZER_STATE_BYTES)}; or give "
                "(state bytes per row, state bytes per element)"
            )
        if not isinstance(opt, str) and (
            len(opt) != 2 or any(not isinstance(x, int) or x < 0 for x in opt)
        ):
            raise ValueError(
                f"optimizer must be a name or (bytes per row, bytes per element), got {opt!r}"
            )
        for field in ("capacity_factor", "bwd_compute_multiplier"):
            if not getattr(self, field) >= 0:
                raise ValueError(f"{field} must be >= 0, got {getattr(self, field)!r}")

    @property
    def state_bytes(self) -> tuple[int, int]:
        return (
            OPTIMIZER_STATE_BYTES[self.optimizer]
            if isinstance(self.optimizer, str)
            else tuple(self.optimizer)
        )

    def shard_costs(
        self, table, ps: ParameterSharding, pooling: float
    ) -> tuple[list[int], list[float]]:
        """Per shard: bytes and ms per step on every device holding it."""
        topo, mesh = self.topology, self.topology.axes
        n, r = group_size(ps.axes, mesh), topo.num_devices // group_size(ps.axes, mesh)
        b = self.batch_size / topo.num_devices
        s = table.data_type.itemsize
        per_row, per_elem = self.state_bytes
        pooled = isinstance(table, EmbeddingBagConfig)
        traffic = _shard_traffic(table, ps, mesh, self.batch_size, pooling)
        sizes, times = [], []
        for shard, t in zip(ps.shards, traffic, strict=True):
            rows, cols = shard.row_size, shard.col_size
            f = rows / table.num_embeddings
            o = table.num_features if pooled else pooling * f
            served = n * b * pooling * f
            outputs = n * b * o * cols * s
            weights = rows * cols * s + rows * per_row + rows * cols * per_elem
            buffers = (
                self.capacity_factor * served * (ID_BYTES + (r - 1) * (ID_BYTES + cols * s))
                + 2 * outputs
            )
            sizes.append(math.ceil(weights + buffers) if shard.num_elements else 0)
            lookup = (
                served * cols * s
                + outputs
                + self.bwd_compute_multiplier * self.batch_size * pooling * f * cols * s
            )
            comm = sum(v / topo.bandwidth(a) for phase in t.values() for a, v in phase.items())
            times.append(
                1e3 * (lookup / topo.memory_bandwidth + comm) if shard.num_elements else 0.0
            )
        return sizes, times

    def device_vectors(
        self, table, ps: ParameterSharding, pooling: float
    ) -> tuple[np.ndarray, np.ndarray]:
        """Per device (row-major over the mesh): bytes and ms the table costs it."""
        mesh = self.topology.axes
        mem, ms = np.zeros(self.topology.num_devices), np.zeros(self.topology.num_devices)
        for shard, size, time in zip(ps.shards, *self.shard_costs(table, ps, pooling), strict=True):
            idx = devices_holding(shard.device, ps.axes, mesh)
            mem[idx] += size
            ms[idx] += time
        return mem, ms

    def estimate(self, table, ps: ParameterSharding, pooling: float, notes=()) -> ShardingEstimate:
        sizes, times = self.shard_costs(table, ps, pooling)
        comm = estimate_collective_bytes(table, ps, self.topology.axes, self.batch_size, pooling)
        return ShardingEstimate(
            shard_bytes=tuple(sizes),
            shard_ms=tuple(times),
            input_dist_bytes=comm["input_dist"],
            output_dist_bytes=comm["output_dist"],
            backward_bytes=comm["backward"],
            notes=tuple(notes),
        )
