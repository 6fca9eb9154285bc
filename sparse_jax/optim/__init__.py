"""Fused sparse optimizers: one row rule per module, one generic apply (`make_update`)."""

from sparse_jax.optim._base import RowRule, SparseOptState
from sparse_jax.optim.adagrad import adagrad
from sparse_jax.optim.adam import adam
from sparse_jax.optim.from_optax import from_optax
from sparse_jax.optim.rowwise_adagrad import rowwise_adagrad
from sparse_jax.optim.sgd import sgd

__all__ = ["RowRule", "SparseOptState", "adagrad", "adam", "from_optax", "rowwise_adagrad", "sgd"]
