"""SGD row rule (FBGEMM's EXACT_SGD): `w -= lr * g` on the deduplicated row gradient."""

from __future__ import annotations

from sparse_jax.optim._base import RowRule, check_positive

__all__ = ["sgd"]


def sgd(lr: float = 0.01, *, stochastic_rounding: bool = True, seed: int = 0) -> RowRule:
    hp = check_positive("sgd", lr=lr)

    def update_rows(rows, state, grads, step):
        return rows - hp["lr"] * grads, state

    return RowRule(
        "sgd",
        lambda table: (),
        update_rows,
        hp,
        stochastic_rounding=stochastic_rounding,
        seed=seed,
        native="sgd",
    )
