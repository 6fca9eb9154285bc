"""The model: `hybrid.Model`, the sparse batches it reads and the bridge it crosses.

- `Model` (`_model`): JAX embedding tables + a PyTorch dense tower, trained as one
  `torch.nn.Module`; the sparse update runs inside `loss.backward()`.
- The sparse half (`_sparse`): `build_sparse` (the one place hybrid constructs its sparse
  module, used through `sparse_jax.SparseModule` only), `SparseTables` (the module, its
  params and optimizer state, the fused update, donated), `sparse_lookup` / `SparseStep`
  (lookup forward, fused update backward, as a `torch.autograd.Function`); `_state_dict`
  mirrors the tables as TorchRec's `embedding_bags.<table>.weight` keys
  (`from_torchrec_state_dict`).
- Sparse batches: `as_kjt` / `torch_kjt` (`_batch`: every form `Model` accepts, read into
  padded KJTs) over `_collate` (checked and padded in torch, static shapes before JAX).
- The DLPack bridge (`_bridge`): `jax_to_torch`, `torch_to_jax`, `torch_ids_to_jax`
  (zero-copy wherever possible, copies counted in `bridge_stats()` / `BridgeStats`).
- `torch_device` (`_device`): the torch device of this process's JAX device.

Public names are re-exported by `hybrid`; the rest of `hybrid` imports the private
modules it needs directly.
"""

from hybrid.model._batch import as_kjt, torch_kjt
from hybrid.model._bridge import (
    BridgeStats,
    bridge_stats,
    jax_to_torch,
    torch_ids_to_jax,
    torch_to_jax,
)
from hybrid.model._device import torch_device
from hybrid.model._model import Model
from hybrid.model._state_dict import from_torchrec_state_dict

__all__ = [
    "BridgeStats",
    "Model",
    "as_kjt",
    "bridge_stats",
    "from_torchrec_state_dict",
    "jax_to_torch",
    "torch_device",
    "torch_ids_to_jax",
    "torch_kjt",
    "torch_to_jax",
]
