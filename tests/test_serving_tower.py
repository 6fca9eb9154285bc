"""The served dense tower (`hybrid.serving._predictor._lean_forward`): the exported graph
as one plain function, with the interaction's advanced index as the same gather by
`index_select`, bit for bit the exported program's logits at every batch size; a graph it
cannot take runs as exported."""

from __future__ import annotations

import torch

from hybrid.serving._predictor import _lean_forward

ATEN = torch.ops.aten


class _Tower(torch.nn.Module):
    """A DLRM-like tower: dense MLP, pooled rows, pairwise dots by one bmm, upper triangle
    by advanced index, over MLP."""

    def __init__(self, n_dense=5, dim=4, features=3):
        super().__init__()
        torch.manual_seed(0)
        self.features, self.dim = features, dim
        self.bottom = torch.nn.Linear(n_dense, dim)
        rows, cols = torch.triu_indices(features + 1, features + 1, offset=1)
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


def test_the_lean_tower_is_the_exported_graph_bit_for_bit_with_index_select():
    module = _exported(_Tower())
    forward = _lean_forward(module, (5, torch.float32), 12, 64)
    assert forward is not module.forward
    ops = {id(v) for v in forward.__globals__.values()}
    assert id(ATEN.index_select.default) in ops and id(ATEN.index.Tensor) not in ops
    gen = torch.Generator().manual_seed(1)
    with torch.inference_mode():
        for batch in (1, 2, 3, 17, 64):
            dense, pooled = (
                torch.randn(batch, 5, generator=gen),
                torch.randn(batch, 12, generator=gen),
            )
            assert torch.equal(forward(dense, pooled), module.forward(dense, pooled)), batch


def test_a_module_without_a_graph_runs_as_it_is():
    tower = _Tower()
    assert _lean_forward(tower, (5, torch.float32), 12, 64) == tower.forward
