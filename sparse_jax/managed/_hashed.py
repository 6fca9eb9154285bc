"""The hashed form of a managed-collision id map: how a map trains on CPU.

The sorted form (`MCHState`) keeps the resident ids ascending: it is what checkpoints hold,
what the XLA form (a GPU's) computes on, what resharding, export and serving read. Kept
sorted by the CPU kernel, every eviction moves each entry between the first change and the
last, and with new ids landing all over the id range that is the whole map: at 2^20 slots
inside a `hybrid.Model` step the moves and the scan for the window's ids were about half the
remap. The hashed form (`MCHHashState`) holds the same map without an order: each slot's id
and policy metadata at the slot, an open-addressing table from id to slot, and the empty
entries' slots in their sorted order. Its training call (`profile_remap`) makes the sorted
form's every decision on the same numbers (ties between equal scores broken by the id, as the
sorted position breaks them), so the batch's slots, the evicted mask and the counts are the
sorted kernel's bit for bit, and `to_sorted` gives back the sorted form's state exactly.

`ManagedCollisionSparseModule` trains its maps in this form on CPU when the kernels are built,
for the policies the kernel has ("lru", "lfu", "ttl"; "distance_lfu" stays sorted) and maps
of at least `HASHED_MIN_SLOTS` slots (smaller ones train faster sorted: see there); `mc_state`
reads the sorted form back (converted once, until the next training step), so everything
outside the training call sees the one state it always saw. The form has no XLA version: a
program that holds it was built for CPU (`hashes`).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from sparse_jax._kernels import (
    cpu_kernels_problem,
    mch_from_hash,
    mch_hash_profile_remap,
    mch_hash_remap,
    mch_to_hash,
)
from sparse_jax.managed._id_map import _KERNEL_POLICIES, MCHManagedCollisionModule, MCHState, RawIds

__all__ = [
    "HASHED_MIN_SLOTS",
    "MCHHashState",
    "hashes",
    "profile_remap",
    "remap",
    "to_hashed",
    "to_sorted",
]


class MCHHashState(NamedTuple):
    """One table's id map in the hashed form (a pytree, carried through the training step)."""

    table: jax.Array  # int32[buckets * 4]: (id hi, id lo, slot, unused; slot -1: free bucket;
    # the unused word of buckets 0 and 1: the map's hash seed, drawn when it is hashed)
    ids: jax.Array  # int32[2Z]: the id at each slot, its (hi, lo) words side by side (INT64_MAX:
    # empty, and the default slot): one cache line for both
    meta: jax.Array  # int32[Z]: the policy's metadata at each slot (LFU count, else last access)
    free: jax.Array  # int32[Z]: the empty entries' slots in their sorted order, then -1
    free_count: jax.Array  # int32: how many entries are empty
    window_hi: jax.Array  # the sorted form's window and counters, as they are
    window_lo: jax.Array
    window_step: jax.Array
    window_used: jax.Array
    step: jax.Array
    last_eviction: jax.Array


def buckets(zch_size: int) -> int:
    """The table's buckets for `zch_size` slots: a power of two at least twice as many (a
    linear-probing table at most half full)."""
    return 1 << max(1, (2 * zch_size - 1).bit_length())


# The smallest map trained hashed unless asked (`hashes(module, forced=False)`). The sorted
# form's cost per eviction grows with the map (its moves), the hashed form's with the ids
# evicted (a few cache misses each). Measured back to back on an Intel Xeon (2 cores, 65,536
# ids a batch, eviction every batch; sorted / hashed ms, LRU): Zipf ids 3.29 / 3.61 at 2^17
# slots, 3.32 / 3.12 at 2^18, 3.23 / 2.86 at 2^19, 3.07 / 1.96 at 2^20; uniform ids (tens of
# thousands of evictions a call) 7.63 / 14.12, 10.12 / 14.54, 9.72 / 13.83, 8.47 / 9.54. From
# 2^20 slots the hashed form is the better choice for skewed ids by a wide margin and close
# for uniform ones; below it, the sorted form.
HASHED_MIN_SLOTS = 1 << 20


def hashes(module: MCHManagedCollisionModule, *, forced: bool = False) -> bool:
    """Whether a map of `module` trains in the hashed form here: its policy has the kernel,
    the CPU kernels (with the hashed calls) are registered on a CPU backend, and the map has
    at least `HASHED_MIN_SLOTS` slots (any size when `forced`)."""
    return (
        module.eviction_policy in _KERNEL_POLICIES
        and (forced or module.zch_size >= HASHED_MIN_SLOTS)
        and cpu_kernels_problem("HybridrecMchHashProfileRemap") is None
    )


def _policy(module: MCHManagedCollisionModule) -> int:
    return _KERNEL_POLICIES[module.eviction_policy]


def to_hashed(module: MCHManagedCollisionModule, state: MCHState) -> MCHHashState:
    """The hashed form of the sorted map `state` (traceable; a CPU kernel call)."""
    leaves = mch_to_hash(*state, policy=_policy(module), buckets=buckets(module.zch_size))
    return MCHHashState(*leaves)


def to_sorted(module: MCHManagedCollisionModule, state: MCHHashState) -> MCHState:
    """The sorted form of the hashed map `state`: exactly the state the sorted kernel holds
    after the same calls."""
    return MCHState(*mch_from_hash(*state, policy=_policy(module)))


def profile_remap(
    module: MCHManagedCollisionModule,
    state: MCHHashState,
    ids: RawIds | jax.Array,
    valid: jax.Array | bool = True,
) -> tuple[MCHHashState, jax.Array, jax.Array, jax.Array]:
    """`module.profile_remap` on the hashed form: (new state, evicted rows, int32[3] counts,
    the batch's slots). The evicted rows are the slots given to new ids ascending, then
    `zch_size`, `min(zch_size, history_capacity)` of them: `jnp.nonzero(mask, size=...,
    fill_value=zch_size)` of the sorted form's evicted mask, what a reset reads (no pass over
    a mask of every slot). Those, the counts and the slots are the sorted form's bit for bit.
    `ids`: `RawIds`, or their `[n, 2]` words (`RawIds.words()`, as a prepared batch holds
    them: the kernel reads them as they are). `valid` masks padding (one bool per id, or
    one for all)."""
    words = not isinstance(ids, RawIds)
    n = ids.shape[0] if words else ids.hi.shape[0]
    module.check_window(n)
    *leaves, rows, counts, slots = mch_hash_profile_remap(
        *state,
        *((ids,) if words else (ids.hi, ids.lo)),
        jnp.broadcast_to(jnp.asarray(valid, bool), (n,)),
        policy=_policy(module),
        interval=module.eviction_interval,
        threshold=module.threshold,
        ttl=module.single_ttl or 0,
    )
    return MCHHashState(*leaves), rows, counts, slots


def remap(module: MCHManagedCollisionModule, state: MCHHashState, ids: RawIds) -> jax.Array:
    """`module.remap` on the hashed form: each id's slot, `default_slot` when not resident."""
    return mch_hash_remap(state.table, ids.hi, ids.lo, default_slot=module.default_slot)
