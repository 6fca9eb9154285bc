"""Sparse batches in the forms `hybrid.Model` accepts, read into padded KJTs.

`Model.forward(dense_features, sparse)` takes `sparse` as any of:

- a `sparse_jax.KeyedJaggedTensor` (JAX arrays), padded to the model's ladder if needed;
- `hybrid.torch_kjt(keys, values, lengths, weights=None)`'s result (the same type);
- a TorchRec-style KJT object (anything with `.keys() .values() .lengths()` returning
  torch tensors, e.g. `torchrec.KeyedJaggedTensor`; weights from `.weights_or_none()`);
- a tuple `(keys, values, lengths)` or `(keys, values, lengths, weights)` of torch tensors;
- a dict `{feature: (values, lengths)}` or `{feature: (values, lengths, weights)}`, one
  entry per feature, every feature with the same batch size.

Torch tensors are collated in torch (see `_collate`): ids checked against int32 (an id
that does not fit raises, naming its feature and batch position; nothing is truncated),
padded to a capacity rung, then handed to JAX through the bridge.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import jax
import torch

from hybrid.model._collate import host_torch_batch, pad_kjt, pad_torch_batch
from sparse_jax import KeyedJaggedTensor

__all__ = ["as_host_kjt", "as_kjt", "torch_kjt"]


def torch_kjt(
    keys: Sequence[str],
    values: torch.Tensor,
    lengths: torch.Tensor,
    weights: torch.Tensor | None = None,
    *,
    ladder: Sequence[int] | None = None,
) -> KeyedJaggedTensor:
    """A padded `sparse_jax.KeyedJaggedTensor` from torch tensors (TorchRec's layout).

    Args:
      keys: feature names.
      values: `[N]` integer ids (int64 ids must fit int32), bags key-major (all of
        feature 0's bags, then feature 1's, ...).
      lengths: `[num_keys * batch_size]` ids per bag.
      weights: optional `[N]` float per-id weights (weighted features).
      ladder: capacity rungs for the padding (default `sparse_jax.DEFAULT_LADDER`).

    The result's `values()` holds the ids then zeros up to the capacity rung (padding that
    belongs to no bag), as `KeyedJaggedTensor.pad` lays it out.
    """
    return pad_torch_batch(keys, values, lengths, weights, ladder=ladder)


def _floors(keys: Sequence[str], length_caps: Mapping[str, int] | None) -> list[int] | None:
    return None if length_caps is None else [length_caps.get(k, 1) for k in keys]


def _dict_parts(batch: Mapping):
    """(keys, values, lengths, weights) torch tensors of a `{feature: (values, lengths[, weights])}` batch."""
    keys, values, lengths, weights = [], [], [], []
    for key, entry in batch.items():
        if not isinstance(entry, tuple | list) or len(entry) not in (2, 3):
            raise ValueError(
                f"feature {key!r}: a dict batch maps each feature to (values, lengths) or "
                f"(values, lengths, weights), got {type(entry).__name__}"
            )
        keys.append(key)
        values.append(entry[0])
        lengths.append(entry[1])
        weights.append(entry[2] if len(entry) == 3 else None)
    sizes = {k: int(n.numel()) for k, n in zip(keys, lengths, strict=True)}
    if len(set(sizes.values())) > 1:
        raise ValueError(
            f"dict batch: features have different batch sizes {sizes}; every feature needs one bag per sample"
        )
    has_w = [w is not None for w in weights]
    if any(has_w) and not all(has_w):
        missing = [k for k, h in zip(keys, has_w, strict=True) if not h]
        raise ValueError(
            f"dict batch: features {missing} have no weights but others do; give weights for all or none"
        )
    return keys, torch.cat(values), torch.cat(lengths), torch.cat(weights) if all(has_w) else None


def _is_torch_kjt(obj) -> bool:
    return all(
        callable(getattr(obj, name, None)) for name in ("keys", "values", "lengths")
    ) and isinstance(obj.values(), torch.Tensor)


def _torch_parts(batch):
    """(keys, values, lengths, weights) of a torch-side batch form, or None for a
    `sparse_jax.KeyedJaggedTensor`; raises for anything else."""
    if isinstance(batch, KeyedJaggedTensor):
        return None
    if isinstance(batch, Mapping):
        return _dict_parts(batch)
    if isinstance(batch, tuple | list):
        if len(batch) not in (3, 4):
            raise ValueError(
                f"a tuple sparse batch is (keys, values, lengths) or (keys, values, lengths, weights), "
                f"got {len(batch)} items"
            )
        return (list(batch[0]), *batch[1:], *([None] if len(batch) == 3 else []))
    if _is_torch_kjt(batch):
        weights = (
            batch.weights_or_none() if callable(getattr(batch, "weights_or_none", None)) else None
        )
        return list(batch.keys()), batch.values(), batch.lengths(), weights
    _unreadable(batch)


def _variable_batch(batch):
    """A TorchRec KJT with per-key batch sizes (variable batch, TorchRec's VBE) as a
    `sparse_jax.KeyedJaggedTensor` of numpy arrays with its strides and inverse indices;
    any other batch as it is."""
    if not _is_torch_kjt(batch) or not callable(getattr(batch, "variable_stride_per_key", None)):
        return batch
    if not batch.variable_stride_per_key():
        return batch
    weights = batch.weights_or_none()
    inverse = batch.inverse_indices_or_none()
    return KeyedJaggedTensor(
        list(batch.keys()),
        batch.values().detach().cpu().numpy(),
        weights=None if weights is None else weights.detach().cpu().numpy(),
        lengths=batch.lengths().detach().cpu().numpy(),
        stride_per_key_per_rank=batch.stride_per_key_per_rank(),
        inverse_indices=None
        if inverse is None
        else (list(inverse[0]), inverse[1].detach().cpu().numpy()),
    )


def as_kjt(
    batch, *, ladder: Sequence[int] | None = None, length_caps: Mapping[str, int] | None = None
) -> KeyedJaggedTensor:
    """Any accepted sparse batch form (module docstring) as a KJT padded to `ladder`.

    `length_caps`: per-feature floors for the bag-length caps (features not named: 1).
    """
    batch = _variable_batch(batch)
    parts = _torch_parts(batch)
    if parts is None:
        return pad_kjt(batch, ladder=ladder, length_caps=_floors(batch.keys(), length_caps))
    keys = parts[0]
    return pad_torch_batch(*parts, ladder=ladder, length_caps=_floors(keys, length_caps))


def as_host_kjt(batch) -> KeyedJaggedTensor:
    """Any accepted sparse batch form as an unpadded KJT of numpy arrays on the host (the
    form `SparseModule.prepare` checks and pads once). Torch CPU tensors are read without a
    copy; a `sparse_jax.KeyedJaggedTensor` of device arrays is read back once."""
    batch = _variable_batch(batch)
    parts = _torch_parts(batch)
    if parts is None:
        return batch  # prepare reads its leaves (no copy for numpy leaves)
    return host_torch_batch(*parts)


def _unreadable(batch):
    if isinstance(batch, jax.Array | torch.Tensor):
        raise TypeError(
            "the sparse batch is a bare array; wrap ids and lengths in a KeyedJaggedTensor "
            "(sparse_jax.KeyedJaggedTensor or hybrid.torch_kjt(keys, values, lengths))"
        )
    raise TypeError(
        f"cannot read a sparse batch from {type(batch).__name__}; pass a sparse_jax.KeyedJaggedTensor, "
        "hybrid.torch_kjt(...), a TorchRec KeyedJaggedTensor, a (keys, values, lengths[, weights]) "
        "tuple or a {feature: (values, lengths[, weights])} dict"
    )
