"""`hybrid.quantize`: a trained `hybrid.Model` as an inference model with quantized tables.

    qmodel = hybrid.quantize(model, "int8")        # or "int4", "int2", "fp16"
    logits = qmodel(dense_features, sparse)         # the call `model` answers in eval
    train.evaluate(qmodel, data, batch_size)        # works as for `model`

The tables become a `sparse_jax.QuantEmbeddingBagCollection` on one JAX device (a
mesh-sharded model's tables are assembled on the host first); the dense tower is a frozen
copy of `model.dense` in eval mode, so the float model is left as it was and can go on
training. The quantized model never trains: a forward in training mode with grad enabled
(e.g. `hybrid.TrainPipeline`) raises, and its dense parameters do not require grad.

A model with managed-collision tables is quantized with its id maps frozen (as
`hybrid.export` freezes them): the quantized model takes raw ids, maps each through its
table's frozen map on the host (an id not resident reads its shard's default row), and
exports with the maps.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator, Mapping

import jax
import numpy as np
import torch
from torch import nn

import dense_torch
from hybrid.model import Model
from hybrid.model._batch import as_host_kjt
from hybrid.model._bridge import jax_to_torch
from hybrid.serving._id_map import frozen_rows
from sparse_jax import (
    FrozenIdMap,
    KeyedJaggedTensor,
    ManagedCollisionCollection,
    PreparedBatch,
    QuantEmbeddingBagCollection,
    split_managed,
)

__all__ = ["QuantizedModel", "quantize"]


class QuantizedModel(nn.Module):
    """A `hybrid.Model` for inference: quantized tables in JAX, the frozen dense tower in torch.

    Built by `hybrid.quantize`. `forward(dense_features, sparse)` takes what `Model.forward`
    takes (any sparse form `hybrid.as_kjt` reads, or `qmodel.prepare(sparse)`'s result) and
    returns the dense tower's logits. `train()` only records the mode (so code that toggles
    `train()`/`eval()` around an evaluation works); the dense tower stays in eval mode, and a
    forward in training mode with grad enabled raises.

    Attributes: `sparse_module` (the `QuantEmbeddingBagCollection`: `packed_tables`,
    `table_bytes()`, `nbytes`), `dense` (the dense tower's copy), `id_maps` ({managed table:
    `sparse_jax.FrozenIdMap`}, empty without managed tables).
    """

    def __init__(
        self,
        sparse_module: QuantEmbeddingBagCollection,
        dense: nn.Module,
        managed: ManagedCollisionCollection | None = None,
        id_maps: Mapping[str, FrozenIdMap] | None = None,
    ):
        super().__init__()
        if (managed is None) != (not id_maps) or (
            managed is not None and set(id_maps) != set(managed.modules)
        ):
            raise ValueError(
                "QuantizedModel: give the managed-collision collection and one frozen id map per managed "
                "table together (hybrid.quantize does)"
            )
        self.sparse_module = sparse_module
        self.dense = dense.eval().requires_grad_(False)
        self.training = False
        self._managed, self.id_maps = managed, dict(id_maps or {})

    def train(self, mode: bool = True) -> QuantizedModel:
        """Record the mode only: the dense tower stays in eval mode (inference only)."""
        self.training = bool(mode)
        return self

    def dense_parameters(self) -> Iterator[nn.Parameter]:
        """The dense tower's parameters (frozen: they do not require grad)."""
        return self.dense.parameters()

    def prepare(self, sparse) -> PreparedBatch:
        """The sparse batch checked (ids against their tables), padded to the capacity ladder
        and placed on the tables' device, once."""
        if isinstance(sparse, PreparedBatch):
            return sparse
        kjt = as_host_kjt(sparse)
        if self._managed is not None:
            kjt = self._rows_of_raw_ids(kjt)
        return self.sparse_module.prepare(kjt)

    def _rows_of_raw_ids(self, kjt):
        """The batch with every managed feature's raw ids replaced by their frozen rows (the
        raw-id checks of training: reserved ids, unmanaged ids that do not fit int32)."""
        split = split_managed(kjt, self._managed)
        ids, values = split.ids, np.asarray(split.ids.values(), np.int64)
        for table, id_map in self.id_maps.items():
            values[split.positions(table)] = frozen_rows(id_map, split.raw_of(table))
        return KeyedJaggedTensor(
            ids.keys(),
            values.astype(np.int32),
            weights=ids.weights_or_none(),
            lengths=ids.lengths(),
            stride=ids.stride(),
        )

    def forward(self, dense_features: torch.Tensor, sparse) -> torch.Tensor:
        """`dense(dense_features, pooled embeddings of the quantized tables)`."""
        if self.training and torch.is_grad_enabled():
            raise RuntimeError(
                "hybrid.quantize made an inference-only model: its tables are quantized and nothing in "
                "it trains. Call qmodel.eval() (or run under torch.no_grad()) to predict; to train, "
                "train the float hybrid.Model and quantize it again"
            )
        pooled = self.sparse_module.apply(self.prepare(sparse))
        embeddings = dense_torch.KeyedTensor(
            pooled.keys(), pooled.length_per_key(), jax_to_torch(pooled.values())
        )
        return self.dense(dense_features, embeddings)

    def extra_repr(self) -> str:
        return repr(self.sparse_module)


def quantize(
    model: Model,
    weight_type: str = "int8",
    *,
    per_table_weight_type: Mapping[str, str] | None = None,
    row_alignment: int = 1,
    device: jax.Device | None = None,
) -> QuantizedModel:
    """An inference copy of a trained `hybrid.Model` with row-wise quantized tables.

    weight_type: "int8" (default), "int4", "int2" or "fp16" (FBGEMM's row-wise formats: fp16
      scale and bias per row; int4 needs even dims, int2 dims divisible by 4);
      `per_table_weight_type` ({table: type}) overrides it per table.
    row_alignment: bytes each packed row is padded to (1, or 16 for TorchRec's layout).
    device: the JAX device holding the quantized tables (default: this process's first
      local device, whose torch twin is `hybrid.torch_device()`).

    `model` is not changed: its tables are read (`table_weights`, gathered from a mesh) and
    its dense tower is copied. Batches are padded to `model.capacity_ladder`."""
    if not isinstance(model, Model):
        raise TypeError(f"hybrid.quantize takes a trained hybrid.Model, got {type(model).__name__}")
    managed = model.sparse_module.managed()
    sparse = QuantEmbeddingBagCollection.from_float(
        model.sparse_module,
        model.sparse_params,
        weight_type,
        per_table_weight_type=per_table_weight_type,
        row_alignment=row_alignment,
        ladder=model.capacity_ladder,
        device=device if device is not None else jax.local_devices()[0],
    )
    if managed is None:
        return QuantizedModel(sparse, copy.deepcopy(model.dense))
    return QuantizedModel(sparse, copy.deepcopy(model.dense), managed.mc, managed.frozen_maps())
