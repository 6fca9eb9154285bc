"""`shard(ebc, mesh, plan)`: an EmbeddingBagCollection sharded over a device mesh.

Same functional API as the unsharded collection (`init`, `apply`, `table_weights`,
`with_table_weights`, and `make_update`), run inside `jax.shard_map`, the batch split
over every device. One scheme serves every ShardingType, because every plan is a set of
blocks (see `_work.py`). For each shard buffer, sharded over axes A and replicated over
the other axes R:

forward   input dist: the local KJT is all-gathered over A (each device of a group sees
          the group's ids; ids are 4 bytes, the cheap side). Each device pools, for its
          work items, the ids that fall in its shard's rows for the whole group batch
          (fused per-position gather+add). Output dist: one all_to_all over A returns to
          every device its samples' partial blocks; row-wise partials are summed and
          column blocks placed at their columns (a reduce-scatter for row_wise, an
          all_to_all for table/column-wise, in bytes).
backward  the mirror all_to_all brings each shard owner the pooled gradient of its items
          for the group batch; the per-id stream (row, bag, scale) and bag gradients are
          all-gathered over R so every replica applies the identical fused update
          (TorchRec's 2D parallel: replicas stay in sync); then `apply_row_rule`.

Every plan trains the model the unsharded collection trains, for every optimizer: row-wise
Adagrad on a column-split table sums each row's statistic over its column blocks before
the rule (`_row_stat.py`; TorchRec keeps one state per row per block instead).

The class here holds the collection's state (plan, buffers, high-water marks) and the
`SparseModule` contract; the work is done by plain functions of its `ShardedStatic`:
`_placement.py` (host weights <-> shard buffers, partition specs), `_input_dist.py`
(which ids reach which device; the route capacity), `_local_lookup.py` (the per-device
forward and fused update inside `shard_map`) and `_collective_bytes.py` (the bytes the
collectives move, with the formula).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import jax
import numpy as np
from jax.sharding import PartitionSpec as P

from sparse_jax import _guard
from sparse_jax._keyed_tensor import KeyedTensor
from sparse_jax._module import LayoutFacts
from sparse_jax._validate import is_concrete
from sparse_jax.optim._base import RowRule, SparseOptState
from sparse_jax.plan import ShardingPlan
from sparse_jax.sharding import _placement
from sparse_jax.sharding._agree import ProcessAgreement
from sparse_jax.sharding._collective_bytes import collective_bytes
from sparse_jax.sharding._input_dist import route_capacity, route_need
from sparse_jax.sharding._local_batch import LocalBatches, pad_parts, split_batch
from sparse_jax.sharding._local_lookup import forward_local, update_local
from sparse_jax.sharding._work import ShardBuffer, ShardedStatic, build_buffers

if TYPE_CHECKING:
    from sparse_jax.sharding._sequence import ShardedEmbeddingCollection

__all__ = ["INPUT_DISTS", "ShardedEmbeddingBagCollection", "shard"]

INPUT_DISTS = ("all_gather", "all_to_all")


def _resolve_plan(plan, tables, mesh_axes) -> ShardingPlan:
    if isinstance(plan, ShardingPlan):
        if dict(plan.mesh_axes) != dict(mesh_axes):
            raise ValueError(
                f"the plan was made for mesh {dict(plan.mesh_axes)} but the mesh is {dict(mesh_axes)}; re-plan"
            )
        plan.validate(tables)
        return plan
    if plan is None:
        from sparse_jax.planner import Planner, Topology

        return Planner(Topology(axes=dict(mesh_axes))).plan(tables, batch_size=1024)
    if isinstance(plan, Mapping):
        return ShardingPlan.from_types(tables, mesh_axes, plan)
    raise ValueError(
        "plan must be a sparse_jax ShardingPlan, a {table: sharding type} dict or None, got a "
        f"{type(plan).__module__}.{type(plan).__qualname__}"
        + (
            " (TorchRec's plans are not read: give {table: 'row_wise', ...} or let the planner plan)"
            if type(plan).__module__.startswith("torchrec")
            else ""
        )
    )


class ShardedEmbeddingBagCollection(LayoutFacts):
    """An EBC whose tables live on `mesh` as `plan` says. Build with `shard(ebc, mesh, plan)`."""

    def __init__(
        self,
        ebc,
        mesh: jax.sharding.Mesh,
        plan=None,
        *,
        ladder: Sequence[int] | None = None,
        input_dist: str = "all_gather",
        max_route_capacity: int | None = None,
    ):
        if input_dist not in INPUT_DISTS:
            raise ValueError(f"input_dist={input_dist!r} is not one of {INPUT_DISTS}")
        self.ebc, self.mesh, self.ladder = ebc, mesh, ladder
        self.input_dist, self.max_route_capacity = input_dist, max_route_capacity
        self._route_high_water = 0
        self.prepare_count = 0
        mesh_axes = {a: int(s) for a, s in mesh.shape.items()}
        self.plan = _resolve_plan(plan, ebc.layout.tables, mesh_axes)
        self.static = ShardedStatic(
            layout=ebc.layout,
            buffers=tuple(build_buffers(ebc.layout, self.plan, mesh_axes)),
            mesh_axes=mesh_axes,
            is_weighted=ebc.is_weighted(),
            bounds_check=ebc.bounds_check,
            kernel=ebc.kernel,
        )
        self.num_devices = self.static.num_devices
        self._apply_jit = jax.jit(self._apply)
        self._high_water = (0, 1)  # (capacity, length cap) seen so far: shapes only grow
        me = jax.process_index()
        # the mesh positions (rows of the batch arrays) whose devices this process drives
        self._local_rows = tuple(
            i for i, d in enumerate(mesh.devices.flat) if d.process_index == me
        )
        self._agree = ProcessAgreement()  # constructed in the same order on every process

    # -- static facts (see `ShardedStatic`) ---------------------------------------------------
    @property
    def layout(self):
        return self.static.layout

    @property
    def buffers(self) -> tuple[ShardBuffer, ...]:
        return self.static.buffers

    @property
    def mesh_axes(self) -> dict[str, int]:
        return self.static.mesh_axes

    def is_weighted(self) -> bool:
        return self.static.is_weighted

    @property
    def bounds_check(self) -> str:
        return self.static.bounds_check

    def stored_blocks(self):
        """Every shard block: where it sits in its shard buffer (rows of all coordinates
        stacked) and which rows and columns of its table it holds."""
        for buf in self.buffers:
            yield from buf.stored_blocks()

    def lookup_compile_count(self) -> int:
        return self._apply_jit._cache_size()

    def managed(self) -> None:
        """A plain sharded collection manages no ids (`SparseModule.managed`)."""
        return None

    # -- weights and state (host copies; see `_placement.py`) -----------------------------------
    def init(self, key: jax.Array) -> dict[str, jax.Array]:
        """The same weights as `ebc.init(key)`, placed on the mesh (each process draws only
        the blocks its devices hold, a table at a time: no whole-table host copies)."""
        return _placement.init_placed(self.mesh, self.buffers, self.ebc.layout.tables, key)

    def table_weights(self, params) -> dict[str, np.ndarray]:
        """Full `[num_embeddings, dim]` weights per table, assembled from the shards (host copies)."""
        return _placement.table_weights(self.buffers, self.tables, params)

    def with_table_weights(self, params, weights: Mapping) -> dict[str, jax.Array]:
        """New params with the named tables replaced; weights are resharded on load."""
        return _placement.with_table_weights(self.mesh, self.buffers, self.tables, params, weights)

    def table_state(self, opt_state: SparseOptState, key: str) -> dict[str, np.ndarray]:
        """One per-row state leaf (e.g. "momentum1") assembled per table: `[rows, dim]` for
        elementwise state; for one-value-per-row state `{(col_offset, col_size): [rows]}`
        (one entry per column block, a single entry unless the table is column-sharded)."""
        return _placement.table_state(self.buffers, self.tables, opt_state, key)

    # -- the batch ------------------------------------------------------------------------------
    def prepare(self, kjt, *, device=None) -> LocalBatches:  # noqa: ARG002 (placed on the mesh)
        """This process's samples checked on the host, split over its devices, padded once
        and placed on the mesh (once per batch; see `SparseModule`).

        One process: `kjt` is the whole batch. Several processes (`jax.distributed`): each
        passes only its own samples (the rows its devices hold in the mesh, in mesh order:
        `process_index * B / processes` on for a mesh laid out by process), and never reads
        or uploads another's; the processes agree on the static shapes through
        `ProcessAgreement` (host integers, no device collective).

        Capacity and length cap never shrink below the largest seen so far, so a steady
        loop compiles once per high-water mark instead of flipping between rungs. With
        `input_dist="all_to_all"` the route capacity is counted here, on the host copy of
        the ids (exact, so no id can overflow and no device value is read)."""
        host = self.ebc.check_host(kjt)
        rows = self._local_rows
        parts = split_batch(
            host,
            len(rows),
            self.ladder,
            min_capacity=self._high_water[0],
            min_length_cap=self._high_water[1],
        )
        routed = self.input_dist == "all_to_all" and any(b.axes for b in self.buffers)
        need = (
            route_need(self.buffers, self.layout, parts, clamp=self.bounds_check == "clamp")
            if routed
            else 0
        )
        if len(rows) < self.num_devices:
            parts, need = self._agree_shapes(parts, need)
        self._high_water = (parts["values"].shape[1], parts["length_cap"])
        route = 0
        if routed:
            self._route_high_water = route_capacity(
                need, self._route_high_water, self.ladder, self.max_route_capacity
            )
            route = self._route_high_water
        arrays = _placement.place_batch(self.mesh, parts, rows)
        self.prepare_count += 1
        return LocalBatches(
            **arrays,
            keys=parts["keys"],
            local_batch=parts["local_batch"],
            length_cap=parts["length_cap"],
            route_capacity=route,
        )

    def _agree_shapes(self, parts: dict, need: int) -> tuple[dict, int]:
        """Every process's parts padded to the largest capacity and length cap of any
        process, and the largest route need; all must have the same samples per device."""
        b_l = parts["local_batch"]
        cap, length_cap, need, most, fewest = self._agree.max(
            [parts["values"].shape[1], parts["length_cap"], need, b_l, -b_l]
        )
        if most != -fewest:
            raise ValueError(
                f"process {jax.process_index()} prepared {b_l} samples per device, but the processes' "
                f"batches range from {-fewest} to {most} per device; give every process the same "
                "number of samples (its share of the global batch)"
            )
        return pad_parts(parts, cap, length_cap), need

    def collective_bytes(
        self, local: LocalBatches, optimizer: str | None = None
    ) -> dict[str, dict[str, int]]:
        """Bytes each device receives through collectives per training step for `local`:
        `{buffer name: {"input_dist", "output_dist", "backward"}, ..., "total": {...}}`;
        with `optimizer="rowwise_adagrad"` and a column-split table, also "row_stat"
        (formula and what is counted: `_collective_bytes.py`)."""
        return collective_bytes(self.static, local, optimizer)

    # -- public, jitted -------------------------------------------------------------------------
    def _apply(self, params, local: LocalBatches):
        all_axes = self.static.all_axes
        specs = jax.tree_util.tree_map(lambda _: P(all_axes), local)
        fn = jax.shard_map(
            functools.partial(forward_local, self.static),
            mesh=self.mesh,
            in_specs=(_placement.param_specs(self.buffers), specs),
            out_specs=P(all_axes),
            check_vma=False,
        )
        return fn(params, local)

    def apply(self, params, batch) -> KeyedTensor:
        """Pooled embeddings `[B, sum of dims]`, batch-sharded over every device. `batch`:
        `prepare(kjt)`'s result (or a KJT, prepared here)."""
        local = batch if isinstance(batch, LocalBatches) else self.prepare(batch)
        values = (
            self._apply_jit(params, local)
            if is_concrete(*jax.tree_util.tree_leaves(params))
            else self._apply(params, local)
        )
        return KeyedTensor(self.layout.feature_names, self.layout.output_dims, values)

    def update_operands(self, local: LocalBatches, grad):
        """(the prepared batch, the pooled gradient batch-sharded on the mesh)."""
        if isinstance(grad, KeyedTensor):
            grad = grad.values()
        want = (local.local_batch * self.num_devices, sum(self.layout.output_dims))
        if tuple(grad.shape) != want:
            raise ValueError(
                f"pooled_grad has shape {tuple(grad.shape)}; expected [batch, sum of dims] = {list(want)}"
            )
        return local, _placement.batch_sharded(self.mesh, grad)

    def update_step(self, rule: RowRule):
        """The traceable fused update `(params, opt_state, (LocalBatches, grad)) -> (params, opt_state)`."""
        static, mesh = self.static, self.mesh
        all_axes = static.all_axes
        param_specs = _placement.param_specs(static.buffers)

        def step(params, opt_state, operands):
            local, grad = operands
            specs = jax.tree_util.tree_map(lambda _: P(all_axes), local)
            state_specs = _placement.state_specs(static.buffers, opt_state)
            body, flag = _guard.through_shard_map(functools.partial(update_local, static, rule))
            fn = jax.shard_map(
                body,
                mesh=mesh,
                in_specs=(
                    param_specs,
                    state_specs.tables,
                    P(),
                    specs,
                    P(all_axes),
                    *[P()] * len(flag),
                ),
                out_specs=(param_specs, state_specs.tables, P()),
                check_vma=False,
            )
            new_params, tables, count = fn(
                params, opt_state.tables, opt_state.count, local, grad, *flag
            )
            return new_params, SparseOptState(count=count, tables=tables)

        return step


def shard(
    ebc,
    mesh: jax.sharding.Mesh,
    plan=None,
    *,
    ladder: Sequence[int] | None = None,
    input_dist: str = "all_gather",
    max_route_capacity: int | None = None,
) -> ShardedEmbeddingBagCollection | ShardedEmbeddingCollection:
    """Shard `ebc` over `mesh`. `plan`: a `ShardingPlan`, `{table: "row_wise", ...}` (defaults
    filled in by `ShardingPlan.from_types`), or None (the planner decides).

    `input_dist`: "all_gather" (default: every device of a shard group sees the group's ids)
    or "all_to_all" (each id goes only to the devices whose shards hold its row, bucketized
    by row block, in `[devices, capacity]` buffers sized from a ladder; a batch that needs
    more is routed at the next rung, logged, or raises above `max_route_capacity`).

    An `EmbeddingCollection` gives a `ShardedEmbeddingCollection` (rows per id)."""
    kw = dict(ladder=ladder, input_dist=input_dist, max_route_capacity=max_route_capacity)
    from sparse_jax._embedding import EmbeddingCollection

    if isinstance(ebc, EmbeddingCollection):
        from sparse_jax.sharding._sequence import ShardedEmbeddingCollection

        return ShardedEmbeddingCollection(ebc, mesh, plan, **kw)
    return ShardedEmbeddingBagCollection(ebc, mesh, plan, **kw)
