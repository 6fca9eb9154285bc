"""dense_torch: KeyedTensor semantics, and every module against a plain-loop computation."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import dense_torch as dt
from dense_torch import KeyedTensor


def _allclose(a: torch.Tensor, b: torch.Tensor, tol: float = 1e-5) -> None:
    assert a.shape == b.shape, (a.shape, b.shape)
    torch.testing.assert_close(a, b, rtol=tol, atol=tol)


def _kt(batch: int, dims: dict[str, int], seed: int = 0) -> KeyedTensor:
    g = torch.Generator().manual_seed(seed)
    return KeyedTensor.from_tensor_list(
        list(dims), [torch.randn(batch, d, generator=g) for d in dims.values()]
    )


# --------------------------------------------------------------------------- KeyedTensor


def test_keyed_tensor_from_tensor_list_round_trip():
    tensors = [torch.full((3, 2), 1.0), torch.full((3, 3), 2.0), torch.full((3, 4), 3.0)]
    kt = KeyedTensor.from_tensor_list(["a", "b", "c"], tensors)
    assert kt.keys() == ["a", "b", "c"]
    assert kt.length_per_key() == [2, 3, 4]
    assert kt.offset_per_key() == [0, 2, 5, 9]
    assert kt.key_dim() == 1
    assert len(kt) == 3 and "b" in kt and "z" not in kt
    _allclose(kt.values(), torch.cat(tensors, dim=1))
    for key, tensor in zip(kt.keys(), tensors, strict=True):
        _allclose(kt[key], tensor)
    as_dict = kt.to_dict()
    assert list(as_dict) == ["a", "b", "c"]
    for key, tensor in zip(kt.keys(), tensors, strict=True):
        _allclose(as_dict[key], tensor)
    # Blocks are views: no copy.
    assert kt["b"].data_ptr() == kt.values()[:, 2:5].data_ptr()
    rebuilt = KeyedTensor(kt.keys(), kt.length_per_key(), kt.values())
    _allclose(rebuilt["c"], tensors[2])
    assert "a': 2" in repr(kt)


def test_keyed_tensor_key_dim_0():
    tensors = [torch.arange(6.0).reshape(2, 3), torch.arange(3.0).reshape(1, 3)]
    kt = KeyedTensor.from_tensor_list(["x", "y"], tensors, key_dim=0, cat_dim=0)
    assert kt.length_per_key() == [2, 1]
    _allclose(kt["y"], tensors[1])
    _allclose(kt.to_dict()["x"], tensors[0])


def test_keyed_tensor_regroup_across_keyed_tensors():
    kt1 = _kt(4, {"a": 2, "b": 3}, seed=1)
    kt2 = _kt(4, {"c": 1, "d": 4}, seed=2)
    groups = [["d", "a"], ["b"], ["a", "c", "b"], []]
    out = KeyedTensor.regroup([kt1, kt2], groups)
    assert [t.shape for t in out] == [(4, 6), (4, 3), (4, 6), (4, 0)]
    _allclose(out[0], torch.cat([kt2["d"], kt1["a"]], dim=1))
    _allclose(out[1], kt1["b"])
    _allclose(out[2], torch.cat([kt1["a"], kt2["c"], kt1["b"]], dim=1))
    named = KeyedTensor.regroup_as_dict([kt1, kt2], groups[:2], ["first", "second"])
    assert list(named) == ["first", "second"]
    _allclose(named["second"], kt1["b"])
    only_empty = KeyedTensor.regroup([kt1], [[], []])
    assert [t.shape for t in only_empty] == [(4, 0), (4, 0)]


@settings(max_examples=25, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 4), min_size=1, max_size=6),
    batch=st.integers(1, 3),
    data=st.data(),
)
def test_keyed_tensor_regroup_matches_dict_lookup(lengths, batch, data):
    keys = [f"f{i}" for i in range(len(lengths))]
    values = torch.randn(batch, sum(lengths))
    kt = KeyedTensor(keys, lengths, values)
    groups = data.draw(st.lists(st.lists(st.sampled_from(keys), max_size=4), max_size=3))
    out = KeyedTensor.regroup([kt], groups)
    as_dict = kt.to_dict()
    for group, tensor in zip(groups, out, strict=True):
        expected = [as_dict[k] for k in group]
        if expected:
            _allclose(tensor, torch.cat(expected, dim=1))
        else:
            assert tensor.shape == (batch, 0)
    # to_dict -> from_tensor_list is the identity.
    again = KeyedTensor.from_tensor_list(list(as_dict), list(as_dict.values()))
    assert again.length_per_key() == lengths
    _allclose(again.values(), values)


@pytest.mark.parametrize(
    ("args", "kwargs", "error", "match"),
    [
        ((["a", "a"], [1, 1], torch.zeros(2, 2)), {}, ValueError, "'a' appears more than once"),
        ((["a", "b"], [1], torch.zeros(2, 1)), {}, ValueError, "2 keys but 1 entries"),
        ((["a", "b"], [1, 2], torch.zeros(2, 4)), {}, ValueError, "add up to 3.*size 4"),
        ((["a"], [-1], torch.zeros(2, 0)), {}, ValueError, "'a' has length -1"),
        ((["a"], [2], torch.zeros(2)), {}, ValueError, "key_dim=1 is not a dimension"),
        ((["a"], [2], [[1.0, 2.0]]), {}, TypeError, "must be a torch.Tensor"),
        ((["a"], [2], torch.zeros(2, 2)), {"key_dim": 2}, ValueError, "key_dim=2"),
    ],
)
def test_keyed_tensor_validation(args, kwargs, error, match):
    with pytest.raises(error, match=match):
        KeyedTensor(*args, **kwargs)


def test_keyed_tensor_lookup_errors():
    kt = _kt(2, {"a": 1, "b": 2})
    with pytest.raises(KeyError, match="no key 'z'.*'a', 'b'"):
        kt["z"]
    with pytest.raises(KeyError, match="group 1 names key 'z'"):
        KeyedTensor.regroup([kt], [["a"], ["z"]])
    with pytest.raises(ValueError, match="'a' is in more than one"):
        KeyedTensor.regroup([kt, _kt(2, {"a": 1})], [["a"]])
    with pytest.raises(ValueError, match="key_dim=0"):
        KeyedTensor.regroup([kt, KeyedTensor(["c"], [2], torch.zeros(2, 2), key_dim=0)], [])
    with pytest.raises(ValueError, match="2 keys and 1 tensors"):
        KeyedTensor.from_tensor_list(["a", "b"], [torch.zeros(2, 1)])
    with pytest.raises(ValueError, match="no tensors"):
        KeyedTensor.from_tensor_list([], [])
    with pytest.raises(ValueError, match="2 groups but 1 keys"):
        KeyedTensor.regroup_as_dict([kt], [["a"], ["b"]], ["x"])


# --------------------------------------------------------------------------- MLP


def _loop_mlp(mlp: dt.MLP, x: torch.Tensor, activations) -> torch.Tensor:
    """Each layer as explicit sums: y[b, o] = act(sum_i W[o, i] * x[b, i] + bias[o])."""
    for perceptron, act in zip(mlp._mlp, activations, strict=True):
        w, bias = perceptron._linear.weight, perceptron._linear.bias
        y = torch.zeros(x.shape[0], w.shape[0])
        for b, o in itertools.product(range(x.shape[0]), range(w.shape[0])):
            y[b, o] = sum(w[o, i] * x[b, i] for i in range(w.shape[1]))
            y[b, o] += 0.0 if bias is None else bias[o]
        x = act(y)
    return x


def _identity(t: torch.Tensor) -> torch.Tensor:
    return t


@pytest.mark.parametrize(
    ("activation", "loop_act"),
    [
        (torch.relu, torch.relu),
        ("relu", torch.relu),
        ("sigmoid", torch.sigmoid),
        (nn.Tanh, torch.tanh),
        (lambda: nn.Tanh(), torch.tanh),
        (nn.functional.gelu, nn.functional.gelu),
    ],
)
def test_mlp_matches_loop(activation, loop_act):
    torch.manual_seed(0)
    mlp = dt.MLP(5, [4, 3, 2], activation=activation)
    x = torch.randn(3, 5)
    with torch.no_grad():
        out = mlp(x)
        assert out.shape == (3, 2)
        _allclose(out, _loop_mlp(mlp, x, [loop_act] * 3))


def test_mlp_options():
    torch.manual_seed(0)
    x = torch.randn(2, 4)
    linear_last = dt.MLP(4, [3, 2], activation_on_last=False)
    no_bias = dt.MLP(4, [3], bias=False)
    assert no_bias._mlp[0]._linear.bias is None
    with torch.no_grad():
        _allclose(linear_last(x), _loop_mlp(linear_last, x, [torch.relu, _identity]))
        _allclose(no_bias(x), _loop_mlp(no_bias, x, [torch.relu]))
    # A module class gives each layer its own activation; an instance is shared.
    per_layer = dt.MLP(4, [3, 2], activation=nn.PReLU)
    assert per_layer._mlp[0]._activation_fn is not per_layer._mlp[1]._activation_fn
    shared = nn.PReLU()
    one = dt.MLP(4, [3, 2], activation=shared)
    assert one._mlp[0]._activation_fn is one._mlp[1]._activation_fn is shared
    assert dt.MLP(4, []).forward(x) is x
    perceptron = dt.Perceptron(4, 3, activation="sigmoid")
    _allclose(perceptron(x), torch.sigmoid(perceptron._linear(x)))


def test_mlp_errors():
    with pytest.raises(ValueError, match="'swish' is not a known name"):
        dt.MLP(3, [2], activation="swish")
    with pytest.raises(ValueError, match=r"layer_sizes\[1\]=0 must be a positive"):
        dt.MLP(3, [2, 0])
    with pytest.raises(TypeError, match="returned int"):
        dt.MLP(3, [2], activation=lambda: 3)
    with pytest.raises(TypeError, match="got int"):
        dt.MLP(3, [2], activation=3)


# --------------------------------------------------------------------------- cross nets


def _loop_cross(x0: torch.Tensor, matrices, biases) -> torch.Tensor:
    """x_{l+1}[b, i] = x0[b, i] * (sum_j M_l[i, j] x_l[b, j] + bias_l[i]) + x_l[b, i]."""
    batch, n = x0.shape
    xl = x0.clone()
    for m, bias in zip(matrices, biases, strict=True):
        nxt = torch.zeros_like(xl)
        for b, i in itertools.product(range(batch), range(n)):
            mixed = sum(m[i, j] * xl[b, j] for j in range(n)) + bias[i]
            nxt[b, i] = x0[b, i] * mixed + xl[b, i]
        xl = nxt
    return xl


def _randomize_biases(module: nn.Module) -> None:
    with torch.no_grad():
        for bias in module.bias:
            bias.normal_()


def test_crossnet_matches_loop():
    torch.manual_seed(0)
    net = dt.CrossNet(in_features=5, num_layers=3)
    _randomize_biases(net)
    assert [tuple(k.shape) for k in net.kernels] == [(5, 5)] * 3
    assert [tuple(b.shape) for b in net.bias] == [(5, 1)] * 3
    x = torch.randn(3, 5)
    with torch.no_grad():
        out = net(x)
        assert out.shape == (3, 5)
        _allclose(out, _loop_cross(x, list(net.kernels), [b[:, 0] for b in net.bias]))


def test_low_rank_crossnet_matches_loop():
    torch.manual_seed(0)
    net = dt.LowRankCrossNet(in_features=6, num_layers=2, low_rank=2)
    _randomize_biases(net)
    assert [tuple(w.shape) for w in net.W_kernels] == [(6, 2)] * 2
    assert [tuple(v.shape) for v in net.V_kernels] == [(2, 6)] * 2
    x = torch.randn(3, 6)
    with torch.no_grad():
        matrices = [w @ v for w, v in zip(net.W_kernels, net.V_kernels, strict=True)]
        _allclose(net(x), _loop_cross(x, matrices, list(net.bias)))
    _allclose(dt.LowRankCrossNet(6, 0)(x), x)


def test_crossnet_errors():
    with pytest.raises(ValueError, match="low_rank=0 must be >= 1"):
        dt.LowRankCrossNet(4, 2, low_rank=0)
    with pytest.raises(ValueError, match="in_features=0"):
        dt.CrossNet(0, 2)
    with pytest.raises(ValueError, match="num_layers=-1"):
        dt.LowRankCrossNet(4, -1)


# --------------------------------------------------------------------------- interaction


def _loop_interaction(dense: torch.Tensor, sparse: torch.Tensor) -> torch.Tensor:
    """[dense, then dot(v_i, v_j) for i < j over v = (dense, f_1, ..., f_F)] per sample."""
    rows = []
    for b in range(dense.shape[0]):
        vectors = [dense[b]] + [sparse[b, f] for f in range(sparse.shape[1])]
        dots = [
            sum(vectors[i][k] * vectors[j][k] for k in range(dense.shape[1]))
            for i in range(len(vectors))
            for j in range(i + 1, len(vectors))
        ]
        rows.append(torch.cat([dense[b], torch.stack(dots)]))
    return torch.stack(rows)


@pytest.mark.parametrize("num_features", [1, 2, 4])
def test_interaction_arch_matches_loop(num_features):
    batch, d = 3, 4
    dense, sparse = torch.randn(batch, d), torch.randn(batch, num_features, d)
    out = dt.InteractionArch(num_features)(dense, sparse)
    size = d + num_features + num_features * (num_features - 1) // 2
    assert out.shape == (batch, size) and dt.interaction_output_size(num_features, d) == size
    _allclose(out, _loop_interaction(dense, sparse))


def test_interaction_arch_edge_cases():
    dense = torch.randn(2, 3)
    assert dt.InteractionArch(0)(dense, torch.zeros(2, 0, 3)) is dense
    assert dt.interaction_output_size(0, 3) == 3
    with pytest.raises(ValueError, match=r"must be \[B, F, D\] = \[2, 2, 3\]"):
        dt.InteractionArch(2)(dense, torch.zeros(2, 3, 3))
    with pytest.raises(ValueError, match="dense_features must be"):
        dt.InteractionArch(2)(torch.zeros(2, 3, 1), torch.zeros(2, 2, 3))
    with pytest.raises(ValueError, match="num_sparse_features=-1"):
        dt.InteractionArch(-1)


def test_interaction_dcn_arch_is_crossnet_over_concat():
    torch.manual_seed(0)
    f, d = 2, 3
    crossnet = dt.LowRankCrossNet((f + 1) * d, num_layers=2, low_rank=2)
    arch = dt.InteractionDCNArch(f, crossnet)
    dense, sparse = torch.randn(4, d), torch.randn(4, f, d)
    flat = torch.cat([dense, sparse[:, 0], sparse[:, 1]], dim=1)
    with torch.no_grad():
        _allclose(arch(dense, sparse), crossnet(flat))
    assert dt.InteractionDCNArch(0, crossnet)(dense, torch.zeros(4, 0, d)) is dense


# --------------------------------------------------------------------------- DLRM


def _dlrm_by_hand(model: dt.DLRM, dense: torch.Tensor, kt: KeyedTensor) -> torch.Tensor:
    embedded = model.dense_arch(dense)
    sparse = torch.stack([kt[k] for k in kt.keys()], dim=1)
    over = model.over_arch.model
    hidden = over[0](_loop_interaction(embedded, sparse))
    return hidden @ over[1].weight.T + over[1].bias  # last layer: no activation


def test_dlrm_shape_and_composition():
    torch.manual_seed(0)
    model = dt.DLRM(
        embedding_dim=4,
        num_sparse_features=3,
        dense_in_features=5,
        dense_arch_layer_sizes=[6, 4],
        over_arch_layer_sizes=[7, 2],
    )
    dense, kt = torch.randn(8, 5), _kt(8, {"a": 4, "b": 4, "c": 4})
    with torch.no_grad():
        logits = model(dense, kt)
        assert logits.shape == (8, 2)
        _allclose(logits, _dlrm_by_hand(model, dense, kt))
        assert (logits < 0).any()  # the over arch's last layer is linear
    assert model.over_arch.model[0]._mlp[0]._linear.in_features == 4 + 3 + 3


def test_dlrm_single_layer_over_arch():
    model = dt.DLRM(2, 2, 3, [2], [1])
    assert model(torch.randn(4, 3), _kt(4, {"a": 2, "b": 2})).shape == (4, 1)


def test_dlrm_dcn_shape_and_composition():
    torch.manual_seed(0)
    model = dt.DLRM_DCN(4, 3, 5, [6, 4], [7, 1], dcn_num_layers=2, dcn_low_rank_dim=3)
    dense, kt = torch.randn(8, 5), _kt(8, {"a": 4, "b": 4, "c": 4})
    crossnet = model.inter_arch.crossnet
    assert isinstance(crossnet, dt.LowRankCrossNet) and crossnet.W_kernels[0].shape == (16, 3)
    with torch.no_grad():
        flat = torch.cat([model.dense_arch(dense), kt.values()], dim=1)
        _allclose(model(dense, kt), model.over_arch(crossnet(flat)))
        assert model(dense, kt).shape == (8, 1)


def test_dlrm_errors_name_the_feature():
    model = dt.DLRM(4, 2, 3, [4], [2, 1])
    dense = torch.randn(2, 3)
    with pytest.raises(ValueError, match="feature 'b' has embedding dim 3.*embedding_dim=4"):
        model(dense, _kt(2, {"a": 4, "b": 3}))
    with pytest.raises(ValueError, match="num_sparse_features=2.*3 features"):
        model(dense, _kt(2, {"a": 4, "b": 4, "c": 4}))
    with pytest.raises(ValueError, match="batch size 5 but dense_features have 2"):
        model(dense, _kt(5, {"a": 4, "b": 4}))
    with pytest.raises(ValueError, match=r"dense_features must be \[B, 3\].*got shape \(2, 4\)"):
        model(torch.randn(2, 4), _kt(2, {"a": 4, "b": 4}))
    with pytest.raises(ValueError, match=r"dense_features must be \[B, 3\].*got shape \(6,\)"):
        model(torch.randn(6), _kt(2, {"a": 4, "b": 4}))
    with pytest.raises(TypeError, match="expects embeddings as a dense_torch.KeyedTensor"):
        model(dense, torch.zeros(2, 8))
    with pytest.raises(ValueError, match="keyed along dim 1"):
        model(dense, KeyedTensor(["a", "b"], [1, 1], torch.zeros(2, 4), key_dim=0))
    with pytest.raises(ValueError, match="last layer size must equal embedding_dim=4"):
        dt.DLRM(4, 2, 3, [8, 5], [2, 1])
    with pytest.raises(ValueError, match="num_sparse_features=0"):
        dt.DLRM(4, 0, 3, [4], [1])
    with pytest.raises(ValueError, match="OverArch layer_sizes is empty"):
        dt.DLRM(4, 1, 3, [4], [])
    with pytest.raises(ValueError, match="1 feature_names"):
        dt.DLRM(4, 2, 3, [4], [1], feature_names=["a"])


def test_dlrm_from_feature_dims():
    model = dt.DLRM.from_feature_dims({"a": 4, "b": 4}, 3, [4], [2, 1])
    assert model.feature_names == ["a", "b"] and model.num_sparse_features == 2
    assert model(torch.randn(2, 3), _kt(2, {"a": 4, "b": 4})).shape == (2, 1)
    with pytest.raises(ValueError, match=r"\['a', 'b'\] \(in this order\).*\['b', 'a'\]"):
        model(torch.randn(2, 3), _kt(2, {"b": 4, "a": 4}))
    with pytest.raises(ValueError, match="feature 'c' has 8 but 'a' has 4"):
        dt.DLRM.from_feature_dims({"a": 4, "b": 4, "c": 8}, 3, [4], [2, 1])
    with pytest.raises(ValueError, match="got no features"):
        dt.DLRM.from_feature_dims({}, 3, [4], [2, 1])
    dcn = dt.DLRM_DCN.from_feature_dims(
        {"a": 4, "b": 4}, 3, [4], [2, 1], dcn_num_layers=1, dcn_low_rank_dim=2
    )
    assert isinstance(dcn, dt.DLRM_DCN)
    assert dcn(torch.randn(2, 3), _kt(2, {"a": 4, "b": 4})).shape == (2, 1)


def test_dlrm_learns_a_planted_signal():
    torch.manual_seed(0)
    batch, d = 256, 4
    dense = torch.randn(batch, 3)
    kt = _kt(batch, {"user": d, "item": d}, seed=3)
    # The label depends on one dense feature and on the user x item agreement.
    score = dense[:, 0] + (kt["user"] * kt["item"]).sum(dim=1)
    labels = (score > 0).float()
    model = dt.DLRM(d, 2, 3, [8, d], [8, 1])
    optimizer = torch.optim.Adam(model.parameters(), lr=0.03)
    losses = []
    for _ in range(60):
        optimizer.zero_grad()
        loss = nn.functional.binary_cross_entropy_with_logits(model(dense, kt)[:, 0], labels)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0], losses[::10]
    with torch.no_grad():
        accuracy = ((model(dense, kt)[:, 0] > 0).float() == labels).float().mean()
    assert accuracy > 0.9, accuracy


# --------------------------------------------------------------------------- TwoTower


def test_two_tower_shapes_and_dot_product():
    torch.manual_seed(0)
    tower = dt.TwoTower(["user", "ctx"], ["item"], embedding_dim=3, layer_sizes=[5, 4])
    kt = _kt(6, {"item": 3, "unused": 2, "user": 3, "ctx": 3})
    with torch.no_grad():
        query, candidate = tower.query_embedding(kt), tower.candidate_embedding(kt)
        assert query.shape == candidate.shape == (6, 4)
        expected_query = _loop_mlp(
            tower.query_proj, torch.cat([kt["user"], kt["ctx"]], dim=1), [torch.relu] * 2
        )
        _allclose(query, expected_query)
        _allclose(candidate, _loop_mlp(tower.candidate_proj, kt["item"], [torch.relu] * 2))
        logits = tower(torch.randn(6, 2), kt)
        assert logits.shape == (6,)
        expected = torch.stack(
            [sum(query[b, e] * candidate[b, e] for e in range(4)) for b in range(6)]
        )
        _allclose(logits, expected)
        _allclose(tower(None, kt), logits)
        assert tower.query_proj._mlp[0]._linear.in_features == 6
    signed = dt.TwoTower(["user"], ["item"], 3, [4], activation_on_last=False)
    assert (signed.query_embedding(kt) < 0).any()


def test_two_tower_errors():
    tower = dt.TwoTower(["u"], ["i"], 2, [3])
    with pytest.raises(KeyError, match="needs feature 'i'"):
        tower(None, _kt(2, {"u": 2}))
    with pytest.raises(ValueError, match="feature 'i' has embedding dim 5"):
        tower(None, _kt(2, {"u": 2, "i": 5}))
    with pytest.raises(ValueError, match="batch size 2 but dense_features have 3"):
        tower(torch.zeros(3, 1), _kt(2, {"u": 2, "i": 2}))
    with pytest.raises(ValueError, match="query_features is empty"):
        dt.TwoTower([], ["i"], 2, [3])
    with pytest.raises(ValueError, match="names feature 'i' twice"):
        dt.TwoTower(["u"], ["i", "i"], 2, [3])
    with pytest.raises(ValueError, match="layer_sizes is empty"):
        dt.TwoTower(["u"], ["i"], 2, [])


# --------------------------------------------------------------------------- determinism


@pytest.mark.parametrize(
    "build",
    [
        lambda: dt.MLP(4, [3, 2]),
        lambda: dt.CrossNet(4, 2),
        lambda: dt.LowRankCrossNet(4, 2, 2),
        lambda: dt.DLRM(4, 2, 3, [5, 4], [3, 1]),
        lambda: dt.DLRM_DCN(4, 2, 3, [5, 4], [3, 1], 2, 2),
        lambda: dt.TwoTower(["u"], ["i"], 4, [3]),
    ],
)
def test_initialization_is_deterministic_under_manual_seed(build):
    torch.manual_seed(7)
    first = build().state_dict()
    torch.manual_seed(7)
    second = build().state_dict()
    torch.manual_seed(8)
    third = build().state_dict()
    assert list(first) == list(second)
    for key in first:
        assert torch.equal(first[key], second[key]), key
    assert any(not torch.equal(first[k], third[k]) for k in first)
