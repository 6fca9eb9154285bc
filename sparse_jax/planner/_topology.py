"""`Topology`: the mesh the planner plans for, its memory budget and bandwidths.

Defaults are TorchRec's planner constants (`torchrec/distributed/planner/constants.py`),
in bytes per second:

- `device_memory_bytes`: 32 GiB (TorchRec's HBM_CAP): what tables, optimizer state and
  their lookup buffers may use per device. Leave room for the dense model yourself.
- `memory_bandwidth`: 897 GiB/s (HBM_MEM_BW), for lookups and updates.
- axis bandwidth: 600 GiB/s for intra-host axes (INTRA_NODE_BANDWIDTH), 12.5 GiB/s for
  inter-host axes (CROSS_NODE_BANDWIDTH); per axis overridable with `axis_bandwidth`.

The last mesh axis is intra-host and the others inter-host unless `intra_host_axes`
says otherwise (`jax.make_mesh` puts neighbouring devices on the last axis).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

from sparse_jax.plan._layout import check_mesh_axes

__all__ = ["Topology"]

GiB = 2**30
DEFAULT_DEVICE_MEMORY_BYTES = 32 * GiB
DEFAULT_MEMORY_BANDWIDTH = 897.0 * GiB
DEFAULT_INTRA_HOST_BANDWIDTH = 600.0 * GiB
DEFAULT_INTER_HOST_BANDWIDTH = 12.5 * GiB


@dataclasses.dataclass(frozen=True, kw_only=True, eq=True)
class Topology:
    """Mesh axes (name -> size, mesh order), per-device memory budget and bandwidths.

    Args:
        axes: e.g. `{"data": 2, "model": 4}`, in mesh order.
        device_memory_bytes: per-device budget for tables + optimizer state + buffers.
        intra_host_axes: axes whose devices share a host (fast links); default: the last.
        memory_bandwidth: device memory bandwidth, bytes/s.
        axis_bandwidth: per-axis collective bandwidth override, bytes/s per device.
    """

    axes: Mapping[str, int]
    device_memory_bytes: int = DEFAULT_DEVICE_MEMORY_BYTES
    intra_host_axes: tuple[str, ...] | None = None
    memory_bandwidth: float = DEFAULT_MEMORY_BANDWIDTH
    axis_bandwidth: Mapping[str, float] | None = None

    def __post_init__(self) -> None:
        axes = check_mesh_axes(self.axes)
        object.__setattr__(self, "axes", axes)
        budget = self.device_memory_bytes
        if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
            raise ValueError(f"device_memory_bytes must be a positive integer, got {budget!r}")
        intra = (list(axes)[-1],) if self.intra_host_axes is None else self.intra_host_axes
        if isinstance(intra, str):
            raise ValueError(
                f"intra_host_axes must be a tuple of axis names, got the string {intra!r}"
            )
        unknown = [a for a in intra if a not in axes]
        if unknown:
            raise ValueError(
                f"intra_host_axes names {unknown}, which are not mesh axes {list(axes)}"
            )
        object.__setattr__(self, "intra_host_axes", tuple(a for a in axes if a in intra))
        bw = dict(self.axis_bandwidth or {})
        unknown = [a for a in bw if a not in axes]
        if unknown:
            raise ValueError(
                f"axis_bandwidth names {unknown}, which are not mesh axes {list(axes)}"
            )
        for a in axes:
            bw.setdefault(
                a,
                DEFAULT_INTRA_HOST_BANDWIDTH
                if a in self.intra_host_axes
                else DEFAULT_INTER_HOST_BANDWIDTH,
            )
        for name, value in [*bw.items(), ("memory_bandwidth", self.memory_bandwidth)]:
            if (
                isinstance(value, bool)
                or not isinstance(value, int | float)
                or not value > 0
                or math.isinf(value)
            ):
                raise ValueError(
                    f"bandwidth for {name!r} must be a positive number of bytes/s, got {value!r}"
                )
        object.__setattr__(self, "axis_bandwidth", {a: float(bw[a]) for a in axes})
        object.__setattr__(self, "memory_bandwidth", float(self.memory_bandwidth))

    __hash__ = None  # type: ignore[assignment]  (holds dicts)

    @classmethod
    def from_mesh(cls, mesh, **kwargs) -> Topology:
        """A topology with the axes of a `jax.sharding.Mesh` (reads `mesh.shape` only)."""
        return cls(axes=dict(mesh.shape), **kwargs)

    @property
    def num_devices(self) -> int:
        return math.prod(self.axes.values())

    @property
    def inter_host_axes(self) -> tuple[str, ...]:
        return tuple(a for a in self.axes if a not in self.intra_host_axes)

    def bandwidth(self, axis: str) -> float:
        """Collective bandwidth along `axis`, bytes/s per device."""
        return self.axis_bandwidth[axis]
