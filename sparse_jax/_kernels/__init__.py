"""Fused CPU kernels (XLA custom calls through `jax.ffi`), with the pure-XLA path as fallback.

`available()` says whether the kernels can run here (CPU backend, library built or
buildable). The lookups and the updates are traceable and run inside `jit` and
`shard_map` like any other op.
"""

from sparse_jax._kernels._ffi import (
    RULES,
    available,
    cpu_kernels_problem,
    fused_update,
    jagged_fused_update,
    jagged_pooled_sum,
    last_update_phases,
    pooled_sum,
    quant_pooled,
    when_built,
)
from sparse_jax._kernels._mch import (
    mask_positions,
    mch_from_hash,
    mch_hash_profile_remap,
    mch_hash_remap,
    mch_profile,
    mch_remap,
    mch_to_hash,
)
from sparse_jax._kernels._random import reset_rows, row_bits, table_bits, zero_rows

__all__ = [
    "RULES",
    "available",
    "cpu_kernels_problem",
    "fused_update",
    "jagged_fused_update",
    "jagged_pooled_sum",
    "last_update_phases",
    "mask_positions",
    "mch_from_hash",
    "mch_hash_profile_remap",
    "mch_hash_remap",
    "mch_profile",
    "mch_remap",
    "mch_to_hash",
    "pooled_sum",
    "quant_pooled",
    "reset_rows",
    "row_bits",
    "table_bits",
    "when_built",
    "zero_rows",
]
