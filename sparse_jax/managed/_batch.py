"""A managed module's prepared batch: raw ids checked on the host (`split_raw_ids`) and
placed as words beside the wrapped collection's own prepared batch (`ManagedBatch`), at an
id capacity per managed table (`managed_id_capacity`)."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from sparse_jax import _validate
from sparse_jax._jagged import KeyedJaggedTensor
from sparse_jax._module import PreparedBatch
from sparse_jax._prepare import host_kjt
from sparse_jax.managed._collection import ManagedCollisionCollection

__all__ = ["ManagedBatch", "managed_id_capacity", "split_raw_ids"]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ManagedBatch(PreparedBatch):
    """A managed module's prepared batch, before `remap`: the wrapped collection's own
    prepared batch (`inner`: a `PaddedBatch`, or a sharded collection's `LocalBatches`, with
    a placeholder where ids are managed) and per managed table its raw ids as int32 words
    with their positions in `inner`'s values: `[cap, 2]` and `[cap]` unsharded, `[devices,
    cap, 2]` and `[devices, cap]` on a mesh (`cap`: the table's own capacity per device, a
    power of two; padding positions point past the values and are dropped)."""

    inner: PreparedBatch
    words: dict[str, jax.Array]
    positions: dict[str, jax.Array]

    @property
    def stride(self) -> int:
        return self.inner.stride


def _raw_ids(values: np.ndarray) -> np.ndarray:
    """int64 raw ids from a batch's values: `[N]` integers (int64 ids as TorchRec carries
    them) or `[N, 2]` int32 words (`RawIds.words()`, how a JAX KJT carries them with x64 off)."""
    if values.ndim == 2 and values.shape[1] == 2 and values.dtype == np.int32:
        return (values[:, 0].astype(np.int64) << 32) | values[:, 1].view(np.uint32).astype(np.int64)
    if values.ndim == 1 and values.dtype.kind in "iu":
        if values.dtype == np.uint64 and values.size and values.max() > np.iinfo(np.int64).max:
            raise ValueError(
                "a managed-collision batch: uint64 ids above 2**63 - 1 do not fit int64"
            )
        return values.astype(np.int64)
    raise ValueError(
        f"a managed-collision batch carries raw ids as [N] integers (int64 ids, as TorchRec) or [N, 2] "
        f"int32 words (RawIds.words()), got {values.dtype} values of shape {tuple(values.shape)}"
    )


def split_raw_ids(kjt: KeyedJaggedTensor, mc: ManagedCollisionCollection):
    """A batch of raw ids checked on the host: (the KJT with a placeholder 0 at every managed
    position and unmanaged ids as int32, for the collection's own checks and layout; the
    raw int64 id of every position; the managed table of every position, "" if none)."""
    host = host_kjt(kjt)
    if host.variable_stride_per_key():
        raise ValueError(
            "a managed-collision batch needs one stride for every key; expand the KJT first "
            "(KeyedJaggedTensor.expand_to_batch)"
        )
    raw = _raw_ids(np.asarray(host.values()))
    keys, stride = host.keys(), host.stride()
    lengths = (
        np.asarray(host.lengths(), np.int64).reshape(len(keys), stride)
        if keys
        else np.zeros((0, stride))
    )
    per_key = lengths.sum(axis=1)
    n = int(per_key.sum())
    tables = np.array(  # fixed-width strings: comparing 65,536 of them is ~6x faster than objects
        [
            mc._feature_table.get(k, "") if mc._feature_table.get(k) in mc.modules else ""
            for k in keys
        ]
        + [""],
    )
    owner = tables[np.repeat(np.arange(len(keys)), per_key)]
    raw = raw[:n]
    reserved = (owner != "") & (raw == np.iinfo(np.int64).max)
    if reserved.any():
        where = _validate.locate(
            int(np.flatnonzero(reserved)[0]), np.asarray(host.lengths()), keys, stride
        )
        raise ValueError(
            f"id 2**63 - 1 at {where} is reserved (it marks an empty slot of a managed-collision "
            "table); map it to another id"
        )
    plain = np.where(owner != "", 0, raw)
    wide = (plain < np.iinfo(np.int32).min) | (plain > np.iinfo(np.int32).max)
    if wide.any():
        bad = int(np.flatnonzero(wide)[0])
        where = _validate.locate(bad, np.asarray(host.lengths()), keys, stride)
        raise ValueError(
            f"id {int(raw[bad])} at {where} is a raw 64-bit id but its table has no managed-collision "
            "module; give the table one (managed_collision_modules) or map its ids into the table's "
            "rows"
        )
    return host._replace(values=plain.astype(np.int32)), raw, owner


def managed_id_capacity(count: int) -> int:
    """The id capacity a managed table's ids are padded to on a device holding `count` of
    them: a power of two, at least 8 (a window of `eviction_interval` batches holds that
    many per device)."""
    return max(8, 1 << max(0, count - 1).bit_length())
