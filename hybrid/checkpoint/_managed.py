"""Managed-collision id maps in a checkpoint (`tables.npz`, beside the tables).

Per managed table, every field of its `MCHState` as `mc/<table>/<field>` (the sorted
resident ids as two words, the slot each owns, LFU counts, LRU steps, the eviction window
and its counters: the whole map, so a resumed run remaps, evicts and resets exactly as
the interrupted one would), its counters as `mc/<table>/counters` (occupancy, admissions,
evictions), and the key evicted rows are drawn from as `mc_key`. The slots are rows of the
table, saved whole as `weight/<table>` beside them, so the map and the rows it points to
always travel together. A checkpoint saved with another split of a managed table (unsharded,
one replicated map, or row-wise maps per shard) is moved onto the model's split on load
(`reshard_mc_arrays`, `sparse_jax.reshard_id_maps`): ids, their rows and optimizer state move
together.
"""

from __future__ import annotations

import warnings

import jax
import numpy as np

from sparse_jax import MCH_STATE_FIELDS, ManagedSparseModule, MCHState, reshard_id_maps

__all__ = ["check_mc_tables", "mc_state_arrays", "reshard_mc_arrays", "restore_mc_state"]


def _managed(model) -> ManagedSparseModule | None:
    return model.sparse_module.managed()


def mc_state_arrays(model) -> dict[str, np.ndarray]:
    """The id maps, counters and draw key of `model`'s managed tables (none: `{}`)."""
    module = _managed(model)
    if module is None:
        return {}
    states, counters, key = (
        module.host_state()
    )  # gathered from every process on a multi-process mesh
    out = {}
    for table, state in states.items():
        for field, leaf in zip(MCH_STATE_FIELDS, state, strict=True):
            out[f"mc/{table}/{field}"] = leaf
    for table, c in counters.items():
        out[f"mc/{table}/counters"] = c
    out["mc_key"] = key
    return out


def check_mc_tables(model, arrays, where: str) -> None:
    """Refuse a checkpoint whose id maps are of other managed tables (or of none) than
    `model`'s, naming both (checked before anything is restored)."""
    module = _managed(model)
    saved = sorted({k.split("/")[1] for k in arrays if k.startswith("mc/")})
    wanted = [] if module is None else module.managed_tables
    if saved != wanted:
        raise ValueError(
            f"{where}: the checkpoint holds id maps of managed-collision tables {saved}, this model "
            f"manages {wanted}; load it with the same [managed_collision] tables"
        )


def reshard_mc_arrays(model, arrays, where: str):
    """`arrays` with the id maps of each managed table saved with another split than
    `model`'s moved onto `model`'s, the table's rows and optimizer state with them (the
    same `arrays` when every split matches). Ids that find no slot are dropped, with a
    warning that names the table and how many."""
    module = _managed(model)
    if module is None:
        return arrays
    out = dict(arrays)
    for table in module.managed_tables:
        keys = [f"mc/{table}/{f}" for f in (*MCH_STATE_FIELDS, "counters")]
        live = module.mc_state[table].sorted_hi
        if any(k not in arrays for k in keys) or arrays[keys[0]].shape == live.shape:
            continue  # a map that lacks a field is refused by restore_mc_state, naming it
        weight = arrays.get(f"weight/{table}")
        if weight is not None and weight.shape[0] != module.mc.modules[table].zch_size:
            continue  # another table size: refused with the table's shapes by the caller
        stacked = live.ndim == 2  # [shards, rows] on a mesh, [rows] unsharded
        saved = [np.asarray(arrays[k]) for k in keys]
        if saved[0].ndim == 1:
            saved = [leaf[None] for leaf in saved]
        try:
            moved = reshard_id_maps(
                # (ranked by the loading policy's metadata when a shard overflows)
                module.mc.modules[table].adopt_metadata(MCHState(*saved[:-1])),
                saved[-1],
                module.mc.modules[table],
                live.shape[0] if stacked else 1,
            )
        except ValueError as e:
            raise ValueError(f"{where}: table {table!r}: {e}") from None
        for key, leaf in zip(keys, (*moved.state, moved.counters), strict=True):
            out[key] = leaf if stacked else leaf[0]
        for key in arrays:
            if key == f"weight/{table}" or key.startswith(f"state/{table}/"):
                out[key] = np.asarray(arrays[key])[moved.row_source]
        if moved.dropped:
            warnings.warn(
                f"{where}: table {table!r}: {moved.dropped} resident id(s) found no slot in their new shard "
                "(ids do not split evenly under the hash) and were dropped, as an eviction drops them",
                stacklevel=2,
            )
    return out


def restore_mc_state(model, arrays, where: str) -> None:
    """Load the id maps saved by `mc_state_arrays` into `model` (after `check_mc_tables`);
    maps of other shapes raise before any map changes."""
    module = _managed(model)
    check_mc_tables(model, arrays, where)
    if module is None:
        return
    wanted = module.managed_tables
    states, counters = {}, {}
    for table in wanted:
        missing = [f for f in (*MCH_STATE_FIELDS, "counters") if f"mc/{table}/{f}" not in arrays]
        if missing:
            raise ValueError(f"{where}: the id map of table {table!r} lacks {missing}")
        states[table] = MCHState(*(arrays[f"mc/{table}/{f}"] for f in MCH_STATE_FIELDS))
        counters[table] = arrays[f"mc/{table}/counters"]
    if "mc_key" not in arrays:
        raise ValueError(
            f"{where}: the checkpoint has id maps but no mc_key (the draw key of evicted rows)"
        )
    key = jax.random.wrap_key_data(np.asarray(arrays["mc_key"]))
    module.load_mc_state(states, counters, key)
