"""Managed collision: raw 64-bit ids mapped to the slots of a fixed-size table, on the device.

TorchRec's `MCHManagedCollisionModule` ("sort ZCH"), as a pure function of an explicit
state so that it runs inside a jitted step:

- A raw id is two 32-bit words (`RawIds`: `hi` int32, `lo` uint32), so 64-bit ids pass
  with jax x64 off and are never truncated; `RawIds.from_int64` splits numpy int64 ids.
- The state holds the resident ids sorted (`(hi, lo)` ascending, empty slots at the end
  as `INT64_MAX`), the slot each one owns, and per-slot metadata (window counts for LFU,
  last-access step for LRU). Slot `zch_size - 1` is reserved: ids not resident map to it
  (the shared default row), so `zch_size - 1` ids fit.
- `profile` appends a training batch to the eviction window; every `eviction_interval`
  calls the window is coalesced (unique ids with counts and last access), ids seen fewer
  than `threshold` times in it are dropped (TorchRec's threshold filters act on the same
  window counts), resident ids' metadata are updated, and resident and new ids compete
  by score (LFU: count, LRU: last access; resident wins ties, then the earlier position;
  new ids are ranked by window count, then raw id). Losing resident slots are given to the
  winning new ids; `profile` returns which slots changed owner (their rows and optimizer
  state must be reset: an id evicted and seen again gets a fresh row).
- `remap` maps ids to slots (binary search over the sorted ids); eval does only this.

Differences from TorchRec 1.8 (docs/torchrec_compat.md): the window holds
`history_capacity` ids (a static size) and a window that would overflow it is refused at
trace time by the shapes, never silently truncated (TorchRec sizes it from the first
batch and drops what does not fit); `threshold` is a fixed count, not a filter function.
`hashed_slots` is the plain hashed mode (id hashed into the table, collisions accepted).
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from sparse_jax.optim._rounding import _mix  # murmur3's finalizer, as the rounding draw

__all__ = ["MCH_STATE_FIELDS", "MCHManagedCollisionModule", "MCHState", "RawIds", "hashed_slots"]

_HI_MAX = np.int32(np.iinfo(np.int32).max)
_LO_MAX = np.uint32(np.iinfo(np.uint32).max)  # (_HI_MAX, _LO_MAX) is INT64_MAX: an empty slot
_POLICIES = ("lru", "lfu")


class RawIds(NamedTuple):
    """Raw int64 ids as two words: `hi` (int32, the signed high half) and `lo` (uint32)."""

    hi: jax.Array
    lo: jax.Array

    @staticmethod
    def from_int64(ids) -> RawIds:
        ids = np.asarray(ids)
        if ids.dtype.kind not in "iu":
            raise ValueError(f"RawIds.from_int64: ids must be integers, got dtype {ids.dtype}")
        wide = ids.astype(np.int64)
        if ids.dtype == np.uint64 and (ids > np.iinfo(np.int64).max).any():
            raise ValueError("RawIds.from_int64: uint64 ids above 2**63 - 1 do not fit int64")
        if (wide == np.iinfo(np.int64).max).any():
            at = int(np.flatnonzero(wide == np.iinfo(np.int64).max)[0])
            raise ValueError(f"RawIds.from_int64: id 2**63 - 1 at position {at} is reserved (it marks an empty slot)")
        return RawIds((wide >> 32).astype(np.int32), (wide & 0xFFFFFFFF).astype(np.uint32))

    def to_int64(self) -> np.ndarray:
        return (np.asarray(self.hi).astype(np.int64) << 32) | np.asarray(self.lo).astype(np.int64)

    def words(self) -> np.ndarray:
        """`[N, 2]` int32: the high word, then the low word's bits (KJT values for raw ids)."""
        return np.stack([np.asarray(self.hi, np.int32), np.asarray(self.lo, np.uint32).view(np.int32)], axis=1)

    @staticmethod
    def from_words(words) -> RawIds:
        """The inverse of `words` (numpy or JAX arrays, traced too)."""
        words = jnp.asarray(words)
        return RawIds(words[:, 0].astype(jnp.int32), jax.lax.bitcast_convert_type(words[:, 1], jnp.uint32))


class MCHState(NamedTuple):
    """One table's managed-collision state (a pytree: it is carried through the step)."""

    sorted_hi: jax.Array  # int32[Z]: resident ids, ascending; empty slots (INT64_MAX) last
    sorted_lo: jax.Array  # uint32[Z]
    slots: jax.Array  # int32[Z]: the slot each sorted entry owns (a permutation of 0..Z-1)
    counts: jax.Array  # int32[Z]: LFU count per sorted entry
    last_access: jax.Array  # int32[Z]: LRU step of last access per sorted entry
    window_hi: jax.Array  # int32[H]: ids seen since the last eviction
    window_lo: jax.Array  # uint32[H]
    window_step: jax.Array  # int32[H]: the step each was seen at (0: empty)
    window_used: jax.Array  # int32: entries of the window in use
    step: jax.Array  # int32: training calls to profile so far
    last_eviction: jax.Array  # int32: the step of the last eviction


MCH_STATE_FIELDS: tuple[str, ...] = MCHState._fields  # the state's fields in order (checkpoints name them)


def _less(ahi, alo, bhi, blo):
    return (ahi < bhi) | ((ahi == bhi) & (alo < blo))


def _search(sorted_hi, sorted_lo, hi, lo):
    """For each query, the first position in `sorted[:-1]` whose id is >= it (left side)."""
    n = sorted_hi.shape[0] - 1
    left = jnp.zeros(hi.shape, jnp.int32)
    right = jnp.full(hi.shape, n, jnp.int32)
    for _ in range(max(n, 1).bit_length()):
        mid = (left + right) // 2
        at = jnp.minimum(mid, n - 1)
        go_right = (mid < right) & _less(sorted_hi[at], sorted_lo[at], hi, lo)
        left = jnp.where(go_right, mid + 1, left)
        right = jnp.where(go_right | (mid >= right), right, mid)
    return left


def _stable_order(*keys):
    """Indices sorting by `keys` (lexicographic, ascending, stable)."""
    index = jnp.arange(keys[0].shape[0], dtype=jnp.int32)
    return jax.lax.sort((*keys, index), num_keys=len(keys), is_stable=True)[-1]


@dataclasses.dataclass(frozen=True)
class MCHManagedCollisionModule:
    """Managed collision for one table of `zch_size` rows (module docstring).

    eviction_policy: "lru" (keep the most recently seen) or "lfu" (keep the most seen).
    eviction_interval: training calls between evictions (1: every step).
    threshold: an id must be seen this many times within one eviction window to be admitted.
    history_capacity: ids one window can hold (>= ids per batch * eviction_interval).
    """

    zch_size: int
    history_capacity: int
    eviction_policy: str = "lru"
    eviction_interval: int = 1
    threshold: int = 1

    def __post_init__(self):
        name = "MCHManagedCollisionModule"
        for field in ("zch_size", "history_capacity", "eviction_interval", "threshold"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value < (2 if field == "zch_size" else 1):
                low = "2 (one row is the default row)" if field == "zch_size" else "1"
                raise ValueError(f"{name}: {field}={value!r} must be an int >= {low}")
        if self.eviction_policy not in _POLICIES:
            raise ValueError(f"{name}: eviction_policy={self.eviction_policy!r}; choose one of {list(_POLICIES)}")

    @property
    def default_slot(self) -> int:
        """The slot ids that are not resident map to."""
        return self.zch_size - 1

    def init(self) -> MCHState:
        z, h = self.zch_size, self.history_capacity
        return MCHState(
            sorted_hi=jnp.full(z, _HI_MAX, jnp.int32), sorted_lo=jnp.full(z, _LO_MAX, jnp.uint32),
            slots=jnp.arange(z, dtype=jnp.int32), counts=jnp.zeros(z, jnp.int32),
            last_access=jnp.zeros(z, jnp.int32), window_hi=jnp.zeros(h, jnp.int32),
            window_lo=jnp.zeros(h, jnp.uint32), window_step=jnp.zeros(h, jnp.int32),
            window_used=jnp.zeros((), jnp.int32), step=jnp.zeros((), jnp.int32),
            last_eviction=jnp.zeros((), jnp.int32),
        )

    def remap(self, state: MCHState, ids: RawIds) -> jax.Array:
        """int32 slot per id: its own slot if resident, else `default_slot`."""
        pos = _search(state.sorted_hi, state.sorted_lo, ids.hi, ids.lo)
        hit = (state.sorted_hi[pos] == ids.hi) & (state.sorted_lo[pos] == ids.lo)
        return jnp.where(hit, state.slots[pos], self.default_slot)

    def profile(self, state: MCHState, ids: RawIds, valid: jax.Array | None = None) -> tuple[MCHState, jax.Array]:
        """Record a training batch (`valid` masks padding) and evict when due.

        Returns the new state and a bool[zch_size] mask of the slots given to new ids this
        call (reset their rows and optimizer state)."""
        n = ids.hi.shape[0]
        if n * self.eviction_interval > self.history_capacity:
            raise ValueError(f"MCHManagedCollisionModule: {self.eviction_interval} batches of {n} id positions (padding "
                             f"to the capacity rung included) may exceed history_capacity={self.history_capacity}; "
                             "give history_capacity >= positions per batch * eviction_interval (nothing a window "
                             "holds is ever dropped)")
        valid = jnp.ones(n, bool) if valid is None else valid
        step = state.step + 1
        # pack this batch's valid ids behind the window's used entries
        order = _stable_order((~valid).astype(jnp.int32))
        taken = jnp.sum(valid.astype(jnp.int32))
        at = state.window_used + jnp.arange(n, dtype=jnp.int32)
        keep = jnp.arange(n) < taken
        at = jnp.where(keep, at, self.history_capacity)
        window = (
            state.window_hi.at[at].set(ids.hi[order], mode="drop"),
            state.window_lo.at[at].set(ids.lo[order], mode="drop"),
            state.window_step.at[at].set(jnp.broadcast_to(step, (n,)), mode="drop"),
        )
        state = state._replace(window_hi=window[0], window_lo=window[1], window_step=window[2],
                               window_used=state.window_used + taken, step=step)
        due = step - state.last_eviction == self.eviction_interval
        evicted = jnp.zeros(self.zch_size, bool)
        return jax.lax.cond(due, self._evict, lambda s: (s, evicted), state)

    def _evict(self, state: MCHState) -> tuple[MCHState, jax.Array]:
        z, h = self.zch_size, self.history_capacity
        used = jnp.arange(h) < state.window_used
        # the window's unique ids with their counts and last access
        order = _stable_order((~used).astype(jnp.int32), state.window_hi, state.window_lo)
        whi, wlo, wstep, wused = (state.window_hi[order], state.window_lo[order], state.window_step[order],
                                  used[order])
        first = wused & jnp.concatenate([jnp.ones(1, bool), (whi[1:] != whi[:-1]) | (wlo[1:] != wlo[:-1])])
        uid = jnp.cumsum(first.astype(jnp.int32)) - 1
        uid = jnp.where(wused, uid, h)
        count = jax.ops.segment_sum(wused.astype(jnp.int32), uid, h)
        last = jax.ops.segment_max(jnp.where(wused, wstep, 0), uid, h)
        uhi = jnp.zeros(h, jnp.int32).at[jnp.where(first, uid, h)].set(whi, mode="drop")
        ulo = jnp.zeros(h, jnp.uint32).at[jnp.where(first, uid, h)].set(wlo, mode="drop")
        real = (jnp.arange(h) < jnp.sum(first.astype(jnp.int32))) & (count >= self.threshold)
        # new candidates ranked by window count (descending), then raw id (ascending)
        rank = _stable_order((~real).astype(jnp.int32), -count)
        uhi, ulo, count, last, real = uhi[rank], ulo[rank], count[rank], last[rank], real[rank]
        pos = _search(state.sorted_hi, state.sorted_lo, uhi, ulo)
        hit = real & (state.sorted_hi[pos] == uhi) & (state.sorted_lo[pos] == ulo)
        hit_at = jnp.where(hit, pos, z)
        int_max = jnp.iinfo(jnp.int32).max
        added = jnp.zeros(z, jnp.int32).at[hit_at].add(count, mode="drop")  # one window id per resident entry
        counts = jnp.where(state.counts > int_max - added, int_max, state.counts + added)  # saturates, never wraps
        lasts = state.last_access.at[hit_at].set(last, mode="drop")
        counts, lasts = counts.at[z - 1].set(int_max), lasts.at[z - 1].set(state.step)
        new = real & ~hit
        if self.eviction_policy == "lfu":
            resident_score, new_score = counts, count
        else:
            resident_score, new_score = lasts, last
        merged = jnp.concatenate([resident_score, jnp.where(new, new_score, -1)])
        ranked = _stable_order(-merged)  # descending, stable: resident first, then position
        top, bottom = ranked[:z], ranked[z:]
        won = top >= z  # new ids in the top z, best first
        lost = bottom < z  # resident entries pushed out, best first
        k = jnp.arange(z, dtype=jnp.int32)
        winners = jnp.zeros(z, jnp.int32).at[jnp.where(won, jnp.cumsum(won) - 1, z)].set(top - z, mode="drop")
        losers = jnp.full(z, z, jnp.int32).at[jnp.where(lost, jnp.cumsum(lost) - 1, z)].set(bottom, mode="drop")
        moved = k < jnp.sum(won.astype(jnp.int32))
        target = jnp.where(moved, losers, z)
        sorted_hi = state.sorted_hi.at[target].set(uhi[winners], mode="drop")
        sorted_lo = state.sorted_lo.at[target].set(ulo[winners], mode="drop")
        counts = counts.at[target].set(count[winners], mode="drop")
        lasts = lasts.at[target].set(last[winners], mode="drop")
        evicted = jnp.zeros(z, bool).at[state.slots[jnp.minimum(target, z - 1)]].max(moved)
        resort = _stable_order(sorted_hi, sorted_lo)
        state = state._replace(
            sorted_hi=sorted_hi[resort], sorted_lo=sorted_lo[resort], slots=state.slots[resort],
            counts=counts[resort], last_access=lasts[resort], window_used=jnp.zeros((), jnp.int32),
            window_step=jnp.zeros(h, jnp.int32), last_eviction=state.step,
        )
        return state, evicted


def hashed_slots(ids: RawIds, num_embeddings: int, seed: int = 0) -> jax.Array:
    """Plain hashed mode: int32 slot in [0, num_embeddings) per raw id (collisions accepted).
    A murmur3-style mix of both words, so ids that differ only in the high word spread too."""
    if isinstance(num_embeddings, bool) or not isinstance(num_embeddings, int) or num_embeddings < 1:
        raise ValueError(f"hashed_slots: num_embeddings={num_embeddings!r} must be an int >= 1")
    x = ids.lo.astype(jnp.uint32) ^ jnp.uint32(seed & 0xFFFFFFFF)
    x = _mix(x ^ _mix(ids.hi.astype(jnp.uint32) + jnp.uint32(0x9E3779B9)))
    return (x % jnp.uint32(num_embeddings)).astype(jnp.int32)
