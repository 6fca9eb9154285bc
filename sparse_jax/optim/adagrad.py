"""Elementwise Adagrad row rule (FBGEMM's EXACT_ADAGRAD).

`s += g * g; w -= lr * g / (sqrt(s) + eps)`, state `s` is `[rows, dim]` fp32, starting at 0.
"""

from __future__ import annotations

import jax.numpy as jnp

from sparse_jax.optim._base import RowRule, check_positive

__all__ = ["adagrad"]


def adagrad(
    lr: float = 0.01, eps: float = 1e-8, *, stochastic_rounding: bool = True, seed: int = 0
) -> RowRule:
    hp = check_positive("adagrad", lr=lr, eps=eps)

    def init_table(table):
        return {"momentum1": jnp.zeros(table.shape, jnp.float32)}

    def row_step(state, grads, step):
        del step
        s = state["momentum1"] + grads * grads
        return -(hp["lr"] * grads / (jnp.sqrt(s) + hp["eps"])), {"momentum1": s}

    def update_rows(rows, state, grads, step):
        delta, state = row_step(state, grads, step)
        return rows + delta, state

    return RowRule(
        "adagrad",
        init_table,
        update_rows,
        hp,
        stochastic_rounding=stochastic_rounding,
        seed=seed,
        native="adagrad",
        row_step=row_step,
    )
