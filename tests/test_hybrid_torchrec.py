"""hybrid.Model against TorchRec itself: a TorchRec DLRM's checkpoint and batch load as they are."""

import pytest

pytest.importorskip("torchrec")

import torch  # noqa: E402
from torchrec.models.dlrm import DLRM as TorchRecDLRM  # noqa: E402
from torchrec.modules import embedding_configs as tr_configs  # noqa: E402
from torchrec.modules.embedding_modules import EmbeddingBagCollection as TorchRecEBC  # noqa: E402
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor as TorchRecKJT  # noqa: E402

import dense_torch  # noqa: E402
import hybrid  # noqa: E402
from sparse_jax import EmbeddingBagConfig  # noqa: E402

pytestmark = pytest.mark.parity

TABLES = [("t0", 11, ["a", "b"], "SUM"), ("t1", 7, ["c"], "MEAN")]
DIM, N_DENSE = 4, 3


def _tr_tables():
    return [
        tr_configs.EmbeddingBagConfig(
            name=n,
            num_embeddings=e,
            embedding_dim=DIM,
            feature_names=f,
            pooling=tr_configs.PoolingType[p],
        )
        for n, e, f, p in TABLES
    ]


def test_torchrec_dlrm_checkpoint_and_kjt_give_the_same_logits():
    torch.manual_seed(0)
    tr_tables = _tr_tables()
    tr_model = TorchRecDLRM(
        embedding_bag_collection=TorchRecEBC(tables=tr_tables),
        dense_in_features=N_DENSE,
        dense_arch_layer_sizes=[8, DIM],
        over_arch_layer_sizes=[8, 1],
    )
    tables = [
        EmbeddingBagConfig(name=n, num_embeddings=e, embedding_dim=DIM, feature_names=f, pooling=p)
        for n, e, f, p in TABLES
    ]
    model = hybrid.Model(tables, dense_torch.DLRM(DIM, 3, N_DENSE, [8, DIM], [8, 1]), seed=5)
    model.load_state_dict(hybrid.from_torchrec_state_dict(tr_model.state_dict()))
    model.eval()

    lengths = torch.tensor([2, 0, 1, 1, 3, 0, 2, 1, 1])  # keys a, b, c; batch 3; empty bags
    kjt = TorchRecKJT(
        keys=["a", "b", "c"],
        values=torch.tensor([1, 10, 3, 4, 4, 9, 0, 6, 2, 5, 6]),
        lengths=lengths,
    )
    dense = torch.randn(3, N_DENSE)
    with torch.no_grad():
        want = tr_model(dense, kjt)
        got = model(dense, kjt)  # the TorchRec KJT itself is an accepted batch form
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_torchrec_configs_and_enums_are_taken_as_they_are():
    """A migrating user's tables: TorchRec's configs (with the init_fn TorchRec sets), its
    PoolingType / DataType / ShardingType members, and a collection handed to the planner."""
    import numpy as np
    from torchrec.distributed.types import ParameterSharding
    from torchrec.distributed.types import ShardingType as TorchRecShardingType

    import sparse_jax as sj
    from sparse_jax.plan import ShardingType
    from sparse_jax.planner import Planner, Topology

    ours = [
        EmbeddingBagConfig(name=n, num_embeddings=e, embedding_dim=DIM, feature_names=f, pooling=p)
        for n, e, f, p in TABLES
    ]
    ebc = sj.EmbeddingBagCollection(_tr_tables())
    assert ebc.embedding_bag_configs() == ours
    params = ebc.init(__import__("jax").random.key(0))
    kjt = sj.KeyedJaggedTensor.from_lengths_sync(
        keys=["a", "b", "c"],
        values=np.array([1, 10, 3, 4, 6]),
        lengths=np.array([2, 1, 1, 0, 1, 0]),
    )
    np.testing.assert_array_equal(
        np.asarray(ebc.apply(params, kjt).values()),
        np.asarray(sj.EmbeddingBagCollection(ours).apply(params, kjt).values()),
    )
    fp16 = tr_configs.DataType.FP16
    assert (
        EmbeddingBagConfig(
            name="x", num_embeddings=3, embedding_dim=4, data_type=fp16
        ).data_type.name
        == "FP16"
    )
    assert ShardingType.coerce(TorchRecShardingType.ROW_WISE) is ShardingType.ROW_WISE
    plan = Planner(Topology(axes={"data": 2})).plan(ebc, batch_size=64)  # TorchRec plans a module
    assert set(plan) == {"t0", "t1"}
    with pytest.raises(
        ValueError, match=r"ParameterSharding \(TorchRec's ranks.*\{table: 'row_wise'\}"
    ):
        ShardingType.coerce(ParameterSharding("row_wise", "fused", ranks=[0, 1]), table="t0")
    with pytest.raises(ValueError, match=r"INT8 tables are for inference.*hybrid.quantize"):
        EmbeddingBagConfig(name="x", num_embeddings=3, embedding_dim=4, data_type="int8")
    custom = tr_configs.EmbeddingBagConfig(
        name="t",
        num_embeddings=5,
        embedding_dim=4,
        feature_names=["a"],
        init_fn=torch.nn.init.zeros_,
    )
    with pytest.raises(
        ValueError, match=r"init_fn \(a torch initializer\) cannot initialize a JAX table"
    ):
        sj.EmbeddingBagCollection([custom])


def test_a_model_on_torchrec_configs_with_bounds_check_and_a_variable_batch_kjt():
    model = hybrid.Model(
        _tr_tables(), dense_torch.DLRM(DIM, 3, N_DENSE, [8, DIM], [8, 1]), bounds_check="clamp"
    )
    model.eval()
    dense = torch.randn(3, N_DENSE)
    big = TorchRecKJT(  # id 99 is past t0's 11 rows: clamped to its last row
        keys=["a", "b", "c"],
        values=torch.tensor([99, 1, 2]),
        lengths=torch.tensor([1, 0, 0, 1, 0, 0, 1, 0, 0]),
    )
    edge = TorchRecKJT(
        keys=["a", "b", "c"],
        values=torch.tensor([10, 1, 2]),
        lengths=torch.tensor([1, 0, 0, 1, 0, 0, 1, 0, 0]),
    )
    with torch.no_grad():
        torch.testing.assert_close(model(dense, big), model(dense, edge), rtol=0, atol=0)
    # TorchRec's variable batch (VBE): per-key batch sizes and the inverse indices that expand
    # each key to the batch; the same batch as a sparse_jax KJT gives the same logits
    import numpy as np

    import sparse_jax as sj

    inverse = torch.tensor([[0, 1, 1], [0, 0, 0], [0, 1, 0]])
    args = dict(stride_per_key_per_rank=[[2], [1], [2]])
    vbe = TorchRecKJT(
        keys=["a", "b", "c"],
        values=torch.tensor([1, 2, 3, 4, 5]),
        lengths=torch.tensor([1, 1, 2, 1, 0]),
        inverse_indices=(["a", "b", "c"], inverse),
        **args,
    )
    same = sj.KeyedJaggedTensor(
        ["a", "b", "c"],
        np.array([1, 2, 3, 4, 5]),
        lengths=np.array([1, 1, 2, 1, 0]),
        inverse_indices=(["a", "b", "c"], inverse.numpy()),
        **args,
    )
    with torch.no_grad():
        got = model(dense, vbe)
        torch.testing.assert_close(got, model(dense, same), rtol=0, atol=0)
    assert got.shape == (3, 1)
