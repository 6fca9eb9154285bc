"""`KeyedTensor`: dense blocks concatenated along one dimension, each reachable by a key.

TorchRec's `torchrec.sparse.jagged_tensor.KeyedTensor`, torch side. The pooled output of an
EmbeddingBagCollection is one: `values()` is `[B, sum(length_per_key)]` and key `f` names the
`[B, length_per_key[f]]` block of feature `f`. Validated once, at construction.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch
import torch.utils._pytree as pytree

__all__ = ["KeyedTensor"]


class KeyedTensor:
    """A tensor whose `key_dim` is split into one named block per key.

    Args:
        keys: one name per block, unique.
        length_per_key: the size of each block along `key_dim` (non-negative ints).
        values: the blocks concatenated along `key_dim`; typically `[B, sum(length_per_key)]`.
        key_dim: the dimension the blocks are concatenated along (default 1: dim 0 is the batch).

    Raises:
        ValueError: when keys repeat, the two lists differ in length, a length is negative,
            `key_dim` is not a dimension of `values`, or the lengths do not add up to
            `values.shape[key_dim]`.
    """

    def __init__(
        self,
        keys: Sequence[str],
        length_per_key: Sequence[int],
        values: torch.Tensor,
        key_dim: int = 1,
        offset_per_key: Sequence[int] | None = None,
        index_per_key: dict[str, int] | None = None,
    ) -> None:
        keys = list(keys)
        length_per_key = [int(n) for n in length_per_key]
        if not isinstance(values, torch.Tensor):
            raise TypeError(
                f"KeyedTensor values must be a torch.Tensor, got {type(values).__name__}; "
                "wrap it with torch.as_tensor(...)."
            )
        if len(keys) != len(length_per_key):
            raise ValueError(
                f"KeyedTensor has {len(keys)} keys but {len(length_per_key)} entries in "
                "length_per_key; give exactly one length per key."
            )
        seen: set[str] = set()
        for position, key in enumerate(keys):
            if key in seen:
                raise ValueError(
                    f"KeyedTensor key {key!r} appears more than once (again at position "
                    f"{position}); keys must be unique, rename one of them."
                )
            seen.add(key)
        for key, length in zip(keys, length_per_key, strict=True):
            if length < 0:
                raise ValueError(
                    f"KeyedTensor key {key!r} has length {length}; lengths must be >= 0."
                )
        if not -values.dim() <= key_dim < values.dim():
            raise ValueError(
                f"KeyedTensor key_dim={key_dim} is not a dimension of values with shape "
                f"{tuple(values.shape)}; use a key_dim in [{-values.dim()}, {values.dim()})."
            )
        total = sum(length_per_key)
        if total != values.shape[key_dim]:
            raise ValueError(
                f"KeyedTensor lengths {dict(zip(keys, length_per_key, strict=True))} add up "
                f"to {total}, but values has size {values.shape[key_dim]} along key_dim="
                f"{key_dim} (shape {tuple(values.shape)}); the lengths must add up to it."
            )
        self._keys = keys
        self._length_per_key = length_per_key
        self._values = values
        self._key_dim = key_dim
        self._offset_per_key = [0, *itertools.accumulate(length_per_key)]
        self._index_per_key = {key: i for i, key in enumerate(keys)}
        # TorchRec's caches: accepted, and checked against the keys and lengths
        if offset_per_key is not None and [int(x) for x in offset_per_key] != self._offset_per_key:
            raise ValueError(
                f"KeyedTensor offset_per_key={list(offset_per_key)} but the lengths give "
                f"{self._offset_per_key}; leave it out (it is computed) or fix it."
            )
        if index_per_key is not None and dict(index_per_key) != self._index_per_key:
            raise ValueError(
                f"KeyedTensor index_per_key={dict(index_per_key)} but the keys give "
                f"{self._index_per_key}; leave it out (it is computed) or fix it."
            )

    @staticmethod
    def from_tensor_list(
        keys: Sequence[str],
        tensors: Sequence[torch.Tensor],
        key_dim: int = 1,
        cat_dim: int = 1,
    ) -> KeyedTensor:
        """Concatenate `tensors` along `cat_dim`; key `keys[i]` names `tensors[i]`.

        Each block's length is its size along `key_dim` (TorchRec's rule; keep the two equal).
        """
        keys, tensors = list(keys), list(tensors)
        if len(keys) != len(tensors):
            raise ValueError(
                f"KeyedTensor.from_tensor_list got {len(keys)} keys and {len(tensors)} "
                "tensors; give exactly one tensor per key."
            )
        if not tensors:
            raise ValueError(
                "KeyedTensor.from_tensor_list got no tensors; build an empty KeyedTensor "
                "directly with KeyedTensor([], [], values) instead."
            )
        return KeyedTensor(
            keys=keys,
            length_per_key=[t.shape[key_dim] for t in tensors],
            values=torch.cat(tensors, dim=cat_dim),
            key_dim=key_dim,
        )

    def keys(self) -> list[str]:
        return self._keys

    def values(self) -> torch.Tensor:
        return self._values

    def key_dim(self) -> int:
        return self._key_dim

    def length_per_key(self) -> list[int]:
        return self._length_per_key

    def offset_per_key(self) -> list[int]:
        """Start of each block along `key_dim`, plus the total: `len(keys) + 1` entries."""
        return self._offset_per_key

    def device(self) -> torch.device:
        return self._values.device

    def index_per_key(self) -> dict[str, int]:
        return dict(self._index_per_key)

    def size_in_bytes(self) -> int:
        return self._values.element_size() * self._values.numel()

    def record_stream(self, stream) -> None:
        """Mark `values()` as in use on `stream` (CUDA streams; see `torch.Tensor.record_stream`)."""
        self._values.record_stream(stream)

    def _index(self, key: str) -> int:
        try:
            return self._index_per_key[key]
        except KeyError:
            raise KeyError(f"KeyedTensor has no key {key!r}; its keys are {self._keys}.") from None

    def __getitem__(self, key: str) -> torch.Tensor:
        """The block of `key`: a view of `values()` narrowed along `key_dim`."""
        index = self._index(key)
        return self._values.narrow(
            self._key_dim, self._offset_per_key[index], self._length_per_key[index]
        )

    def __contains__(self, key: object) -> bool:
        return key in self._index_per_key

    def __len__(self) -> int:
        return len(self._keys)

    def to_dict(self) -> dict[str, torch.Tensor]:
        """`{key: block}` in key order; the blocks are views of `values()`."""
        blocks = self._values.split(self._length_per_key, dim=self._key_dim)
        return dict(zip(self._keys, blocks, strict=True))

    def to(self, device: torch.device | str, non_blocking: bool = False) -> KeyedTensor:
        return KeyedTensor(
            self._keys,
            self._length_per_key,
            self._values.to(device, non_blocking=non_blocking),
            self._key_dim,
        )

    @staticmethod
    def regroup(
        keyed_tensors: Sequence[KeyedTensor], groups: Sequence[Sequence[str]]
    ) -> list[torch.Tensor]:
        """One tensor per group: the blocks of the group's keys, concatenated along key_dim.

        Keys are looked up across all `keyed_tensors` (a key must live in exactly one of
        them); a key may appear in several groups. All inputs must share `key_dim`.
        """
        keyed_tensors = list(keyed_tensors)
        if not keyed_tensors:
            raise ValueError("KeyedTensor.regroup got no KeyedTensors; pass at least one.")
        key_dim = keyed_tensors[0].key_dim()
        owner: dict[str, KeyedTensor] = {}
        for position, kt in enumerate(keyed_tensors):
            if kt.key_dim() != key_dim:
                raise ValueError(
                    f"KeyedTensor.regroup: keyed_tensors[{position}] has key_dim="
                    f"{kt.key_dim()} but keyed_tensors[0] has key_dim={key_dim}; "
                    "all must be concatenated along the same dimension."
                )
            for key in kt.keys():
                if key in owner:
                    raise ValueError(
                        f"KeyedTensor.regroup: key {key!r} is in more than one of the "
                        "keyed_tensors, so a group naming it is ambiguous; rename one."
                    )
                owner[key] = kt
        blocks: list[torch.Tensor] = []
        split_sizes: list[int] = []
        for group_index, group in enumerate(groups):
            size = 0
            for key in group:
                if key not in owner:
                    raise KeyError(
                        f"KeyedTensor.regroup: group {group_index} names key {key!r}, which "
                        f"none of the keyed_tensors has; available keys: {list(owner)}."
                    )
                block = owner[key][key]
                blocks.append(block)
                size += block.shape[key_dim]
            split_sizes.append(size)
        if not blocks:  # only empty groups
            empty = keyed_tensors[0].values().narrow(key_dim, 0, 0)
            return [empty for _ in split_sizes]
        return list(torch.cat(blocks, dim=key_dim).split(split_sizes, dim=key_dim))

    @staticmethod
    def regroup_as_dict(
        keyed_tensors: Sequence[KeyedTensor],
        groups: Sequence[Sequence[str]],
        keys: Sequence[str],
    ) -> dict[str, torch.Tensor]:
        """`regroup`, with the i-th group's tensor named `keys[i]`."""
        if len(groups) != len(keys):
            raise ValueError(
                f"KeyedTensor.regroup_as_dict got {len(groups)} groups but {len(keys)} "
                "keys; give one key per group."
            )
        return dict(zip(keys, KeyedTensor.regroup(keyed_tensors, groups), strict=True))

    def __repr__(self) -> str:
        blocks = ", ".join(
            f"{k!r}: {n}" for k, n in zip(self._keys, self._length_per_key, strict=True)
        )
        return (
            f"KeyedTensor({{{blocks}}}, values={tuple(self._values.shape)} "
            f"{self._values.dtype}, key_dim={self._key_dim})"
        )


# A torch pytree node (values is the leaf; keys, lengths and key_dim are its context), so
# `torch.utils._pytree`, `torch.compile` and `torch.export` see through it.
def _flatten(kt: KeyedTensor):
    return [kt.values()], (tuple(kt.keys()), tuple(kt.length_per_key()), kt.key_dim())


def _unflatten(children, context) -> KeyedTensor:
    keys, lengths, key_dim = context
    return KeyedTensor(list(keys), list(lengths), children[0], key_dim)


def _flatten_with_keys(kt: KeyedTensor):
    children, context = _flatten(kt)
    return [(pytree.GetAttrKey("_values"), children[0])], context


pytree.register_pytree_node(
    KeyedTensor,
    _flatten,
    _unflatten,
    serialized_type_name="dense_torch.KeyedTensor",
    flatten_with_keys_fn=_flatten_with_keys,
)
