"""Fault injection: NaN / Inf in features, loss and gradients never reach the weights, and
the decision is made on the device (no host read)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import hybrid
from sparse_jax import (
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    KeyedJaggedTensor,
    make_update,
    optim,
)
from sparse_jax.sharding import shard
from tests.test_pipeline import _batches, _loss, _model


def _host_tree(tree):
    return [np.array(x) for x in jax.tree_util.tree_leaves(tree)]


@pytest.mark.parametrize("where", ["one_device", "data2_model4"])
@pytest.mark.parametrize("rule", ["rowwise_adagrad", "adam", "sgd"])
def test_make_update_skips_a_nonfinite_gradient_in_place(where, rule):
    tables = [EmbeddingBagConfig(name="t", num_embeddings=64, embedding_dim=8, feature_names=["f"])]
    module = EmbeddingBagCollection(tables, kernel="xla")
    if where != "one_device":
        module = shard(module, jax.make_mesh((2, 4), ("data", "model")), {"t": "row_wise"})
    r = getattr(optim, rule)(lr=0.1)
    params = module.init(jax.random.key(0))
    state = r.init(params)
    update = make_update(module, r, skip_nonfinite=True)
    batch = module.prepare(KeyedJaggedTensor(["f"], np.arange(16) % 64, lengths=np.full(8, 2)))
    good = jnp.ones((8, 8), jnp.float32)
    params, state = update(params, state, batch, good)  # applied
    steps = int(state.count)
    before = _host_tree((params, state))
    for bad in (good.at[3, 2].set(jnp.nan), good.at[0, 0].set(jnp.inf)):
        params, state = update(params, state, batch, bad)
        for a, b in zip(before, _host_tree((params, state)), strict=True):
            np.testing.assert_array_equal(a, b)  # bitwise untouched, step count included
    params, state = update(params, state, batch, good, ok=jnp.zeros((), bool))  # the caller's flag
    for a, b in zip(before, _host_tree((params, state)), strict=True):
        np.testing.assert_array_equal(a, b)
    count, first = update.nonfinite()
    assert (int(count), int(first)) == (3, 1)
    params, state = update(params, state, batch, good)
    assert int(state.count) == steps + 1  # skipped calls did not count as optimizer steps
    assert not all(
        np.array_equal(a, b) for a, b in zip(before, _host_tree((params, state)), strict=True)
    )


def _snapshot(model, opt):
    tables = {k: v.clone() for k, v in model.table_weights().items()}
    dense = [p.detach().clone() for p in model.dense_parameters()]
    state = [{k: v.clone() for k, v in s.items() if torch.is_tensor(v)} for s in opt.state.values()]
    sparse_state = _host_tree(model.sparse_opt_state)
    return tables, dense, state, sparse_state


def _assert_same(a, b):
    for (name, x), y in zip(a[0].items(), b[0].values(), strict=True):
        assert torch.equal(x, y), f"table {name} changed"
    for x, y in zip(a[1], b[1], strict=True):
        assert torch.equal(x, y)
    for sx, sy in zip(a[2], b[2], strict=True):
        for k in sx:
            assert torch.equal(sx[k], sy[k]), k
    for x, y in zip(a[3], b[3], strict=True):
        np.testing.assert_array_equal(x, y)


def _run(batches, *, after=None):
    model = _model()
    opt = torch.optim.Adam(model.dense_parameters(), lr=0.01)
    pipeline = hybrid.TrainPipeline(model, opt, _loss)
    it = iter(batches)
    snaps, losses = [], []
    for _ in batches:
        losses.append(pipeline.progress(it))
        model.wait_for_sparse_update()
        snaps.append(_snapshot(model, opt))
        if after:
            after(len(snaps) - 1)
    return model, pipeline, snaps, losses


def test_nan_features_skip_the_whole_batch_and_training_goes_on_exactly():
    batches = _batches(4)
    poisoned = list(batches)
    dense, sparse, labels = batches[2]
    dense = dense.clone()
    dense[1, 0] = float("nan")
    poisoned[2] = (dense, sparse, labels)
    model, pipeline, snaps, losses = _run(poisoned)
    assert math.isnan(float(losses[2]))
    _assert_same(snaps[1], snaps[2])  # batch 2 changed nothing: tables, dense, both optimizers
    assert pipeline.nonfinite() == {"sparse": 1, "dense": 1, "first_batch": 2}
    # (the guard is always on in the pipeline: tests/test_pipeline.py counts zero host reads)
    # and the run continues exactly as one that never saw batch 2
    _, _, clean, clean_losses = _run([batches[0], batches[1], batches[3]])
    _assert_same(snaps[3], clean[2])
    assert float(losses[3]) == float(clean_losses[2])


class _NanGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad * float("nan")


def test_a_nonfinite_pooled_gradient_with_a_finite_loss_never_reaches_the_tables(monkeypatch):
    model = _model()
    opt = torch.optim.SGD(model.dense_parameters(), lr=0.1)
    pipeline = hybrid.TrainPipeline(model, opt, _loss)
    batches = _batches(2)
    it = iter(batches)
    pipeline.progress(it)
    model.wait_for_sparse_update()
    tables = {k: v.clone() for k, v in model.table_weights().items()}
    original = model.dense.forward

    def poisoned(dense_features, embeddings):
        import dense_torch

        kt = dense_torch.KeyedTensor(
            embeddings.keys(), embeddings.length_per_key(), _NanGrad.apply(embeddings.values())
        )
        return original(dense_features, kt)

    monkeypatch.setattr(model.dense, "forward", poisoned)
    loss = pipeline.progress(it)
    assert math.isfinite(float(loss))
    for name, w in model.table_weights().items():
        assert torch.equal(w, tables[name]), name
    assert pipeline.nonfinite()["sparse"] == 1


def _train_config(tmp_path, **overrides):
    from hybrid.training import load_config

    sets = [
        'data.source="synthetic"',
        "data.num_samples=512",
        "data.num_eval_samples=256",
        "data.num_sparse=3",
        "data.num_dense=3",
        "data.num_embeddings=50",
        "train.batch_size=64",
        "train.eval_batch_size=256",
        "train.steps=6",
        "log.every=2",
        f"checkpoint.dir='{tmp_path / 'ckpt'}'",
        "checkpoint.every=2",
        "log.metrics_path=''",
        *[f"{k}={v}" for k, v in overrides.items()],
    ]
    return load_config(None, sets)


def _poison_step(monkeypatch, step):
    from hybrid.data import BatchLoader

    original = BatchLoader.batch

    def batch(self, s, **kw):
        dense, sparse, labels = original(self, s, **kw)
        if s == step:
            dense = dense.clone()
            dense[0, 0] = float("inf") * 0  # NaN
        return dense, sparse, labels

    monkeypatch.setattr(BatchLoader, "batch", batch)


def test_training_stops_naming_the_step_and_writes_no_poisoned_checkpoint(tmp_path, monkeypatch):
    from hybrid.train import run

    _poison_step(monkeypatch, 2)  # 0-based: the 3rd step
    with pytest.raises(hybrid.NonFiniteError, match=r"step 3 had a non-finite loss"):
        run(_train_config(tmp_path), echo=lambda *a: None)
    saved = sorted(p.name for p in (tmp_path / "ckpt").glob("step_*"))
    assert saved == ["step_00000002"]  # written before the bad step; none after it


def test_training_with_skip_policy_skips_and_finishes(tmp_path, monkeypatch):
    from hybrid.train import run

    _poison_step(monkeypatch, 2)
    result = run(_train_config(tmp_path, **{"train.nonfinite": '"skip"'}), echo=lambda *a: None)
    assert result["step"] == 6
    assert math.isnan(result["losses"][3]) and all(
        math.isfinite(v) for k, v in result["losses"].items() if k != 3
    )
    assert math.isfinite(result["eval"]["auc"])


def test_a_diverging_learning_rate_stops_before_poisoning_anything(tmp_path):
    from hybrid.train import run

    config = _train_config(
        tmp_path,
        **{"dense_optimizer.name": '"sgd"', "dense_optimizer.lr": "1e30", "checkpoint.every": "1"},
    )
    with pytest.raises(hybrid.NonFiniteError, match=r"step \d+ had a non-finite loss"):
        run(config, echo=lambda *a: None)
    from hybrid import latest_checkpoint, load_checkpoint

    last = latest_checkpoint(tmp_path / "ckpt")
    if last is not None:  # whatever was saved holds finite weights only
        model_config = _train_config(tmp_path)
        from hybrid.train import build

        model, dense_opt, *_ = build(model_config)
        load_checkpoint(last, model=model, dense_optimizer=dense_opt)
        for w in model.table_weights().values():
            assert torch.isfinite(w).all()
        for p in model.dense_parameters():
            assert torch.isfinite(p).all()
