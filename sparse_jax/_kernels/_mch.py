"""Call wrappers of the managed-collision CPU kernels (`mc_remap_cpu.cc`): the fused training
remap of one id map (`mch_profile`, its state updated in place, the batch's slots too on
request), the eval lookup (`mch_remap`) and the positions of a mask's set entries
(`mask_positions`, the rows a reset draws; their random bits are `_random.row_bits`).
`sparse_jax.managed` chooses them at CPU lowering (`when_built`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from sparse_jax._kernels._ffi import _register

__all__ = ["mask_positions", "mch_profile", "mch_remap"]

_STATE_LEAVES = 11  # MCHState's fields, in order


def mch_profile(
    *leaves, policy: int, interval: int, threshold: int, ttl: int = 0, remap: bool = False
) -> list:
    """`MCHManagedCollisionModule._profile` as one call: `leaves` are the state's 11 fields
    then the batch's `hi`, `lo` and `valid`; `policy` 0 LRU, 1 LFU, 2 TTL (`ttl`: its
    single_ttl; "distance_lfu" has no kernel); returns the new state's fields, the
    bool[zch_size] mask of the slots given to new ids and int32[3] (entries held before the
    call, after it, slots given to new ids);
    with `remap`, then the int32 slot of each of the batch's ids on the new state (`mch_remap`
    of it, padding included), read off the eviction instead of searched. The state's buffers
    are aliased to the outputs (XLA donates them when the caller does)."""
    _register()
    state, (hi, lo, valid) = leaves[:_STATE_LEAVES], leaves[_STATE_LEAVES:]
    outs = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in state]
    outs.append(jax.ShapeDtypeStruct(state[0].shape, jnp.bool_))
    outs.append(jax.ShapeDtypeStruct((3,), jnp.int32))
    if remap:
        outs.append(jax.ShapeDtypeStruct(hi.shape, jnp.int32))
    call = jax.ffi.ffi_call(
        "HybridrecMchProfileRemap" if remap else "HybridrecMchProfile",
        outs,
        input_output_aliases={i: i for i in range(_STATE_LEAVES)},
    )
    return call(
        *state,
        hi.astype(jnp.int32),
        lo.astype(jnp.uint32),
        valid.astype(jnp.bool_),
        policy=np.int32(policy),
        interval=np.int32(interval),
        threshold=np.int32(threshold),
        ttl=np.int32(ttl),
    )


def mch_remap(sorted_hi, sorted_lo, slots, hi, lo) -> jax.Array:
    """int32 slot per id (`hi`, `lo`): its entry's slot if resident, else `zch_size - 1`."""
    _register()
    out = jax.ShapeDtypeStruct(hi.shape, jnp.int32)
    return jax.ffi.ffi_call("HybridrecMchRemap", out)(
        sorted_hi, sorted_lo, slots, hi.astype(jnp.int32), lo.astype(jnp.uint32)
    )


def mask_positions(mask, size: int, fill: int) -> jax.Array:
    """int32[size]: the positions of `mask`'s first `size` True entries ascending, then `fill`
    (`jnp.nonzero(mask, size=size, fill_value=fill)[0]`, in one pass)."""
    _register()
    out = jax.ShapeDtypeStruct((size,), jnp.int32)
    return jax.ffi.ffi_call("HybridrecMaskPositions", out)(
        mask.astype(jnp.bool_), fill=np.int32(fill)
    )
