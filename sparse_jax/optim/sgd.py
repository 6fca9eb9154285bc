"""SGD row rule (FBGEMM's EXACT_SGD): `w -= lr * g` on the deduplicated row gradient."""

from __future__ import annotations

from sparse_jax.optim._base import RowRule, check_positive

__all__ = ["sgd"]


def sgd(lr: float = 0.01, *, stochastic_rounding: bool = True, seed: int = 0) -> RowRule:
    hp = check_positive("sgd", lr=lr)

    def row_step(state, grads, step):
        del step
        return grads * -hp["lr"], state

    def update_rows(rows, state, grads, step):
        delta, state = row_step(state, grads, step)
        return rows + delta, state

    return RowRule(
        "sgd",
        lambda table: (),
        update_rows,
        hp,
        stochastic_rounding=stochastic_rounding,
        seed=seed,
        native="sgd",
        row_step=row_step,
    )
