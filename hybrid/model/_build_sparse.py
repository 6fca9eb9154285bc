"""`_build_sparse`: the one place `hybrid` constructs its sparse module.

Every sparse module implements `sparse_jax.SparseModule` (prepare, apply, the fused update
through `sparse_jax.make_update`, table weights, stored blocks); `hybrid` uses nothing
else of it. Without a mesh (or with a
one-device mesh) that is the unsharded `EmbeddingBagCollection`; on a larger mesh it is
`sparse_jax.sharding.shard(ebc, mesh, plan)` (the planner's plan when none is given; a
`{table: sharding type}` dict works too).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax

from sparse_jax import (
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    ManagedCollisionEmbeddingBagCollection,
    ManagedCollisionSparseModule,
)
from sparse_jax.sharding import ShardedManagedCollisionModule, shard

__all__ = ["_build_sparse", "mesh_device"]

_CACHE_SIZE = 16
_collections: dict[tuple, EmbeddingBagCollection] = {}


def _collection(
    tables, is_weighted: bool, kernel: str, bounds_check: str, ladder=None
) -> EmbeddingBagCollection:
    """One `EmbeddingBagCollection` per configuration, shared by every model built from it.

    A collection is stateless (its params live with the model) and owns its jitted lookup,
    so sharing it lets a second model with the same tables (an eval replica, a restart, the
    next test) reuse the compiled programs instead of compiling them again.
    """
    key = (tuple(tables), bool(is_weighted), kernel, bounds_check, ladder)
    try:
        ebc = _collections.get(key)
    except TypeError:  # unhashable config values: no sharing
        return EmbeddingBagCollection(
            tables, is_weighted=is_weighted, kernel=kernel, bounds_check=bounds_check, ladder=ladder
        )
    if ebc is None:
        ebc = EmbeddingBagCollection(
            tables, is_weighted=is_weighted, kernel=kernel, bounds_check=bounds_check, ladder=ladder
        )
        if len(_collections) >= _CACHE_SIZE:
            _collections.pop(next(iter(_collections)))
        _collections[key] = ebc
    return ebc


def mesh_device(mesh: jax.sharding.Mesh | None) -> jax.Device | None:
    """The only device of a one-device mesh (None without a mesh, or for a sharded one: its
    arrays carry their own mesh shardings)."""
    return None if mesh is None or mesh.devices.size > 1 else mesh.devices.flat[0]


def _build_sparse(
    tables: Sequence[EmbeddingBagConfig],
    *,
    is_weighted: bool,
    mesh: jax.sharding.Mesh | None,
    plan=None,
    kernel: str = "auto",
    bounds_check: str = "error",
    ladder: Sequence[int] | None = None,
    input_dist: str = "all_gather",
    managed_collision_modules=None,
):
    """The sparse module for `tables` on `mesh` following `plan`. `ladder`: capacity rungs
    for a whole batch; a sharded module pads each device's part, so it gets the rungs
    divided by the device count. `managed_collision_modules` ({table: module}): those
    tables take raw ids through a `ManagedCollisionSparseModule` (one per model: it holds
    the id maps; on a mesh, `ShardedManagedCollisionModule`)."""
    if plan is not None and mesh is None:
        raise ValueError(
            "a sharding plan was given without a mesh; pass mesh=hybrid.make_mesh(...) with the "
            "axes the plan names, or drop plan= to keep every table on one device"
        )
    if mesh is not None and not isinstance(mesh, jax.sharding.Mesh):
        raise TypeError(
            f"mesh must be a jax.sharding.Mesh (see hybrid.make_mesh), got {type(mesh).__name__}"
        )
    ladder = None if ladder is None else tuple(ladder)
    if managed_collision_modules:  # a module per model (it holds the id maps): never shared
        if mesh is None or (mesh.devices.size == 1 and plan is None):
            ebc = EmbeddingBagCollection(tables, is_weighted=is_weighted, kernel=kernel, bounds_check=bounds_check,
                                         ladder=ladder)
            return ManagedCollisionSparseModule(ManagedCollisionEmbeddingBagCollection(ebc, managed_collision_modules))
        ebc = EmbeddingBagCollection(tables, is_weighted=is_weighted, kernel=kernel, bounds_check=bounds_check)
        sharded = shard(ebc, mesh, plan, ladder=_per_device(ladder, mesh.devices.size), input_dist=input_dist)
        return ShardedManagedCollisionModule(sharded, managed_collision_modules)
    if mesh is None or (mesh.devices.size == 1 and plan is None):
        return _collection(tables, is_weighted, kernel, bounds_check, ladder)
    ebc = _collection(tables, is_weighted, kernel, bounds_check)
    return shard(ebc, mesh, plan, ladder=_per_device(ladder, mesh.devices.size), input_dist=input_dist)


def _per_device(ladder: tuple[int, ...] | None, devices: int) -> tuple[int, ...] | None:
    """A whole-batch ladder as per-device rungs (each at least 8, a multiple of 8)."""
    if ladder is None:
        return None
    rungs = {math.ceil(math.ceil(r / devices) / 8) * 8 for r in ladder}
    return tuple(sorted(max(8, r) for r in rungs))
