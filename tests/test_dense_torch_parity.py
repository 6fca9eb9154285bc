"""dense_torch against TorchRec 1.8.0 (the oracle): same weights and inputs, same outputs.

TorchRec's towers run end to end (EmbeddingBagCollection + KeyedJaggedTensor); ours get the
pooled KeyedTensor that TorchRec's EmbeddingBagCollection returns, and the dense part of
TorchRec's state_dict (every key not under `sparse_arch.`).
"""

from __future__ import annotations

import pytest
import torch

torchrec = pytest.importorskip("torchrec")

from torchrec.models import dlrm as tr_dlrm  # noqa: E402
from torchrec.modules import crossnet as tr_crossnet  # noqa: E402
from torchrec.modules import mlp as tr_mlp  # noqa: E402
from torchrec.modules.embedding_configs import EmbeddingBagConfig  # noqa: E402
from torchrec.modules.embedding_modules import EmbeddingBagCollection  # noqa: E402
from torchrec.sparse import jagged_tensor as tr_jt  # noqa: E402

import dense_torch as dt  # noqa: E402

pytestmark = pytest.mark.parity

TOL = 1e-6
FEATURES = ["f1", "f2", "f3"]  # table t1 serves f1 and f2, table t2 serves f3


def _close(ours: torch.Tensor, theirs: torch.Tensor) -> None:
    assert ours.shape == theirs.shape, (ours.shape, theirs.shape)
    torch.testing.assert_close(ours, theirs, rtol=TOL, atol=TOL)


def _same_state(ours: torch.nn.Module, theirs: torch.nn.Module) -> None:
    a, b = ours.state_dict(), theirs.state_dict()
    assert list(a) == list(b)
    for key in a:
        assert torch.equal(a[key], b[key]), key


def _ebc(dim: int) -> EmbeddingBagCollection:
    torch.manual_seed(0)
    return EmbeddingBagCollection(
        tables=[
            EmbeddingBagConfig(
                name="t1", num_embeddings=20, embedding_dim=dim, feature_names=["f1", "f2"]
            ),
            EmbeddingBagConfig(
                name="t2", num_embeddings=10, embedding_dim=dim, feature_names=["f3"]
            ),
        ]
    )


def _kjt(batch: int) -> tr_jt.KeyedJaggedTensor:
    g = torch.Generator().manual_seed(1)
    lengths = torch.randint(0, 4, (len(FEATURES) * batch,), generator=g)
    lengths[0] = 0  # an empty bag
    values = torch.randint(0, 10, (int(lengths.sum()),), generator=g)
    return tr_jt.KeyedJaggedTensor.from_lengths_sync(FEATURES, values, lengths)


def _pooled(ebc: EmbeddingBagCollection, batch: int) -> dt.KeyedTensor:
    theirs = ebc(_kjt(batch))
    return dt.KeyedTensor(theirs.keys(), theirs.length_per_key(), theirs.values().detach())


def _dense_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v for k, v in model.state_dict().items() if not k.startswith("sparse_arch.")}


class _DenseWrapper(torch.nn.Module):
    """TorchRec's DLRM without its sparse arch, for a state_dict comparison."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.dense_arch, self.inter_arch, self.over_arch = (
            model.dense_arch,
            model.inter_arch,
            model.over_arch,
        )


# --------------------------------------------------------------------------- KeyedTensor


def test_keyed_tensor_matches_torchrec():
    tensors = [torch.randn(3, n) for n in (2, 1, 4, 3)]
    keys = ["a", "b", "c", "d"]
    ours = dt.KeyedTensor.from_tensor_list(keys, tensors)
    theirs = tr_jt.KeyedTensor.from_tensor_list(keys, tensors)
    assert ours.offset_per_key() == theirs.offset_per_key()
    assert ours.length_per_key() == theirs.length_per_key()
    _close(ours.values(), theirs.values())
    for key in keys:
        _close(ours[key], theirs[key])
        _close(ours.to_dict()[key], theirs.to_dict()[key])
    other = [torch.randn(3, 2)]
    ours2 = dt.KeyedTensor.from_tensor_list(["e"], other)
    theirs2 = tr_jt.KeyedTensor.from_tensor_list(["e"], other)
    for groups in ([["c", "e"], ["a", "d", "b"]], [["a", "a", "e"], ["d"], ["e", "b"]]):
        got = dt.KeyedTensor.regroup([ours, ours2], groups)
        want = tr_jt.KeyedTensor.regroup([theirs, theirs2], groups)
        for g, w in zip(got, want, strict=True):
            _close(g, w)


# --------------------------------------------------------------------------- blocks


@pytest.mark.parametrize("activation", [torch.relu, "relu", "sigmoid", torch.nn.Tanh])
def test_mlp_matches_torchrec_init_and_output(activation):
    torch.manual_seed(3)
    theirs = tr_mlp.MLP(6, [5, 4, 2], activation=activation)
    torch.manual_seed(3)
    ours = dt.MLP(6, [5, 4, 2], activation=activation)
    _same_state(ours, theirs)
    x = torch.randn(4, 6)
    _close(ours(x), theirs(x))


def test_crossnets_match_torchrec_init_and_output():
    x = torch.randn(4, 9)
    for make_ours, make_theirs in [
        (lambda: dt.CrossNet(9, 3), lambda: tr_crossnet.CrossNet(9, 3)),
        (
            lambda: dt.LowRankCrossNet(9, 3, low_rank=2),
            lambda: tr_crossnet.LowRankCrossNet(9, 3, low_rank=2),
        ),
    ]:
        torch.manual_seed(5)
        theirs = make_theirs()
        torch.manual_seed(5)
        ours = make_ours()
        _same_state(ours, theirs)
        with torch.no_grad():
            for p in theirs.bias:
                p.normal_()
        ours.load_state_dict(theirs.state_dict())
        _close(ours(x), theirs(x))


def test_interaction_arch_matches_torchrec():
    dense, sparse = torch.randn(5, 4), torch.randn(5, 3, 4)
    _close(dt.InteractionArch(3)(dense, sparse), tr_dlrm.InteractionArch(3)(dense, sparse))


# --------------------------------------------------------------------------- towers


def test_dlrm_matches_torchrec_dlrm():
    dim, batch = 4, 6
    ebc = _ebc(dim)
    torch.manual_seed(11)
    theirs = tr_dlrm.DLRM(
        embedding_bag_collection=ebc,
        dense_in_features=5,
        dense_arch_layer_sizes=[7, dim],
        over_arch_layer_sizes=[6, 3, 1],
    )
    torch.manual_seed(11)
    ours = dt.DLRM(dim, len(FEATURES), 5, [7, dim], [6, 3, 1], feature_names=FEATURES)
    _same_state(ours, _DenseWrapper(theirs))  # same seed, same creation order: same init
    dense = torch.randn(batch, 5)
    with torch.no_grad():
        want = theirs(dense_features=dense, sparse_features=_kjt(batch))
        got = ours(dense, _pooled(ebc, batch))
    assert got.shape == (batch, 1)
    _close(got, want)


def test_dlrm_dcn_matches_torchrec_dlrm_dcn():
    dim, batch = 4, 6
    ebc = _ebc(dim)
    theirs = tr_dlrm.DLRM_DCN(
        embedding_bag_collection=ebc,
        dense_in_features=5,
        dense_arch_layer_sizes=[7, dim],
        over_arch_layer_sizes=[6, 2],
        dcn_num_layers=2,
        dcn_low_rank_dim=3,
    )
    with torch.no_grad():
        for p in theirs.inter_arch.crossnet.bias:
            p.normal_()
    ours = dt.DLRM_DCN(dim, len(FEATURES), 5, [7, dim], [6, 2], 2, 3)
    ours.load_state_dict(_dense_state(theirs))  # strict: the names map one to one
    dense = torch.randn(batch, 5)
    with torch.no_grad():
        want = theirs(dense_features=dense, sparse_features=_kjt(batch))
        got = ours(dense, _pooled(ebc, batch))
    assert got.shape == (batch, 2)
    _close(got, want)


def test_two_tower_matches_torchrec_example_formula():
    """TorchRec's retrieval example: MLP(cat(pooled[f] for f in group)), logit = sum(q * c)."""
    dim, batch = 4, 6
    ebc = _ebc(dim)
    ours = dt.TwoTower(["f1", "f2"], ["f3"], dim, [5, 3])
    query_proj = tr_mlp.MLP(2 * dim, [5, 3])
    candidate_proj = tr_mlp.MLP(dim, [5, 3])
    query_proj.load_state_dict(ours.query_proj.state_dict())
    candidate_proj.load_state_dict(ours.candidate_proj.state_dict())
    with torch.no_grad():
        pooled = ebc(_kjt(batch))
        query = query_proj(torch.cat([pooled["f1"], pooled["f2"]], dim=1))
        candidate = candidate_proj(pooled["f3"])
        want = (query * candidate).sum(dim=1)
        got = ours(None, _pooled(ebc, batch))
    _close(ours.query_embedding(_pooled(ebc, batch)).detach(), query)
    _close(got, want)
