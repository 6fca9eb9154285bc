"""`hybrid.Model`: JAX embedding tables + a PyTorch dense tower, trained as one torch module.

    model = hybrid.Model(tables, dense_torch.DLRM(...), sparse_optimizer=rowwise_adagrad(lr=0.05))
    dense_opt = torch.optim.Adam(model.dense_parameters(), lr=1e-3)
    logits = model(dense_features, kjt)        # one training step:
    loss = bce(logits.squeeze(-1), labels)
    loss.backward()                            # dense grads + the fused sparse update
    dense_opt.step(); dense_opt.zero_grad()

Forward: the sparse batch (any form `hybrid.as_kjt` reads, or `model.prepare(sparse)`'s
result) is prepared once: ids checked on the host, padded to the capacity ladder (values to
a rung, bag lengths to length caps that only grow, so steady training reuses one
compiled program), split and placed; then looked up in JAX, handed to torch zero-copy, wrapped in a
`dense_torch.KeyedTensor` and passed to `dense(dense_features, embeddings)`.
Backward: the pooled gradient goes back to JAX and the fused sparse update runs once, on
the forward's prepared batch (see `_sparse`); a second backward through the same forward raises. In `eval()` mode or under `torch.no_grad()` the tables are never
updated (the pooled embeddings are then a plain tensor).

State dict (TorchRec naming): `embedding_bags.<table>.weight` holds each table's full
weights (a torch copy), like a TorchRec `EmbeddingBagCollection` under the attribute
`embedding_bags`; the dense tower's keys sit under `dense.` (e.g.
`dense.over_arch.model.1.bias`); `hybrid.from_torchrec_state_dict` renames a TorchRec
DLRM checkpoint to these keys. `load_state_dict` accepts the same keys; `strict=False` with
only `embedding_bags.*` keys loads pretrained tables. Optimizer state is not in the state dict (it is
`model.sparse_opt_state`, TorchRec keeps it in the fused optimizer too).

Devices: `model.to(device)` moves the dense tower only; the tables stay where JAX keeps
them (the default device, or the mesh). On GPU, give the dense tower and the batch the GPU
that JAX uses for this process, so the pooled embeddings cross zero-copy.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import jax
import torch
from torch import nn

import dense_torch
from hybrid.model._batch import as_host_kjt
from hybrid.model._sparse import SparseTables, build_sparse, mesh_device, sparse_lookup
from hybrid.model._state_dict import EmbeddingBagsState
from sparse_jax import (
    DEFAULT_LADDER,
    EmbeddingBagConfig,
    PreparedBatch,
)
from sparse_jax.optim import RowRule, SparseOptState, rowwise_adagrad

__all__ = ["Model"]

DEFAULT_SPARSE_OPTIMIZER = rowwise_adagrad(lr=0.01)  # one instance: models share its programs


class Model(nn.Module):
    """A recommender model: sparse tables in JAX, `dense` in torch.

    Args:
      tables: `sparse_jax.EmbeddingBagConfig`s (TorchRec's names and arguments; TorchRec's
        own `EmbeddingBagConfig`s are taken too, field by field).
      dense: a torch module keeping the dense contract,
        `dense(dense_features [B, n_dense], embeddings: dense_torch.KeyedTensor) -> logits`
        (e.g. `dense_torch.DLRM`); its parameters are the model's torch parameters.
      mesh: a `jax.sharding.Mesh` (`hybrid.make_mesh("data=2,model=4")`); None keeps every
        table on the default device. A one-device mesh puts the tables on that device.
      plan: a `sparse_jax.sharding.ShardingPlan` for the mesh (None: the planner's).
      sparse_optimizer: a `sparse_jax.optim` row rule, applied in backward
        (default `rowwise_adagrad(lr=0.01)`, TorchRec's usual choice).
      is_weighted: the batch carries per-id weights (TorchRec's weighted EBC).
      seed: initializes the tables (`jax.random.key(seed)`).
      capacity_ladder: sorted id capacities batches are padded to (default
        `sparse_jax.DEFAULT_LADDER`).
      input_dist: on a sharded mesh, how ids reach the tables' shards: "all_gather"
        (default) or "all_to_all" (see `sparse_jax.sharding.shard`).
      managed_collision_modules: `{table: sparse_jax.MCHManagedCollisionModule}`
        (TorchRec's name): those tables take raw 64-bit ids (int64 in a torch KJT, or
        `RawIds.words()` in a JAX one) and map them to their rows on the device, evicting by
        the module's policy; evicted rows restart from a fresh row and zero optimizer state.
        A training forward (the one whose backward updates the tables) advances the id
        maps, right before its lookup; eval only reads them. On a mesh, a row-wise table
        keeps one id map per shard (ids hashed to shards, as TorchRec), any other placement
        one replicated map (`sparse_jax.sharding.ShardedManagedCollisionModule`).
      bounds_check: ids outside their table: "error" (default; refused in `prepare`, naming
        the feature, sample and id), "clamp" into the table, or "skip" (they add nothing).
    """

    def __init__(
        self,
        tables: Sequence[EmbeddingBagConfig],
        dense: nn.Module,
        *,
        mesh: jax.sharding.Mesh | None = None,
        plan=None,
        sparse_optimizer: RowRule | None = None,
        is_weighted: bool = False,
        seed: int = 0,
        capacity_ladder: Sequence[int] | None = None,
        input_dist: str = "all_gather",
        managed_collision_modules=None,
        bounds_check: str = "error",
    ):
        super().__init__()
        if not isinstance(dense, nn.Module):
            raise TypeError(
                f"dense must be a torch.nn.Module (e.g. dense_torch.DLRM), got {type(dense).__name__}"
            )
        self.capacity_ladder = tuple(DEFAULT_LADDER if capacity_ladder is None else capacity_ladder)
        module = build_sparse(
            tables,
            is_weighted=is_weighted,
            mesh=mesh,
            plan=plan,
            ladder=self.capacity_ladder,
            input_dist=input_dist,
            managed_collision_modules=managed_collision_modules,
            bounds_check=bounds_check,
        )
        rule = DEFAULT_SPARSE_OPTIMIZER if sparse_optimizer is None else sparse_optimizer
        self._tables = SparseTables(module, rule, jax.random.key(seed), device=mesh_device(mesh))
        self.mesh, self.plan = mesh, plan
        self.embedding_bags = EmbeddingBagsState(self._tables)  # first in state_dict, as TorchRec
        self.dense = dense

    # -- the sparse side -----------------------------------------------------------------------
    @property
    def sparse_module(self):
        """The functional sparse module (an `EmbeddingBagCollection`, or its sharded form)."""
        return self._tables.module

    @property
    def sparse_params(self) -> dict[str, jax.Array]:
        """The tables' stacked buffers. Donated to every update: do not keep them across a step."""
        return self._tables.params

    @property
    def sparse_opt_state(self) -> SparseOptState:
        """The sparse optimizer state. Donated to every update: do not keep it across a step."""
        return self._tables.opt_state

    def load_sparse_opt_state(self, state: SparseOptState) -> None:
        """Replace the sparse optimizer state (same structure and shapes as `sparse_opt_state`;
        values on the host are placed on the tables' devices, sharded like them)."""
        self._tables.load_opt_state(state)

    def load_sparse_buffers(self, params: dict[str, jax.Array], state: SparseOptState) -> None:
        """Replace the tables' stacked buffers and the sparse optimizer state with device
        arrays laid out exactly as `sparse_params` / `sparse_opt_state` (e.g. a checkpoint
        restored shard by shard on every process); nothing is read on the host."""
        self._tables.load_buffers(params, state)

    @property
    def sparse_optimizer(self) -> RowRule:
        return self._tables.rule

    def table_weights(self) -> dict[str, torch.Tensor]:
        """{table: [num_embeddings, dim]} full weights as torch tensors (copies)."""
        return self._tables.table_weights_torch()

    def guard_update(self, ok: torch.Tensor) -> None:
        """Make the sparse update of the last training forward depend on the device boolean
        `ok` (e.g. `torch.isfinite(loss)`): when it is false the tables are left as they
        were. Nothing is read on the host. (A non-finite pooled gradient is always skipped.)"""
        step = self._tables.pending
        if step is None:
            raise RuntimeError("guard_update: no training forward is waiting for its backward")
        step.ok = ok

    def sparse_nonfinite(self):
        """(sparse updates skipped as non-finite, index of the first or -1), as JAX device
        scalars: read them when you log, not every step."""
        return self._tables.nonfinite()

    def wait_for_sparse_update(self) -> None:
        """Block until every sparse update dispatched so far has finished (the update runs
        asynchronously after `loss.backward()`). Reads no value; a timer or a torch
        collective that must not overlap JAX's work calls this first."""
        jax.block_until_ready((self._tables.params, self._tables.opt_state))

    def order_after_sparse_update(self) -> torch.Tensor:
        """A torch view of the sparse optimizer's step counter on this process's device,
        defined only once every sparse update dispatched so far has finished. Taking it
        orders the torch work queued after it (a dense all-reduce) after JAX's update on the
        device: on a GPU, DLPack makes torch's current stream wait for the update's event,
        with no host wait; on CPU (no streams) it waits for the update, as
        `wait_for_sparse_update`."""
        count = self._tables.opt_state.count
        if jax.default_backend() == "cpu":
            jax.block_until_ready((self._tables.params, self._tables.opt_state))
        local = count.addressable_shards[0].data if len(count.sharding.device_set) > 1 else count
        return torch.utils.dlpack.from_dlpack(local)

    def managed_collision_stats(self) -> dict[str, jax.Array]:
        """{managed table: int32[3] device array (slots in use, ids admitted so far, resident
        ids evicted so far)}; empty without managed tables. Read them when you log."""
        managed = self._tables.managed
        return managed.stats() if managed is not None else {}

    def compile_counts(self) -> dict[str, int]:
        """Programs the sparse lookup and update have compiled (steady training: constant)."""
        return self._tables.compile_counts()

    def dense_parameters(self) -> Iterator[nn.Parameter]:
        """The dense tower's parameters, for any torch optimizer (the tables have none)."""
        return self.dense.parameters()

    # -- forward ---------------------------------------------------------------------------
    def prepare(self, sparse) -> PreparedBatch:
        """The sparse batch validated (ids against their tables, on the host), padded to the
        capacity ladder (length caps never shrink), split per device and placed on the
        tables' devices: once per batch. `model(dense, prepared)` and the update that its
        backward runs use it as it is. `hybrid.TrainPipeline` calls this for batch i+1
        while step i computes."""
        if isinstance(sparse, PreparedBatch):
            return sparse
        return self._tables.prepare(as_host_kjt(sparse))

    def forward(self, dense_features: torch.Tensor, sparse) -> torch.Tensor:
        """`dense(dense_features, pooled embeddings)`; `sparse` is any form in the class
        docstring (prepared here, once) or `model.prepare(sparse)`'s result."""
        pooled = sparse_lookup(self._tables, self.prepare(sparse), train=self.training)
        module = self._tables.module
        embeddings = dense_torch.KeyedTensor(module.feature_names, module.output_dims, pooled)
        return self.dense(dense_features, embeddings)
