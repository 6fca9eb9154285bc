"""Managed collision: raw 64-bit ids mapped to the slots of a fixed-size table, on the device.

TorchRec's `MCHManagedCollisionModule` ("sort ZCH"), as a pure function of an explicit
state so that it runs inside a jitted step:

- A raw id is two 32-bit words (`RawIds`: `hi` int32, `lo` uint32), so 64-bit ids pass
  with jax x64 off and are never truncated; `RawIds.from_int64` splits numpy int64 ids.
- The state holds the resident ids sorted (`(hi, lo)` ascending, empty slots at the end
  as `INT64_MAX`), the slot each one owns, and per-entry metadata: counts for LFU, the
  last-access step for LRU and TTL, both for DistanceLFU (`metadata_fields`; as TorchRec's
  policies, each keeps only its own: the other column stays zero). Slot `zch_size - 1` is
  reserved: ids not resident map to it (the shared default row), so `zch_size - 1` ids fit.
- `profile` appends a training batch to the eviction window; every `eviction_interval`
  calls the window is coalesced (unique ids with counts and last access), ids seen fewer
  than `threshold` times in it are dropped (TorchRec's threshold filters act on the same
  window counts), resident ids' metadata are updated, and resident and new ids compete
  by score (LFU: count, LRU: last access, DistanceLFU: count over a power of the steps since
  last seen, TTL: only ids unseen for more than `single_ttl` steps can lose; resident wins
  ties, then the earlier position; new ids are ranked by window count, then raw id, LRU and
  TTL by last access first, DistanceLFU by its score first). Losing resident slots are given to the
  winning new ids; `profile` returns which slots changed owner (their rows and optimizer
  state must be reset: an id evicted and seen again gets a fresh row).
- `remap` maps ids to slots (binary search over the sorted ids); eval does only this.
- On CPU, when the kernels are built (`sparse_jax._kernels.when_built`, decided at
  lowering), `profile` and `remap` are fused C++ calls (`mc_remap_cpu.cc`: a hash table over
  the window, a radix selection of the weakest residents, entries moved in place; never a
  sort of the table) giving bit for bit the state and outputs of the XLA form below, for
  "lru", "lfu" and "ttl"; "distance_lfu" (float scores) lowers to the XLA form on CPU too.
  `profile_remap` (the training step's call) is `profile` then `remap` of the batch as one
  kernel call there: the slots are read off the eviction, not searched again. The unsharded
  module trains its maps in a hashed form instead (`_hashed`: no entry moves at an
  eviction), which makes these same decisions and converts back to this state.
- On a GPU, `profile` has no data-dependent control flow (`by_platform`, `_static_loops`):
  the eviction is computed every call and kept only when due (a select, not a `lax.cond`,
  whose predicate a GPU copies to the host), the radix passes and the k-th score's
  bisection run a fixed number of times with the extra iterations masked. Elsewhere the
  loops stop early and the eviction runs only when due. Both give the same maps.

Differences from TorchRec 1.8 (docs/torchrec_compat.md): the window holds
`history_capacity` ids (a static size) and a window that would overflow it is refused at
trace time by the shapes, never silently truncated (TorchRec sizes it from the first
batch and drops what does not fit); `threshold` is a fixed count, not a filter function.
`hashed_slots` is the plain hashed mode (id hashed into the table, collisions accepted).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from sparse_jax._kernels import mch_profile, mch_remap, when_built
from sparse_jax._kernels._platform import by_platform
from sparse_jax.optim._rounding import _mix  # murmur3's finalizer, as the rounding draw

__all__ = [
    "MCH_STATE_FIELDS",
    "MCHManagedCollisionModule",
    "MCHState",
    "RawIds",
    "hashed_slots",
    "host_hashed_slots",
]

_HI_MAX = np.int32(np.iinfo(np.int32).max)
_LO_MAX = np.uint32(np.iinfo(np.uint32).max)  # (_HI_MAX, _LO_MAX) is INT64_MAX: an empty slot
_POLICIES = ("lru", "lfu", "distance_lfu", "ttl")
_KERNEL_POLICIES = {"lru": 0, "lfu": 1, "ttl": 2}  # the fused CPU kernel's policy codes
# the per-entry metadata each policy keeps (TorchRec's `metadata_info`); the state's other
# metadata column is left as it is (zeros from `init`)
_METADATA = {
    "lru": ("last_access",),
    "lfu": ("counts",),
    "distance_lfu": ("counts", "last_access"),
    "ttl": ("last_access",),
}


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
            raise ValueError(
                f"RawIds.from_int64: id 2**63 - 1 at position {at} is reserved (it marks an empty slot)"
            )
        return _split_int64(wide)

    def to_int64(self) -> np.ndarray:
        return (np.asarray(self.hi).astype(np.int64) << 32) | np.asarray(self.lo).astype(np.int64)

    def words(self) -> np.ndarray:
        """`[N, 2]` int32: the high word, then the low word's bits (KJT values for raw ids)."""
        return np.stack(
            [np.asarray(self.hi, np.int32), np.asarray(self.lo, np.uint32).view(np.int32)], axis=1
        )

    @staticmethod
    def from_words(words) -> RawIds:
        """The inverse of `words` (numpy or JAX arrays, traced too)."""
        words = jnp.asarray(words)
        return RawIds(
            words[:, 0].astype(jnp.int32), jax.lax.bitcast_convert_type(words[:, 1], jnp.uint32)
        )


def _split_int64(wide: np.ndarray) -> RawIds:
    """int64 ids as their two words, unchecked (the empty marker `2**63 - 1` included)."""
    wide = np.asarray(wide, np.int64)
    return RawIds((wide >> 32).astype(np.int32), (wide & 0xFFFFFFFF).astype(np.uint32))


class MCHState(NamedTuple):
    """One table's managed-collision state (a pytree: it is carried through the step)."""

    sorted_hi: jax.Array  # int32[Z]: resident ids, ascending; empty slots (INT64_MAX) last
    sorted_lo: jax.Array  # uint32[Z]
    slots: jax.Array  # int32[Z]: the slot each sorted entry owns (a permutation of 0..Z-1)
    counts: jax.Array  # int32[Z]: LFU count per sorted entry ("lfu", "distance_lfu")
    last_access: jax.Array  # int32[Z]: step of last access per sorted entry (all but "lfu")
    window_hi: jax.Array  # int32[H]: ids seen since the last eviction
    window_lo: jax.Array  # uint32[H]
    window_step: jax.Array  # int32[H]: the step each was seen at (0: empty)
    window_used: jax.Array  # int32: entries of the window in use
    step: jax.Array  # int32: training calls to profile so far
    last_eviction: jax.Array  # int32: the step of the last eviction


MCH_STATE_FIELDS: tuple[str, ...] = (
    MCHState._fields
)  # the state's fields in order (checkpoints name them)


def _less(ahi, alo, bhi, blo):
    return (ahi < bhi) | ((ahi == bhi) & (alo < blo))


_BLOCK = 8  # entries per block of `_search`'s first level


def _search(sorted_hi, sorted_lo, hi, lo):
    """For each query, the first position in `sorted[:-1]` whose id is >= it (left side).

    In two levels, both counting the ids below the query: first the blocks of `_BLOCK` entries
    whose last id is below it, in a small copy of those ids as `[hi, lo]` rows (one 8-byte
    gather a step, cheaper on XLA CPU than two 4-byte ones), then the entries of its block."""
    n = sorted_hi.shape[0] - 1
    blocks = n // _BLOCK
    fence = jnp.stack(
        [
            sorted_hi[_BLOCK - 1 : blocks * _BLOCK : _BLOCK],
            jax.lax.bitcast_convert_type(
                sorted_lo[_BLOCK - 1 : blocks * _BLOCK : _BLOCK], jnp.int32
            ),
        ],
        axis=1,
    )

    def fence_at(at):
        rows = fence[at]
        return rows[:, 0], jax.lax.bitcast_convert_type(rows[:, 1], jnp.uint32)

    block = _count_below(fence_at, blocks, jnp.zeros(hi.shape, jnp.int32), hi, lo)
    return _count_below(
        lambda at: (sorted_hi[at], sorted_lo[at]), n, block * _BLOCK, hi, lo, _BLOCK - 1
    )


def _count_below(ids_at, n, start, hi, lo, most=None):
    """`start` plus how many of the sorted ids `ids_at(start..n-1)` are below each query,
    counting up to `most` (default: all) by halving steps."""
    pos = start
    for k in reversed(range((n if most is None else most).bit_length())):
        cand = pos + (1 << k)
        at = jnp.minimum(cand, n) - 1
        at_hi, at_lo = ids_at(at)
        pos = jnp.where((cand <= n) & _less(at_hi, at_lo, hi, lo), cand, pos)
    return pos


def occupancy(state: MCHState) -> jax.Array:
    """int32: the entries an id holds (the reserved default slot never counts). The ids sort
    before the empty entries (`INT64_MAX`), so this is where the first empty entry is: a
    binary search, not a pass over the map."""
    n = state.sorted_hi.shape[0] - 1
    empty_hi, empty_lo = jnp.full((1,), _HI_MAX), jnp.full((1,), _LO_MAX)
    at = _count_below(lambda i: (state.sorted_hi[i], state.sorted_lo[i]), n, 0, empty_hi, empty_lo)
    return at[0].astype(jnp.int32)


def _prefix_sum(x):
    """Inclusive prefix sum of int32 `x`: a scan tree, ~4x faster on XLA CPU than `jnp.cumsum`
    (a reduce-window)."""
    return jax.lax.associative_scan(jnp.add, x)


def _bit_length(x):
    """Bits of non-negative int32 `x` (traced): 0 for 0."""
    return 32 - jax.lax.clz(x)


def _radix_pass(perm, word, shift):
    """`perm` reordered stably by the digit of uint32 `word` (indexed like the input) at `shift`.

    The digit is packed above the entry's place in `perm`, so the keys are distinct and a plain
    one-operand value sort (XLA CPU's fast path, ~6x faster than a sort carrying an index) is a
    stable sort of the digits; the low bits give the permutation back."""
    n = perm.shape[0]
    b = max(n - 1, 1).bit_length()
    digit = (word[perm] >> shift) & np.uint32((1 << (32 - b)) - 1)
    keys = (digit << np.uint32(b)) | jnp.arange(n, dtype=jnp.uint32)
    return perm[(jax.lax.sort(keys) & np.uint32((1 << b) - 1)).astype(jnp.int32)]


_STATIC_LOOPS: contextvars.ContextVar = contextvars.ContextVar(
    "hybridrec_static_loops", default=False
)


@contextlib.contextmanager
def _static_loops(on: bool):
    """Trace with fixed trip counts and no `cond` (the GPU form) while `on`."""
    token = _STATIC_LOOPS.set(on)
    try:
        yield
    finally:
        _STATIC_LOOPS.reset(token)


def _radix_order(words, widths, n):
    """Indices sorting `n` entries by uint32 `words` (the most significant first; `widths[i]`
    low bits of `words[i]` are used, a static int or a traced int32) ascending, stable: an LSD
    radix sort."""
    step = 32 - max(n - 1, 1).bit_length()
    perm = jnp.arange(n, dtype=jnp.int32)
    for word, width in zip(reversed(words), reversed(widths), strict=True):
        if isinstance(width, int):
            for shift in range(0, width, step):
                perm = _radix_pass(perm, word, np.uint32(shift))
        elif _STATIC_LOOPS.get():  # every pass a 32-bit word may need, those past the width masked
            for shift in range(0, 32, step):
                perm = jnp.where(shift < width, _radix_pass(perm, word, np.uint32(shift)), perm)
        else:  # as many passes as the traced width needs
            perm, _ = jax.lax.while_loop(
                lambda c, w=width: c[1] < w,
                lambda c, w=word: (_radix_pass(c[0], w, c[1].astype(jnp.uint32)), c[1] + step),
                (perm, jnp.int32(0)),
            )
    return perm


def _pack(fields):
    """`(words, widths)` for `_radix_order` from `(uint32 value, bits)` fields, the most
    significant first, packed into as few words as fit (each word is a set of radix passes)."""
    words, widths, word, width = [], [], None, 0
    for value, bits in reversed(fields):
        if bits == 0:
            continue
        if width + bits > 32:
            words.append(word)
            widths.append(width)
            word, width = None, 0
        word = value if word is None else word | (value << np.uint32(width))
        width += bits
    if word is not None:
        words.append(word)
        widths.append(width)
    return words[::-1], widths[::-1]


@dataclasses.dataclass(frozen=True)
class MCHManagedCollisionModule:
    """Managed collision for one table of `zch_size` rows (module docstring).

    eviction_policy: which resident ids lose their rows to new ids at an eviction (scores
        are compared after the window's counts and last access are merged in; a resident
        wins ties, new ids rank as the oracle in tests/reference.py says):
        "lru": the least recently seen lose (TorchRec's `LRU_EvictionPolicy`).
        "lfu": the least seen since admission lose (`LFU_EvictionPolicy`).
        "distance_lfu": TorchRec's `DistanceLFU_EvictionPolicy`: the lowest
            `count / (step - last_access + 1) ** decay_exponent` loses, computed in float32
            as TorchRec does (`step`: training calls to `profile`, TorchRec's iteration).
            With `decay_exponent` 1.0 (TorchRec's default), 2.0 or 0.0 the scores are bit for
            bit TorchRec's; other exponents take XLA's `pow`, which may differ from torch's
            by an ulp and so order two nearly equal scores the other way.
        "ttl": a time to live of `single_ttl` training calls (TorchRec's
            `HashZchEvictionPolicyName.SINGLE_TTL_EVICTION`, whose `single_ttl` is in hours of
            wall-clock time; here it counts calls to `profile`, so a run is reproducible).
            A resident id not seen for more than `single_ttl` calls (`step - last_access >
            single_ttl`) is expired: only expired ids and empty rows are given to new ids,
            the least recently seen first; an id seen within its ttl is never evicted, and a
            new id finding no expired row maps to the default row until one expires. As in
            TorchRec, an expired id keeps its row (and is still looked up) until a new id
            takes it. New ids compete as for "lru" (last seen, then count, then raw id).
            What a TorchRec user gets: MPZCH's probe-range search is not modelled (any
            expired row of the table can be taken), and time is in calls, not hours.
    eviction_interval: training calls between evictions (1: every step).
    threshold: an id must be seen this many times within one eviction window to be admitted.
    history_capacity: ids one window can hold (>= ids per batch * eviction_interval).
    decay_exponent: "distance_lfu"'s exponent (TorchRec's name), a finite float >= 0.
    single_ttl: "ttl"'s time to live in training calls (TorchRec's name), an int >= 1;
        required for "ttl" and refused for the other policies.
    """

    zch_size: int
    history_capacity: int
    eviction_policy: str = "lru"
    eviction_interval: int = 1
    threshold: int = 1
    decay_exponent: float = 1.0
    single_ttl: int | None = None

    def __post_init__(self):
        name = "MCHManagedCollisionModule"
        for field in ("zch_size", "history_capacity", "eviction_interval", "threshold"):
            value = getattr(self, field)
            if (
                isinstance(value, bool)
                or not isinstance(value, int)
                or value < (2 if field == "zch_size" else 1)
            ):
                low = "2 (one row is the default row)" if field == "zch_size" else "1"
                raise ValueError(f"{name}: {field}={value!r} must be an int >= {low}")
        if self.eviction_policy not in _POLICIES:
            raise ValueError(
                f"{name}: eviction_policy={self.eviction_policy!r}; choose one of {list(_POLICIES)}"
            )
        e = self.decay_exponent
        if isinstance(e, bool) or not isinstance(e, int | float) or not 0 <= e < float("inf"):
            raise ValueError(f"{name}: decay_exponent={e!r} must be a finite number >= 0")
        ttl = self.single_ttl
        if self.eviction_policy == "ttl":
            if isinstance(ttl, bool) or not isinstance(ttl, int) or ttl < 1:
                raise ValueError(
                    f"{name}: single_ttl={ttl!r} must be an int >= 1 with eviction_policy='ttl' "
                    "(training calls an id may go unseen before its row may be taken)"
                )
        elif ttl is not None:
            raise ValueError(
                f"{name}: single_ttl={ttl!r} is for eviction_policy='ttl', not "
                f"{self.eviction_policy!r}; leave it out"
            )

    @property
    def metadata_fields(self) -> tuple[str, ...]:
        """The per-entry metadata the policy keeps (TorchRec's `metadata_info`): "lfu" the
        counts, "lru" and "ttl" the last access, "distance_lfu" both. The state's other
        metadata column is never written (it stays zero from `init`, and `adopt_metadata`
        zeroes it in a loaded map), so an eviction moves one column less."""
        return _METADATA[self.eviction_policy]

    def adopt_metadata(self, state) -> MCHState:
        """A saved map (`MCHState` of host arrays, `[Z]` or `[shards, Z]` leaves) made this
        policy's: the metadata it does not keep zeroed, and a kept column that the map did
        not keep (zero at every resident entry: saved under another policy) filled as if
        each resident id had just been seen once: count 1, last access the map's step. So
        a policy switched on resume does not find every resident at the lowest score (TTL:
        expired; LFU: below any new id) and lose them all at the next eviction."""
        state = MCHState(*(np.asarray(leaf) for leaf in state))
        resident = (state.sorted_hi != _HI_MAX) | (state.sorted_lo != _LO_MAX)
        # a row's own step (`[shards]` steps on a mesh, one per map)
        step = np.asarray(state.step)[..., None]
        fills = {"counts": 1, "last_access": step}
        out = {}
        for field in ("counts", "last_access"):
            column = getattr(state, field)
            if field not in self.metadata_fields:
                out[field] = np.zeros_like(column)
                continue
            never_kept = resident.any(axis=-1) & ~(column * resident).any(axis=-1)
            filled = np.where(resident, fills[field], column).astype(column.dtype)
            out[field] = np.where(never_kept[..., None], filled, column)
        return state._replace(**out)

    @property
    def default_slot(self) -> int:
        """The slot ids that are not resident map to."""
        return self.zch_size - 1

    def init(self) -> MCHState:
        z, h = self.zch_size, self.history_capacity
        return MCHState(
            sorted_hi=jnp.full(z, _HI_MAX, jnp.int32),
            sorted_lo=jnp.full(z, _LO_MAX, jnp.uint32),
            slots=jnp.arange(z, dtype=jnp.int32),
            counts=jnp.zeros(z, jnp.int32),
            last_access=jnp.zeros(z, jnp.int32),
            window_hi=jnp.zeros(h, jnp.int32),
            window_lo=jnp.zeros(h, jnp.uint32),
            window_step=jnp.zeros(h, jnp.int32),
            window_used=jnp.zeros((), jnp.int32),
            step=jnp.zeros((), jnp.int32),
            last_eviction=jnp.zeros((), jnp.int32),
        )

    def remap(self, state: MCHState, ids: RawIds) -> jax.Array:
        """int32 slot per id: its own slot if resident, else `default_slot`. On CPU the
        built kernel (`mch_remap`) answers, elsewhere the binary search below."""
        default = self.default_slot

        def search(sorted_hi, sorted_lo, slots, hi, lo):
            pos = _search(sorted_hi, sorted_lo, hi, lo)
            hit = (sorted_hi[pos] == hi) & (sorted_lo[pos] == lo)
            return jnp.where(hit, slots[pos], default)

        operands = (state.sorted_hi, state.sorted_lo, state.slots, ids.hi, ids.lo)
        out = jax.ShapeDtypeStruct(jnp.shape(ids.hi), jnp.int32)
        (slots,) = by_platform(operands, [out], default=search, cpu=when_built(mch_remap, search))
        return slots

    def profile(
        self, state: MCHState, ids: RawIds, valid: jax.Array | None = None
    ) -> tuple[MCHState, jax.Array]:
        """Record a training batch (`valid` masks padding) and evict when due.

        Returns the new state and a bool[zch_size] mask of the slots given to new ids this
        call (reset their rows and optimizer state)."""
        state, evicted, _ = self.profile_occupied(state, ids, valid)
        return state, evicted

    def profile_occupied(
        self, state: MCHState, ids: RawIds, valid: jax.Array | None = None
    ) -> tuple[MCHState, jax.Array, jax.Array]:
        """`profile`, and int32[3]: the entries an id held before it (`occupancy(state)`) and
        after it, and the slots it gave to new ids (the mask's count): read in the same call,
        so the map updated in place needs no copy kept for the count, and the step no search
        of the new map and no pass over the mask (XLA:CPU compiles each of the search's
        steps as a program of its own)."""
        return self._profile_call(state, ids, valid, remap=False)

    def profile_remap(
        self, state: MCHState, ids: RawIds, valid: jax.Array | None = None
    ) -> tuple[MCHState, jax.Array, jax.Array, jax.Array]:
        """`profile_occupied`, then `remap(new state, ids)` (padding included): the training
        remap as one call. The CPU kernel reads the slots off the eviction (every valid id
        is in the window it just coalesced) instead of sorting and searching the batch
        again; elsewhere this is the two calls. The same state, mask and slots, bit for bit."""
        return self._profile_call(state, ids, valid, remap=True)

    def check_window(self, n: int) -> None:
        """Refuse batches of `n` id positions that the window could not hold."""
        if n * self.eviction_interval > self.history_capacity:
            raise ValueError(
                f"MCHManagedCollisionModule: {self.eviction_interval} batches of {n} id positions (padding "
                f"to the capacity rung included) may exceed history_capacity={self.history_capacity}; "
                "give history_capacity >= positions per batch * eviction_interval (nothing a window "
                "holds is ever dropped)"
            )

    def _profile_call(self, state, ids, valid, *, remap: bool):
        n = ids.hi.shape[0]
        self.check_window(n)
        valid = jnp.ones(n, bool) if valid is None else valid
        leaves, tree = jax.tree_util.tree_flatten((state, ids, valid))
        # the new state has the state's shapes, plus the bool[zch_size] evicted mask (no
        # second trace of the eviction to find out)
        out = (
            state,
            jax.ShapeDtypeStruct((self.zch_size,), jnp.bool_),
            jax.ShapeDtypeStruct((3,), jnp.int32),
        )
        if remap:
            out = (*out, jax.ShapeDtypeStruct((n,), jnp.int32))
        out_leaves, out_tree = jax.tree_util.tree_flatten(out)

        def form(static: bool):
            def run(*ops):
                state, ids, valid = jax.tree_util.tree_unflatten(tree, ops)
                with _static_loops(static):
                    done = self._profile(state, ids, valid)
                slots = (self.remap(done[0], ids),) if remap else ()
                counts = jnp.stack(
                    [occupancy(state), occupancy(done[0]), jnp.sum(done[1].astype(jnp.int32))]
                )
                return jax.tree_util.tree_leaves((*done, counts, *slots))

            return run

        def kernel(*ops):  # the fused CPU kernel: the same state and outputs, bit for bit
            return mch_profile(
                *ops,
                policy=_KERNEL_POLICIES[self.eviction_policy],
                interval=self.eviction_interval,
                threshold=self.threshold,
                ttl=self.single_ttl or 0,
                remap=remap,
            )

        # the kernel has no float scores: "distance_lfu" runs the XLA form on CPU too
        cpu = (
            when_built(kernel, form(False))
            if self.eviction_policy in _KERNEL_POLICIES
            else form(False)
        )
        got = by_platform(
            leaves,
            out_leaves,
            default=form(False),
            cpu=cpu,
            cuda=form(True),
            rocm=form(True),
        )
        return jax.tree_util.tree_unflatten(out_tree, got)

    def _profile(
        self, state: MCHState, ids: RawIds, valid: jax.Array
    ) -> tuple[MCHState, jax.Array]:
        """`profile`'s program (checked arguments)."""
        n = ids.hi.shape[0]
        step = state.step + 1
        # pack this batch's valid ids, in order, behind the window's used entries
        rank = _prefix_sum(valid.astype(jnp.int32))
        taken = jnp.sum(valid.astype(jnp.int32))  # (rank[-1] fails on an empty batch)
        at = jnp.where(valid, state.window_used + rank - 1, self.history_capacity)
        window = (
            state.window_hi.at[at].set(ids.hi, mode="drop"),
            state.window_lo.at[at].set(ids.lo, mode="drop"),
            state.window_step.at[at].set(jnp.broadcast_to(step, (n,)), mode="drop"),
        )
        state = state._replace(
            window_hi=window[0],
            window_lo=window[1],
            window_step=window[2],
            window_used=state.window_used + taken,
            step=step,
        )
        due = step - state.last_eviction == self.eviction_interval
        evicted = jnp.zeros(self.zch_size, bool)
        if _STATIC_LOOPS.get():  # computed every call, kept when due: no conditional
            done = self._evict(state)
            return jax.tree_util.tree_map(
                lambda new, old: jnp.where(due, new, old), done, (state, evicted)
            )
        return jax.lax.cond(due, self._evict, lambda s: (s, evicted), state)

    def _evict(self, state: MCHState) -> tuple[MCHState, jax.Array]:
        z, h = self.zch_size, self.history_capacity
        uhi, ulo, count, last, real = _window_ids(state, self.threshold)
        pos = _search(state.sorted_hi, state.sorted_lo, uhi, ulo)
        hit = real & (state.sorted_hi[pos] == uhi) & (state.sorted_lo[pos] == ulo)
        hit_at = jnp.where(hit, pos, z)
        int_max = jnp.iinfo(jnp.int32).max
        added = (
            jnp.zeros(z, jnp.int32).at[hit_at].add(count, mode="drop")
        )  # one window id per resident entry
        counts = jnp.where(
            state.counts > int_max - added, int_max, state.counts + added
        )  # saturates, never wraps
        lasts = state.last_access.at[hit_at].set(last, mode="drop")
        counts, lasts = counts.at[z - 1].set(int_max), lasts.at[z - 1].set(state.step)
        new = real & ~hit
        by_count = ((h - count).astype(jnp.uint32), (h - 1).bit_length())  # count descending
        # last access descending (within the window: step - last < interval)
        by_last = (
            (state.step - last).astype(jnp.uint32),
            (self.eviction_interval - 1).bit_length(),
        )
        policy = self.eviction_policy
        if policy == "lfu":
            resident_score, new_score = counts, count
            fields = [by_count]  # count descending, then raw id
        elif policy == "distance_lfu":
            resident_score = distance_lfu_score(counts, lasts, state.step, self.decay_exponent)
            new_score = distance_lfu_score(count, last, state.step, self.decay_exponent)
            # score descending, then count descending, then raw id
            by_score = ((jnp.iinfo(jnp.int32).max - new_score).astype(jnp.uint32), 31)
            fields = [by_score, by_count]
        elif policy == "ttl":
            resident_score, new_score = _ttl_scores(state, lasts, self.single_ttl)
            new_score = jnp.broadcast_to(new_score, last.shape)
            fields = [by_last, by_count]  # as for LRU
        else:
            resident_score, new_score = lasts, last
            fields = [by_last, by_count]  # then raw id
        winner, loser = _contest(new, new_score, fields, resident_score)
        loser_slot = state.slots[jnp.minimum(loser, z - 1)]
        evicted = jnp.zeros(z, bool).at[jnp.where(loser < z, loser_slot, z)].set(True, mode="drop")
        lost = jnp.zeros(z, bool).at[loser].set(True, mode="drop")
        won = jnp.zeros(h, bool).at[winner].set(True, mode="drop")
        won_slot = jnp.zeros(h, jnp.int32).at[winner].set(loser_slot, mode="drop")
        # where every entry lands once losers leave and winners join, still sorted by raw id
        below = pos + _less(state.sorted_hi[pos], state.sorted_lo[pos], uhi, ulo).astype(
            jnp.int32
        )  # residents < id
        stay_at, win_at = _merged_places(lost, won, below)

        def place(stayers, winners):
            return (
                jnp.zeros_like(stayers)
                .at[stay_at]
                .set(stayers, mode="drop")
                .at[win_at]
                .set(winners, mode="drop")
            )

        kept = self.metadata_fields
        state = state._replace(
            sorted_hi=place(state.sorted_hi, uhi),
            sorted_lo=place(state.sorted_lo, ulo),
            slots=place(state.slots, won_slot),
            counts=place(counts, count) if "counts" in kept else state.counts,
            last_access=place(lasts, last) if "last_access" in kept else state.last_access,
            window_used=jnp.zeros((), jnp.int32),
            window_step=jnp.zeros(h, jnp.int32),
            last_eviction=state.step,
        )
        return state, evicted


def distance_lfu_score(counts, lasts, step, decay_exponent: float):
    """TorchRec's DistanceLFU score `count / (step - last + 1) ** decay_exponent` in float32,
    as the int32 of its bits (a score is finite and >= 0, so the ints order as the floats).
    The exponents 1, 2 and 0 are exact (a division, a product, none); others take `pow`."""
    distance = (step - lasts + 1).astype(jnp.float32)
    if decay_exponent == 1:
        weight = distance
    elif decay_exponent == 2:
        weight = distance * distance
    elif decay_exponent == 0:
        weight = jnp.ones_like(distance)
    else:
        weight = jnp.power(distance, jnp.float32(decay_exponent))
    return jax.lax.bitcast_convert_type(counts.astype(jnp.float32) / weight, jnp.int32)


def _ttl_scores(state: MCHState, lasts, single_ttl: int):
    """ "ttl"'s (resident, new) scores: an expired resident (`step - last > single_ttl`) or an
    empty entry scores its last access (empty: 0), a live one `int32.max` (never loses); a new
    id scores `step`, above every expired last access (< step - single_ttl)."""
    empty = (state.sorted_hi == _HI_MAX) & (state.sorted_lo == _LO_MAX)
    expired = empty | (state.step - lasts > single_ttl)
    resident = jnp.where(expired, jnp.where(empty, 0, lasts), jnp.iinfo(jnp.int32).max)
    return resident, state.step


def _window_ids(state: MCHState, threshold: int):
    """The window's distinct ids ascending (`hi`, `lo`), with their counts, last access and
    whether they are admitted (seen >= threshold times), padded to the window's size."""
    h = state.window_hi.shape[0]
    used = jnp.arange(h) < state.window_used
    # unused entries (the window's tail) take the largest key: the stable sort leaves them last
    key_hi = jnp.where(
        used,
        jax.lax.bitcast_convert_type(state.window_hi, jnp.uint32) ^ np.uint32(1 << 31),
        _LO_MAX,
    )
    key_lo = jnp.where(used, state.window_lo, _LO_MAX)
    order = _radix_order([key_hi, key_lo], [32, 32], h)
    whi, wlo, wstep, wused = (
        state.window_hi[order],
        state.window_lo[order],
        state.window_step[order],
        used[order],
    )
    first = wused & jnp.concatenate(
        [jnp.ones(1, bool), (whi[1:] != whi[:-1]) | (wlo[1:] != wlo[:-1])]
    )
    uid = jnp.where(wused, _prefix_sum(first.astype(jnp.int32)) - 1, h)
    count = jax.ops.segment_sum(wused.astype(jnp.int32), uid, h)
    last = jax.ops.segment_max(jnp.where(wused, wstep, 0), uid, h)
    uhi = jnp.zeros(h, jnp.int32).at[jnp.where(first, uid, h)].set(whi, mode="drop")
    ulo = jnp.zeros(h, jnp.uint32).at[jnp.where(first, uid, h)].set(wlo, mode="drop")
    real = (jnp.arange(h) < jnp.sum(first.astype(jnp.int32))) & (count >= threshold)
    return uhi, ulo, count, last, real


def _contest(new, new_score, fields, resident_score):
    """The new ids (`new`, by unique id) that take resident entries, and the entries they take:
    `(winner, loser)`, the best winner with the best loser first, padded with `len(new)` and
    `len(resident_score)`. As a stable descending sort of resident then new scores keeping the
    top `len(resident_score)` would decide: a resident wins ties, then the earlier entry; new
    ids rank by `fields` (`_best_new_first`)."""
    h, z = new.shape[0], resident_score.shape[0]
    best = _best_new_first(new, fields)
    # at most h new ids, so only the h weakest residents can lose; the last entry (the default
    # slot's, scored highest) never does
    k = min(h, z - 1)
    weakest = _weakest_first(resident_score[: z - 1], k)
    # the i-th best new id is in the top z iff it beats the i-th weakest resident
    i = jnp.arange(k, dtype=jnp.int32)
    best_score = jnp.where(i < jnp.sum(new.astype(jnp.int32)), new_score[best[:k]], -1)
    n_won = jnp.sum((best_score > resident_score[weakest]).astype(jnp.int32))
    # the best winner takes the best loser's (the n_won-th weakest) entry, and so on down
    moved = i < n_won
    return jnp.where(moved, best[:k], h), jnp.where(
        moved, weakest[jnp.maximum(n_won - 1 - i, 0)], z
    )


def _best_new_first(new, fields):
    """Indices of the `new` entries, best first by `fields` (their sort keys, the most
    significant first, as for `_pack`; ties: the lower index), then the others."""
    n = new.shape[0]
    at = jnp.where(new, _prefix_sum(new.astype(jnp.int32)) - 1, n)
    index = jnp.zeros(n, jnp.int32).at[at].set(jnp.arange(n, dtype=jnp.int32), mode="drop")
    # the others, packed last, take the largest key: the stable sort leaves them last
    fields = [
        (
            jnp.full(n, (1 << bits) - 1, jnp.uint32)
            .at[at]
            .set(value.astype(jnp.uint32), mode="drop"),
            bits,
        )
        for value, bits in fields
    ]
    words, widths = _pack(fields)
    return index[_radix_order(words, widths, n)]


def _weakest_first(score, k):
    """Positions of the `k` lowest of int32 `score` (>= 0), the lowest first; among equal
    scores the later position first (a resident loses to one before it)."""
    t = _kth_smallest(score, k)
    below = score < t
    tied = score == t
    # all entries below t, and the latest of those at t
    tied_after = _prefix_sum(tied[::-1].astype(jnp.int32))[::-1]  # tied entries at positions >= p
    take = below | (tied & (tied_after <= k - jnp.sum(below.astype(jnp.int32))))
    at = _prefix_sum(take[::-1].astype(jnp.int32))[::-1] - 1  # latest position first
    picked = (
        jnp.zeros(k, jnp.int32)
        .at[jnp.where(take, at, k)]
        .set(jnp.arange(score.shape[0], dtype=jnp.int32), mode="drop")
    )
    low = jnp.min(score)
    key = (score[picked] - low).astype(jnp.uint32)
    return picked[_radix_order([key], [_bit_length(t - low)], k)]


def _kth_smallest(score, k):
    """The `k`-th smallest of int32 `score` (>= 0), by bisection over values."""

    def count_at_most(t):
        return jnp.sum((score <= t).astype(jnp.int32))

    def halve(bounds):
        lo, hi = bounds
        mid = (lo >> 1) + (hi >> 1) + (lo & hi & 1)  # floor((lo + hi) / 2) without overflow
        fits = count_at_most(mid) >= k
        return jnp.where(fits, lo, mid), jnp.where(fits, mid, hi)

    # count_at_most(lo) < k <= count_at_most(hi)
    bounds = (jnp.min(score) - 1, jnp.max(score))
    if _STATIC_LOOPS.get():  # an int32 range halves to one value in at most 32 steps

        def halve_open(_, b):
            return tuple(
                jnp.where(b[0] < b[1] - 1, new, old) for new, old in zip(halve(b), b, strict=True)
            )

        return jax.lax.fori_loop(0, 33, halve_open, bounds)[1]
    _, hi = jax.lax.while_loop(lambda b: b[0] < b[1] - 1, halve, bounds)
    return hi


def _merged_places(lost, won, below):
    """Where the staying residents (not `lost`, in order) and the winning new ids (`won`,
    ascending; `below`: how many residents are < each) land in one ascending array. New ids
    never equal a resident, so this is the order a stable sort by raw id would give."""
    z = lost.shape[0]
    lost_upto = _prefix_sum(lost.astype(jnp.int32))
    won_upto = _prefix_sum(jnp.zeros(z, jnp.int32).at[jnp.where(won, below, z)].add(1, mode="drop"))
    stay_at = jnp.where(lost, z, jnp.arange(z, dtype=jnp.int32) - lost_upto + won_upto)
    lost_before = jnp.concatenate([jnp.zeros(1, jnp.int32), lost_upto])[below]
    win_at = jnp.where(won, _prefix_sum(won.astype(jnp.int32)) - 1 + below - lost_before, z)
    return stay_at, win_at


def hashed_slots(ids: RawIds, num_embeddings: int, seed: int = 0) -> jax.Array:
    """Plain hashed mode: int32 slot in [0, num_embeddings) per raw id (collisions accepted).
    A murmur3-style mix of both words, so ids that differ only in the high word spread too."""
    if (
        isinstance(num_embeddings, bool)
        or not isinstance(num_embeddings, int)
        or num_embeddings < 1
    ):
        raise ValueError(f"hashed_slots: num_embeddings={num_embeddings!r} must be an int >= 1")
    x = ids.lo.astype(jnp.uint32) ^ jnp.uint32(seed & 0xFFFFFFFF)
    x = _mix(x ^ _mix(ids.hi.astype(jnp.uint32) + jnp.uint32(0x9E3779B9)))
    return (x % jnp.uint32(num_embeddings)).astype(jnp.int32)


def host_hashed_slots(ids: np.ndarray, num_embeddings: int, seed: int = 0) -> np.ndarray:
    """`hashed_slots` of int64 `ids` on the host, with numpy (bit for bit the same slots):
    for host-side preparation, which must not run device work."""
    words = _split_int64(ids)
    hi, lo = (
        words.hi.astype(np.uint32),
        words.lo,
    )  # the high word's bits, as the device hash takes them

    def mix(h):
        h = h ^ (h >> np.uint32(16))
        h = h * np.uint32(0x85EBCA6B)
        h = h ^ (h >> np.uint32(13))
        h = h * np.uint32(0xC2B2AE35)
        return h ^ (h >> np.uint32(16))

    with np.errstate(over="ignore"):
        x = mix((lo ^ np.uint32(seed & 0xFFFFFFFF)) ^ mix(hi + np.uint32(0x9E3779B9)))
    return (x % np.uint32(num_embeddings)).astype(np.int32)
