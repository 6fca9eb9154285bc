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

Collective bytes per step on the device holding the shard (ids are int32, 4 bytes):

    input_dist  = (n - 1) * b * L * f * 4          ids received from the group's n - 1 peers
    output_dist = (n - 1) * b * O * C * s          results sent back: all_to_all of pooled
                  [b, C] blocks (table / column blocks) or reduce-scatter of partial sums (row blocks)
    backward    = output_dist                      the pooled gradient mirrors the output dist
                + (r - 1) * ids_served * (4 + C*s) all-gather of (ids, per-id grads) over the
                                                   replica axes so the copies stay identical
    data_parallel (n = 1): no forward comm; backward = (N - 1) * b * L * (4 + D * s).

Which link carries it: a peer is reached over the first mesh axis (mesh order) along which
its coordinate differs, so among n - 1 peers, group axis a_i carries
(size(a_i) - 1) * prod(sizes of the group axes after a_i). table_row_wise and grid_shard
reduce hierarchically: output dist (and its gradient) is a reduce-scatter in the host,
(m - 1) * k chunks of b * O * C * s over the intra axis, then an all_to_all across hosts,
(k - 1) chunks over the inter axis (k hosts, m devices per host).

Time per step on the device holding the shard, in ms:

    compute = (ids_served * C * s                         gather rows
               + n * b * O * C * s                        write outputs
               + bwd_multiplier * B * L * f * C * s)       update: every replica applies all ids
              / memory_bandwidth
    comms   = sum over the three phases and the axes of bytes / axis_bandwidth

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
from collections.abc import Mapping

import numpy as np

from sparse_jax._configs import EmbeddingBagConfig
from sparse_jax.sharding import ParameterSharding, ShardingEstimate, ShardingType
from sparse_jax.sharding._layout import devices_holding, group_size

from ._topology import Topology

__all__ = ["OPTIMIZER_STATE_BYTES", "CostModel", "estimate_collective_bytes"]

# optimizer name -> (state bytes per row, state bytes per element), fp32 state.
OPTIMIZER_STATE_BYTES: dict[str, tuple[int, int]] = {
    "sgd": (0, 0),
    "adagrad": (0, 4),
    "rowwise_adagrad": (4, 0),
    "adam": (0, 8),
}
ID_BYTES = 4
PHASES = ("input_dist", "output_dist", "backward")
_HIERARCHICAL = (ShardingType.TABLE_ROW_WISE, ShardingType.GRID_SHARD)


def _peers_per_axis(axes, mesh_axes: Mapping[str, int]) -> dict[str, int]:
    out = {}
    for i, a in enumerate(axes):
        out[a] = (mesh_axes[a] - 1) * math.prod(mesh_axes[x] for x in axes[i + 1 :])
    return out


def _shard_traffic(table, ps: ParameterSharding, mesh_axes, batch_size: int, pooling: float):
    """Per shard: phase -> axis -> bytes per step (floats), as documented above."""
    order = list(mesh_axes)
    n = group_size(ps.axes, mesh_axes)
    other = tuple(a for a in order if a not in ps.axes)
    b = batch_size / group_size(order, mesh_axes)
    s = table.data_type.itemsize
    pooled = isinstance(table, EmbeddingBagConfig)
    out = []
    for shard in ps.shards:
        f = shard.row_size / table.num_embeddings
        o = table.num_features if pooled else pooling * f
        chunk = b * o * shard.col_size * s
        if ps.sharding_type in _HIERARCHICAL:
            inter, intra = ps.axes
            k, m = mesh_axes[inter], mesh_axes[intra]
            output = {intra: (m - 1) * k * chunk, inter: (k - 1) * chunk}
        else:
            output = {a: p * chunk for a, p in _peers_per_axis(ps.axes, mesh_axes).items()}
        ids = {
            a: p * b * pooling * f * ID_BYTES
            for a, p in _peers_per_axis(ps.axes, mesh_axes).items()
        }
        served = n * b * pooling * f
        sync = {
            a: p * served * (ID_BYTES + shard.col_size * s)
            for a, p in _peers_per_axis(other, mesh_axes).items()
        }
        backward = dict(output)
        for a, v in sync.items():
            backward[a] = backward.get(a, 0.0) + v
        out.append({"input_dist": ids, "output_dist": output, "backward": backward})
    return out


def estimate_collective_bytes(
    table,
    parameter_sharding: ParameterSharding,
    mesh_axes: Mapping[str, int],
    batch_size: int,
    pooling_factor: float,
) -> dict[str, int]:
    """Collective bytes per step for one table: {"input_dist", "output_dist", "backward"}.

    For each device of the table's group, the bytes it receives (input dist, backward) or
    sends (output dist) to other devices, summed over the shards it holds; the largest
    over devices is returned (the busiest device, e.g. the owner of a table_wise table).
    Formulas in the module docstring. Pure: no devices are touched.
    """
    traffic = _shard_traffic(table, parameter_sharding, dict(mesh_axes), batch_size, pooling_factor)
    per_device: dict[tuple, dict[str, float]] = {}
    for shard, t in zip(parameter_sharding.shards, traffic, strict=True):
        acc = per_device.setdefault(shard.device, dict.fromkeys(PHASES, 0.0))
        for phase in PHASES:
            acc[phase] += sum(t[phase].values())
    return {p: math.ceil(max(acc[p] for acc in per_device.values()) - 1e-9) for p in PHASES}


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
