"""`SparseTables`: the sparse module, its params and optimizer state, and the fused update.

The tables and their optimizer state live here, in JAX, never in torch. The update
donates both: each step replaces `params` and `opt_state` with the arrays it returns, and
the previous arrays are deleted. So nothing outside should keep a reference to them (read
them through the properties when needed, and copy what must survive a step).
"""

from __future__ import annotations

from collections.abc import Mapping

import jax
import numpy as np
import torch

from sparse_jax import (
    KeyedJaggedTensor,
    KeyedTensor,
    PreparedBatch,
    SparseModule,
    make_update,
)
from sparse_jax.optim import RowRule, SparseOptState

__all__ = ["SparseTables"]

_UPDATE_CACHE_SIZE = 16
_updates: dict[tuple[int, int], tuple] = {}


def _update_for(module, rule: RowRule):
    """`make_update(module, rule)`, shared by models with the same module and rule objects
    (both immutable), so their jitted update compiles once."""
    key = (id(module), id(rule))
    hit = _updates.get(key)
    if hit is not None and hit[0] is module and hit[1] is rule:
        return hit[2]
    update = make_update(module, rule, skip_nonfinite=True)
    if len(_updates) >= _UPDATE_CACHE_SIZE:
        _updates.pop(next(iter(_updates)))
    _updates[key] = (module, rule, update)  # holding both keeps their ids from being reused
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
    """Holds `module` (a `sparse_jax.SparseModule`, from `_build_sparse`), `params`,
    `opt_state` and the update step. It uses the module through the contract only: a managed
    module is reached through `module.managed()`."""

    def __init__(self, module: SparseModule, rule: RowRule, key: jax.Array, device: jax.Device | None = None):
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
            self.managed.place_maps(device)  # beside the tables, before any checkpoint loads into them
        # committed to one device from the start: the update returns committed arrays, and
        # jit keys its cache on commitment, so uncommitted first-step inputs would compile twice
        self._params = _committed(params, device)
        self._opt_state = _committed(rule.init(self._params), device)
        # shared compiled step, this model's own counters of skipped (non-finite) batches
        self._update = _update_for(module, rule).with_fresh_counters()

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
                raise ValueError(f"optimizer state leaf has shape {tuple(np.shape(new))}, expected {tuple(old.shape)}")
        def place(new, old):
            host = np.asarray(new, old.dtype)
            return jax.make_array_from_callback(old.shape, old.sharding, lambda index: host[index])

        self._opt_state = jax.tree.map(place, state, current)

    def prepare(self, kjt: KeyedJaggedTensor) -> PreparedBatch:
        """The batch checked, padded, split and placed on the tables' devices, once."""
        return self.module.prepare(kjt, device=self.device)

    def lookup(self, batch: PreparedBatch, *, training: bool = False) -> tuple[KeyedTensor, PreparedBatch]:
        """(pooled embeddings (JAX KeyedTensor), the batch the update takes). A
        managed-collision batch is remapped first: in training its id maps advance and the
        rows they gave to new ids are reset (donated tables and state), in eval it is only
        read; the update then takes the slot ids."""
        if self.managed is not None and self.managed.needs_remap(batch):
            if training:
                self._params, self._opt_state, batch = self.managed.remap(self._params, self._opt_state, batch)
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
        counts = {"lookup": self.module.lookup_compile_count(), "update": self._update.compile_count()}
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
