"""`collective_bytes(static, local)`: the bytes the sharded programs' collectives bring each
device per training step, computed from the static shapes the programs use.

Every device receives the same bytes (one SPMD program). For a buffer over axes A (a group
of n_A devices) replicated over the other axes R (n_R copies), B_l the local batch, cap_l
the local capacity, K the KJT's keys, M the buffer's work items per coordinate, W its
width, L the length cap, N = M*n_A*B_l*L:

    input_dist  = (n_A - 1) * (cap_l * 4 + K * B_l * 4 [+ cap_l * 4])
                  all_gather over A of values, lengths [and weights: weighted only]
    output_dist = (n_A - 1) * M * B_l * W * 4     all_to_all over A of fp32 [M, n_A, B_l, W]
    backward    = input_dist                      the update re-gathers the KJT
                + output_dist                     mirror all_to_all of the pooled gradient
                + (n_R - 1) * (N * 12 + M * n_A * B_l * W * 4)
                  all_gather over R of rows, bag (int32), scale (fp32) and bag grads

With `input_dist="all_to_all"` a buffer over axes receives instead
input_dist = (n_A - 1) * route_capacity * 12 (row, bag, weight triples), and its
replica stream has N = n_A * route_capacity entries (the routing's capacity is counted
on the host when the batch is prepared, so it moves no bytes).

Row-wise Adagrad with column-split tables (`optimizer="rowwise_adagrad"`) adds one psum of
the per-row statistic (`_row_stat.py`) over all D devices, counted under "row_stat" as the
partial vectors every device needs from the others: (D - 1) * split_rows * 4.

`apply` moves input_dist + output_dist; the step from `make_update` moves backward
(a separate program: it recomputes the positions, so it all-gathers the KJT again).
Counted as the compiled programs move them: XLA merges identical collectives, so an
all-gather of a value an earlier buffer already gathered (the KJT over the same axes,
an identical id stream over the same replica axes) counts once, on the first buffer;
the weights are gathered only by a weighted collection (otherwise the compiler drops
them). Without axes (data_parallel) there is no forward communication.
"""

from __future__ import annotations

import math

import numpy as np

from sparse_jax.sharding._local_batch import LocalBatches
from sparse_jax.sharding._row_stat import row_space
from sparse_jax.sharding._work import ShardedStatic

__all__ = ["collective_bytes"]


def collective_bytes(
    static: ShardedStatic, local: LocalBatches, optimizer: str | None = None
) -> dict[str, dict[str, int]]:
    """Bytes each device receives through collectives per training step for `local`:
    `{buffer name: {"input_dist", "output_dist", "backward"}, ..., "total": {...}}`, and
    "row_stat" when `optimizer` is "rowwise_adagrad" and a table is column-split (formula
    in the module docstring)."""
    if not isinstance(local, LocalBatches):
        raise ValueError(
            f"collective_bytes takes the LocalBatches of `sharded.prepare(kjt)`, got {type(local).__name__}"
        )
    seen: set = set()

    def gathered(key, n: int, per_device: int) -> int:
        """Bytes an all_gather over n devices brings in; once per distinct gathered value."""
        if n <= 1 or key in seen:
            return 0
        seen.add(key)
        return (n - 1) * per_device

    def nbytes(*shape, dtype=np.float32) -> int:
        return math.prod(shape) * np.dtype(dtype).itemsize

    b_l, length_cap = local.local_batch, local.length_cap
    kjt = [("values", local.values), ("lengths", local.lengths)]
    if static.is_weighted:
        kjt.append(("weights", local.weights))
    out: dict[str, dict[str, int]] = {}
    for buf in static.buffers:
        n_a, m, w = buf.group_size, buf.max_items, buf.width
        replica_axes = static.replica_axes(buf)
        n_r = static.num_replicas(buf)
        input_dist = output_dist = 0
        routed = bool(local.route_capacity and buf.axes)
        if routed:  # all_to_all of (row, bag, weight) int32/int32/fp32 triples
            input_dist = (n_a - 1) * local.route_capacity * 12
        elif buf.axes:
            input_dist = sum(
                gathered(("kjt", buf.axes, name), n_a, nbytes(x.shape[-1], dtype=x.dtype))
                for name, x in kjt
            )
        if buf.axes:
            output_dist = (n_a - 1) * nbytes(m, b_l, w)
        stream = (n_a, local.route_capacity, buf.name) if routed else (m, n_a, b_l, length_cap)
        n_ids = math.prod(stream[:2]) if routed else math.prod(stream)
        items = tuple(sorted((k, v.tobytes()) for k, v in buf.item_table().items()))
        replicas = (
            gathered(
                ("rows", buf.axes, stream, buf.rows_per_device, items),
                n_r,
                nbytes(n_ids, dtype=np.int32),
            )
            + gathered(("bag", replica_axes, stream), n_r, nbytes(n_ids, dtype=np.int32))
            + gathered(("scale", buf.axes, stream, items), n_r, nbytes(n_ids))
            + gathered(("bag_grads", buf.name), n_r, nbytes(m * n_a * b_l, w))
        )
        out[buf.name] = {
            "input_dist": input_dist,
            "output_dist": output_dist,
            "backward": input_dist + output_dist + replicas,
        }
    if (
        optimizer == "rowwise_adagrad"
        and (space := row_space(static)).size
        and static.num_devices > 1
    ):
        out["row_stat"] = {
            "input_dist": 0,
            "output_dist": 0,
            "backward": (static.num_devices - 1) * nbytes(space.size),
        }
    out["total"] = {
        k: sum(v[k] for v in out.values()) for k in ("input_dist", "output_dist", "backward")
    }
    return out
