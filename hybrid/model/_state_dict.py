"""The tables in `Model.state_dict()`: TorchRec's `embedding_bags.<table>.weight` keys.

`EmbeddingBagsState` is a parameter-free `nn.Module` registered as `model.embedding_bags`,
so torch's own `state_dict` / `load_state_dict` recursion reaches it and the keys are
exactly those of a TorchRec `EmbeddingBagCollection` held under the same attribute name.
Saving copies each table's full weights out of JAX into a torch tensor (the tables
themselves never cross: they are donated to every update). Loading copies the given
tensors into the tables (and, on a mesh, into their shards): pretrained weights go in with
`model.load_state_dict({"embedding_bags.<table>.weight": w, ...}, strict=False)`.

`from_torchrec_state_dict` renames a TorchRec model's keys (`torchrec.models.dlrm.DLRM`,
or `DLRMTrain` with its `model.` prefix) to these: its embedding bags to
`embedding_bags.<table>.weight`, everything else under `dense.`, which is where
`dense_torch.DLRM` / `DLRM_DCN` (TorchRec's parameter names) expect them.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from hybrid.model._sparse import SparseTables

__all__ = ["EmbeddingBagsState", "from_torchrec_state_dict"]

_TORCHREC_EBC = "sparse_arch.embedding_bag_collection.embedding_bags."


def from_torchrec_state_dict(state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A TorchRec DLRM's state dict with `hybrid.Model`'s keys (tensors are not copied).

    `sparse_arch.embedding_bag_collection.embedding_bags.<table>.weight` becomes
    `embedding_bags.<table>.weight`; every other key `k` becomes `dense.<k>`. A leading
    `model.` (TorchRec's `DLRMTrain` wrapper) is dropped first.
    """
    keys = list(state_dict)
    strip = "model." if keys and all(k.startswith("model.") for k in keys) else ""
    out = {}
    for key, value in state_dict.items():
        key = key[len(strip) :]
        if key.startswith(_TORCHREC_EBC):
            out["embedding_bags." + key[len(_TORCHREC_EBC) :]] = value
        elif key.startswith("sparse_arch."):
            raise ValueError(
                f"state dict key {strip + key!r}: only a TorchRec EmbeddingBagCollection under "
                f"{_TORCHREC_EBC!r} maps to hybrid.Model's tables"
            )
        else:
            out["dense." + key] = value
    return out


class EmbeddingBagsState(nn.Module):
    """State-dict view of the sparse tables: `<prefix><table>.weight` per table."""

    def __init__(self, tables: SparseTables):
        super().__init__()
        self._tables = tables
        self._shapes = {t.name: (t.num_embeddings, t.embedding_dim) for t in tables.module.tables}

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        for name, weight in self._tables.table_weights_torch().items():
            destination[f"{prefix}{name}.weight"] = weight

    def _load_from_state_dict(
        self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
    ):
        found = {}
        for name, shape in self._shapes.items():
            key = f"{prefix}{name}.weight"
            if key not in state_dict:
                if strict:
                    missing_keys.append(key)
                continue
            weight = state_dict[key]
            if tuple(weight.shape) != shape:
                error_msgs.append(
                    f"size mismatch for {key}: table {name!r} is [{shape[0]}, {shape[1]}] "
                    f"(num_embeddings, embedding_dim) but the checkpoint holds {list(weight.shape)}; "
                    "load weights of the same shape or change the table config"
                )
                continue
            if weight.dtype.is_complex or not weight.dtype.is_floating_point:
                error_msgs.append(
                    f"{key}: table weights must be floating point, got {weight.dtype}"
                )
                continue
            found[name] = weight
        if strict:
            for key in state_dict:
                if (
                    key.startswith(prefix)
                    and key[len(prefix) :].removesuffix(".weight") not in self._shapes
                ):
                    unexpected_keys.append(key)
        if found and not error_msgs:
            self._tables.load_table_weights(found)

    def extra_repr(self) -> str:
        return ", ".join(f"{name}: {list(shape)}" for name, shape in self._shapes.items())
