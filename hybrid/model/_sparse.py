"""The sparse half of `hybrid.Model`: its module, its state, and the step torch runs.

- `build_sparse`: the one place `hybrid` constructs its sparse module. Every sparse module
  implements `sparse_jax.SparseModule` (prepare, apply, the fused update through
  `sparse_jax.make_update`, table weights, stored blocks); `hybrid` uses nothing else of
  it. Without a mesh (or with a one-device mesh) that is the unsharded
  `EmbeddingBagCollection`; on a larger mesh it is `sparse_jax.sharding.shard(ebc, mesh,
  plan)` (the planner's plan when none is given; a `{table: sharding type}` dict works too).
- `SparseTables`: the sparse module, its params and optimizer state, and the fused update.
  The tables and their optimizer state live here, in JAX, never in torch. The update
  donates both: each step replaces `params` and `opt_state` with the arrays it returns, and
  the previous arrays are deleted. So nothing outside should keep a reference to them (read
  them through the properties when needed, and copy what must survive a step).
- `sparse_lookup` / `SparseStep`: the sparse step as a `torch.autograd.Function`, JAX
  lookup forward, fused JAX update backward:

      pooled = sparse_lookup(tables, prepared)        # torch [B, sum dims], requires_grad
      ... dense forward, loss ...
      loss.backward()                                 # runs the fused sparse update

  forward: the JAX lookup (jit) gives the pooled embeddings, handed to torch through DLPack
  (zero-copy for a single-device array). backward: the gradient of the pooled embeddings
  goes back to JAX through DLPack (laid out as the pooled array was), and `make_update`'s
  fused step runs on the SAME prepared batch the forward looked up (nothing is checked or
  split again): per touched row dedup, row rule, scatter into the donated tables and
  optimizer state, whose references `SparseTables` replaces. No gradient is returned for
  any table (there is no torch parameter for them): the sparse update happens inside
  backward, as TorchRec's fused optimizer does, and the user steps only the dense optimizer.

  Each forward's update runs at most once. A second backward through the same graph
  (`retain_graph=True`) raises instead of applying the update twice; to combine several
  losses, add them and call backward once.
"""

from __future__ import annotations

import collections
import math
import weakref
from collections.abc import Mapping, Sequence

import jax
import numpy as np
import torch

from hybrid.model._bridge import jax_to_torch, torch_to_jax
from sparse_jax import (
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    KeyedJaggedTensor,
    KeyedTensor,
    ManagedCollisionEmbeddingBagCollection,
    ManagedCollisionSparseModule,
    PreparedBatch,
    SparseModule,
    make_update,
)
from sparse_jax.optim import RowRule, SparseOptState
from sparse_jax.sharding import ShardedManagedCollisionModule, shard

__all__ = ["SparseStep", "SparseTables", "build_sparse", "mesh_device", "sparse_lookup"]


# -- the module ------------------------------------------------------------------------------

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


def build_sparse(
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
            ebc = EmbeddingBagCollection(
                tables,
                is_weighted=is_weighted,
                kernel=kernel,
                bounds_check=bounds_check,
                ladder=ladder,
            )
            return ManagedCollisionSparseModule(
                ManagedCollisionEmbeddingBagCollection(ebc, managed_collision_modules)
            )
        ebc = EmbeddingBagCollection(
            tables, is_weighted=is_weighted, kernel=kernel, bounds_check=bounds_check
        )
        sharded = shard(
            ebc, mesh, plan, ladder=_per_device(ladder, mesh.devices.size), input_dist=input_dist
        )
        return ShardedManagedCollisionModule(sharded, managed_collision_modules)
    if mesh is None or (mesh.devices.size == 1 and plan is None):
        return _collection(tables, is_weighted, kernel, bounds_check, ladder)
    ebc = _collection(tables, is_weighted, kernel, bounds_check)
    return shard(
        ebc, mesh, plan, ladder=_per_device(ladder, mesh.devices.size), input_dist=input_dist
    )


def _per_device(ladder: tuple[int, ...] | None, devices: int) -> tuple[int, ...] | None:
    """A whole-batch ladder as per-device rungs (each at least 8, a multiple of 8)."""
    if ladder is None:
        return None
    rungs = {math.ceil(math.ceil(r / devices) / 8) * 8 for r in ladder}
    return tuple(sorted(max(8, r) for r in rungs))


# -- its state and update --------------------------------------------------------------------

# (id(module), id(rule)) -> the shared update, held weakly: it lives while a model built on
# that module and rule holds it (`SparseTables._shared_update`) or while it is among the
# `_KEEP_UPDATES` most recently built (a model rebuilt on the same cached collection and
# rule, e.g. after a restart, reuses its program); the update holds both objects, so their
# ids cannot be reused while an entry is there. Older updates of dropped models are freed.
_KEEP_UPDATES = 4
_updates: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
_recent_updates: collections.deque = collections.deque(maxlen=_KEEP_UPDATES)


def _update_for(module, rule: RowRule):
    """`make_update(module, rule)`, shared by the models with the same module and rule
    objects (both immutable), so their jitted update compiles once."""
    key = (id(module), id(rule))
    update = _updates.get(key)
    if update is None:
        update = make_update(module, rule, skip_nonfinite=True)
        _updates[key] = update
    if update not in _recent_updates:
        _recent_updates.append(update)
    return update


def _committed(tree, device: jax.Device | None):
    """Every array of `tree` committed to `device`, or to where it already is."""
    return jax.tree.map(
        lambda x: jax.device_put(x, device if device is not None else x.sharding), tree
    )


_TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def _to_torch_copy(array: jax.Array) -> torch.Tensor:
    """A torch tensor owning a copy of `array` (bf16 through its bits: numpy has no bf16)."""
    host = np.asarray(array)
    name = host.dtype.name
    if name == "bfloat16":
        return torch.from_numpy(host.view(np.uint16).copy()).view(torch.bfloat16)
    if name not in _TORCH_DTYPES:
        raise TypeError(f"table dtype {name} has no torch equivalent")
    return torch.from_numpy(host.copy())


class SparseTables:
    """Holds `module` (a `sparse_jax.SparseModule`, from `build_sparse`), `params`,
    `opt_state` and the update step. It uses the module through the contract only: a managed
    module is reached through `module.managed()`."""

    def __init__(
        self, module: SparseModule, rule: RowRule, key: jax.Array, device: jax.Device | None = None
    ):
        if not isinstance(rule, RowRule):
            raise TypeError(
                f"sparse_optimizer must be a sparse_jax.optim row rule (sgd, adagrad, rowwise_adagrad, "
                f"adam or from_optax(...)), got {type(rule).__name__}"
            )
        self.module, self.rule, self.device = module, rule, device
        self.managed = module.managed()  # the managed-collision part, or None
        self.pending = None  # the SparseStep whose backward runs next (set by its forward)
        params = module.init(key)
        if self.managed is not None:
            self.managed.place_maps(
                device
            )  # beside the tables, before any checkpoint loads into them
        # committed to one device from the start: the update returns committed arrays, and
        # jit keys its cache on commitment, so uncommitted first-step inputs would compile twice
        self._params = _committed(params, device)
        self._opt_state = _committed(rule.init(self._params), device)
        # shared compiled step, this model's own counters of skipped (non-finite) batches
        self._shared_update = _update_for(module, rule)
        self._update = self._shared_update.with_fresh_counters()

    @property
    def params(self) -> dict[str, jax.Array]:
        return self._params

    @property
    def opt_state(self) -> SparseOptState:
        return self._opt_state

    def load_opt_state(self, state: SparseOptState) -> None:
        """Replace the optimizer state (e.g. from a checkpoint): same structure and shapes as
        the current one; each leaf is placed like the leaf it replaces."""
        current = self._opt_state
        if jax.tree.structure(state) != jax.tree.structure(current):
            raise ValueError(
                f"optimizer state has structure {jax.tree.structure(state)}, but {self.rule.name} on these "
                f"tables has {jax.tree.structure(current)}"
            )
        for new, old in zip(jax.tree.leaves(state), jax.tree.leaves(current), strict=True):
            if tuple(np.shape(new)) != tuple(old.shape):
                raise ValueError(
                    f"optimizer state leaf has shape {tuple(np.shape(new))}, expected {tuple(old.shape)}"
                )

        def place(new, old):
            if isinstance(new, jax.Array) and not new.is_fully_addressable:
                # a global array of a multi-process job (e.g. a checkpoint resharded on load):
                # no process can read it whole, so it is resharded on the devices
                return jax.jit(lambda x: x.astype(old.dtype), out_shardings=old.sharding)(new)
            host = np.asarray(new, old.dtype)
            return jax.make_array_from_callback(old.shape, old.sharding, lambda index: host[index])

        self._opt_state = jax.tree.map(place, state, current)

    def load_buffers(self, params: dict[str, jax.Array], opt_state: SparseOptState) -> None:
        """Replace the stacked buffers and the optimizer state with device arrays already laid
        out as the current ones (same structure, shapes, dtypes and shardings; e.g. restored
        shard by shard from a checkpoint). Nothing goes through the host."""
        for what, new, old in (
            ("params", params, self._params),
            ("optimizer state", opt_state, self._opt_state),
        ):
            if jax.tree.structure(new) != jax.tree.structure(old):
                raise ValueError(
                    f"load_buffers: {what} has structure {jax.tree.structure(new)}, expected "
                    f"{jax.tree.structure(old)}"
                )
            for a, b in zip(jax.tree.leaves(new), jax.tree.leaves(old), strict=True):
                if (
                    a.shape != b.shape
                    or a.dtype != b.dtype
                    or not a.sharding.is_equivalent_to(b.sharding, b.ndim)
                ):
                    raise ValueError(
                        f"load_buffers: a {what} leaf is {a.dtype}{list(a.shape)} on {a.sharding}, "
                        f"expected {b.dtype}{list(b.shape)} on {b.sharding}"
                    )
        self._params, self._opt_state = dict(params), opt_state

    def prepare(self, kjt: KeyedJaggedTensor) -> PreparedBatch:
        """The batch checked, padded, split and placed on the tables' devices, once."""
        return self.module.prepare(kjt, device=self.device)

    def lookup(
        self, batch: PreparedBatch, *, training: bool = False
    ) -> tuple[KeyedTensor, PreparedBatch]:
        """(pooled embeddings (JAX KeyedTensor), the batch the update takes). A
        managed-collision batch is remapped first: in training its id maps advance and the
        rows they gave to new ids are reset (donated tables and state), in eval it is only
        read; the update then takes the slot ids."""
        if self.managed is not None and self.managed.needs_remap(batch):
            if training:
                self._params, self._opt_state, batch = self.managed.remap(
                    self._params, self._opt_state, batch
                )
            else:
                batch = self.managed.remap_eval(batch)
        return self.module.apply(self._params, batch), batch

    def apply_gradient(self, batch: PreparedBatch, pooled_grad: jax.Array, ok=None) -> None:
        """One fused update on the forward's prepared batch; the old params and state are
        donated (deleted). Skipped, on the device, when the gradient is not finite or the
        device boolean `ok` is false."""
        self._params, self._opt_state = self._update(
            self._params, self._opt_state, batch, pooled_grad, ok=ok
        )

    def nonfinite(self) -> tuple[jax.Array, jax.Array]:
        """(updates skipped as non-finite, index of the first such update or -1): device scalars."""
        return self._update.nonfinite()

    def compile_counts(self) -> dict[str, int]:
        """Programs compiled so far by the lookup and the update (for recompilation checks;
        shared with other models built from the same tables and optimizer)."""
        counts = {
            "lookup": self.module.lookup_compile_count(),
            "update": self._update.compile_count(),
        }
        if self.managed is not None:
            counts["remap"] = self.managed.remap_compile_count()
        return counts

    # -- whole-table access (copies) ---------------------------------------------------------
    def table_weights_torch(self) -> dict[str, torch.Tensor]:
        """{table: [num_embeddings, dim] torch tensor}, copies owned by torch."""
        return {
            name: _to_torch_copy(w) for name, w in self.module.table_weights(self._params).items()
        }

    def load_table_weights(self, weights: Mapping[str, torch.Tensor | np.ndarray]) -> None:
        """Replace the named tables' weights (their optimizer state is kept)."""
        host = {}
        for name, w in weights.items():
            if isinstance(w, torch.Tensor):
                w = w.detach().to("cpu", torch.float32).numpy()
            host[name] = np.asarray(w)
        self._params = self.module.with_table_weights(self._params, host)


# -- the step as torch sees it ---------------------------------------------------------------


class SparseStep:
    """One forward's sparse facts: the tables, the prepared batch, the pooled layout, and
    whether its update has run."""

    def __init__(self, tables: SparseTables, batch: PreparedBatch):
        self.tables, self.batch = tables, batch
        self.pooled_sharding: jax.sharding.Sharding | None = None
        self.applied = False
        self.ok: torch.Tensor | None = None  # set by `Model.guard_update` (e.g. the loss is finite)

    def forward(self, training: bool = False) -> torch.Tensor:
        # a managed-collision batch comes back as its slot ids: the update runs on those
        kt, self.batch = self.tables.lookup(self.batch, training=training)
        pooled = kt.values()
        self.pooled_sharding = pooled.sharding
        return jax_to_torch(pooled)

    def backward(self, grad: torch.Tensor) -> None:
        if self.applied:
            raise RuntimeError(
                "hybrid.Model: backward ran twice through the same forward; the sparse update "
                "of that batch was already applied (the tables were updated in the first backward). "
                "Sum the losses and call backward once, or run a new forward"
            )
        self.applied = True
        # back in the pooled array's layout (its device, or its batch sharding on a mesh)
        pooled_grad = torch_to_jax(grad.to(torch.float32), sharding=self.pooled_sharding)
        ok = None if self.ok is None else torch_to_jax(self.ok.reshape(()).to(torch.bool))
        self.tables.apply_gradient(self.batch, pooled_grad, ok=ok)


class _SparseLookup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, anchor: torch.Tensor, step: SparseStep) -> torch.Tensor:  # noqa: ARG004
        ctx.step = step
        return step.forward(training=True)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        ctx.step.backward(grad)
        return None, None


def sparse_lookup(tables: SparseTables, batch: PreparedBatch, *, train: bool) -> torch.Tensor:
    """Pooled embeddings `[B, sum of feature dims]` as a torch tensor.

    With `train` (and grad enabled) the tensor requires grad and its backward applies the
    fused sparse update once; otherwise it is a plain tensor and nothing updates the tables.
    """
    step = SparseStep(tables, batch)
    if not (train and torch.is_grad_enabled()):
        return step.forward()
    tables.pending = step  # the step whose backward is next (Model.guard_update)
    # the anchor is a leaf that requires grad, so autograd records the Function and calls its
    # backward; it receives no gradient (backward returns None for it)
    anchor = torch.empty(0, requires_grad=True)
    return _SparseLookup.apply(anchor, step)
