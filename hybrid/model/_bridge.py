"""The DLPack bridge: jax.Array <-> torch.Tensor, zero-copy wherever DLPack allows it.

    t = jax_to_torch(pooled)        # shares pooled's buffer (single-device array)
    g = torch_to_jax(t.grad)        # shares the tensor's storage

Rules (DESIGN.md, "Bridge rules"):
- Objects, not capsules: both directions hand the array / tensor object itself to the
  other framework's `from_dlpack`, so on GPU the producer's stream is synchronized with the
  consumer's (`__dlpack__(stream=...)`); a raw capsule would skip that handshake.
- Zero-copy needs a compact row-major buffer at a 64-byte-aligned address. A tensor that is
  not contiguous is made `.contiguous()` and one that is misaligned is cloned (torch's
  allocators align fresh storage) before the crossing; each such copy is counted in
  `bridge_stats()` under its reason. (Left alone, JAX would copy a misaligned buffer
  silently.) Tensors are `.detach()`ed first: DLPack refuses tensors that require grad.
- An array sharded over several local devices (e.g. the 8 XLA CPU devices of the tests)
  cannot cross as one DLPack tensor: its distinct local shards are joined into one new
  tensor, one copy (counted as "joined_shards"). A replicated array crosses zero-copy (one
  shard is the whole block). With one local device per process (the process model) the
  pooled embeddings are single-device and cross zero-copy.
- The two sides share memory after a zero-copy crossing: JAX arrays are immutable, so do
  not modify a tensor from `jax_to_torch` in place, nor a tensor after `torch_to_jax`.
  Never cross tables or optimizer state (they are donated to the update; a shared buffer
  cannot be).
- Ids: JAX keeps ids as int32 unless x64 is on, and an int64 tensor crossing with x64 off
  would be truncated silently. `torch_ids_to_jax` narrows explicitly after a range check
  that names the offending id (a counted copy, "ids_to_int32").
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable

import jax
import numpy as np
import torch

__all__ = ["BridgeStats", "bridge_stats", "jax_to_torch", "torch_ids_to_jax", "torch_to_jax"]

ALIGNMENT = 64  # bytes; XLA's CPU runtime wants this for a buffer it does not own
_INT32 = np.iinfo(np.int32)


@dataclasses.dataclass
class BridgeStats:
    """Counters of what crossed the bridge: zero-copy crossings and copies by reason.

    Reasons: "non_contiguous", "unaligned", "joined_shards", "to_sharding", and for ids
    "ids_to_int32" (cast, maybe padded) and "padded_ids" (padded to a capacity).
    """

    zero_copy: int = 0
    copies: collections.Counter = dataclasses.field(default_factory=collections.Counter)

    def reset(self) -> None:
        self.zero_copy = 0
        self.copies.clear()

    @property
    def total_copies(self) -> int:
        return sum(self.copies.values())


_STATS = BridgeStats()


def bridge_stats() -> BridgeStats:
    """The process-wide bridge counters (a live object; call `.reset()` to start over)."""
    return _STATS


# ------------------------------------------------------------------------- JAX -> torch


def _index_box(index: tuple[slice, ...], shape: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
    return tuple(
        (s.start or 0, dim if s.stop is None else s.stop)
        for s, dim in zip(index, shape, strict=True)
    )


def jax_to_torch(array: jax.Array) -> torch.Tensor:
    """A torch tensor holding `array`'s values (the process-local block of a sharded array).

    Single-device (or fully replicated) arrays cross zero-copy: the tensor aliases the
    array's buffer. Arrays split over several local devices are joined into one new tensor
    on the first shard's device (one copy). Raises for an array whose local shards do not
    form one block (nothing silently dropped).
    """
    if not isinstance(array, jax.Array):
        raise TypeError(f"jax_to_torch expects a jax.Array, got {type(array).__name__}")
    if len(array.sharding.device_set) == 1 and array.is_fully_addressable:
        _STATS.zero_copy += 1
        return torch.from_dlpack(array)
    shape = tuple(array.shape)
    shards: dict[tuple[tuple[int, int], ...], jax.Array] = {}
    for shard in array.addressable_shards:
        shards.setdefault(_index_box(shard.index, shape), shard.data)
    if len(shards) == 1:  # replicated over the local devices: any one shard is the block
        _STATS.zero_copy += 1
        return torch.from_dlpack(next(iter(shards.values())))
    out = _join(
        [(box, torch.from_dlpack(data)) for box, data in shards.items()], shape, array.sharding
    )
    _STATS.copies["joined_shards"] += 1
    return out


def _join(
    parts: list[tuple[tuple[tuple[int, int], ...], torch.Tensor]], shape, sharding
) -> torch.Tensor:
    """One new tensor holding the `(box, tensor)` parts (a box per dim: `(start, stop)` in the
    global array), which must tile one block; its origin is the smallest start per dim."""
    lo = tuple(min(box[d][0] for box, _ in parts) for d in range(len(shape)))
    hi = tuple(max(box[d][1] for box, _ in parts) for d in range(len(shape)))
    covered = sum(int(np.prod([b - a for a, b in box])) for box, _ in parts)
    if covered != int(np.prod([b - a for a, b in zip(lo, hi, strict=True)])):
        raise ValueError(
            f"jax_to_torch: the local shards of this {shape} array (sharding {sharding}) "
            f"do not tile one block (they span {list(zip(lo, hi, strict=True))}); shard the "
            "batch dimension so each process holds one contiguous block"
        )
    first = parts[0][1]
    out = torch.empty(
        [b - a for a, b in zip(lo, hi, strict=True)], dtype=first.dtype, device=first.device
    )
    for box, part in parts:
        out[tuple(slice(a - l0, b - l0) for (a, b), l0 in zip(box, lo, strict=True))].copy_(part)
    return out


# ------------------------------------------------------------------------- torch -> JAX


def _exportable(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` detached, compact and 64-byte aligned; copies (counted) only when needed."""
    tensor = tensor.detach()
    if tensor.is_conj() or tensor.is_neg():
        tensor = tensor.resolve_conj().resolve_neg()
    if not tensor.is_contiguous():
        _STATS.copies["non_contiguous"] += 1
        return tensor.contiguous()  # fresh storage: aligned
    if tensor.numel() and tensor.data_ptr() % ALIGNMENT:
        _STATS.copies["unaligned"] += 1
        return tensor.clone(memory_format=torch.contiguous_format)
    return tensor


def torch_to_jax(
    tensor: torch.Tensor, *, sharding: jax.sharding.Sharding | None = None
) -> jax.Array:
    """A jax.Array with `tensor`'s values, sharing its storage when it is compact and aligned.

    Without `sharding` the array lives on the tensor's device (zero-copy). With `sharding`
    (e.g. the batch sharding of the pooled embeddings) the tensor is taken as this process's
    block of the global array and laid out on the mesh (a counted copy, "to_sharding").
    """
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"torch_to_jax expects a torch.Tensor, got {type(tensor).__name__}")
    tensor = _exportable(tensor)
    array = jax.dlpack.from_dlpack(tensor)
    if sharding is None or (len(sharding.device_set) == 1 and array.sharding == sharding):
        _STATS.zero_copy += 1
        return array
    _STATS.copies["to_sharding"] += 1
    return jax.make_array_from_process_local_data(sharding, array)


def torch_ids_to_jax(
    tensor: torch.Tensor,
    *,
    what: str = "ids",
    where: Callable[[int], str] | None = None,
    capacity: int | None = None,
) -> jax.Array:
    """Integer ids as a jax int32 array (int64 with x64 on), never truncating.

    Ids wider than int32 are range-checked first; one out of range raises a ValueError
    naming it (and, through `where(index)`, its feature and batch position). int32 tensors
    cross zero-copy; others are cast into a fresh int32 buffer (a counted copy,
    "ids_to_int32"). With `capacity`, the ids are written into a fresh zero-filled buffer of
    that size (the padded static-shape form; counted as "ids_to_int32" or "padded_ids").
    """
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(
            f"{what}: expected a torch.Tensor of integer ids, got {type(tensor).__name__}"
        )
    if tensor.is_floating_point() or tensor.is_complex() or tensor.dtype == torch.bool:
        raise ValueError(
            f"{what}: ids must be an integer tensor, got dtype {tensor.dtype}; convert with "
            ".long() (or hash strings to integers) first"
        )
    if tensor.dim() != 1:
        raise ValueError(f"{what}: ids must be 1-D, got shape {tuple(tensor.shape)}")
    n = tensor.numel()
    if capacity is not None and capacity < n:
        raise ValueError(f"{what}: capacity {capacity} is below the {n} ids")
    tensor = tensor.detach()
    target = torch.int64 if jax.config.jax_enable_x64 else torch.int32
    if target == torch.int32 and n and torch.iinfo(tensor.dtype).max > _INT32.max:
        bad = torch.nonzero((tensor > _INT32.max) | (tensor < _INT32.min)).flatten()
        if bad.numel():
            i = int(bad[0])
            loc = where(i) if where is not None else f"index {i}"
            raise ValueError(
                f"{what}: id {int(tensor[i])} at {loc} does not fit in int32 and jax x64 is off "
                f"({bad.numel()} such ids); hash or remap ids into the table's range (e.g. "
                "ids % num_embeddings) before the batch reaches the model, or enable "
                "jax.config.update('jax_enable_x64', True)"
            )
    if capacity is None and tensor.dtype == target:
        return torch_to_jax(tensor)
    out = torch.zeros(n if capacity is None else capacity, dtype=target, device=tensor.device)
    out[:n] = tensor
    _STATS.copies["ids_to_int32" if tensor.dtype != target else "padded_ids"] += 1
    return jax.dlpack.from_dlpack(out)
