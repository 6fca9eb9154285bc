"""hybrid.Model: training steps equal a pure-PyTorch model, eval never updates, state dicts."""

import copy

import jax
import numpy as np
import pytest
import torch
from torch import nn

import dense_torch
import hybrid
from sparse_jax import EmbeddingBagConfig, KeyedJaggedTensor
from sparse_jax import optim as sparse_optim
from sparse_jax.optim import rowwise_adagrad, sgd

LR_SPARSE, LR_DENSE, EPS = 0.1, 0.05, 1e-8
N_DENSE = 3


class ConcatTower(nn.Module):
    """A dense tower for features of mixed widths: MLP over [dense features, embeddings]."""

    def __init__(self, width: int):
        super().__init__()
        self.mlp = dense_torch.MLP(N_DENSE + width, [8])
        self.out = nn.Linear(8, 1)

    def forward(self, dense_features, embeddings):
        return self.out(self.mlp(torch.cat([dense_features, embeddings.values()], dim=1))).squeeze(
            -1
        )


def _tables(mean: bool):
    """Two groups (dims 4 and 8), a shared table; with `mean`, t0 and t1 pool by MEAN."""
    pooling = "MEAN" if mean else "SUM"
    return [
        EmbeddingBagConfig(
            name="t0", num_embeddings=12, embedding_dim=4, feature_names=["a", "b"], pooling=pooling
        ),
        EmbeddingBagConfig(
            name="t1", num_embeddings=9, embedding_dim=8, feature_names=["c"], pooling=pooling
        ),
        EmbeddingBagConfig(
            name="t2", num_embeddings=7, embedding_dim=4, feature_names=["d"], pooling="SUM"
        ),
    ]


KEYS = ["c", "a", "d", "b"]  # not the output order (a, b, c, d): the model must reorder


def _batch(seed, *, batch=6, weighted=False, num_rows=7, max_len=4):
    """Torch-side batch with empty bags and duplicate ids: (dense, (keys, values, lengths[, w]), labels).

    Bag 0 is empty, the last bag of each feature has `max_len` ids, the rest 0..max_len."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, max_len + 1, (len(KEYS) * batch,), generator=g)
    lengths[0] = 0
    lengths[batch - 1 :: batch] = max_len
    values = torch.randint(0, num_rows, (int(lengths.sum()),), generator=g)
    sparse = (KEYS, values, lengths)
    if weighted:
        sparse += (torch.rand(values.numel(), generator=g) + 0.5,)
    dense = torch.randn(batch, N_DENSE, generator=g)
    return dense, sparse, (torch.rand(batch, generator=g) > 0.5).float()


# ------------------------------------------------------------------ the pure-PyTorch reference


class TorchReference(nn.Module):
    """torch.nn.EmbeddingBag per table + a copy of the dense tower; sparse rules in torch."""

    def __init__(self, tables, dense, table_weights, *, weighted):
        super().__init__()
        self.bags = nn.ModuleDict(
            {
                t.name: nn.EmbeddingBag(
                    t.num_embeddings,
                    t.embedding_dim,
                    mode=t.pooling.value.lower(),
                    _weight=table_weights[t.name].clone(),
                )
                for t in tables
            }
        )
        self.features = [(f, t.name) for t in tables for f in t.feature_names]
        self.dense = copy.deepcopy(dense)
        self.weighted = weighted
        self.state = {t.name: torch.zeros(t.num_embeddings) for t in tables}  # rowwise adagrad

    def forward(self, dense_features, sparse):
        keys, values, lengths = sparse[:3]
        stride = lengths.numel() // len(keys)
        offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
        blocks, self.touched = [], {}
        for feature, table in self.features:
            k = keys.index(feature)
            a, b = int(offsets[k * stride]), int(offsets[(k + 1) * stride])
            bag_lengths = lengths[k * stride : (k + 1) * stride]
            bag_offsets = torch.cat([torch.zeros(1, dtype=torch.long), bag_lengths.cumsum(0)[:-1]])
            psw = sparse[3][a:b] if self.weighted else None
            blocks.append(self.bags[table](values[a:b], bag_offsets, per_sample_weights=psw))
            self.touched.setdefault(table, set()).update(values[a:b].tolist())
        dims = [blk.shape[1] for blk in blocks]
        embeddings = dense_torch.KeyedTensor(
            [f for f, _ in self.features], dims, torch.cat(blocks, dim=1)
        )
        return self.dense(dense_features, embeddings)

    @torch.no_grad()
    def sparse_step(self, rule):
        """The rule on the dense gradient of each EmbeddingBag weight, touched rows only
        (duplicates were summed by autograd): rowwise adagrad `s += mean(g^2)`,
        `w -= lr * g / (sqrt(s) + eps)`; sgd `w -= lr * g`."""
        for table, bag in self.bags.items():
            rows = torch.tensor(sorted(self.touched.get(table, ())), dtype=torch.long)
            if not rows.numel():
                continue
            g = bag.weight.grad[rows]
            if rule == "sgd":
                bag.weight[rows] -= LR_SPARSE * g
            else:
                self.state[table][rows] += (g * g).mean(dim=1)
                bag.weight[rows] -= LR_SPARSE * g / (self.state[table][rows].sqrt() + EPS)[:, None]
            bag.weight.grad = None


def _close(got, want, what):
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=lambda m: f"{what}: {m}")


@pytest.mark.parametrize("rule", ["rowwise_adagrad", "sgd"])
@pytest.mark.parametrize("features", ["sum_and_mean", "weighted_sum"])
def test_training_steps_match_pure_pytorch(rule, features):
    # torch.nn.EmbeddingBag takes per_sample_weights with mode="sum" only
    weighted = features == "weighted_sum"
    torch.manual_seed(0)
    tables = _tables(mean=not weighted)
    dense = ConcatTower(width=4 + 4 + 8 + 4)
    optimizer = (
        rowwise_adagrad(lr=LR_SPARSE, eps=EPS) if rule == "rowwise_adagrad" else sgd(lr=LR_SPARSE)
    )
    model = hybrid.Model(tables, dense, sparse_optimizer=optimizer, is_weighted=weighted, seed=3)
    ref = TorchReference(tables, model.dense, model.table_weights(), weighted=weighted)
    opt = torch.optim.SGD(model.dense_parameters(), lr=LR_DENSE)
    ref_opt = torch.optim.SGD(ref.dense.parameters(), lr=LR_DENSE)
    bce = nn.BCEWithLogitsLoss()
    for step in range(2):  # the second step reads the optimizer state of the first
        dense_x, sparse, labels = _batch(step, weighted=weighted)
        logits, ref_logits = model(dense_x, sparse), ref(dense_x, sparse)
        _close(logits, ref_logits, f"step {step} logits")
        loss, ref_loss = bce(logits, labels), bce(ref_logits, labels)
        _close(loss, ref_loss, f"step {step} loss")
        loss.backward()
        ref_loss.backward()
        ref.sparse_step(rule)
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
        for name, weight in model.table_weights().items():
            _close(weight, ref.bags[name].weight.detach(), f"step {step} table {name}")
        for (name, p), q in zip(
            model.dense.named_parameters(), ref.dense.parameters(), strict=True
        ):
            _close(p.detach(), q.detach(), f"step {step} dense {name}")
    assert int(model.sparse_opt_state.count) == 2


def test_dlrm_step_matches_pure_pytorch():
    torch.manual_seed(1)
    tables = [
        EmbeddingBagConfig(name="t0", num_embeddings=12, embedding_dim=4, feature_names=["a", "b"]),
        EmbeddingBagConfig(
            name="t1", num_embeddings=9, embedding_dim=4, feature_names=["c", "d"], pooling="MEAN"
        ),
    ]
    dense = dense_torch.DLRM(4, 4, N_DENSE, [8, 4], [8, 1])
    model = hybrid.Model(tables, dense, sparse_optimizer=rowwise_adagrad(lr=LR_SPARSE, eps=EPS))
    ref = TorchReference(tables, model.dense, model.table_weights(), weighted=False)
    dense_x, sparse, labels = _batch(7)
    logits, ref_logits = model(dense_x, sparse), ref(dense_x, sparse)
    _close(logits, ref_logits, "logits")
    nn.functional.binary_cross_entropy_with_logits(logits.squeeze(-1), labels).backward()
    nn.functional.binary_cross_entropy_with_logits(ref_logits.squeeze(-1), labels).backward()
    ref.sparse_step("rowwise_adagrad")
    for name, weight in model.table_weights().items():
        _close(weight, ref.bags[name].weight.detach(), f"table {name}")
    for p, q in zip(model.dense_parameters(), ref.dense.parameters(), strict=True):
        _close(p.grad, q.grad, "dense grad")


# ------------------------------------------------------------------ when tables update


def _model(**kwargs):
    torch.manual_seed(0)
    return hybrid.Model(_tables(mean=False), ConcatTower(width=20), **kwargs)


def _snapshot(model):
    return {k: v.clone() for k, v in model.table_weights().items()}


def _assert_tables_equal(model, snapshot):
    for name, weight in model.table_weights().items():
        assert torch.equal(weight, snapshot[name]), f"table {name} changed"


def test_eval_mode_never_updates_tables():
    model = _model()
    before = _snapshot(model)
    model.eval()
    dense_x, sparse, _ = _batch(0)
    model(dense_x, sparse).sum().backward()  # dense grads flow; the tables stay
    _assert_tables_equal(model, before)
    assert int(model.sparse_opt_state.count) == 0
    assert all(p.grad is not None for p in model.dense_parameters())


def test_no_grad_forward_never_updates_tables():
    model = _model()
    before = _snapshot(model)
    with torch.no_grad():
        out = model(*_batch(0)[:2])
    assert not out.requires_grad
    _assert_tables_equal(model, before)
    assert int(model.sparse_opt_state.count) == 0


def test_backward_applies_the_update_once_and_a_second_backward_raises():
    model = _model()
    before = _snapshot(model)
    loss = model(*_batch(0)[:2]).sum()
    loss.backward(retain_graph=True)
    assert int(model.sparse_opt_state.count) == 1
    after_one = _snapshot(model)
    assert not all(torch.equal(after_one[k], before[k]) for k in before)
    with pytest.raises(RuntimeError, match="backward ran twice through the same forward"):
        loss.backward()
    _assert_tables_equal(model, after_one)
    assert int(model.sparse_opt_state.count) == 1


def test_a_batch_of_empty_bags_pools_to_zeros_and_updates_nothing():
    model = _model()
    before = _snapshot(model)
    dense_x = torch.randn(2, N_DENSE)
    empty = (KEYS, torch.zeros(0, dtype=torch.long), torch.zeros(2 * len(KEYS), dtype=torch.long))
    model(dense_x, empty).sum().backward()
    _assert_tables_equal(model, before)
    assert int(model.sparse_opt_state.count) == 1


def test_pooled_embeddings_cross_zero_copy():
    model = _model()
    stats = hybrid.bridge_stats()
    stats.reset()
    model(*_batch(0)[:2]).sum().backward()
    assert stats.copies["joined_shards"] == 0 and stats.copies["unaligned"] == 0
    assert stats.zero_copy >= 2  # pooled out, pooled gradient back (plus the batch's arrays)


def test_steady_training_compiles_once():
    model = _model(capacity_ladder=[128])
    for step in range(4):  # every batch fits the one rung; every length cap is 4
        dense_x, sparse, _ = _batch(step, max_len=3)
        model(dense_x, sparse).sum().backward()
        if step == 0:
            first = model.compile_counts()
    assert model.compile_counts() == first


# ------------------------------------------------------------------ batch forms and ids


def test_every_batch_form_gives_the_same_logits():
    model = _model()
    model.eval()
    dense_x, (keys, values, lengths), _ = _batch(2)
    kjt = KeyedJaggedTensor(keys, values.numpy(), lengths=lengths.numpy())
    stride = lengths.numel() // len(keys)
    offsets = [0, *lengths.cumsum(0).tolist()]
    as_dict = {
        k: (
            values[offsets[i * stride] : offsets[(i + 1) * stride]],
            lengths[i * stride : (i + 1) * stride],
        )
        for i, k in enumerate(keys)
    }
    forms = [(keys, values, lengths), kjt, hybrid.torch_kjt(keys, values, lengths), as_dict]
    outs = [model(dense_x, form) for form in forms]
    for out in outs[1:]:
        torch.testing.assert_close(out, outs[0], rtol=0, atol=0)


def test_torch_kjt_is_the_padded_layout_of_sparse_jax():
    _, (keys, values, lengths), _ = _batch(4)
    ours = hybrid.torch_kjt(keys, values, lengths)
    ref = KeyedJaggedTensor(keys, values.numpy(), lengths=lengths.numpy()).pad()
    assert jax.tree_util.tree_structure(ours) == jax.tree_util.tree_structure(ref)
    for a, b in zip(jax.tree_util.tree_leaves(ours), jax.tree_util.tree_leaves(ref), strict=True):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_ids_above_2_31_fail_naming_the_feature():
    model = _model()
    dense_x, (keys, values, lengths), _ = _batch(0)
    values = values.clone()
    values[-1] = 2**31 + 5  # last id: feature "b", the last non-empty bag
    # checked on the host before anything is placed: never truncated to a valid int32 id
    with pytest.raises(
        ValueError, match=r"feature 'b' .*id 2147483653 at batch position \d, index \d+ in the bag"
    ):
        model(dense_x, (keys, values, lengths))


def test_ids_outside_a_table_fail_naming_the_feature():
    model = _model()
    dense_x, (keys, values, lengths), _ = _batch(0)
    values = values.clone()
    values[-1] = 100
    with pytest.raises(ValueError, match=r"feature 'b' \(table 't0', num_embeddings=12\): id 100"):
        model(dense_x, (keys, values, lengths))


# ------------------------------------------------------------------ state dict


def test_state_dict_uses_torchrec_keys_and_copies():
    model = _model()
    sd = model.state_dict()
    tables = [k for k in sd if k.startswith("embedding_bags.")]
    assert tables == [
        "embedding_bags.t0.weight",
        "embedding_bags.t1.weight",
        "embedding_bags.t2.weight",
    ]
    assert set(sd) - set(tables) == {f"dense.{k}" for k in model.dense.state_dict()}
    assert tuple(sd["embedding_bags.t1.weight"].shape) == (9, 8)
    saved = sd["embedding_bags.t0.weight"].clone()
    model(*_batch(0)[:2]).sum().backward()  # an update does not reach the saved copy
    assert torch.equal(sd["embedding_bags.t0.weight"], saved)
    sd["embedding_bags.t0.weight"].zero_()  # and editing the copy does not reach the model
    assert model.table_weights()["t0"].abs().sum() > 0


def test_state_dict_round_trip():
    a = _model(seed=1)
    a(*_batch(0)[:2]).sum().backward()
    b = _model(seed=2)
    b.load_state_dict(a.state_dict())
    for name, weight in a.table_weights().items():
        assert torch.equal(b.table_weights()[name], weight)
    a.eval()
    b.eval()
    dense_x, sparse, _ = _batch(5)
    torch.testing.assert_close(b(dense_x, sparse), a(dense_x, sparse), rtol=0, atol=0)
    b.train()
    b(dense_x, sparse).sum().backward()  # loaded tables train


def test_load_pretrained_tables():
    model = _model()
    pretrained = torch.arange(12 * 4, dtype=torch.float32).reshape(12, 4) / 10
    before = _snapshot(model)
    missing, unexpected = model.load_state_dict(
        {"embedding_bags.t0.weight": pretrained}, strict=False
    )
    assert "embedding_bags.t1.weight" in missing and not unexpected
    assert torch.equal(model.table_weights()["t0"], pretrained)
    assert torch.equal(model.table_weights()["t1"], before["t1"])
    model(*_batch(0)[:2]).sum().backward()
    assert not torch.equal(model.table_weights()["t0"], pretrained)


def test_load_state_dict_errors_name_the_table():
    model = _model()
    with pytest.raises(
        RuntimeError, match=r"size mismatch for embedding_bags.t0.weight: table 't0' is \[12, 4\]"
    ):
        model.load_state_dict({"embedding_bags.t0.weight": torch.zeros(5, 4)}, strict=False)
    with pytest.raises(
        RuntimeError, match=r"Unexpected key\(s\) in state_dict: \"embedding_bags.nope.weight\""
    ):
        model.load_state_dict({**model.state_dict(), "embedding_bags.nope.weight": torch.zeros(1)})
    with pytest.raises(RuntimeError, match="Missing key.*embedding_bags.t2.weight"):
        model.load_state_dict(
            {k: v for k, v in model.state_dict().items() if k != "embedding_bags.t2.weight"}
        )


# ------------------------------------------------------------------ mesh


def test_one_device_mesh_keeps_tables_on_that_device():
    device = jax.devices()[3]
    model = _model(mesh=hybrid.make_mesh("data=1", devices=[device]))
    assert all(p.devices() == {device} for p in model.sparse_params.values())
    model(*_batch(0)[:2]).sum().backward()
    assert all(p.devices() == {device} for p in model.sparse_params.values())
    assert int(model.sparse_opt_state.count) == 1


@pytest.mark.parametrize(
    "plan",
    [
        {"t0": "row_wise", "t1": "table_wise", "t2": "column_wise"},
        {"t0": "grid_shard", "t1": "data_parallel"},
        None,
    ],
)
def test_sharded_mesh_matches_one_device(plan):
    # row-wise adagrad: column-split tables sum each row's statistic over their blocks
    rule = sparse_optim.rowwise_adagrad(lr=0.1)
    single = _model(sparse_optimizer=rule)
    sharded = _model(mesh=hybrid.make_mesh("data=2,model=4"), plan=plan, sparse_optimizer=rule)
    sharded.load_state_dict(single.state_dict())  # the same starting tables and tower
    opts = [torch.optim.SGD(m.dense_parameters(), lr=0.1) for m in (single, sharded)]
    for seed in range(3):
        dense_x, sparse, labels = _batch(seed, batch=8)
        for model, opt in zip((single, sharded), opts, strict=True):
            opt.zero_grad()
            logits = model(dense_x, sparse)
            nn.functional.binary_cross_entropy_with_logits(logits.squeeze(-1), labels).backward()
            opt.step()
        _close(sharded(dense_x, sparse), single(dense_x, sparse), f"logits after step {seed}")
    for name, weight in single.table_weights().items():
        _close(sharded.table_weights()[name], weight, f"table {name}")


def test_plan_without_mesh_is_an_error():
    with pytest.raises(ValueError, match="plan was given without a mesh"):
        _model(plan=object())


# ------------------------------------------------------------------ it learns


def test_dlrm_learns_a_planted_signal():
    from hybrid.demo import train

    result = train(steps=120, batch_size=256, eval_samples=4096)
    assert result["eval_auc"] > 0.75, result
    assert result["last_loss"] < result["first_loss"], result


def test_from_torchrec_state_dict_renames_keys():
    w, b = torch.zeros(3, 4), torch.zeros(2)
    sd = {
        "model.sparse_arch.embedding_bag_collection.embedding_bags.t0.weight": w,
        "model.over_arch.model.1.bias": b,
    }
    assert hybrid.from_torchrec_state_dict(sd) == {
        "embedding_bags.t0.weight": w,
        "dense.over_arch.model.1.bias": b,
    }
    with pytest.raises(ValueError, match="sparse_arch.weighted_ebc.x"):
        hybrid.from_torchrec_state_dict({"sparse_arch.weighted_ebc.x": w})


def test_load_sparse_opt_state_checks_structure_and_places_leaves():
    model = _model()
    state = model.sparse_opt_state
    host = jax.tree.map(lambda x: np.asarray(x) + 1, state)
    model.load_sparse_opt_state(host)
    for got, want in zip(
        jax.tree.leaves(model.sparse_opt_state), jax.tree.leaves(host), strict=True
    ):
        np.testing.assert_array_equal(np.asarray(got), want)
    with pytest.raises(ValueError, match="optimizer state has structure"):
        model.load_sparse_opt_state({"count": 0})


def test_models_on_one_module_and_rule_share_their_update_and_dropped_ones_free_it():
    """The compiled update is shared while a model holds it; once the models are dropped and
    more recent updates have been built, nothing keeps it (nor the rule it holds)."""
    import gc
    import weakref

    from hybrid.model import _sparse

    rule = rowwise_adagrad(lr=0.01)
    first, second = _model(sparse_optimizer=rule), _model(sparse_optimizer=rule)
    assert first._tables._shared_update is second._tables._shared_update
    gone = weakref.ref(first._tables._shared_update)
    del first, second
    for _ in range(_sparse._KEEP_UPDATES):  # newer models push it out of the recent ones
        _model(sparse_optimizer=rowwise_adagrad(lr=0.01))
    gc.collect()
    assert gone() is None
