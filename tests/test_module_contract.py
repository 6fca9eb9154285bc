"""The sparse-module contract (`sparse_jax.SparseModule`): every module implements it, its
stored blocks tile every table, and `hybrid` reaches into nothing private of `sparse_jax`."""

from __future__ import annotations

import ast
import pathlib

import jax
import numpy as np
import pytest

from sparse_jax import (
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    EmbeddingCollection,
    EmbeddingConfig,
    KeyedJaggedTensor,
    PreparedBatch,
    SparseModule,
)
from sparse_jax.sharding import shard

ROOT = pathlib.Path(__file__).resolve().parent.parent
TYPES = ["data_parallel", "table_wise", "row_wise", "column_wise", "table_row_wise", "table_column_wise", "grid_shard"]


def _bag_tables():
    return [
        EmbeddingBagConfig(name="t0", num_embeddings=37, embedding_dim=8, feature_names=["a"]),
        EmbeddingBagConfig(name="t1", num_embeddings=50, embedding_dim=8, feature_names=["b"]),
    ]


def _mesh():
    return jax.make_mesh((2, 4), ("data", "model"))


def _modules():
    ebc = EmbeddingBagCollection(_bag_tables())
    ec = EmbeddingCollection([EmbeddingConfig(name="s", num_embeddings=30, embedding_dim=4, feature_names=["a"])])
    return {
        "ebc": ebc,
        "ec": ec,
        "sharded_ebc": shard(ebc, _mesh(), {"t0": "row_wise", "t1": "table_wise"}),
        "sharded_ec": shard(ec, _mesh(), {"s": "row_wise"}),
    }


@pytest.mark.parametrize("name", ["ebc", "ec", "sharded_ebc", "sharded_ec"])
def test_every_sparse_module_implements_the_contract_and_prepares_once(name):
    module = _modules()[name]
    assert isinstance(module, SparseModule)
    kjt = KeyedJaggedTensor(["a", "b"], np.arange(16) % 30, lengths=np.array([2, 0, 1, 1] * 4))
    if name.endswith("ec"):
        kjt = KeyedJaggedTensor(["a"], np.array([1, 2, 3, 4]), lengths=np.array([2, 0, 1, 1, 0, 0, 0, 0]))
    params = module.init(jax.random.key(0))
    before = module.prepare_count
    batch = module.prepare(kjt)
    assert isinstance(batch, PreparedBatch) and batch.stride == kjt.stride()
    module.apply(params, batch)
    assert module.prepare_count == before + 1  # apply used the prepared batch as it is
    module.apply(params, kjt)
    assert module.prepare_count == before + 2  # a raw KJT is prepared by apply


@pytest.mark.parametrize("kind", TYPES)
def test_stored_blocks_tile_every_table_exactly_once(kind):
    tables = _bag_tables()
    sharded = shard(EmbeddingBagCollection(tables), _mesh(), {t.name: kind for t in tables})
    params = sharded.init(jax.random.key(0))
    weights = {k: np.asarray(v) for k, v in EmbeddingBagCollection(tables).table_weights(
        EmbeddingBagCollection(tables).init(jax.random.key(0))).items()}
    cover = {t.name: np.zeros((t.num_embeddings, t.embedding_dim), int) for t in tables}
    for block in sharded.stored_blocks():
        cover[block.table][block.row_offset : block.row_offset + block.num_rows,
                           block.col_offset : block.col_offset + block.num_cols] += 1
        stored = np.asarray(params[block.buffer])[block.buffer_row : block.buffer_row + block.num_rows, : block.num_cols]
        want = weights[block.table][block.row_offset : block.row_offset + block.num_rows,
                                    block.col_offset : block.col_offset + block.num_cols]
        np.testing.assert_array_equal(stored, want)  # the block holds what it says it holds
    for name, c in cover.items():
        assert (c == 1).all(), f"table {name}: rows/columns covered {np.unique(c)} times under {kind}"


def _private_names_defined_in(package: pathlib.Path) -> set[str]:
    names = set()
    for path in package.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.ClassDef):
                names.add(node.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                names.add(node.attr)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
            elif isinstance(node, ast.Call) and "setattr" in ast.unparse(node.func) and len(node.args) > 1:
                if isinstance(node.args[1], ast.Constant):  # set through setattr / object.__setattr__
                    names.add(node.args[1].value)
    return {n for n in names if n.startswith("_")}


def test_hybrid_uses_no_private_part_of_sparse_jax():
    """No `sparse_jax._module` import, and every `x._name` hybrid reads is a name hybrid
    itself defines (so none of sparse_jax's private attributes, e.g. `_apply_jit`)."""
    hybrid = ROOT / "hybrid"
    own = _private_names_defined_in(hybrid) | {"_value"}
    bad = []
    for path in hybrid.rglob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("sparse_jax"):
                parts = node.module.split(".") + [a.name for a in node.names]
                if any(p.startswith("_") for p in parts):
                    bad.append(f"{path.name}:{node.lineno} imports {node.module}.{[a.name for a in node.names]}")
            if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
                if node.attr not in own and not (isinstance(node.value, ast.Name) and node.value.id in {"torch", "jax", "os", "sys", "np"}):
                    bad.append(f"{path.name}:{node.lineno} reads .{node.attr}")
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "hasattr":
                bad.append(f"{path.name}:{node.lineno} probes with hasattr")
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr":
                name = node.args[1].value if len(node.args) > 1 and isinstance(node.args[1], ast.Constant) else ""
                if str(name).startswith("_") and not str(name).startswith("__") and name not in own:
                    bad.append(f"{path.name}:{node.lineno} reads {name} through getattr")
    assert bad == [], "\n".join(bad)
