"""The managed modules' compiled programs (issue 34, item 3): identical modules share them,
a training run over batches of several sizes compiles the heavy remap once per id capacity,
and dropped models leave no programs (memory mappings, RSS) behind.

Compiles are counted from JAX's own backend-compile events (`jax.monitoring`), by the name of
the jitted function, so the counts do not depend on how a module keeps its programs."""

import contextlib
import json
import os
import subprocess
import sys
import weakref

import jax
import numpy as np
import pytest

from sparse_jax import (
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    KeyedJaggedTensor,
    ManagedCollisionEmbeddingBagCollection,
    ManagedCollisionSparseModule,
    MCHManagedCollisionModule,
    RawIds,
)
from sparse_jax.managed._programs import Program, ProgramCache
from sparse_jax.optim import rowwise_adagrad
from sparse_jax.sharding import ShardedManagedCollisionModule, shard

ITEMS, DIM = 12, 4
_BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"


@contextlib.contextmanager
def _compiles():
    """The names of the programs XLA compiles inside the block (a list, filled as they do)."""
    names: list[str] = []

    def listen(event, duration, **kwargs):  # noqa: ARG001
        if event == _BACKEND_COMPILE:
            names.append(str(kwargs.get("fun_name", "")))

    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        yield names
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)


def _remap(name: str) -> bool:
    """Whether a compiled program is a managed remap (before issue 34 the sharded ones were
    `train` and `evaluate`)."""
    return "remap" in name or "scatter" in name or name in ("jit(train)", "jit(evaluate)")


def _tables(z):
    return [
        EmbeddingBagConfig(
            name="users", num_embeddings=z, embedding_dim=DIM, feature_names=["user"]
        ),
        EmbeddingBagConfig(
            name="items", num_embeddings=ITEMS, embedding_dim=DIM, feature_names=["item"]
        ),
    ]


def _unsharded(z):
    ebc = EmbeddingBagCollection(_tables(z))
    return ManagedCollisionSparseModule(
        ManagedCollisionEmbeddingBagCollection(
            ebc, {"users": MCHManagedCollisionModule(z, history_capacity=256)}
        )
    )


def _sharded(z):
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("model",))
    sharded = shard(
        EmbeddingBagCollection(_tables(z)), mesh, {"users": "row_wise", "items": "table_wise"}
    )
    return ShardedManagedCollisionModule(
        sharded, {"users": MCHManagedCollisionModule(z, history_capacity=256)}
    )


def _train(module, shapes, seed=0):
    """Training remaps (and one eval remap each) over batches of `shapes`: (users per
    sample, items per sample) for a batch of 8 samples."""
    rule = rowwise_adagrad(lr=0.1)
    params = module.init(jax.random.key(1))
    opt = rule.init(params)
    rng = np.random.default_rng(seed)
    pool = rng.integers(-(2**62), 2**62, size=50)
    for users, items in shapes:
        u = pool[rng.integers(0, 50, 8 * users)]
        i = rng.integers(0, ITEMS, 8 * items)
        lengths = np.array([users] * 8 + [items] * 8, np.int32)
        kjt = KeyedJaggedTensor(
            ["user", "item"], RawIds.from_int64(np.concatenate([u, i])).words(), lengths=lengths
        )
        batch = module.prepare(kjt)
        params, opt, _ = module.remap(params, opt, batch)
        module.remap_eval(batch)
    jax.block_until_ready(params)
    return module


@pytest.mark.parametrize("build", [_unsharded, _sharded], ids=["unsharded", "sharded"])
def test_an_identical_model_compiles_no_remap_program_of_its_own(build):
    z = {"_unsharded": 20, "_sharded": 22}[
        build.__name__
    ]  # sizes no other test uses: its own programs
    shapes = [(1, 1), (1, 3), (2, 1)]
    with _compiles() as first:
        _train(build(z), shapes)
    assert any(_remap(name) for name in first), first
    with _compiles() as second:
        again = _train(build(z), shapes, seed=1)
    assert [n for n in second if _remap(n)] == []
    assert again.remap_compile_count() >= 2  # the shared programs, counted


def test_a_training_run_over_batches_of_several_sizes_compiles_the_remap_once_per_id_capacity():
    # the items' lengths move the collection's own capacity (the batch's values) over
    # several sizes; the users' ids fill two id capacities (8 then 16 positions): the heavy
    # remap (profile, map, reset) compiles once for each, however the rest of the batch moves
    shapes = [(1, 1), (1, 1), (1, 4), (1, 16), (1, 2), (2, 1), (2, 9), (1, 30), (2, 2)]
    with _compiles() as names:
        module = _train(_unsharded(24), shapes)
    heavy = [
        n for n in names if "remap_train" in n
    ]  # the unsharded program's name, before and after
    assert len(heavy) == 2, names
    # one eval program per id capacity; one small scatter per length of the batch's values
    assert len([n for n in names if "remap_eval" in n]) == 2, names
    assert module.remap_compile_count() == len([n for n in names if _remap(n)])


def test_a_program_lives_while_a_module_holds_it_or_it_is_recent():
    built = []

    def build(spec):
        built.append(spec)
        return Program()

    cache = ProgramCache(build, keep=1)
    held = cache.get("a")
    assert cache.get("a") is held and built == ["a"]
    gone = weakref.ref(cache.get("b"))  # the recent one: kept
    assert gone() is not None and len(cache) == 2
    cache.get("a")  # "b" leaves the recent ones and nothing holds it
    assert gone() is None and len(cache) == 1
    del held
    cache.clear()
    assert len(cache) == 0


@pytest.mark.slow
def test_dropped_managed_models_leave_no_programs_behind():
    """30 `hybrid.Model`s with a managed table built, trained, evaluated and dropped one after
    another (tests/managed_churn.py, in a fresh process): the memory mappings and RSS stay
    flat. Measured (2-core CPU): each dropped model used to keep its remap programs, ~1,200
    mappings and ~30 MiB; now ~31 mappings and ~2.7 MiB for each of the first 16 (hybrid's
    cache of the 16 latest fused updates holds their modules), flat after (within 1 mapping and
    1 MiB). Bounds: under 1,000 mappings and 120 MiB over the 30, flat over the last 10."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    done = subprocess.run(
        [sys.executable, "-m", "tests.managed_churn", "30"],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads(done.stdout.strip().splitlines()[-1])
    maps = [r["maps"] for r in rows]
    rss = [r["rss_mib"] for r in rows]
    assert maps[-1] - maps[0] < 1000, maps
    assert rss[-1] - rss[0] < 120, rss
    assert max(maps[-10:]) - min(maps[-10:]) < 50, maps
    assert max(rss[-10:]) - min(rss[-10:]) < 16, rss
