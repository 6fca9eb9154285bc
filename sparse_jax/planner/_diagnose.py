"""Sentences for people: layout labels, `explain` notes, and `PlannerError` messages."""

from __future__ import annotations

import math

import numpy as np

from sparse_jax.plan import ParameterSharding, ShardingType
from sparse_jax.plan import _layout as L
from sparse_jax.plan._report import format_bytes

from ._partition import loads

ST = ShardingType
MAX_LISTED = 3


def _b(n: float) -> str:
    return f"{int(n):,} bytes ({format_bytes(n)})"


def label(ps: ParameterSharding) -> str:
    """E.g. `table_wise over ['model'] at model=2`."""
    t, axes = ps.sharding_type, list(ps.axes)
    if t is ST.DATA_PARALLEL:
        return "data_parallel (a copy on every device)"
    at = ", ".join(
        " ".join(f"{a}={c}" for a, c in zip(axes, s.device, strict=True))
        for s in ps.shards
        if s.num_elements
    )
    blocks = len({s.col_offset for s in ps.shards})
    if t is ST.TABLE_WISE:
        return f"table_wise over {axes} at {at}"
    if t is ST.ROW_WISE:
        return f"row_wise over {axes} ({len(ps.shards)} row blocks)"
    if t is ST.TABLE_ROW_WISE:
        return f"table_row_wise over {axes} on {axes[0]}={ps.shards[0].device[0]}"
    if t is ST.GRID_SHARD:
        return f"grid_shard over {axes} ({blocks} column blocks)"
    return f"{t.value} over {axes} ({blocks} column blocks at {at})"


def _family(ps: ParameterSharding) -> str:
    return ps.sharding_type.value + (f" over {list(ps.axes)}" if ps.axes else "")


def _who(names) -> str:
    return (
        f"table {names[0]!r}"
        if len(names) == 1
        else f"tables {list(names)} (one group, placed together)"
    )


def _constraint_text(c) -> str:
    parts = []
    if c.sharding_types is not None:
        parts.append(f"sharding_types={[t.value for t in c.sharding_types]}")
    for field in ("axes", "pin", "min_partition", "group"):
        if getattr(c, field) is not None:
            parts.append(f"{field}={getattr(c, field)!r}")
    return ", ".join(parts)


def notes(items, assign, i: int, budget: float, constraints) -> list[str]:
    """Why item i got its option: the runner-up layouts (re-placed alone, the others fixed)."""
    item, a = items[i], assign[i]
    load_ms, load_mem = loads(items, assign)
    load_ms, load_mem = load_ms - item.ms[a], load_mem - item.mem[a]
    peak = (load_ms + item.ms).max(axis=1)
    fits = ((load_mem + item.mem) <= budget).all(axis=1)
    chosen = peak[a]
    out = [
        f"chosen: {label(item.options[a][0])}; the busiest device then costs {chosen:.4f} ms/step"
    ]
    best: dict[str, int] = {}
    for o, opt in enumerate(item.options):
        fam = _family(opt[0])
        if fam == _family(item.options[a][0]):
            continue
        if fam not in best or (fits[o], -peak[o]) > (fits[best[fam]], -peak[best[fam]]):
            best[fam] = o
    ranked = sorted(best.items(), key=lambda kv: (not fits[kv[1]], peak[kv[1]], kv[0]))
    for _, o in [kv for kv in ranked if fits[kv[1]]][:MAX_LISTED]:
        extra = f" (+{100 * (peak[o] - chosen) / chosen:.1f}%)" if chosen > 0 else ""
        out.append(
            f"runner-up: {label(item.options[o][0])}: busiest device {peak[o]:.4f} ms/step{extra}"
        )
    for fam, o in [kv for kv in ranked if not fits[kv[1]]][:MAX_LISTED]:
        need = (load_mem + item.mem[o]).max()
        out.append(
            f"rejected: {fam} would fill a device to {format_bytes(need)}, over the {format_bytes(budget)} budget"
        )
    for name in item.names:
        if name in constraints:
            out.append(f"constraints on {name!r}: {_constraint_text(constraints[name])}")
    return out


def no_candidates(table, topology, constraint) -> str:
    return (
        f"table {table.name!r}: no layout on mesh {topology.axes} satisfies its constraints "
        f"({_constraint_text(constraint)}); two-level types need an inter-host and an intra-host axis "
        f"of size > 1, column splits need embedding_dim ({table.embedding_dim}) >= 2 x min_partition, "
        "and a pin excludes every layout that reaches other indices: relax the constraints"
    )


def _state_bytes(t, model) -> int:
    per_row, per_elem = model.state_bytes
    return t.num_embeddings * (t.embedding_dim * (t.data_type.itemsize + per_elem) + per_row)


def infeasible(items, failure, tables, topology, constraints, model, pooling) -> str:
    item = items[failure.item]
    by_name = {t.name: t for t in tables}
    need_per_option = item.mem.max(axis=1)
    j = int(np.argmin(need_per_option))
    need, budget = float(need_per_option[j]), topology.device_memory_bytes
    smallest = label(item.options[j][0])
    if need > budget:
        msg = (
            f"{_who(item.names)} needs at least {_b(need)} on one device even in its smallest allowed "
            f"layout, {smallest}, but the budget is {_b(budget)} per device."
        )
        state = sum(_state_bytes(by_name[n], model) for n in item.names)
    else:
        # Each layout needs its bytes on its own devices: name, for the layout that comes
        # closest to fitting, the device that falls furthest short.
        short = item.mem - failure.free  # options x devices; every option is short somewhere
        j = int(np.argmin(short.max(axis=1)))
        d = int(np.argmax(short[j]))
        where = " ".join(
            f"{a}={c}"
            for a, c in zip(
                topology.axes, np.unravel_index(d, tuple(topology.axes.values())), strict=True
            )
        )
        msg = (
            f"{_who(item.names)} does not fit beside the tables placed before it: its closest "
            f"allowed layout, {label(item.options[j][0])}, needs {_b(item.mem[j, d])} on device "
            f"{where}, which has only {_b(failure.free[d])} left (of {_b(budget)})."
        )
        state = sum(_state_bytes(t, model) for t in tables)
    remedies = []
    for name in item.names:
        c = constraints.get(name)
        if c is not None and c.pin is not None and need <= budget:
            remedies.append(f"move or drop the pin={c.pin!r} of {name!r}")
        if c is not None and c.sharding_types is not None and ST.ROW_WISE not in c.sharding_types:
            axes = (
                tuple(a for a in topology.axes if topology.axes[a] > 1) or tuple(topology.axes)[:1]
            )
            t = by_name[name]
            rw = model.device_vectors(
                t, L.row_wise(t.num_embeddings, t.embedding_dim, axes, topology.axes), pooling[name]
            )[0].max()
            remedies.append(
                f"allow row_wise for {name!r} (over {list(axes)} it needs {_b(rw)} per device)"
            )
    devices = math.ceil(state / budget)
    if devices > topology.num_devices:
        what = "its" if need > budget else "all tables'"
        remedies.append(
            f"use a mesh of at least {devices} devices ({what} weights and optimizer state alone are "
            f"{_b(state)}; this mesh has {topology.num_devices})"
        )
    elif need > budget and not remedies:
        remedies.append(
            "lower batch_size or capacity_factor (its id and output buffers grow with the batch)"
        )
    elif need <= budget:
        remedies.append(
            "allow row_wise or column_wise for the large tables, or shard them over more mesh axes "
            "(every replica of a table costs memory)"
        )
    remedies.append(
        f"raise device_memory_bytes above {_b(budget)}"
        + (f" to at least {int(need):,}" if need > budget else "")
    )
    return msg + " To fit: " + "; or ".join(remedies) + "."
