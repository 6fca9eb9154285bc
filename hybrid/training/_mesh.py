"""`make_mesh`: a named device mesh from `"data=2,model=4"` or `{"data": 2, "model": 4}`.

The mesh spans `jax.devices()` (every process's devices under `jax.distributed`), axes in
the order given, devices laid out by `jax.make_mesh` (row-major over the axes, as the
sharding plans number them). JAX 0.10 makes the axes Explicit by default: inputs go onto
the mesh with the sharding the sparse module's `shard_map` expects.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import jax

__all__ = ["make_mesh", "parse_mesh"]


def parse_mesh(spec: str | Mapping[str, int]) -> dict[str, int]:
    """`"data=2,model=4"` or a mapping -> `{"data": 2, "model": 4}` (order kept), checked."""
    if isinstance(spec, str):
        axes: dict[str, int] = {}
        entries = [e.strip() for e in spec.split(",")]
        for entry in entries:
            name, sep, size = entry.partition("=")
            name, size = name.strip(), size.strip()
            if not sep or not name or not size:
                raise ValueError(
                    f"mesh {spec!r}: entry {entry!r} is not name=size; write e.g. 'data=2,model=4'"
                )
            try:
                value = int(size)
            except ValueError:
                hint = next((c for c in ";: " if c in size), None)
                raise ValueError(
                    f"mesh {spec!r}: axis {name!r} has size {size!r}, not an integer"
                    + (
                        f"; separate axes with ',', not {hint!r} (e.g. 'data=2,model=4')"
                        if hint
                        else ""
                    )
                ) from None
            if name in axes:
                raise ValueError(f"mesh {spec!r}: axis {name!r} is named twice")
            axes[name] = value
    elif isinstance(spec, Mapping):
        axes = dict(spec)
    else:
        raise TypeError(
            f"a mesh is given as 'data=2,model=4' or {{'data': 2, 'model': 4}}, got {type(spec).__name__}"
        )
    if not axes:
        raise ValueError("the mesh needs at least one axis, e.g. 'data=8'")
    for name, size in axes.items():
        if not isinstance(name, str) or not name.isidentifier():
            raise ValueError(
                f"mesh axis name {name!r} must be an identifier such as 'data' or 'model'"
            )
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"mesh axis {name!r} must have an integer size >= 1, got {size!r}")
    return axes


def make_mesh(
    spec: str | Mapping[str, int],
    *,
    devices: Sequence[jax.Device] | None = None,
    axis_types: Sequence[jax.sharding.AxisType] | None = None,
) -> jax.sharding.Mesh:
    """A `jax.sharding.Mesh` with the named axes over `devices` (default: `jax.devices()`).

    The product of the axis sizes must equal the number of devices. `axis_types` defaults
    to JAX's (Explicit in JAX 0.10).
    """
    axes = parse_mesh(spec)
    devices = list(jax.devices() if devices is None else devices)
    need = math.prod(axes.values())
    if need != len(devices):
        shape = " x ".join(f"{n}={s}" for n, s in axes.items())
        raise ValueError(
            f"mesh {shape} needs {need} devices but there are {len(devices)} "
            f"({devices[0].platform if devices else 'no'} devices); choose axis sizes whose product is "
            f"{len(devices)} (e.g. 'data={len(devices)}')"
        )
    kwargs = {} if axis_types is None else {"axis_types": tuple(axis_types)}
    return jax.make_mesh(tuple(axes.values()), tuple(axes), devices=devices, **kwargs)
