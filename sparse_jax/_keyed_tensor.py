"""`KeyedTensor`: dense per-feature blocks side by side (TorchRec's pooled EBC output).

`values()` is `[B, sum(length_per_key)]` (for `key_dim=1`); feature `k` owns columns
`offset_per_key()[k] : offset_per_key()[k + 1]`. A pytree: values is the leaf; keys and
lengths are static aux data.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["KeyedTensor"]


@jax.tree_util.register_pytree_node_class
class KeyedTensor:
    """Dense per-key blocks side by side along `key_dim` (TorchRec's `KeyedTensor`).

    `offset_per_key` / `index_per_key` are TorchRec's caches: accepted and checked.
    """

    def __init__(
        self,
        keys: Sequence[str],
        length_per_key: Sequence[int],
        values,
        key_dim: int = 1,
        offset_per_key: Sequence[int] | None = None,
        index_per_key: dict | None = None,
    ):
        keys = tuple(keys)
        lengths = tuple(int(n) for n in length_per_key)
        if len(keys) != len(lengths):
            raise ValueError(
                f"KeyedTensor: {len(keys)} keys but {len(lengths)} entries in length_per_key"
            )
        if len(set(keys)) != len(keys):
            dup = sorted({k for k in keys if keys.count(k) > 1})
            raise ValueError(f"KeyedTensor: key(s) {dup} appear twice; keys must be unique")
        neg = [k for k, n in zip(keys, lengths, strict=True) if n < 0]
        if neg:
            raise ValueError(
                f"KeyedTensor: key(s) {neg} have a negative length; lengths must be >= 0"
            )
        if values.ndim <= key_dim or values.shape[key_dim] != sum(lengths):
            raise ValueError(
                f"KeyedTensor: values has shape {values.shape} but the keys need {sum(lengths)} "
                f"entries along dim {key_dim}"
            )
        self._keys, self._lengths, self._values, self._key_dim = keys, lengths, values, key_dim
        if offset_per_key is not None and [int(x) for x in offset_per_key] != self.offset_per_key():
            raise ValueError(
                f"KeyedTensor: offset_per_key={list(offset_per_key)} but the lengths give "
                f"{self.offset_per_key()}"
            )
        if index_per_key is not None and dict(index_per_key) != self.index_per_key():
            raise ValueError(
                f"KeyedTensor: index_per_key={dict(index_per_key)} but the keys give {self.index_per_key()}"
            )

    def tree_flatten(self):
        return (self._values,), (self._keys, self._lengths, self._key_dim)

    @classmethod
    def tree_unflatten(cls, aux, children):
        obj = object.__new__(cls)
        obj._keys, obj._lengths, obj._key_dim = aux
        (obj._values,) = children
        return obj

    @classmethod
    def from_tensor_list(
        cls, keys: Sequence[str], tensors: Sequence, key_dim: int = 1, cat_dim: int = 1
    ) -> KeyedTensor:
        """`tensors` concatenated along `cat_dim`; key i's length is `tensors[i].shape[key_dim]`
        (TorchRec's rule: keep the two dims equal for the blocks to line up)."""
        if len(keys) != len(tensors):
            raise ValueError(
                f"KeyedTensor.from_tensor_list: {len(keys)} keys and {len(tensors)} tensors; give one "
                "tensor per key"
            )
        if not tensors:
            raise ValueError(
                "KeyedTensor.from_tensor_list: no tensors; build KeyedTensor([], [], values) directly"
            )
        return cls(
            keys,
            [t.shape[key_dim] for t in tensors],
            jnp.concatenate(tensors, axis=cat_dim),
            key_dim,
        )

    def keys(self) -> list[str]:
        return list(self._keys)

    def values(self) -> jax.Array:
        return self._values

    def key_dim(self) -> int:
        return self._key_dim

    def length_per_key(self) -> list[int]:
        return list(self._lengths)

    def offset_per_key(self) -> list[int]:
        return [0, *np.cumsum(self._lengths, dtype=np.int64).tolist()]

    def index_per_key(self) -> dict[str, int]:
        return {k: i for i, k in enumerate(self._keys)}

    def size_in_bytes(self) -> int:
        return int(np.prod(self._values.shape)) * np.dtype(self._values.dtype).itemsize

    def device(self) -> jax.Device:
        devices = self._values.devices()
        if len(devices) != 1:
            raise ValueError(f"this KeyedTensor's values span {len(devices)} devices")
        return next(iter(devices))

    def to(self, device, non_blocking: bool = False) -> KeyedTensor:
        del non_blocking
        return jax.tree_util.tree_map(lambda x: jax.device_put(x, device), self)

    def __getitem__(self, key: str) -> jax.Array:
        if key not in self._keys:
            raise KeyError(f"feature {key!r} is not in this KeyedTensor (keys: {list(self._keys)})")
        i = self._keys.index(key)
        start = sum(self._lengths[:i])
        return jax.lax.slice_in_dim(
            self._values, start, start + self._lengths[i], axis=self._key_dim
        )

    def to_dict(self) -> dict[str, jax.Array]:
        return {k: self[k] for k in self._keys}

    @staticmethod
    def regroup(
        keyed_tensors: Sequence[KeyedTensor], groups: Sequence[Sequence[str]]
    ) -> list[jax.Array]:
        """One array per group: its keys' blocks concatenated along `key_dim`. A key must be in
        exactly one of the KeyedTensors, and all share `key_dim`."""
        if not keyed_tensors:
            raise ValueError("KeyedTensor.regroup: no KeyedTensors; pass at least one")
        key_dim = keyed_tensors[0].key_dim()
        where: dict[str, KeyedTensor] = {}
        for i, kt in enumerate(keyed_tensors):
            if kt.key_dim() != key_dim:
                raise ValueError(
                    f"KeyedTensor.regroup: keyed_tensors[{i}] has key_dim={kt.key_dim()} but "
                    f"keyed_tensors[0] has {key_dim}"
                )
            for k in kt.keys():
                if k in where:
                    raise ValueError(
                        f"KeyedTensor.regroup: key {k!r} is in more than one KeyedTensor; a group "
                        "naming it is ambiguous"
                    )
                where[k] = kt
        out = []
        for group in groups:
            missing = [k for k in group if k not in where]
            if missing:
                raise KeyError(f"regroup: feature(s) {missing} are in none of the KeyedTensors")
            if not group:
                out.append(jax.lax.slice_in_dim(keyed_tensors[0].values(), 0, 0, axis=key_dim))
                continue
            out.append(jnp.concatenate([where[k][k] for k in group], axis=key_dim))
        return out

    @staticmethod
    def regroup_as_dict(
        keyed_tensors: Sequence[KeyedTensor], groups: Sequence[Sequence[str]], keys: Sequence[str]
    ) -> dict[str, jax.Array]:
        """`regroup`, the i-th group's array named `keys[i]`."""
        if len(groups) != len(keys):
            raise ValueError(
                f"KeyedTensor.regroup_as_dict: {len(groups)} groups but {len(keys)} keys; give one key "
                "per group"
            )
        return dict(zip(keys, KeyedTensor.regroup(keyed_tensors, groups), strict=True))

    def __repr__(self) -> str:
        return f"KeyedTensor(keys={list(self._keys)}, length_per_key={list(self._lengths)}, values={self._values})"
