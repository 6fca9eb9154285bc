"""`make_update`: the fused sparse optimizer step of a collection, jitted, buffers donated.

    update = make_update(ebc, rowwise_adagrad(lr=0.05))
    batch = ebc.prepare(kjt)                  # once; the forward uses the same batch
    params, opt_state = update(params, opt_state, batch, pooled_grad)

`pooled_grad` is the gradient of the loss w.r.t. `ebc.apply(params, kjt).values()`
(`[B, sum of feature dims]`, or that KeyedTensor). The step never forms a table-sized
gradient: per buffer it streams the batch's ids through `apply_row_rule` (sort, dedup,
gather touched rows + state, row rule, scatter) into the donated `params` and `opt_state`;
fp32 buffers on CPU with the C++ kernels take one custom call that reads the KJT and the
pooled gradient in place (`_kernels.jagged_fused_update`).
After the call the arrays passed in are deleted (donated); use the returned ones.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from sparse_jax import _guard, _kernels, _lookup
from sparse_jax._configs import PoolingType
from sparse_jax._kernels._platform import by_platform
from sparse_jax._layout import TableLayout
from sparse_jax._lookup import use_ffi
from sparse_jax._module import PreparedBatch
from sparse_jax._row_update import ffi_rule, update_rows
from sparse_jax.optim._apply import apply_sorted_runs
from sparse_jax.optim._base import RowRule, SparseOptState

__all__ = ["make_update", "fused_update"]


def _bag_grads(layout: TableLayout, group: str, pooled_grad):
    """`[F_g * B, dim]`: the pooled gradient of the group's features, stacked feature-major."""
    blocks = [
        pooled_grad[:, s.out_offset : s.out_offset + s.dim] for s in layout.slots_of_group(group)
    ]
    return jnp.concatenate(blocks, axis=0)


def _jagged_kernel_update(
    layout: TableLayout,
    group: str,
    rule: RowRule,
    table,
    state,
    kjt,
    pooled_grad,
    *,
    weighted: bool,
    bounds_check: str,
):
    """The C++ kernel's update of one fp32 buffer, read from the KJT and the pooled gradient
    in place (no id stream, no stacked bag gradients). Under the guard a skipped step hands
    the kernel empty bags (all offsets 0): it writes nothing."""
    key_indices = layout.key_indices(kjt.keys())
    members = [i for i, s in enumerate(layout.features) if s.group == group]
    slots = [layout.features[i] for i in members]
    leaf = state.get("momentum1") if isinstance(state, dict) else None
    good = _guard.current()
    offsets = kjt.offsets() if good is None else jnp.where(good, kjt.offsets(), 0)
    new_table, new_leaf = _kernels.jagged_fused_update(
        rule.native,
        table,
        leaf,
        kjt.values(),
        offsets,
        kjt.weights() if weighted else None,
        pooled_grad,
        stride=kjt.stride(),
        keys=[key_indices[i] for i in members],
        row_offsets=[s.row_offset for s in slots],
        num_rows=[s.num_rows for s in slots],
        mean=[s.pooling is PoolingType.MEAN for s in slots],
        grad_columns=[s.out_offset for s in slots],
        clamp=bounds_check == "clamp",
        lr=rule.hyperparams["lr"],
        eps=rule.hyperparams.get("eps", 0.0),
    )
    return new_table, ({"momentum1": new_leaf} if leaf is not None else state)


def _group_update(
    layout: TableLayout,
    group: str,
    rule: RowRule,
    table,
    state,
    step,
    kjt,
    pooled_grad,
    *,
    weighted: bool,
    bounds_check: str,
    kernel: str,
    sorted_ids=None,
):
    """One group's update. The id stream feeds `update_rows` (C++, Pallas or XLA by the
    lowering platform); on CPU, fp32 buffers of a rule the C++ kernels know take the jagged
    C++ update instead (it reads the KJT in place), chosen when the CPU program is lowered.
    With kernel="xla" and the batch's host-sorted stream (`sorted_ids`), the bucketed
    sorted-run XLA form on every platform (`optim._apply.apply_sorted_runs`)."""

    def stream(table, state, step, kjt, pooled_grad, ids=None):
        rows, bag, scale = _lookup.id_stream(
            kjt, layout, group, weighted=weighted, bounds_check=bounds_check
        )
        return update_rows(
            rule,
            table,
            state,
            step,
            rows,
            bag,
            scale,
            _bag_grads(layout, group, pooled_grad),
            kernel=kernel,
            sorted_ids=ids,
        )

    if kernel == "xla" and sorted_ids is not None:
        # every rule and platform, fp32 SGD on CPU included (the bucketed runs measured
        # faster than adding every id's step into the table: benchmarks/NOTES.md, issue 31)
        grads = _bag_grads(layout, group, pooled_grad)
        return apply_sorted_runs(rule, table, state, step, sorted_ids, grads, good=_guard.current())
    args = (table, state, step, kjt, pooled_grad, sorted_ids)  # the Pallas update reads the runs

    if (
        kernel not in ("auto", "ffi")
        or not ffi_rule(rule, table)
        or (kernel == "ffi" and not use_ffi(kernel, table))
    ):
        return stream(*args)
    leaves, treedef = jax.tree_util.tree_flatten(args)

    def unpacked(fn):
        def run(*ops):
            out = fn(*jax.tree_util.tree_unflatten(treedef, ops))
            return jax.tree_util.tree_leaves(out)

        return run

    def jagged(table, state, step, kjt, pooled_grad, ids):
        return _jagged_kernel_update(
            layout,
            group,
            rule,
            table,
            state,
            kjt,
            pooled_grad,
            weighted=weighted,
            bounds_check=bounds_check,
        )

    out_tree = jax.tree_util.tree_structure((table, state))
    avals = [
        jax.ShapeDtypeStruct(x.shape, x.dtype) for x in jax.tree_util.tree_leaves((table, state))
    ]
    cpu = _kernels.when_built(unpacked(jagged), unpacked(stream))  # built: decided at lowering
    out = by_platform(leaves, avals, default=unpacked(stream), cpu=cpu)
    return jax.tree_util.tree_unflatten(out_tree, out)


def fused_update(
    layout: TableLayout,
    rule: RowRule,
    params,
    opt_state: SparseOptState,
    kjt,
    pooled_grad,
    *,
    weighted: bool,
    bounds_check: str,
    kernel: str,
    sorted_ids=None,
):
    """The traceable step of `EmbeddingBagCollection.update_step` (no donation, no checks);
    `pooled_grad` is the `[B, sum of dims]` array (`update_operands` unwrapped a KeyedTensor);
    `sorted_ids`: the prepared batch's host-sorted streams (group -> `SortedIds`) or None."""
    want = (kjt.stride(), sum(layout.output_dims))
    if tuple(pooled_grad.shape) != want:
        raise ValueError(
            f"pooled_grad has shape {tuple(pooled_grad.shape)}; expected [batch, sum of dims] = {list(want)}"
        )
    step = opt_state.count + 1
    new_params, new_states = {}, {}
    for group in layout.groups:
        new_params[group], new_states[group] = _group_update(
            layout,
            group,
            rule,
            params[group],
            opt_state.tables[group],
            step,
            kjt,
            pooled_grad,
            weighted=weighted,
            bounds_check=bounds_check,
            kernel=kernel,
            sorted_ids=None if sorted_ids is None else sorted_ids[group],
        )
    return new_params, SparseOptState(count=_guard.next_count(opt_state.count), tables=new_states)


class _Update:
    """Callable returned by `make_update`: the module's update operands, then the jitted,
    donating step. A prepared batch (`module.prepare`) is used as it is; a raw KJT is
    prepared first (one preparation).

    With `skip_nonfinite`, a batch whose gradient (or weights) holds a NaN or an infinity,
    or whose `ok` flag is false, leaves the tables and optimizer state exactly as they were
    (decided on the device by predicated writes, `sparse_jax._guard`: no branch, nothing is
    read on the host, buffers stay in place). `nonfinite()` gives, as device arrays, how many calls were
    skipped and the index of the first one (-1: none); read them when you log."""

    def __init__(self, module, rule: RowRule, *, skip_nonfinite: bool):
        if not isinstance(rule, RowRule):
            raise ValueError(
                f"make_update needs a sparse_jax.optim row rule, got {type(rule).__name__}"
            )
        self.module, self.rule, self.skip_nonfinite = module, rule, bool(skip_nonfinite)
        step = module.update_step(rule)
        if self.skip_nonfinite:
            self.jitted = jax.jit(_guarded(step), donate_argnums=(0, 1))
            self._reset_counters()
        else:
            self.jitted = jax.jit(step, donate_argnums=(0, 1))

    @property
    def collection(self):
        return self.module

    def __call__(self, params, opt_state, batch, pooled_grad, *, ok=None):
        """One fused update. `ok`: an extra device boolean (e.g. "the loss is finite"); with
        `skip_nonfinite`, the update is skipped when it is false."""
        if not isinstance(batch, PreparedBatch):
            batch = self.module.prepare(batch)
        operands = self.module.update_operands(batch, pooled_grad)
        if not self.skip_nonfinite:
            if ok is not None:
                raise ValueError("ok= needs make_update(..., skip_nonfinite=True)")
            return self.jitted(params, opt_state, operands)
        # no eager op per call (each is a host round of dispatch that, on a GPU, costs more
        # than the update itself): the default flag is made once per placement, the call
        # index lives on the device and the program returns the next one
        like = opt_state.count
        flag = self._default_flag(like) if ok is None else _flag_on_devices(ok, like)
        if self._calls == 0 and like.committed:  # placed like the state: one program
            self._skipped, self._call = jax.device_put((self._skipped, self._call), like.sharding)
        params, opt_state, self._skipped, self._call = self.jitted(
            params, opt_state, operands, flag, self._skipped, self._call
        )
        self._calls += 1
        return params, opt_state

    def _default_flag(self, like: jax.Array) -> jax.Array:
        """ "No extra condition" as the program takes it, made once per placement."""
        key = like.sharding if like.committed else None
        if key not in self._true_flags:
            self._true_flags[key] = _flag_on_devices(jnp.ones((), bool), like)
        return self._true_flags[key]

    def with_fresh_counters(self) -> _Update:
        """The same compiled step with its own skip counters (one per model sharing it)."""
        other = object.__new__(_Update)
        other.__dict__.update(self.__dict__)
        if self.skip_nonfinite:
            other._reset_counters()
        return other

    def _reset_counters(self) -> None:
        self._skipped = (jnp.zeros((), jnp.int32), jnp.full((), -1, jnp.int32))  # (skipped, first)
        self._call = jnp.zeros((), jnp.int32)  # this call's index, on the device
        self._calls = 0
        self._true_flags = {}

    def nonfinite(self) -> tuple[jax.Array, jax.Array]:
        """(calls skipped, index of the first skipped call or -1), device scalars."""
        if not self.skip_nonfinite:
            raise ValueError("this update was made without skip_nonfinite=True")
        return self._skipped

    def compile_count(self) -> int:
        """How many programs the jitted step has compiled (one per distinct input shape)."""
        return self.jitted._cache_size()


def _flag_on_devices(ok: jax.Array, like_array: jax.Array) -> jax.Array:
    """This process's boolean as one entry per device of the tables' mesh (`[devices]`,
    sharded over every axis), so the program ANDs every process's flag: all replicas take
    the same decision. Built from per-device copies of the local flag (no host read, no
    cross-process transfer). One device: the scalar itself (no op), so an uncommitted flag
    lets the program follow the tables wherever they are (a committed flag beside
    uncommitted tables would be a second program, compiled again once the tables come back
    committed from the first call)."""
    like = like_array.sharding
    if not isinstance(like, jax.sharding.NamedSharding):
        ok = ok if isinstance(ok, jax.Array) else jnp.asarray(ok, bool)
        return ok if ok.shape == () else ok.reshape(())
    mesh = like.mesh
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(tuple(mesh.axis_names)))
    one = _as_entry(ok)  # one small program, not an eager op per device
    local = [jax.device_put(one, d) for d in sharding.addressable_devices_indices_map((mesh.size,))]
    return jax.make_array_from_single_device_arrays((mesh.size,), sharding, local)


_as_entry = jax.jit(lambda ok: jnp.reshape(jnp.asarray(ok, bool), (1,)))


def all_finite(tree) -> jax.Array:
    """A device boolean: every leaf of `tree` is finite (integer leaves always are: they
    are not read, so a program checks only its float operands)."""
    flags = [
        jnp.all(jnp.isfinite(x))
        for x in jax.tree_util.tree_leaves(tree)
        if jnp.issubdtype(jnp.asarray(x).dtype, jnp.inexact)
    ]
    return jnp.all(jnp.stack(flags)) if flags else jnp.ones((), bool)


def _guarded(step):
    """`step` whose writes are kept only when its operands are finite and `ok` holds: the
    step is traced under `_guard.predicated(good)`, so every update masks its writes with
    the flag on the device (no `lax.cond`: a GPU conditional syncs with the host). A
    skipped call leaves the donated buffers exactly as they were."""

    def run(params, opt_state, operands, ok, skipped, call):
        good = jnp.all(ok) & all_finite(operands)
        with _guard.predicated(good):
            params, opt_state = step(params, opt_state, operands)
        count, first = skipped
        first = jnp.where(~good & (first < 0), call, first)
        return params, opt_state, (count + (~good).astype(jnp.int32), first), call + 1

    return run


def make_update(module, rule: RowRule, *, skip_nonfinite: bool = False) -> _Update:
    """The fused update step for a sparse module with the row rule `rule` (params, state donated).

    `update(params, opt_state, batch, grad)`: `batch` is `module.prepare(kjt)` (or a KJT,
    prepared here), `grad` the gradient of `module.apply(params, batch)`. With
    `skip_nonfinite=True` a non-finite gradient never reaches the tables (see `_Update`)."""
    return _Update(module, rule, skip_nonfinite=skip_nonfinite)
