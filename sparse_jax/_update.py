"""`make_update`: the fused sparse optimizer step of a collection, jitted, buffers donated.

    update = make_update(ebc, rowwise_adagrad(lr=0.05))
    batch = ebc.prepare(kjt)                  # once; the forward uses the same batch
    params, opt_state = update(params, opt_state, batch, pooled_grad)

`pooled_grad` is the gradient of the loss w.r.t. `ebc.apply(params, kjt).values()`
(`[B, sum of feature dims]`, or that KeyedTensor). The step never forms a table-sized
gradient: per buffer it streams the batch's ids through `apply_row_rule` (sort, dedup,
gather touched rows + state, row rule, scatter) into the donated `params` and `opt_state`.
After the call the arrays passed in are deleted (donated); use the returned ones.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from sparse_jax import _lookup
from sparse_jax._keyed_tensor import KeyedTensor
from sparse_jax._layout import TableLayout
from sparse_jax._module import PreparedBatch
from sparse_jax.optim._apply import apply_row_rule
from sparse_jax.optim._base import RowRule, SparseOptState

__all__ = ["make_update", "fused_update"]


def _bag_grads(layout: TableLayout, group: str, pooled_grad, stride: int):
    """`[F_g * B, dim]`: the pooled gradient of the group's features, stacked feature-major."""
    blocks = [pooled_grad[:, s.out_offset : s.out_offset + s.dim] for s in layout.slots_of_group(group)]
    return jnp.concatenate(blocks, axis=0)


def fused_update(layout: TableLayout, rule: RowRule, params, opt_state: SparseOptState, kjt, pooled_grad, *,
                 weighted: bool, bounds_check: str, kernel: str = "xla"):
    """The traceable step (no donation, no checks): used by `make_update` and by sharded code."""
    if isinstance(pooled_grad, KeyedTensor):
        pooled_grad = pooled_grad.values()
    want = (kjt.stride(), sum(layout.output_dims))
    if tuple(pooled_grad.shape) != want:
        raise ValueError(f"pooled_grad has shape {tuple(pooled_grad.shape)}; expected [batch, sum of dims] = {list(want)}")
    step = opt_state.count + 1
    new_params, new_states = {}, {}
    for group in layout.groups:
        rows, bag, scale = _lookup.id_stream(kjt, layout, group, weighted=weighted, bounds_check=bounds_check)
        new_params[group], new_states[group] = apply_row_rule(
            rule, params[group], opt_state.tables[group], step, rows, bag, scale,
            _bag_grads(layout, group, pooled_grad, kjt.stride()), kernel=kernel,
        )
    return new_params, SparseOptState(count=step, tables=new_states)


class _Update:
    """Callable returned by `make_update`: the module's update operands, then the jitted,
    donating step. A prepared batch (`module.prepare`) is used as it is; a raw KJT is
    prepared first (one preparation)."""

    def __init__(self, module, rule: RowRule):
        if not isinstance(rule, RowRule):
            raise ValueError(f"make_update needs a sparse_jax.optim row rule, got {type(rule).__name__}")
        self.module, self.rule = module, rule
        self.jitted = jax.jit(module.update_step(rule), donate_argnums=(0, 1))

    @property
    def collection(self):
        return self.module

    def __call__(self, params, opt_state, batch, pooled_grad):
        if not isinstance(batch, PreparedBatch):
            batch = self.module.prepare(batch)
        return self.jitted(params, opt_state, self.module.update_operands(batch, pooled_grad))

    def compile_count(self) -> int:
        """How many programs the jitted step has compiled (one per distinct input shape)."""
        return self.jitted._cache_size()


def make_update(module, rule: RowRule) -> _Update:
    """The fused update step for a sparse module with the row rule `rule` (params, state donated).

    `update(params, opt_state, batch, grad)`: `batch` is `module.prepare(kjt)` (or a KJT,
    prepared here), `grad` the gradient of `module.apply(params, batch)`."""
    return _Update(module, rule)
