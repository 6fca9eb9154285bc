"""Row-wise Adagrad row rule (FBGEMM's EXACT_ROWWISE_ADAGRAD, TorchRec's default).

One state value per row: `s += mean(g * g)` over the row, `w -= lr * g / (sqrt(s) + eps)`.
State `momentum1` is `[rows]` fp32, starting at 0 (FBGEMM's layout).
"""

from __future__ import annotations

import jax.numpy as jnp

from sparse_jax.optim._base import RowRule, check_positive

__all__ = ["rowwise_adagrad"]


def rowwise_adagrad(
    lr: float = 0.01, eps: float = 1e-8, *, stochastic_rounding: bool = True, seed: int = 0
) -> RowRule:
    hp = check_positive("rowwise_adagrad", lr=lr, eps=eps)

    def init_table(table):
        return {"momentum1": jnp.zeros(table.shape[:1], jnp.float32)}

    def row_step(state, grads, step):
        del step
        s = state["momentum1"] + jnp.mean(grads * grads, axis=1)
        scale = hp["lr"] / (jnp.sqrt(s) + hp["eps"])
        return -scale[:, None] * grads, {"momentum1": s}

    def update_rows(rows, state, grads, step):
        delta, state = row_step(state, grads, step)
        return rows + delta, state

    return RowRule(
        "rowwise_adagrad",
        init_table,
        update_rows,
        hp,
        stochastic_rounding=stochastic_rounding,
        seed=seed,
        native="rowwise_adagrad",
        row_step=row_step,
    )
