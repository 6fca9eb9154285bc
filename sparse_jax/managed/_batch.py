"""A managed module's prepared batch: raw ids checked on the host (`split_raw_ids`) and
placed as words beside the wrapped collection's own prepared batch (`ManagedBatch`), at an
id capacity per managed table (`managed_id_capacity`)."""

from __future__ import annotations

import dataclasses
import sys
from typing import NamedTuple

import jax
import numpy as np

from sparse_jax import _validate
from sparse_jax._jagged import KeyedJaggedTensor
from sparse_jax._module import PreparedBatch
from sparse_jax._prepare import host_kjt
from sparse_jax.managed._collection import ManagedCollisionCollection

__all__ = [
    "ManagedBatch",
    "RawIdSplit",
    "managed_id_capacity",
    "raw_words_into",
    "split_managed",
    "split_raw_ids",
]


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


class RawIdSplit(NamedTuple):
    """A batch of raw ids checked on the host (`split_managed`): `ids`, the KJT with a
    placeholder 0 at every managed position and unmanaged ids as int32 (for the collection's
    own checks and layout); `raw`, the int64 id of every position; `tables`, the managed
    tables in code order; `code`, per position the index of its managed table in `tables`,
    -1 if none; `spans`, per managed table the value ranges `[a, b)` of its features, in
    order (a feature's values are contiguous)."""

    ids: KeyedJaggedTensor
    raw: np.ndarray
    tables: tuple[str, ...]
    code: np.ndarray
    spans: dict[str, list[tuple[int, int]]]

    def positions(self, table: str) -> np.ndarray:
        """The positions of `table`'s ids, ascending (int64)."""
        spans = self.spans.get(table, [])
        if len(spans) == 1:
            return np.arange(*spans[0], dtype=np.int64)
        return np.concatenate(
            [np.arange(a, b, dtype=np.int64) for a, b in spans] or [np.zeros(0, np.int64)]
        )

    def raw_of(self, table: str) -> np.ndarray:
        """`table`'s raw ids in position order (a view when its features are one span)."""
        spans = self.spans.get(table, [])
        if len(spans) == 1:
            return self.raw[spans[0][0] : spans[0][1]]
        return self.raw[self.positions(table)]

    def owner(self) -> np.ndarray:
        """Per position its managed table's name, "" if none (fixed-width strings)."""
        return np.array([*self.tables, ""])[self.code]


def split_managed(kjt: KeyedJaggedTensor, mc: ManagedCollisionCollection) -> RawIdSplit:
    """`kjt`'s raw ids checked on the host and split by managed table (`RawIdSplit`): a
    managed feature's ids may be any int64 but `2**63 - 1`; an unmanaged feature's must
    fit int32."""
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
        else np.zeros((0, stride), np.int64)
    )
    per_key = lengths.sum(axis=1)
    ends = np.cumsum(per_key)
    n = int(ends[-1]) if len(keys) else 0
    raw = raw[:n]
    owners = [mc._feature_table.get(k) for k in keys]
    tables = tuple(sorted({t for t in owners if t in mc.modules}))
    spans: dict[str, list[tuple[int, int]]] = {}
    plain_spans = []  # unmanaged features' value ranges
    for ki, t in enumerate(owners):
        a, b = int(ends[ki] - per_key[ki]), int(ends[ki])
        if b > a:
            (spans.setdefault(t, []) if t in mc.modules else plain_spans).append((a, b))
    for a, b in sorted(s for table_spans in spans.values() for s in table_spans):
        if (raw[a:b] == np.iinfo(np.int64).max).any():
            bad = a + int(np.flatnonzero(raw[a:b] == np.iinfo(np.int64).max)[0])
            where = _validate.locate(bad, np.asarray(host.lengths()), keys, stride)
            raise ValueError(
                f"id 2**63 - 1 at {where} is reserved (it marks an empty slot of a managed-collision "
                "table); map it to another id"
            )
    values = np.zeros(n, np.int32)  # managed positions: the placeholder 0
    for a, b in plain_spans:
        part = raw[a:b]
        if part.min() < np.iinfo(np.int32).min or part.max() > np.iinfo(np.int32).max:
            wide = (part < np.iinfo(np.int32).min) | (part > np.iinfo(np.int32).max)
            bad = a + int(np.flatnonzero(wide)[0])
            where = _validate.locate(bad, np.asarray(host.lengths()), keys, stride)
            raise ValueError(
                f"id {int(raw[bad])} at {where} is a raw 64-bit id but its table has no "
                "managed-collision module; give the table one (managed_collision_modules) or map "
                "its ids into the table's rows"
            )
        values[a:b] = part
    key_code = np.array([tables.index(t) if t in mc.modules else -1 for t in owners], np.int16)
    code = np.repeat(key_code, per_key)
    ids = host._replace(values=values)
    return RawIdSplit(ids, raw, tables, code, spans)


def split_raw_ids(kjt: KeyedJaggedTensor, mc: ManagedCollisionCollection):
    """A batch of raw ids checked on the host: (the KJT with a placeholder 0 at every managed
    position and unmanaged ids as int32, for the collection's own checks and layout; the
    raw int64 id of every position; the managed table of every position, "" if none).
    `split_managed` is the same split without the per-position strings."""
    split = split_managed(kjt, mc)
    return split.ids, split.raw, split.owner()


def raw_words_into(out: np.ndarray, raw: np.ndarray) -> None:
    """`out[:len(raw)]` (`[N, 2]` int32) = the words of int64 `raw` (`RawIds.words()`: the
    high word, then the low word's bits), unchecked."""
    count = raw.shape[0]
    if sys.byteorder == "little":  # an int64 is (low, high) in memory: two strided copies
        halves = np.ascontiguousarray(raw, np.int64).view(np.int32).reshape(count, 2)
        out[:count, 0] = halves[:, 1]
        out[:count, 1] = halves[:, 0]
    else:
        out[:count, 0] = raw >> 32
        out[:count, 1] = (raw & 0xFFFFFFFF).astype(np.uint32).view(np.int32)


def managed_id_capacity(count: int) -> int:
    """The id capacity a managed table's ids are padded to on a device holding `count` of
    them: a power of two, at least 8 (a window of `eviction_interval` batches holds that
    many per device)."""
    return max(8, 1 << max(0, count - 1).bit_length())
