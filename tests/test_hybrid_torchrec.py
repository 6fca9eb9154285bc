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


def test_torchrec_dlrm_checkpoint_and_kjt_give_the_same_logits():
    torch.manual_seed(0)
    tr_tables = [
        tr_configs.EmbeddingBagConfig(
            name=n,
            num_embeddings=e,
            embedding_dim=DIM,
            feature_names=f,
            pooling=tr_configs.PoolingType[p],
        )
        for n, e, f, p in TABLES
    ]
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
