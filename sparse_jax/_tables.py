"""Parameters shared by the pooled and sequence collections: init and per-table weights.

A collection stacks tables of the same dim and dtype into one buffer (`TableLayout`);
params are `{group: [rows, dim]}`. These methods convert between that and per-table
`[num_embeddings, embedding_dim]` weights (TorchRec's per-table view).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from sparse_jax import _lookup
from sparse_jax._layout import TableLayout
from sparse_jax._module import LayoutFacts, StoredBlock
from sparse_jax._prepare import host_kjt

__all__ = ["TableCollection"]


class TableCollection(LayoutFacts):
    """The unsharded half of the `SparseModule` contract that both collections share."""

    layout: TableLayout
    plan = None  # unsharded: no ShardingPlan
    mesh_axes = None

    def managed(self) -> None:
        """A plain collection manages no ids (`SparseModule.managed`)."""
        return None

    def check_structure(self, kjt) -> None:
        """The KJT's keys and id dtype fit this collection (no id is read); collections add
        their checks."""
        self.layout.key_indices(kjt.keys())
        if kjt.variable_stride_per_key() and self.expands_variable_stride:
            raise ValueError(
                f"{type(self).__name__}: a variable-batch KJT is expanded by prepare(); pass it to "
                "prepare() or apply() outside jit, or call expand_to_batch() first"
            )
        values = kjt.values()
        if values.ndim != 1 or not jnp.issubdtype(values.dtype, jnp.integer):
            raise ValueError(
                f"{type(self).__name__}: the KeyedJaggedTensor's values must be integer ids of shape [N], got "
                f"{values.dtype} {tuple(values.shape)}; a KJT of floats or [N, D] rows is not a lookup batch"
            )

    # pooled collections expand a variable-batch KJT to the batch by its inverse indices
    # before the lookup (the pooled rows TorchRec's expanded output holds); sequence
    # collections keep each feature's own bags
    expands_variable_stride = True

    def check_host(self, kjt):
        """The batch on the host, its structure and (with bounds_check="error") its ids checked."""
        host = host_kjt(kjt)
        if self.expands_variable_stride:
            host = host.expand_to_batch()
        self.check_structure(host)
        if self.bounds_check == "error":
            _lookup.check_ids(host, self.layout)
        return host

    def stored_blocks(self):
        """Each table whole, at its offset in its group's stacked buffer."""
        for t in self.layout.tables:
            group, offset = self.layout.table_group[t.name]
            yield StoredBlock(group, t.name, offset, 0, t.num_embeddings, 0, t.embedding_dim)

    def init(self, key: jax.Array) -> dict[str, jax.Array]:
        """Per table its `init_fn`, else uniform(weight_init_min, weight_init_max), with
        `fold_in(key, table index)`; stacked per group in the table's dtype (fresh buffers)."""
        parts: dict[str, list] = {g: [] for g in self.layout.groups}
        for i, t in enumerate(self.layout.tables):
            g, _ = self.layout.table_group[t.name]
            parts[g].append(
                t.initial_weights(jax.random.fold_in(key, i)).astype(t.data_type.numpy_dtype)
            )
        return {g: jnp.array(jnp.concatenate(ws), copy=True) for g, ws in parts.items()}

    def reset_parameters(self, key: jax.Array) -> dict[str, jax.Array]:
        """Fresh parameters (TorchRec's `reset_parameters`; functional: returns them)."""
        return self.init(key)

    def table_weights(self, params) -> dict[str, jax.Array]:
        """{table name: [num_embeddings, dim]} views of the stacked buffers (copies)."""
        out = {}
        for t in self.layout.tables:
            g, off = self.layout.table_group[t.name]
            out[t.name] = params[g][off : off + t.num_embeddings]
        return out

    def with_table_weights(self, params, weights: dict) -> dict[str, jax.Array]:
        """New params with the named tables replaced (e.g. pretrained weights)."""
        by_name = {t.name: t for t in self.layout.tables}
        params = dict(params)
        for name, w in weights.items():
            if name not in by_name:
                raise ValueError(
                    f"with_table_weights: no table named {name!r} (tables: {list(by_name)})"
                )
            t = by_name[name]
            w = jnp.asarray(w)
            if w.shape != (t.num_embeddings, t.embedding_dim):
                raise ValueError(
                    f"with_table_weights: table {name!r} is [{t.num_embeddings}, {t.embedding_dim}], "
                    f"got weights of shape {w.shape}"
                )
            g, off = self.layout.table_group[name]
            params[g] = params[g].at[off : off + t.num_embeddings].set(w.astype(params[g].dtype))
        return params
