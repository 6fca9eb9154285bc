"""Managed-collision id maps in a checkpoint (`tables.npz`, beside the tables).

Per managed table, every field of its `MCHState` as `mc/<table>/<field>` (the sorted
resident ids as two words, the slot each owns, LFU counts, LRU steps, the eviction window
and its counters: the whole map, so a resumed run remaps, evicts and resets exactly as
the interrupted one would), its counters as `mc/<table>/counters` (occupancy, admissions,
evictions), and the key evicted rows are drawn from as `mc_key`. The slots are rows of the
table, saved whole as `weight/<table>` beside them, so the map and the rows it points to
always travel together.
"""

from __future__ import annotations

import jax
import numpy as np

from sparse_jax import MCH_STATE_FIELDS, ManagedSparseModule, MCHState

__all__ = ["check_mc_tables", "mc_state_arrays", "restore_mc_state"]


def _managed(model) -> ManagedSparseModule | None:
    module = model.sparse_module
    return module if isinstance(module, ManagedSparseModule) else None


def mc_state_arrays(model) -> dict[str, np.ndarray]:
    """The id maps, counters and draw key of `model`'s managed tables (none: `{}`)."""
    module = _managed(model)
    if module is None:
        return {}
    out = {}
    for table, state in module.mc_state.items():
        for field, leaf in zip(MCH_STATE_FIELDS, state, strict=True):
            out[f"mc/{table}/{field}"] = np.asarray(leaf)
    for table, counters in module.mc_counters.items():
        out[f"mc/{table}/counters"] = np.asarray(counters)
    out["mc_key"] = np.asarray(jax.random.key_data(module.draw_key))
    return out


def check_mc_tables(model, arrays, where: str) -> None:
    """Refuse a checkpoint whose id maps are of other managed tables (or of none) than
    `model`'s, naming both (checked before anything is restored)."""
    module = _managed(model)
    saved = sorted({k.split("/")[1] for k in arrays if k.startswith("mc/")})
    wanted = [] if module is None else module.managed_tables
    if saved != wanted:
        raise ValueError(f"{where}: the checkpoint holds id maps of managed-collision tables {saved}, this model "
                         f"manages {wanted}; load it with the same [managed_collision] tables")


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
        raise ValueError(f"{where}: the checkpoint has id maps but no mc_key (the draw key of evicted rows)")
    key = jax.random.wrap_key_data(np.asarray(arrays["mc_key"]))
    module.load_mc_state(states, counters, key)
