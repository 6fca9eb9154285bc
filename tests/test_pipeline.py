"""The training step as a device program: one preparation per step, no host reads of device
values in steady steps, and `hybrid.TrainPipeline` equal to the plain loop."""

from __future__ import annotations

import jax
import numpy as np
import pytest
import torch
from torch import nn

import dense_torch
import hybrid
from sparse_jax import EmbeddingBagConfig
from sparse_jax.optim import rowwise_adagrad
from tests.host_reads import count_eager_ops, count_host_reads

KEYS = ["a", "b", "c"]
N_DENSE = 3


class Tower(nn.Module):
    def __init__(self):
        super().__init__()
        self.mlp = dense_torch.MLP(N_DENSE + 3 * 8, [8])
        self.out = nn.Linear(8, 1)

    def forward(self, dense_features, embeddings):
        x = torch.cat([dense_features, embeddings.values()], dim=1)
        return self.out(self.mlp(x)).squeeze(-1)


def _tables():
    return [
        EmbeddingBagConfig(name="t0", num_embeddings=40, embedding_dim=8, feature_names=["a"]),
        EmbeddingBagConfig(name="t1", num_embeddings=64, embedding_dim=8, feature_names=["b", "c"]),
    ]


def _model(mesh=None, plan=None, input_dist="all_gather"):
    torch.manual_seed(0)
    return hybrid.Model(
        _tables(),
        Tower(),
        mesh=mesh,
        plan=plan,
        input_dist=input_dist,
        sparse_optimizer=rowwise_adagrad(lr=0.1),
        seed=3,
    )


def _batches(count, *, batch=16, seed=0, max_len=5):
    """`count` torch batches `(dense, (keys, values, lengths), labels)` with empty bags."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        lengths = torch.randint(0, max_len + 1, (len(KEYS) * batch,), generator=g)
        values = torch.randint(0, 40, (int(lengths.sum()),), generator=g)
        dense = torch.randn(batch, N_DENSE, generator=g)
        labels = (torch.rand(batch, generator=g) > 0.5).float()
        out.append((dense, (KEYS, values, lengths), labels))
    return out


def _loss(logits, labels):
    return nn.functional.binary_cross_entropy_with_logits(logits, labels)


def _plain_step(model, opt, batch):
    dense, sparse, labels = batch
    loss = _loss(model(dense, sparse), labels)
    opt.zero_grad()
    loss.backward()
    opt.step()
    return loss.detach()


MESHES = {
    "one_device": dict(mesh=None, plan=None),
    "data2_model4": dict(mesh="data=2,model=4", plan={"t0": "row_wise", "t1": "table_wise"}),
}


@pytest.mark.parametrize("input_dist", ["all_gather", "all_to_all"])
@pytest.mark.parametrize("where", list(MESHES))
def test_steady_steps_prepare_once_and_read_nothing_from_the_devices(where, input_dist):
    if where == "one_device" and input_dist == "all_to_all":
        pytest.skip("the input dist only exists on a sharded mesh")
    spec = MESHES[where]
    mesh = None if spec["mesh"] is None else hybrid.make_mesh(spec["mesh"])
    model = _model(mesh, spec["plan"], input_dist)
    opt = torch.optim.SGD(model.dense_parameters(), lr=0.05)
    batches = _batches(9)
    for batch in batches[:3]:  # warm-up: compiles, ladders reach their high-water marks
        _plain_step(model, opt, batch)
    model.wait_for_sparse_update()
    module = model.sparse_module
    before = module.prepare_count
    with count_host_reads() as reads, count_eager_ops() as eager:
        for batch in batches[3:6]:
            _plain_step(model, opt, batch)
        pipeline = hybrid.TrainPipeline(model, opt, _loss)
        it = iter(batches[6:])
        losses = [pipeline.progress(it) for _ in range(3)]
        with pytest.raises(StopIteration):
            pipeline.progress(it)
    assert reads.sites == [], f"device values read on the host in steady steps: {reads.sites}"
    assert eager.sites == [], f"eager JAX ops (host dispatch) in steady steps: {eager.sites}"
    assert module.prepare_count - before == 6, "each step must prepare its batch exactly once"
    assert pipeline.stats.prepared == 3 and pipeline.stats.steps == 3
    assert all(isinstance(v, torch.Tensor) and v.dim() == 0 for v in losses)
    model.wait_for_sparse_update()
    counts = model.compile_counts()
    for batch in batches[:3]:  # steady: no new programs
        _plain_step(model, opt, batch)
    assert model.compile_counts() == counts


def test_the_update_consumes_the_forwards_prepared_batch():
    model = _model()
    opt = torch.optim.SGD(model.dense_parameters(), lr=0.05)
    module = model.sparse_module
    (batch,) = _batches(1)
    before = module.prepare_count
    prepared = model.prepare(batch[1])
    assert module.prepare_count == before + 1
    loss = _loss(model(batch[0], prepared), batch[2])
    loss.backward()
    opt.step()
    assert module.prepare_count == before + 1  # neither forward nor backward prepared again


def _train_plain(batches):
    model = _model()
    opt = torch.optim.Adam(model.dense_parameters(), lr=0.01)
    losses = [_plain_step(model, opt, b) for b in batches]
    return model, losses


def _train_pipelined(batches):
    model = _model()
    opt = torch.optim.Adam(model.dense_parameters(), lr=0.01)
    pipeline = hybrid.TrainPipeline(model, opt, _loss)
    it = iter(batches)
    losses = []
    while True:
        try:
            losses.append(pipeline.progress(it))
        except StopIteration:
            break
    pipeline.close()
    return model, losses


def _assert_same_model(a, b):
    for (name, wa), wb in zip(a.table_weights().items(), b.table_weights().values(), strict=True):
        assert torch.equal(wa, wb), f"table {name} differs"
    for pa, pb in zip(a.dense_parameters(), b.dense_parameters(), strict=True):
        assert torch.equal(pa, pb)
    for la, lb in zip(
        __import__("jax").tree_util.tree_leaves(a.sparse_opt_state),
        __import__("jax").tree_util.tree_leaves(b.sparse_opt_state),
        strict=True,
    ):
        np.testing.assert_array_equal(np.asarray(la), np.asarray(lb))


def test_pipeline_equals_the_plain_loop_bitwise_with_a_partial_last_batch():
    batches = _batches(5) + _batches(1, batch=6, seed=9)  # the last batch is smaller
    plain, plain_losses = _train_plain(batches)
    piped, piped_losses = _train_pipelined(batches)
    assert len(piped_losses) == len(batches)
    assert [float(x) for x in piped_losses] == [float(x) for x in plain_losses]
    _assert_same_model(plain, piped)


def test_pipeline_exhaustion_raises_stop_iteration_and_stays_exhausted():
    model = _model()
    pipeline = hybrid.TrainPipeline(model, torch.optim.SGD(model.dense_parameters(), lr=0.1), _loss)
    it = iter(_batches(2))
    pipeline.progress(it)
    pipeline.progress(it)
    for _ in range(2):
        with pytest.raises(StopIteration):
            pipeline.progress(it)
    with pytest.raises(StopIteration):
        pipeline.progress(iter([]))


def test_a_failing_batch_surfaces_from_progress_naming_its_index():
    batches = _batches(4)
    dense, (keys, values, lengths), labels = batches[2]
    bad = values.clone()
    bad[0] = 10_000  # outside table t0
    batches[2] = (dense, (keys, bad, lengths), labels)
    model = _model()
    opt = torch.optim.SGD(model.dense_parameters(), lr=0.1)
    pipeline = hybrid.TrainPipeline(model, opt, _loss)
    it = iter(batches)
    pipeline.progress(it)
    before = {k: v.clone() for k, v in model.table_weights().items()}
    pipeline.progress(it)  # batch 1 runs although batch 2 is being (badly) prepared
    assert any(not torch.equal(before[k], v) for k, v in model.table_weights().items())
    with pytest.raises(hybrid.BatchPreparationError, match=r"batch 2 .*id 10000") as err:
        pipeline.progress(it)
    assert err.value.batch_index == 2 and isinstance(err.value.__cause__, ValueError)
    pipeline.progress(it)  # the pipeline goes on with batch 3
    with pytest.raises(StopIteration):
        pipeline.progress(it)


def test_a_malformed_item_names_the_expected_form():
    model = _model()
    pipeline = hybrid.TrainPipeline(model, torch.optim.SGD(model.dense_parameters(), lr=0.1), _loss)
    with pytest.raises(
        hybrid.BatchPreparationError, match=r"batch 0 .*\(dense_features, sparse, labels\)"
    ):
        pipeline.progress(iter([("only", "two")]))


def test_the_next_batch_is_prepared_while_the_step_runs():
    """Batch i+1 is taken from the iterator before step i's progress returns."""
    taken = []

    def source():
        for i, b in enumerate(_batches(3)):
            taken.append(i)
            yield b

    model = _model()
    pipeline = hybrid.TrainPipeline(model, torch.optim.SGD(model.dense_parameters(), lr=0.1), _loss)
    it = source()
    pipeline.progress(it)
    pipeline._queued.result()  # the background stage of batch 1
    assert taken == [0, 1]


def test_the_read_counter_sees_every_kind_of_host_read():
    """The instrument behind the zero-reads test: each conversion is caught, and a batch
    given as device arrays (read back once by prepare) is caught too."""
    import jax.numpy as jnp

    from sparse_jax import KeyedJaggedTensor

    x = jnp.arange(4.0) + 1
    readers = [
        lambda a: np.asarray(a),
        lambda a: np.array(a),
        lambda a: float(a[0]),
        lambda a: a.tolist(),
        lambda a: int(a[1]),
        lambda a: __import__("jax").device_get(a),
        lambda a: a[0].item(),
    ]
    for read in readers:
        with count_host_reads() as reads:
            read(x)
        assert reads.count >= 1, read
    model = _model()
    dense, (keys, values, lengths), _ = _batches(1)[0]
    on_device = KeyedJaggedTensor(keys, values.numpy(), lengths=lengths.numpy())
    with count_host_reads() as reads:
        model.prepare(on_device)
    assert reads.count > 0 and "_prepare.py" in reads.sites[0]


def test_torch_device_follows_the_jax_device():
    class Fake:
        def __init__(self, platform, hardware_id):
            self.platform, self.local_hardware_id = platform, hardware_id

    assert hybrid.torch_device(Fake("gpu", 3)) == torch.device("cuda", 3)
    assert hybrid.torch_device(Fake("cuda", 0)) == torch.device("cuda", 0)
    assert hybrid.torch_device(Fake("rocm", 1)) == torch.device("cuda", 1)
    assert hybrid.torch_device(Fake("cpu", 0)) == torch.device("cpu")
    assert hybrid.torch_device() == torch.device("cpu")  # this machine's JAX device


def test_the_dense_grad_hook_runs_only_after_the_sparse_update_finished():
    """A torch collective in the hook (the dense all-reduce) never overlaps JAX's update."""
    seen = []

    def hook(model):
        leaves = jax.tree_util.tree_leaves((model.sparse_params, model.sparse_opt_state))
        seen.append(all(x.is_ready() for x in leaves))

    model = _model()
    pipeline = hybrid.TrainPipeline(
        model, torch.optim.SGD(model.dense_parameters(), lr=0.1), _loss, dense_grad_hook=hook
    )
    it = iter(_batches(3))
    for _ in range(3):
        pipeline.progress(it)
    assert seen == [True, True, True]
    barrier = model.order_after_sparse_update()  # what the pipeline takes before the hook
    assert isinstance(barrier, torch.Tensor) and int(barrier) == 3  # the updates' step counter
