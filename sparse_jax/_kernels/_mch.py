"""Call wrappers of the managed-collision CPU kernels (`mc_remap_cpu.cc`): the fused training
remap of one id map (`mch_profile`, its state updated in place, the batch's slots too on
request), the eval lookup (`mch_remap`) and the positions of a mask's set entries
(`mask_positions`, the rows a reset draws; their random bits are `_random.row_bits`).
`sparse_jax.managed` chooses them at CPU lowering (`when_built`).

The hashed form of a map (`sparse_jax.managed._hashed`): its training remap
(`mch_hash_profile_remap`), its eval lookup (`mch_hash_remap`), and the conversions from and
to the sorted form (`mch_to_hash`, `mch_from_hash`). CPU only, with no XLA form: the module
that holds a hashed map has chosen it for a CPU device with the kernels built."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from sparse_jax._kernels._ffi import _register

__all__ = [
    "mask_positions",
    "mch_from_hash",
    "mch_hash_profile_remap",
    "mch_hash_remap",
    "mch_profile",
    "mch_remap",
    "mch_to_hash",
]

_STATE_LEAVES = 11  # MCHState's fields, in order
_HASHED_LEAVES = 11  # MCHHashState's fields, in order


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


def mch_hash_profile_remap(
    *leaves, policy: int, interval: int, threshold: int, ttl: int = 0
) -> list:
    """`mch_profile(..., remap=True)` on the hashed form: `leaves` are `MCHHashState`'s 11
    fields then the batch's `hi`, `lo` and `valid` (or its `[n, 2]` words and `valid`: the
    kernel splits them, not XLA); returns the new state's 11 fields (the
    buffers aliased), the slots given to new ids (int32[min(zch_size, history_capacity)]:
    ascending, then `zch_size`; the sorted form's evicted mask's set entries), int32[3]
    counts and the batch's slots: the sorted form's counts and slots, bit for bit."""
    _register()
    state, batch = leaves[:_HASHED_LEAVES], leaves[_HASHED_LEAVES:]
    if len(batch) == 2:  # ([n, 2] words, valid)
        words, valid = batch
        ids, n = (words.astype(jnp.int32),), words.shape[0]
    else:
        hi, lo, valid = batch
        ids, n = (hi.astype(jnp.int32), lo.astype(jnp.uint32)), hi.shape[0]
    z, h = state[2].shape[0], state[5].shape[0]
    outs = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in state]
    outs += [
        jax.ShapeDtypeStruct((min(z, h),), jnp.int32),
        jax.ShapeDtypeStruct((3,), jnp.int32),
        jax.ShapeDtypeStruct((n,), jnp.int32),
    ]
    call = jax.ffi.ffi_call(
        "HybridrecMchHashProfileRemap",
        outs,
        input_output_aliases={i: i for i in range(_HASHED_LEAVES)},
    )
    return call(
        *state,
        *ids,
        valid.astype(jnp.bool_),
        policy=np.int32(policy),
        interval=np.int32(interval),
        threshold=np.int32(threshold),
        ttl=np.int32(ttl),
    )


def mch_hash_remap(table, hi, lo, *, default_slot: int) -> jax.Array:
    """int32 slot per id on a hashed map's `table`: its slot if resident, else `default_slot`."""
    _register()
    out = jax.ShapeDtypeStruct(hi.shape, jnp.int32)
    return jax.ffi.ffi_call("HybridrecMchHashRemap", out)(
        table, hi.astype(jnp.int32), lo.astype(jnp.uint32), default_slot=np.int32(default_slot)
    )


def mch_to_hash(*leaves, policy: int, buckets: int) -> list:
    """The hashed form's 11 fields of a sorted map (`MCHState`'s 11 `leaves`), its table of
    `buckets` (a power of two) buckets."""
    _register()
    z, h = leaves[0].shape[0], leaves[5].shape[0]
    i32, u32 = jnp.int32, jnp.uint32
    outs = [
        jax.ShapeDtypeStruct((buckets * 4,), i32),
        jax.ShapeDtypeStruct((2 * z,), i32),
        jax.ShapeDtypeStruct((z,), i32),
        jax.ShapeDtypeStruct((z,), i32),
        jax.ShapeDtypeStruct((), i32),
        jax.ShapeDtypeStruct((h,), i32),
        jax.ShapeDtypeStruct((h,), u32),
        jax.ShapeDtypeStruct((h,), i32),
        jax.ShapeDtypeStruct((), i32),
        jax.ShapeDtypeStruct((), i32),
        jax.ShapeDtypeStruct((), i32),
    ]
    return jax.ffi.ffi_call("HybridrecMchToHash", outs)(*leaves, policy=np.int32(policy))


def mch_from_hash(*leaves, policy: int) -> list:
    """The sorted form's 11 fields (`MCHState`) of a hashed map's 11 `leaves`."""
    _register()
    z, h = leaves[2].shape[0], leaves[5].shape[0]
    i32, u32 = jnp.int32, jnp.uint32
    shapes = [(z, i32), (z, u32), (z, i32), (z, i32), (z, i32), (h, i32), (h, u32), (h, i32)]
    outs = [jax.ShapeDtypeStruct((n,), t) for n, t in shapes]
    outs += [jax.ShapeDtypeStruct((), i32)] * 3
    return jax.ffi.ffi_call("HybridrecMchFromHash", outs)(*leaves, policy=np.int32(policy))
