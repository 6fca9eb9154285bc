"""The served dense tower (`hybrid.serving._predictor._lean_forward`): the exported graph
as one plain function, with the interaction's advanced index as the same gather by
`index_select`, bit for bit the exported program's logits at every batch size; a graph it
cannot take runs as exported. With the fused interaction (`_fused_forward`,
`hybrid.serving._interaction`): the kernel equals the plain loops of `reference.py`, a
sample's row is the same in any batch, the tower's logits are the graph's within the load
check's tolerance, and a tower with another interaction keeps its graph."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import hybrid.serving as serving
from hybrid.serving import _kernel
from hybrid.serving._interaction import ATOL, RTOL, FusedInteraction, fused_interaction
from hybrid.serving._predictor import _fused_forward, _lean_forward
from tests import reference

ATEN = torch.ops.aten


class _Tower(torch.nn.Module):
    """A DLRM-like tower: dense MLP, pooled rows, pairwise dots by one bmm, upper triangle
    by advanced index, over MLP."""

    def __init__(self, n_dense=5, dim=4, features=3, offset=1):
        super().__init__()
        torch.manual_seed(0)
        self.features, self.dim = features, dim
        self.bottom = torch.nn.Linear(n_dense, dim)
        rows, cols = torch.triu_indices(features + 1, features + 1, offset=offset)
        self.register_buffer("rows", rows)
        self.register_buffer("cols", cols)
        self.top = torch.nn.Linear(dim + rows.shape[0], 1)

    def forward(self, dense, pooled):
        x = torch.relu(self.bottom(dense))
        stacked = torch.cat([x.unsqueeze(1), pooled.reshape(-1, self.features, self.dim)], 1)
        dots = torch.bmm(stacked, stacked.transpose(1, 2))[:, self.rows, self.cols]
        return self.top(torch.cat([x, dots], 1))


def _exported(tower):
    batch = torch.export.Dim("batch", min=1, max=64)
    program = torch.export.export(
        tower,
        (torch.randn(4, 5), torch.randn(4, 12)),
        dynamic_shapes=({0: batch}, {0: batch}),
    )
    return program.module(check_guards=False)


def _inputs(seed: int):
    """(dense [B, 5], pooled [B, 12]) for B in 1, 2, 3, 17, 64: `_Tower`'s inputs."""
    gen = torch.Generator().manual_seed(seed)
    for batch in (1, 2, 3, 17, 64):
        yield torch.randn(batch, 5, generator=gen), torch.randn(batch, 12, generator=gen)


def test_the_lean_tower_is_the_exported_graph_bit_for_bit_with_index_select():
    module = _exported(_Tower())
    forward = _lean_forward(module, (5, torch.float32), 12, 64)
    assert forward is not module.forward
    ops = {id(v) for v in forward.__globals__.values()}
    assert id(ATEN.index_select.default) in ops and id(ATEN.index.Tensor) not in ops
    with torch.inference_mode():
        for dense, pooled in _inputs(seed=1):
            assert torch.equal(forward(dense, pooled), module.forward(dense, pooled)), len(dense)


def test_a_module_without_a_graph_runs_as_it_is():
    tower = _Tower()
    assert _lean_forward(tower, (5, torch.float32), 12, 64) == tower.forward


@pytest.fixture(scope="module")
def fused() -> FusedInteraction:
    found = fused_interaction(_kernel.library())
    if isinstance(found, str):
        pytest.skip(found)
    return found


@pytest.mark.parametrize(
    ("batch", "features", "dim"),
    [(1, 1, 1), (3, 0, 4), (5, 3, 4), (7, 2, 5), (4, 8, 16), (6, 3, 17), (2, 8, 64), (3, 4, 70)],
)
def test_the_fused_interaction_is_the_reference_loops(fused, batch, features, dim):
    gen = torch.Generator().manual_seed(batch * 100 + features * 10 + dim)
    dense = torch.randn(batch, dim, generator=gen)
    sparse = torch.randn(batch, features, dim, generator=gen)
    got = fused(dense, sparse)
    assert got.shape == (batch, dim + features * (features + 1) // 2)
    assert torch.equal(got[:, :dim], dense)  # the dense output, untouched
    want = reference.interaction_loop(dense.numpy(), sparse.numpy())
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-5, atol=1e-5 * dim)
    # a sample's row is the same alone as in its batch (the batched matmul's is not)
    for b in range(batch):
        assert torch.equal(fused(dense[b : b + 1], sparse[b : b + 1]), got[b : b + 1])
    # strided inputs: columns of wider rows, the features not contiguous
    wide = torch.randn(batch, dim + 3, generator=gen)[:, 2 : 2 + dim]
    spread = torch.randn(batch, features, dim + 2, generator=gen)[:, :, 1 : 1 + dim]
    want = reference.interaction_loop(wide.numpy(), spread.numpy())
    np.testing.assert_allclose(fused(wide, spread).numpy(), want, rtol=1e-5, atol=1e-5 * dim)


def test_the_fused_interaction_refuses_what_does_not_fit(fused):
    with pytest.raises(ValueError, match="refused dense"):
        fused(torch.randn(2, 3), torch.randn(2, 2, 4))  # dense narrower than the features
    with pytest.raises(TypeError, match="float32"):
        fused(torch.randn(2, 4, dtype=torch.float64), torch.randn(2, 2, 4))


def test_the_fused_tower_calls_the_kernel_and_gives_the_graphs_logits(fused):
    module = _exported(_Tower())
    forward = _fused_forward(module, (5, torch.float32), 12, 64, fused)
    assert callable(forward), forward
    ops = {id(v) for v in forward.__globals__.values()}
    assert id(fused) in ops
    assert not ops & {id(ATEN.bmm.default), id(ATEN.index.Tensor), id(ATEN.index_select.default)}
    with torch.inference_mode():
        for dense, pooled in _inputs(seed=2):
            torch.testing.assert_close(
                forward(dense, pooled), module.forward(dense, pooled), rtol=RTOL, atol=ATOL
            )


@pytest.mark.parametrize("offset", [0, 2])
def test_a_tower_with_another_interaction_keeps_its_graph(fused, offset):
    """The diagonal included (offset 0) or a pair left out (offset 2): not TorchRec's
    interaction, so not the kernel's."""
    module = _exported(_Tower(offset=offset))
    why = _fused_forward(module, (5, torch.float32), 12, 64, fused)
    assert why == "the dense tower holds no DLRM interaction (InteractionArch) the kernel takes"


def test_a_module_without_a_graph_keeps_its_forward(fused):
    why = _fused_forward(_Tower(), (5, torch.float32), 12, 64, fused)
    assert why == "the dense tower is not a graph of (dense_features, pooled) -> logits"


def test_load_takes_only_the_interactions_it_knows(tmp_path):
    with pytest.raises(ValueError, match="interaction='bmm'"):
        serving.load(tmp_path, interaction="bmm")
