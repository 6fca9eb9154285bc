"""Adam row rule (FBGEMM's ADAM), lazy: only touched rows step.

`m = b1 m + (1 - b1) g; v = b2 v + (1 - b2) g^2;`
`w -= lr * (m / (1 - b1^t) / (sqrt(v / (1 - b2^t)) + eps) + weight_decay * w)`,
with `t` the global step number (as FBGEMM's `iter`). State `momentum1`, `momentum2`:
`[rows, dim]` fp32.
"""

from __future__ import annotations

import jax.numpy as jnp

from sparse_jax.optim._base import RowRule, check_positive

__all__ = ["adam"]


def adam(
    lr: float = 0.001,
    beta1: float = 0.9,
    beta2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    *,
    stochastic_rounding: bool = True,
    seed: int = 0,
) -> RowRule:
    hp = check_positive("adam", lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay)
    for k in ("beta1", "beta2"):
        if not hp[k] < 1:
            raise ValueError(f"adam: {k}={hp[k]} must be below 1")

    def init_table(table):
        # two distinct buffers: both are donated to the update
        return {
            "momentum1": jnp.zeros(table.shape, jnp.float32),
            "momentum2": jnp.zeros(table.shape, jnp.float32),
        }

    def update_rows(rows, state, grads, step):
        b1, b2 = hp["beta1"], hp["beta2"]
        m = b1 * state["momentum1"] + (1 - b1) * grads
        v = b2 * state["momentum2"] + (1 - b2) * grads * grads
        t = step.astype(jnp.float32)
        m_hat = m / (1 - b1**t)
        v_hat = v / (1 - b2**t)
        new = rows - hp["lr"] * (m_hat / (jnp.sqrt(v_hat) + hp["eps"]) + hp["weight_decay"] * rows)
        return new, {"momentum1": m, "momentum2": v}

    return RowRule(
        "adam",
        init_table,
        update_rows,
        hp,
        stochastic_rounding=stochastic_rounding,
        seed=seed,
        native="adam",
    )
