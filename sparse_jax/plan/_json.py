"""Plan JSON: one shard per line so a person can read and edit it.

```
{
  "format": "hybridrec.ShardingPlan",
  "version": 1,
  "mesh_axes": {"data": 2, "model": 4},
  "device_memory_bytes": 17179869184,
  "tables": {
    "t_big": {
      "sharding_type": "row_wise",
      "axes": ["model"],
      "shards": [
        {"row_offset": 0, "row_size": 250, "col_offset": 0, "col_size": 64, "device": [0]},
        ...
      ],
      "estimate": {"shard_bytes": [...], "shard_ms": [...], "input_dist_bytes": 0, ...}
    }
  }
}
```
`device_memory_bytes` and `estimate` are optional. Floats are written with `repr`, so
a plan round-trips exactly.
"""

from __future__ import annotations

import json
from collections.abc import Mapping

from ._types import ParameterSharding, Shard, ShardingEstimate

FORMAT = "hybridrec.ShardingPlan"
VERSION = 1
_TOP = {"format", "version", "mesh_axes", "device_memory_bytes", "tables"}
_ENTRY = {"sharding_type", "axes", "shards", "estimate"}
_SHARD = ("row_offset", "row_size", "col_offset", "col_size", "device")
_ESTIMATE = (
    "shard_bytes",
    "shard_ms",
    "input_dist_bytes",
    "output_dist_bytes",
    "backward_bytes",
    "notes",
)


def _d(value) -> str:
    return json.dumps(value)


def dump(
    shardings: Mapping[str, ParameterSharding], mesh_axes: Mapping[str, int], budget: int | None
) -> str:
    lines = [
        "{",
        f'  "format": {_d(FORMAT)},',
        f'  "version": {VERSION},',
        f'  "mesh_axes": {_d(dict(mesh_axes))},',
    ]
    if budget is not None:
        lines.append(f'  "device_memory_bytes": {budget},')
    lines.append('  "tables": {')
    for k, (name, ps) in enumerate(shardings.items()):
        lines += [
            f"    {_d(name)}: {{",
            f'      "sharding_type": {_d(ps.sharding_type.value)},',
            f'      "axes": {_d(list(ps.axes))},',
            '      "shards": [',
        ]
        for i, s in enumerate(ps.shards):
            fields = {f: list(s.device) if f == "device" else getattr(s, f) for f in _SHARD}
            lines.append(f"        {_d(fields)}{',' if i + 1 < len(ps.shards) else ''}")
        lines.append("      ]" + ("," if ps.estimate is not None else ""))
        if ps.estimate is not None:
            est = {
                f: list(getattr(ps.estimate, f))
                if f in ("shard_bytes", "shard_ms", "notes")
                else getattr(ps.estimate, f)
                for f in _ESTIMATE
            }
            lines.append(f'      "estimate": {_d(est)}')
        lines.append("    }" + ("," if k + 1 < len(shardings) else ""))
    lines += ["  }", "}"]
    return "\n".join(lines) + "\n"


def _need(obj, keys, allowed, where: str) -> None:
    if not isinstance(obj, dict):
        raise ValueError(f"{where} must be a JSON object, got {type(obj).__name__}")
    unknown = sorted(set(obj) - set(allowed))
    if unknown:
        raise ValueError(
            f"{where} has unknown key(s) {unknown}; allowed keys are {sorted(allowed)}"
        )
    missing = [k for k in keys if k not in obj]
    if missing:
        raise ValueError(f"{where} is missing key(s) {missing}")


def _shard(obj, where: str) -> Shard:
    _need(obj, _SHARD, _SHARD, where)
    if not isinstance(obj["device"], list):
        raise ValueError(f"{where}: device must be a list of coordinates, got {obj['device']!r}")
    try:
        return Shard(**{f: tuple(obj[f]) if f == "device" else obj[f] for f in _SHARD})
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None


def _estimate(obj, where: str) -> ShardingEstimate:
    _need(obj, ("shard_bytes", "shard_ms"), _ESTIMATE, where)
    try:
        return ShardingEstimate(**obj)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{where}: {e}") from None


def load(text: str) -> tuple[dict[str, ParameterSharding], dict[str, int], int | None]:
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"the sharding plan is not valid JSON: {e}") from None
    _need(doc, ("format", "version", "mesh_axes", "tables"), _TOP, "the sharding plan")
    if doc["format"] != FORMAT or doc["version"] != VERSION:
        raise ValueError(
            f"the text is a {doc['format']!r} version {doc['version']!r} document; expected "
            f"{FORMAT!r} version {VERSION}"
        )
    if not isinstance(doc["tables"], dict):
        raise ValueError("the sharding plan's 'tables' must be an object of table name -> sharding")
    out = {}
    for name, entry in doc["tables"].items():
        where = f"table {name!r}"
        _need(entry, ("sharding_type", "axes", "shards"), _ENTRY, where)
        if not isinstance(entry["axes"], list) or not isinstance(entry["shards"], list):
            raise ValueError(f"{where}: 'axes' and 'shards' must be lists")
        shards = tuple(_shard(s, f"{where} shard {i}") for i, s in enumerate(entry["shards"]))
        est = entry.get("estimate")
        try:
            out[name] = ParameterSharding(
                sharding_type=entry["sharding_type"],
                axes=tuple(entry["axes"]),
                shards=shards,
                estimate=None if est is None else _estimate(est, f"{where} estimate"),
            )
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None
    return out, doc["mesh_axes"], doc.get("device_memory_bytes")
