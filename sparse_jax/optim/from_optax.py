"""Any elementwise optax GradientTransformation as a fused row rule.

Lazy semantics: only the rows a batch touched step. Their per-row state (every state leaf
shaped like the table) is gathered, stepped by `tx.update` and scattered back; rows no id
touched keep their weights *and* state (unlike dense optax, where e.g. Adam's moments of
untouched rows decay every step). Global leaves (e.g. optax's step `count`) advance once
per update. Only elementwise transformations are valid: anything mixing rows (global norm
clipping, per-tensor statistics) would see just the touched rows.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from sparse_jax.optim._base import RowRule

__all__ = ["from_optax"]


def from_optax(
    tx: optax.GradientTransformation,
    name: str = "optax",
    *,
    stochastic_rounding: bool = True,
    seed: int = 0,
) -> RowRule:
    if not (hasattr(tx, "init") and hasattr(tx, "update")):
        raise ValueError(
            f"from_optax: expected an optax.GradientTransformation, got {type(tx).__name__}"
        )

    # optax mixes python floats with int32 counts, which strict dtype promotion rejects
    def init_table(table):
        with jax.numpy_dtype_promotion("standard"):
            return tx.init(jnp.zeros(table.shape, jnp.float32))

    def update_rows(rows, state, grads, step):
        with jax.numpy_dtype_promotion("standard"):
            updates, new_state = tx.update(grads, state, rows)
            return optax.apply_updates(rows, updates), new_state

    return RowRule(
        name, init_table, update_rows, {}, stochastic_rounding=stochastic_rounding, seed=seed
    )
