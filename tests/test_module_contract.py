"""The sparse-module contract (`sparse_jax.SparseModule`, `sparse_jax.ManagedSparseModule`):
every module implements it, `managed()` tells a managed module from a plain one, its stored
blocks tile every table, and `hybrid` reaches into nothing private of `sparse_jax`, asks no
module its type, and reads of a managed module only what the contract declares."""

from __future__ import annotations

import ast
import dataclasses
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
    ManagedCollisionEmbeddingBagCollection,
    ManagedCollisionEmbeddingCollection,
    ManagedCollisionSparseModule,
    ManagedSparseModule,
    MCHManagedCollisionModule,
    PreparedBatch,
    RawIds,
    SparseModule,
)
from sparse_jax.optim import sgd
from sparse_jax.sharding import ShardedManagedCollisionModule, shard

ROOT = pathlib.Path(__file__).resolve().parent.parent
TYPES = [
    "data_parallel",
    "table_wise",
    "row_wise",
    "column_wise",
    "table_row_wise",
    "table_column_wise",
    "grid_shard",
]


def _bag_tables():
    return [
        EmbeddingBagConfig(name="t0", num_embeddings=37, embedding_dim=8, feature_names=["a"]),
        EmbeddingBagConfig(name="t1", num_embeddings=50, embedding_dim=8, feature_names=["b"]),
    ]


def _mesh():
    return jax.make_mesh((2, 4), ("data", "model"))


PLAIN = ["ebc", "ec", "sharded_ebc", "sharded_ec"]
MANAGED = ["managed_ebc", "managed_ec", "sharded_managed_ebc", "sharded_managed_ec"]


def _mch(table, rows):
    return {table: MCHManagedCollisionModule(rows, history_capacity=64)}


def _modules(name):
    ebc = EmbeddingBagCollection(_bag_tables())
    ec = EmbeddingCollection(
        [EmbeddingConfig(name="s", num_embeddings=32, embedding_dim=4, feature_names=["a"])]
    )
    if name in MANAGED:  # t0 (80 rows: 10 a shard) and s (32) managed
        ebc = EmbeddingBagCollection(
            [dataclasses.replace(_bag_tables()[0], num_embeddings=80), _bag_tables()[1]]
        )
    build = {
        "ebc": lambda: ebc,
        "ec": lambda: ec,
        "sharded_ebc": lambda: shard(ebc, _mesh(), {"t0": "row_wise", "t1": "table_wise"}),
        "sharded_ec": lambda: shard(ec, _mesh(), {"s": "row_wise"}),
        "managed_ebc": lambda: ManagedCollisionSparseModule(
            ManagedCollisionEmbeddingBagCollection(ebc, _mch("t0", 80))
        ),
        "managed_ec": lambda: ManagedCollisionSparseModule(
            ManagedCollisionEmbeddingCollection(ec, _mch("s", 32))
        ),
        "sharded_managed_ebc": lambda: ShardedManagedCollisionModule(
            shard(ebc, _mesh(), {"t0": "row_wise", "t1": "table_wise"}), _mch("t0", 80)
        ),
        "sharded_managed_ec": lambda: ShardedManagedCollisionModule(
            shard(ec, _mesh(), {"s": "row_wise"}), _mch("s", 32)
        ),
    }
    return build[name]()


def _batch(name):
    if name.endswith("ec"):
        return KeyedJaggedTensor(
            ["a"], np.array([1, 2, 3, 4]), lengths=np.array([2, 0, 1, 1, 0, 0, 0, 0])
        )
    return KeyedJaggedTensor(["a", "b"], np.arange(16) % 30, lengths=np.array([2, 0, 1, 1] * 4))


@pytest.mark.parametrize("name", PLAIN + MANAGED)
def test_every_sparse_module_implements_the_contract_and_prepares_once(name):
    module = _modules(name)
    assert isinstance(module, SparseModule)
    kjt = _batch(name)
    params = module.init(jax.random.key(0))
    before = module.prepare_count
    batch = module.prepare(kjt)
    assert isinstance(batch, PreparedBatch) and batch.stride == kjt.stride()
    module.apply(params, batch)
    assert module.prepare_count == before + 1  # apply used the prepared batch as it is
    module.apply(params, kjt)
    assert module.prepare_count == before + 2  # a raw KJT is prepared by apply


@pytest.mark.parametrize("name", PLAIN + MANAGED)
def test_managed_says_which_modules_manage_ids_and_the_managed_ones_keep_the_managed_contract(name):
    module = _modules(name)
    if name in PLAIN:
        assert module.managed() is None
        assert not isinstance(module, ManagedSparseModule)
        return
    managed = module.managed()
    assert managed is module and isinstance(managed, ManagedSparseModule)
    params = module.init(jax.random.key(0))
    opt_state = sgd(lr=0.1).init(params)
    managed.place_maps(None)
    table = managed.managed_tables[0]
    assert (
        managed.managed_tables == [table]
        and set(managed.mc.modules) == {table}
        and set(managed.mc_state) == {table}
    )
    kjt = _batch(name)
    lengths = np.asarray(kjt.lengths())
    values = np.asarray(kjt.values()).astype(np.int64)
    values[:4] = [3, 2**40 + 5, 3, -7]  # feature "a" (the managed table's) takes raw 64-bit ids
    raw = set(values[: int(lengths[: kjt.stride()].sum())].tolist())
    batch = module.prepare(
        KeyedJaggedTensor(kjt.keys(), RawIds.from_int64(values).words(), lengths=lengths)
    )
    assert managed.needs_remap(batch)
    eval_rows = managed.remap_eval(batch)
    assert not managed.needs_remap(eval_rows)
    params, opt_state, rows = managed.remap(params, opt_state, batch)
    assert not managed.needs_remap(rows) and isinstance(rows, PreparedBatch)
    module.apply(params, rows)
    assert managed.remap_compile_count() >= 2
    counters = {t: np.asarray(c) for t, c in managed.stats().items()}
    assert list(counters) == [table] and counters[table][0] == len(
        raw
    )  # every distinct raw id holds a slot
    frozen = managed.frozen_maps()[table]
    assert frozen.ids.tolist() == sorted(raw)
    states, counts, key = managed.host_state()
    # LRU keeps the last access, not the counts: a map whose counts were kept (saved under
    # LFU, or before each policy kept only its own) loads with them zeroed
    assert (
        not np.asarray(states[table].counts).any() and np.asarray(states[table].last_access).any()
    )
    stale = states[table]._replace(counts=np.full_like(np.asarray(states[table].counts), 7))
    managed.load_mc_state({table: stale}, counts, jax.random.wrap_key_data(key))
    loaded = managed.host_state()[0][table]
    np.testing.assert_array_equal(
        RawIds(*(np.asarray(x) for x in states[table][:2])).to_int64(),
        RawIds(*(np.asarray(x) for x in loaded[:2])).to_int64(),
    )
    assert not np.asarray(loaded.counts).any()
    np.testing.assert_array_equal(np.asarray(loaded.last_access), np.asarray(stale.last_access))


@pytest.mark.parametrize("kind", TYPES)
def test_stored_blocks_tile_every_table_exactly_once(kind):
    tables = _bag_tables()
    sharded = shard(EmbeddingBagCollection(tables), _mesh(), {t.name: kind for t in tables})
    params = sharded.init(jax.random.key(0))
    weights = {
        k: np.asarray(v)
        for k, v in EmbeddingBagCollection(tables)
        .table_weights(EmbeddingBagCollection(tables).init(jax.random.key(0)))
        .items()
    }
    cover = {t.name: np.zeros((t.num_embeddings, t.embedding_dim), int) for t in tables}
    for block in sharded.stored_blocks():
        cover[block.table][
            block.row_offset : block.row_offset + block.num_rows,
            block.col_offset : block.col_offset + block.num_cols,
        ] += 1
        stored = np.asarray(params[block.buffer])[
            block.buffer_row : block.buffer_row + block.num_rows, : block.num_cols
        ]
        want = weights[block.table][
            block.row_offset : block.row_offset + block.num_rows,
            block.col_offset : block.col_offset + block.num_cols,
        ]
        np.testing.assert_array_equal(stored, want)  # the block holds what it says it holds
    for name, c in cover.items():
        assert (c == 1).all(), (
            f"table {name}: rows/columns covered {np.unique(c)} times under {kind}"
        )


def _private_names_defined_in(package: pathlib.Path) -> set[str]:
    names = set()
    for path in package.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                names.add(node.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                names.add(node.attr)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
            elif (
                isinstance(node, ast.Call)
                and "setattr" in ast.unparse(node.func)
                and len(node.args) > 1
            ):
                if isinstance(
                    node.args[1], ast.Constant
                ):  # set through setattr / object.__setattr__
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
                    bad.append(
                        f"{path.name}:{node.lineno} imports {node.module}.{[a.name for a in node.names]}"
                    )
            if (
                isinstance(node, ast.Attribute)
                and node.attr.startswith("_")
                and not node.attr.startswith("__")
            ):
                if node.attr not in own and not (
                    isinstance(node.value, ast.Name)
                    and node.value.id in {"torch", "jax", "os", "sys", "np"}
                ):
                    bad.append(f"{path.name}:{node.lineno} reads .{node.attr}")
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id == "hasattr"
            ):
                bad.append(f"{path.name}:{node.lineno} probes with hasattr")
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id == "getattr"
            ):
                name = (
                    node.args[1].value
                    if len(node.args) > 1 and isinstance(node.args[1], ast.Constant)
                    else ""
                )
                if str(name).startswith("_") and not str(name).startswith("__") and name not in own:
                    bad.append(f"{path.name}:{node.lineno} reads {name} through getattr")
    assert bad == [], "\n".join(bad)


def _hybrid_trees():
    for path in sorted((ROOT / "hybrid").rglob("*.py")):
        yield path, ast.parse(path.read_text())


def test_hybrid_asks_no_sparse_module_its_type():
    """Whether a module manages ids is `module.managed()`, not an `isinstance` of a module
    type (a collection, a sparse module, a managed module) that hybrid imports."""
    bad = []
    for path, tree in _hybrid_trees():
        imported = {
            a.asname or a.name
            for node in ast.walk(tree)
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("sparse_jax")
            for a in node.names
        }
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id == "isinstance"
            ):
                types = {n.id for n in ast.walk(node.args[1]) if isinstance(n, ast.Name)} & imported
                if any("Module" in t or "Collection" in t for t in types):
                    bad.append(f"{path.name}:{node.lineno} isinstance(..., {sorted(types)})")
    assert bad == [], "\n".join(bad)


def _declared(protocol) -> set[str]:
    names = set()
    for cls in protocol.__mro__:
        if cls.__module__ == protocol.__module__:
            names |= set(getattr(cls, "__annotations__", {})) | {
                n for n in vars(cls) if not n.startswith("_")
            }
    return names


def test_hybrid_reads_of_a_managed_module_only_what_the_contract_declares():
    """Every attribute hybrid reads on what `managed()` returned (directly, through a helper
    that returns it, or through an attribute named `managed`) is a member of
    `ManagedSparseModule`."""
    declared = _declared(ManagedSparseModule)
    assert {
        "remap",
        "remap_eval",
        "needs_remap",
        "stats",
        "frozen_maps",
        "host_state",
        "load_mc_state",
        "place_maps",
        "mc",
        "mc_state",
        "managed_tables",
        "prepare",
        "apply",
        "managed",
    } <= declared

    def gives_managed(value, getters):
        call = value.func if isinstance(value, ast.Call) else None
        return (
            (isinstance(value, ast.Attribute) and value.attr == "managed")
            or (isinstance(call, ast.Attribute) and call.attr == "managed")
            or (isinstance(call, ast.Name) and call.id in getters)
        )

    read, seen = [], 0
    for path, tree in _hybrid_trees():
        getters = {
            f.name
            for f in ast.walk(tree)
            if isinstance(f, ast.FunctionDef)
            for r in ast.walk(f)
            if isinstance(r, ast.Return) and r.value is not None and gives_managed(r.value, set())
        }
        for func in (f for f in ast.walk(tree) if isinstance(f, ast.FunctionDef)):
            names = {
                t.id
                for node in ast.walk(func)
                if isinstance(node, ast.Assign) and gives_managed(node.value, getters)
                for t in node.targets
                if isinstance(t, ast.Name)
            }
            for node in ast.walk(func):
                if isinstance(node, ast.Attribute) and (
                    (isinstance(node.value, ast.Name) and node.value.id in names)
                    or (isinstance(node.value, ast.Attribute) and node.value.attr == "managed")
                ):
                    seen += 1
                    if node.attr not in declared:
                        read.append(
                            f"{path.name}:{node.lineno} reads .{node.attr} of a managed module"
                        )
    assert seen > 10  # the scan finds hybrid's uses (remap, stats, frozen maps, checkpoints, ...)
    assert read == [], "\n".join(read)
