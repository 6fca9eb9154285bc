"""Text reports of a plan: the per-device stats table and the per-table explanation."""

from __future__ import annotations

from . import _layout
from ._types import ShardingType


def format_bytes(n: float) -> str:
    """`1.50 GiB` style (binary units)."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"


def _coord_text(mesh: dict[str, int], flat: int) -> str:
    coord = _layout.axis_coords(list(mesh), mesh)[flat]
    return " ".join(f"{a}={c}" for a, c in zip(mesh, coord, strict=True))


def device_totals(plan) -> tuple[list, list]:
    mesh = plan.mesh_axes
    n = plan.num_devices
    if any(ps.estimate is None for ps in plan.values()):
        return [None] * n, [None] * n
    mem, ms = [0] * n, [0.0] * n
    for ps in plan.values():
        for shard, b, t in zip(
            ps.shards, ps.estimate.shard_bytes, ps.estimate.shard_ms, strict=True
        ):
            for i in _layout.devices_holding(shard.device, ps.axes, mesh):
                mem[i] += b
                ms[i] += t
    return mem, ms


MAX_NAMED = 4


def _tables_on(plan, flat: int) -> str:
    """`a (row_wise), b (table_wise)`, or counts per type when more than MAX_NAMED tables."""
    mesh, held = plan.mesh_axes, []
    for name, ps in plan.items():
        if any(
            flat in _layout.devices_holding(s.device, ps.axes, mesh)
            for s in ps.shards
            if s.num_elements
        ):
            held.append((name, ps.sharding_type.value))
    if len(held) <= MAX_NAMED:
        return ", ".join(f"{n} ({t})" for n, t in held) or "-"
    counts = {t.value: sum(1 for _, k in held if k == t.value) for t in ShardingType}
    return f"{len(held)} tables: " + ", ".join(f"{c} {t}" for t, c in counts.items() if c)


def _where(ps) -> str:
    """Indices used along each axis: `data=1 model=0-3`; `all` for data_parallel."""
    parts = []
    for k, axis in enumerate(ps.axes):
        used = sorted({s.device[k] for s in ps.shards if s.num_elements})
        run = used and used == list(range(used[0], used[-1] + 1)) and len(used) > 2
        parts.append(
            f"{axis}={used[0]}-{used[-1]}" if run else f"{axis}=" + ",".join(map(str, used))
        )
    return " ".join(parts) or "all devices"


def stats_table(plan) -> str:
    mesh, budget = plan.mesh_axes, plan.device_memory_bytes
    mem, ms = device_totals(plan)
    shape = " x ".join(f"{a}={s}" for a, s in mesh.items())
    head = f"ShardingPlan: {len(plan)} tables on mesh {shape} ({plan.num_devices} devices)"
    if budget is not None:
        head += f", budget {format_bytes(budget)} per device"
    width = max(len(_coord_text(mesh, i)) for i in range(plan.num_devices))
    rows = [
        head,
        f"{'device':>6}  {'coordinates':<{width}}  {'memory used / budget':<30} {'ms/step':>8}  tables",
    ]
    for i in range(plan.num_devices):
        if mem[i] is None:
            used = "- (no estimates)"
            time = "-"
        else:
            used = format_bytes(mem[i])
            if budget is not None:
                used += f" / {format_bytes(budget)} ({100 * mem[i] / budget:.0f}%)"
            time = f"{ms[i]:.3f}"
        rows.append(
            f"{i:>6}  {_coord_text(mesh, i):<{width}}  {used:<30} {time:>8}  {_tables_on(plan, i)}"
        )
    if ms[0] is not None:
        worst = max(range(len(ms)), key=lambda i: (ms[i], -i))
        rows.append(
            f"max estimated step cost {ms[worst]:.3f} ms on device {worst}; "
            f"max memory {format_bytes(max(mem))}"
        )
    rows.append("")
    name_w = max(len("table"), *(len(n) for n in plan))
    where_w = max(len("placement"), *(len(_where(ps)) for ps in plan.values()))
    rows.append(
        f"{'table':<{name_w}}  {'sharding_type':<17}  {'placement':<{where_w}}  {'shards':>6}  "
        f"{'max bytes/device':>16} {'ms/step':>8}"
    )
    for name, ps in plan.items():
        est = ps.estimate
        size = format_bytes(max(est.shard_bytes)) if est else "-"
        time = f"{max(est.shard_ms):.3f}" if est else "-"
        rows.append(
            f"{name:<{name_w}}  {ps.sharding_type.value:<17}  {_where(ps):<{where_w}}  {len(ps.shards):>6}  "
            f"{size:>16} {time:>8}"
        )
    return "\n".join(rows)


def explain(plan, name: str) -> str:
    ps = plan[name]
    mesh = plan.mesh_axes
    rows_n = max(s.row_offset + s.row_size for s in ps.shards)
    cols_n = max(s.col_offset + s.col_size for s in ps.shards)
    other = [a for a in mesh if a not in ps.axes]
    replicas = _layout.group_size(other, mesh)
    where = f"over {list(ps.axes)}" if ps.axes else "on every device"
    out = [
        f"table {name!r} ({rows_n} x {cols_n}): {ps.sharding_type.value} {where}, {len(ps.shards)} shard(s)"
        + (f", replicated over {other} ({replicas} copies)" if ps.axes and replicas > 1 else "")
    ]
    est = ps.estimate
    for i, s in enumerate(ps.shards):
        at = " ".join(f"{a}={c}" for a, c in zip(ps.axes, s.device, strict=True)) or "all devices"
        cost = (
            f": {format_bytes(est.shard_bytes[i])}, {est.shard_ms[i]:.4f} ms/step per device"
            if est
            else ""
        )
        out.append(f"  shard {i}: {s.describe()} at {at}{cost}")
    if est is None:
        out.append(
            "  no estimates (a hand-written plan); Planner.estimate(plan, tables, batch_size=...) adds them"
        )
        return "\n".join(out)
    out.append(
        f"  collectives per step on its busiest device: input dist {format_bytes(est.input_dist_bytes)}, "
        f"output dist {format_bytes(est.output_dist_bytes)}, backward {format_bytes(est.backward_bytes)}"
    )
    out += [f"  {note}" for note in est.notes]
    return "\n".join(out)
