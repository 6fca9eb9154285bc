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
    def __init__(self, keys: Sequence[str], length_per_key: Sequence[int], values, key_dim: int = 1):
        keys = tuple(keys)
        lengths = tuple(int(n) for n in length_per_key)
        if len(keys) != len(lengths):
            raise ValueError(f"KeyedTensor: {len(keys)} keys but {len(lengths)} entries in length_per_key")
        if len(set(keys)) != len(keys):
            dup = sorted({k for k in keys if keys.count(k) > 1})
            raise ValueError(f"KeyedTensor: key(s) {dup} appear twice; keys must be unique")
        if values.ndim <= key_dim or values.shape[key_dim] != sum(lengths):
            raise ValueError(
                f"KeyedTensor: values has shape {values.shape} but the keys need {sum(lengths)} "
                f"entries along dim {key_dim}"
            )
        self._keys, self._lengths, self._values, self._key_dim = keys, lengths, values, key_dim

    def tree_flatten(self):
        return (self._values,), (self._keys, self._lengths, self._key_dim)

    @classmethod
    def tree_unflatten(cls, aux, children):
        obj = object.__new__(cls)
        obj._keys, obj._lengths, obj._key_dim = aux
        (obj._values,) = children
        return obj

    @classmethod
    def from_tensor_list(cls, keys: Sequence[str], tensors: Sequence, key_dim: int = 1) -> KeyedTensor:
        return cls(keys, [t.shape[key_dim] for t in tensors], jnp.concatenate(tensors, axis=key_dim), key_dim)

    def keys(self) -> list[str]:
        return list(self._keys)

    def values(self) -> jax.Array:
        return self._values

    def key_dim(self) -> int:
        return self._key_dim

    def length_per_key(self) -> list[int]:
        return list(self._lengths)

    def offset_per_key(self) -> list[int]:
        return [0, *np.cumsum(self._lengths).tolist()]

    def __getitem__(self, key: str) -> jax.Array:
        if key not in self._keys:
            raise KeyError(f"feature {key!r} is not in this KeyedTensor (keys: {list(self._keys)})")
        i = self._keys.index(key)
        start = sum(self._lengths[:i])
        return jax.lax.slice_in_dim(self._values, start, start + self._lengths[i], axis=self._key_dim)

    def to_dict(self) -> dict[str, jax.Array]:
        return {k: self[k] for k in self._keys}

    @staticmethod
    def regroup(keyed_tensors: Sequence[KeyedTensor], groups: Sequence[Sequence[str]]) -> list[jax.Array]:
        """Concatenate the named features of several KeyedTensors into one array per group."""
        where: dict[str, KeyedTensor] = {}
        for kt in keyed_tensors:
            for k in kt.keys():
                where.setdefault(k, kt)
        out = []
        for group in groups:
            missing = [k for k in group if k not in where]
            if missing:
                raise KeyError(f"regroup: feature(s) {missing} are in none of the KeyedTensors")
            out.append(jnp.concatenate([where[k][k] for k in group], axis=keyed_tensors[0].key_dim()))
        return out

    def __repr__(self) -> str:
        return f"KeyedTensor(keys={list(self._keys)}, length_per_key={list(self._lengths)}, values={self._values})"
