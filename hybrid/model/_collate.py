"""Collate torch-side sparse batches to static shapes before they cross to JAX.

A batch from torch (`keys`, `values [N]`, `lengths [K * B]`, optional `weights [N]`) is
checked and padded *in torch*: values go into a fresh int32 buffer of the capacity rung
(after a range check that never truncates an id), weights into a float32 buffer of the
same size, and each feature's longest bag is rounded up to its length cap (`sparse_jax.length_cap`, never
below the caller's floors). Only arrays of static shapes (a ladder rung, `K * B`) then
cross the bridge zero-copy, and the padded `sparse_jax.KeyedJaggedTensor` is assembled
from them through its pytree constructor, the layout `KeyedJaggedTensor.pad` produces:
padding ids are 0 with weight 0 after the last bag.

Why not build an unpadded KJT and call `.pad()`: on JAX 0.10 turning a numpy array into a
jax array (`jnp.asarray`) compiles a small program per new shape, and the number of ids
changes every batch, so that path compiles once per step.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from hybrid.model._bridge import torch_ids_to_jax, torch_to_jax
from sparse_jax import KeyedJaggedTensor, capacity_for, length_cap
from sparse_jax import length_caps as cap_rule

__all__ = ["host_torch_batch", "pad_kjt", "pad_torch_batch"]


def _check_keys(keys: Sequence[str]) -> tuple[str, ...]:
    keys = tuple(keys)
    if not keys:
        raise ValueError("a sparse batch needs at least one feature name in keys")
    for i, k in enumerate(keys):
        if not isinstance(k, str):
            raise ValueError(f"sparse batch: key {i} must be a string feature name, got {k!r}")
        if keys.index(k) != i:
            raise ValueError(
                f"sparse batch: key {k!r} appears twice (positions {keys.index(k)} and {i}); keys must be unique"
            )
    return keys


def _caps(lengths_kb: torch.Tensor, floors: Sequence[int] | None) -> tuple[int, ...]:
    """The one length-cap rule (`sparse_jax.length_caps`), on the batch's lengths."""
    return cap_rule(lengths_kb.detach().cpu().numpy(), floors)


def _checked(keys, values, lengths, weights):
    """(keys, stride, lengths, offsets [int32], number of ids): the batch's structure checked."""
    keys = _check_keys(keys)
    for name, t in (("values", values), ("lengths", lengths), ("weights", weights)):
        if t is not None and not isinstance(t, torch.Tensor):
            raise TypeError(f"sparse batch: {name} must be a torch.Tensor, got {type(t).__name__}")
    if lengths.dim() != 1 or lengths.numel() % len(keys) or lengths.is_floating_point():
        raise ValueError(
            f"sparse batch: lengths has shape {tuple(lengths.shape)} and dtype {lengths.dtype} for "
            f"{len(keys)} keys {list(keys)}; it must be 1-D integers with num_keys * batch_size "
            "entries (key-major)"
        )
    stride = lengths.numel() // len(keys)
    lengths = lengths.detach()
    negative = torch.nonzero(lengths < 0).flatten()
    if negative.numel():
        i = int(negative[0])
        raise ValueError(
            f"sparse batch: length {int(lengths[i])} at feature {keys[i // stride]!r}, batch position "
            f"{i % stride} is negative; lengths count ids per bag"
        )
    n = int(lengths.sum())
    if values.dim() != 1 or values.numel() != n:
        raise ValueError(
            f"sparse batch: values has shape {tuple(values.shape)} but lengths sum to {n}; every id "
            "belongs to exactly one bag, so values must be 1-D with sum(lengths) ids"
        )
    if values.is_floating_point() or values.is_complex() or values.dtype == torch.bool:
        raise ValueError(
            f"sparse batch: ids must be an integer tensor, got dtype {values.dtype}; convert with "
            ".long() (or hash strings to integers) first"
        )
    if weights is not None and (weights.shape != values.shape or not weights.is_floating_point()):
        raise ValueError(
            f"sparse batch: weights has shape {tuple(weights.shape)} and dtype {weights.dtype}; give "
            f"one floating-point weight per id ({n})"
        )
    offsets = torch.zeros(lengths.numel() + 1, dtype=torch.int32, device=lengths.device)
    torch.cumsum(lengths, dim=0, out=offsets[1:])
    return keys, stride, lengths, offsets, n


def _host(t: torch.Tensor):
    """A numpy view of a CPU tensor (a device tensor is copied to the host once)."""
    return t.detach().cpu().numpy()


def host_torch_batch(
    keys: Sequence[str],
    values: torch.Tensor,
    lengths: torch.Tensor,
    weights: torch.Tensor | None = None,
) -> KeyedJaggedTensor:
    """An unpadded KJT of numpy arrays (views of CPU tensors) with the batch's structure
    checked: the input of `SparseModule.prepare`, which checks the ids and pads once.
    Ids keep their dtype here; `prepare` narrows them to int32 after a range check."""
    keys, stride, lengths, offsets, _ = _checked(keys, values, lengths, weights)
    children = (
        _host(values),
        None if weights is None else _host(weights.to(torch.float32)),
        _host(lengths.to(torch.int32, copy=True)),  # never aliases the caller's lengths
        _host(offsets),
    )
    return KeyedJaggedTensor.tree_unflatten((keys, stride, None), children)


def pad_torch_batch(
    keys: Sequence[str],
    values: torch.Tensor,
    lengths: torch.Tensor,
    weights: torch.Tensor | None = None,
    *,
    ladder: Sequence[int] | None = None,
    length_caps: Sequence[int] | None = None,
) -> KeyedJaggedTensor:
    """A padded KJT from torch tensors (key-major layout, as TorchRec); see the module doc.

    `ladder`: capacity rungs (default `sparse_jax.DEFAULT_LADDER`); `length_caps`: per-key
    floors for the bag-length caps (a loader passing the same floors keeps one program).
    """
    keys, stride, lengths, offsets, n = _checked(keys, values, lengths, weights)
    capacity = capacity_for(n, ladder, what="sparse batch")

    def where(index: int) -> str:
        bag = int(
            torch.searchsorted(offsets[1:], torch.tensor(index, dtype=torch.int32), right=True)
        )
        return f"feature {keys[bag // stride]!r}, batch position {bag % stride}, index {index - int(offsets[bag])} in the bag"

    ids = torch_ids_to_jax(values, what="sparse batch", where=where, capacity=capacity)
    jax_weights = None
    if weights is not None:
        padded_w = torch.zeros(capacity, dtype=torch.float32, device=weights.device)
        padded_w[:n] = weights.detach()
        jax_weights = torch_to_jax(padded_w)
    caps = _caps(lengths.reshape(len(keys), stride), length_caps)
    own_lengths = lengths.to(torch.int32, copy=True)  # the KJT never aliases the caller's tensors
    children = (ids, jax_weights, torch_to_jax(own_lengths), torch_to_jax(offsets))
    # the pytree constructor, with the aux data KeyedJaggedTensor.tree_flatten gives (keys,
    # stride, length caps); tests/test_hybrid_bridge.py checks it against `.pad()`'s treedef
    return KeyedJaggedTensor.tree_unflatten((keys, stride, caps), children)


def pad_kjt(
    kjt: KeyedJaggedTensor,
    *,
    ladder: Sequence[int] | None = None,
    length_caps: Sequence[int] | None = None,
) -> KeyedJaggedTensor:
    """`kjt` padded to `ladder` with caps at least `length_caps`; a KJT already padded to a
    rung of the ladder with such caps is returned as it is."""
    caps = kjt.length_caps()
    floors = [1] * len(kjt.keys()) if length_caps is None else length_caps
    if caps is not None and all(c >= length_cap(f) for c, f in zip(caps, floors, strict=True)):
        if kjt.capacity() == capacity_for(int(kjt.offsets()[-1]), ladder, what="sparse batch"):
            return kjt
    return kjt.pad(ladder, length_caps=length_caps)
