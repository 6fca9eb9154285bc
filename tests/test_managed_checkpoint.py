"""Managed-collision id maps in checkpoints: a run resumed from a checkpoint remaps,
evicts and resets exactly as the uninterrupted run (tables, id maps, counters, draws)."""

import re

import numpy as np
import pytest
import torch

import dense_torch
import hybrid
from hybrid import checkpoint
from hybrid.checkpoint import _arrays
from sparse_jax import EmbeddingBagConfig, MCHManagedCollisionModule, MCHState

Z = 6


def _model(modules=None, seed=0):
    torch.manual_seed(seed)
    tables = [
        EmbeddingBagConfig(name="users", num_embeddings=Z, embedding_dim=4, feature_names=["user"]),
        EmbeddingBagConfig(name="items", num_embeddings=8, embedding_dim=4, feature_names=["item"]),
    ]
    if modules is None:
        modules = {
            "users": MCHManagedCollisionModule(
                Z, history_capacity=64, eviction_policy="lru", eviction_interval=2
            )
        }
    model = hybrid.Model(
        tables,
        dense_torch.DLRM(4, 2, 3, [4, 4], [4, 1]),
        managed_collision_modules=modules,
        seed=seed,
    )
    return model, torch.optim.SGD(model.dense_parameters(), lr=0.1)


def _batches(steps, seed=0):
    rng = np.random.default_rng(seed)
    pool = rng.integers(-(2**62), 2**62, size=14)
    out = []
    for _ in range(steps):
        users = [pool[rng.integers(0, 14, rng.integers(0, 3))] for _ in range(4)]
        lengths = torch.tensor([len(u) for u in users] + [1] * 4, dtype=torch.int32)
        values = torch.cat(
            [
                torch.as_tensor(np.concatenate(users).astype(np.int64)),
                torch.from_numpy(rng.integers(0, 8, 4)),
            ]
        )
        out.append(
            (
                torch.from_numpy(rng.normal(size=(4, 3)).astype(np.float32)),
                (["user", "item"], values, lengths),
                torch.from_numpy(rng.integers(0, 2, 4).astype(np.float32)),
            )
        )
    return out


def _train(model, opt, batches):
    for dense, sparse, labels in batches:
        loss = torch.nn.functional.binary_cross_entropy_with_logits(
            model(dense, sparse).squeeze(-1), labels
        )
        loss.backward()
        opt.step()
        opt.zero_grad()


def _snapshot(model):
    arrays = checkpoint.sparse_state_arrays(model)
    return {k: v for k, v in arrays.items() if k != "mc_key"}, arrays["mc_key"]


def test_a_resumed_run_remaps_evicts_and_resets_as_the_uninterrupted_one(tmp_path):
    batches = _batches(24)
    model, opt = _model()
    _train(model, opt, batches[:9])  # mid-window: interval 2
    path = checkpoint.save_checkpoint(tmp_path, step=9, model=model, dense_optimizer=opt)
    saved = checkpoint.sparse_state_arrays(model)
    assert saved["mc/users/window_used"] > 0  # saved mid-window: the next eviction needs those ids
    assert {k for k in saved if k.startswith("mc/")} == {
        f"mc/users/{f}" for f in (*MCHState._fields, "counters")
    }
    _train(model, opt, batches[9:])
    want, want_key = _snapshot(model)
    assert (
        want["mc/users/counters"][2] > saved["mc/users/counters"][2]
    )  # evictions after the checkpoint

    resumed, ropt = _model(
        seed=7
    )  # other tables, other draw key, empty id maps: all replaced by the load
    checkpoint.load_checkpoint(path, model=resumed, dense_optimizer=ropt)
    for key, value in saved.items():
        np.testing.assert_array_equal(
            checkpoint.sparse_state_arrays(resumed)[key], value, err_msg=key
        )
    _train(resumed, ropt, batches[9:])
    got, got_key = _snapshot(resumed)
    assert sorted(got) == sorted(want)
    for key, value in want.items():
        np.testing.assert_array_equal(got[key], value, err_msg=key)
    np.testing.assert_array_equal(got_key, want_key)


def test_the_orbax_format_carries_the_id_maps_and_resumes_alike(tmp_path):
    """The "orbax" format (hybrid/checkpoint/_sharded.py): the id maps, counters and draw key
    saved asynchronously beside the rows, restored shard by shard (the same layout)."""
    pytest.importorskip("orbax.checkpoint")
    batches = _batches(24)
    model, opt = _model()
    _train(model, opt, batches[:9])
    saver = checkpoint.AsyncCheckpointer()
    path = saver.save(
        tmp_path, step=9, model=model, dense_optimizer=opt, meta={}, run_id="run-orbax"
    )
    saved = checkpoint.sparse_state_arrays(model)
    _train(model, opt, batches[9:])  # training goes on while the save is written
    saver.close()
    assert checkpoint.latest_checkpoint(tmp_path) == path
    on_disk = checkpoint.checkpoint_arrays(path)
    assert sorted(on_disk) == sorted(saved)
    for key, value in saved.items():
        np.testing.assert_array_equal(on_disk[key], value, err_msg=key)
    want, want_key = _snapshot(model)

    resumed, ropt = _model(seed=7)
    checkpoint.load_checkpoint(path, model=resumed, dense_optimizer=ropt)
    _train(resumed, ropt, batches[9:])
    got, got_key = _snapshot(resumed)
    for key, value in want.items():
        np.testing.assert_array_equal(got[key], value, err_msg=key)
    np.testing.assert_array_equal(got_key, want_key)


def test_a_checkpoint_loads_only_into_a_model_managing_the_same_tables(tmp_path):
    model, opt = _model()
    _train(model, opt, _batches(3))
    path = checkpoint.save_checkpoint(tmp_path, step=3, model=model, dense_optimizer=opt)
    plain, popt = _model(modules={})
    with pytest.raises(
        ValueError,
        match="^"
        + re.escape(
            f"checkpoint {path}: the checkpoint holds id maps of managed-collision tables ['users'], this model "
            "manages []; load it with the same [managed_collision] tables"
        )
        + "$",
    ):
        checkpoint.load_checkpoint(path, model=plain, dense_optimizer=popt)
    other, oopt = _model(modules={"items": MCHManagedCollisionModule(8, history_capacity=64)})
    with pytest.raises(
        ValueError,
        match=r"holds id maps of managed-collision tables \['users'\], this model manages "
        r"\['items'\]",
    ):
        checkpoint.load_checkpoint(path, model=other, dense_optimizer=oopt)
    wider, wopt = _model(modules={"users": MCHManagedCollisionModule(Z, history_capacity=128)})
    with pytest.raises(
        ValueError,
        match=r"table 'users': managed-collision window_hi has int32\[64\], expected "
        r"int32\[128\] \(zch_size, history_capacity or the "
        r"table's sharding changed\?\)",
    ):
        checkpoint.load_checkpoint(path, model=wider, dense_optimizer=wopt)
    plain_path = checkpoint.save_checkpoint(
        tmp_path / "plain", step=1, model=plain, dense_optimizer=popt
    )
    with pytest.raises(
        ValueError,
        match=r"holds id maps of managed-collision tables \[\], this model manages "
        r"\['users'\]",
    ):
        checkpoint.load_checkpoint(plain_path, model=model, dense_optimizer=opt)


def test_changing_the_managed_collision_config_is_a_resume_change():
    old = {"data": {"source": "movielens"}, "managed_collision": {"tables": {"t_user": 512}}}
    assert checkpoint.config_changes(
        old, {**old, "managed_collision": {"tables": {"t_user": 256}}}
    ) == [("managed_collision.tables.t_user", 512, 256)]
    assert (
        checkpoint.config_changes(
            {"data": {"source": "movielens"}},
            {
                "data": {"source": "movielens", "raw_ids": []},
                "managed_collision": {
                    "tables": {},
                    "eviction_policy": "lru",
                    "eviction_interval": 1,
                    "threshold": 1,
                    "history_capacity": 0,
                },
            },
        )
        == []
    )  # a checkpoint from before these keys resumes
    assert checkpoint.config_changes(
        old, {**old, "managed_collision": {"tables": {"t_user": 512}, "eviction_policy": "lfu"}}
    ) == [("managed_collision.eviction_policy", "lru", "lfu")]


def test_id_maps_missing_a_field_or_the_draw_key_are_refused_naming_the_checkpoint(tmp_path):
    model, opt = _model()
    _train(model, opt, _batches(3))
    arrays = checkpoint.sparse_state_arrays(model)
    where = f"checkpoint {tmp_path}"
    with pytest.raises(
        ValueError,
        match="^"
        + re.escape(
            f"{where}: the checkpoint has id maps but no mc_key (the draw key of evicted rows)"
        )
        + "$",
    ):
        _arrays._restore_sparse(model, {k: v for k, v in arrays.items() if k != "mc_key"}, where)
    with pytest.raises(
        ValueError,
        match="^"
        + re.escape(f"{where}: the id map of table 'users' lacks ['slots', 'counters']")
        + "$",
    ):
        _arrays._restore_sparse(
            model,
            {k: v for k, v in arrays.items() if k not in ("mc/users/slots", "mc/users/counters")},
            where,
        )
