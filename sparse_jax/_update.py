"""`make_update`: the fused sparse optimizer step of a collection, jitted, buffers donated.

    update = make_update(ebc, rowwise_adagrad(lr=0.05))
    params, opt_state = update(params, opt_state, kjt, pooled_grad)

`pooled_grad` is the gradient of the loss w.r.t. `ebc.apply(params, kjt).values()`
(`[B, sum of feature dims]`, or that KeyedTensor). The step never forms a table-sized
gradient: per buffer it streams the batch's ids through `apply_row_rule` (sort, dedup,
gather touched rows + state, row rule, scatter) into the donated `params` and `opt_state`.
After the call the arrays passed in are deleted (donated); use the returned ones.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from sparse_jax import _lookup
from sparse_jax._keyed_tensor import KeyedTensor
from sparse_jax._layout import TableLayout
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


def _batch_sharded(collection, grad):
    """The pooled gradient placed batch-sharded on the collection's mesh (explicit-axis meshes
    from `jax.make_mesh` do not reshard inputs implicitly)."""
    if isinstance(grad, KeyedTensor):
        grad = grad.values()
    sharding = NamedSharding(collection.mesh, P(tuple(collection.mesh.axis_names)))
    if isinstance(grad, jax.Array) and grad.sharding.is_equivalent_to(sharding, grad.ndim):
        return grad
    host = np.asarray(grad)  # the same global value on every process
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


class _Update:
    """Callable returned by `make_update`: eager id checks, then the jitted, donating step."""

    def __init__(self, collection, rule: RowRule):
        if not isinstance(rule, RowRule):
            raise ValueError(f"make_update needs a sparse_jax.optim row rule, got {type(rule).__name__}")
        self.collection, self.rule = collection, rule
        if hasattr(collection, "update_fn"):  # sharded or sequence: the collection's own step
            step = collection.update_fn(rule)
            self._prepare = getattr(collection, "prepare_update", None) or (
                lambda kjt, g: (collection.batch(kjt), _batch_sharded(collection, g))
            )
        else:

            def step(params, opt_state, kjt, pooled_grad):
                return fused_update(collection.layout, rule, params, opt_state, kjt, pooled_grad,
                                    weighted=collection.is_weighted, bounds_check=collection.bounds_check,
                                    kernel=collection.kernel)

            def prepare(kjt, grad):
                # the update reads no length caps: dropping them keeps one program per capacity
                return (kjt if kjt.capacity() else kjt.pad(capacity=8)).without_length_caps(), grad

            self._prepare = prepare
        self.jitted = jax.jit(step, donate_argnums=(0, 1))

    def __call__(self, params, opt_state, kjt, pooled_grad):
        self.collection._check(kjt)
        return self.jitted(params, opt_state, *self._prepare(kjt, pooled_grad))

    def compile_count(self) -> int:
        """How many programs the jitted step has compiled (one per distinct input shape)."""
        return self.jitted._cache_size()


def make_update(collection, rule: RowRule) -> _Update:
    """The fused update step for `collection` with the row rule `rule` (params, state donated)."""
    return _Update(collection, rule)
