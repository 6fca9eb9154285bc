"""The served tower's DLRM interaction by one C call: `fused_interaction(library)` and
`interaction_rewrite(graph, attrs, fused)`.

An exported DLRM tower computes TorchRec's `InteractionArch` as five torch ops: the dense
arch's output stacked over the pooled features (`cat`), every pairwise dot at once (`bmm`
of the `[F + 1, D]` blocks with their transposes), the upper triangle gathered (`flatten`,
`index_select`: `_predictor._gather_rewrite`'s form) and set after the dense output
(`cat`). At batch 512 of 9 vectors of 64 the `bmm` alone took 0.25 ms of a 0.49 ms tower on
one thread: MKL's overhead per 9 x 64 block. `FusedInteraction` calls the kernel library's
`HybridrecInteraction` (`sparse_jax/_kernels/interaction_cpu.cc`) instead: per sample, its
vectors in L1, the dense output copied and the `F (F + 1) / 2` dots written straight into
the over arch's input row.

The dots sum in another order than MKL's, so the logits differ from the exported graph's in
the last bits (`hybrid.serving.load` checks them within `RTOL` / `ATOL` on probe batches and
otherwise keeps the graph). Unlike the batched matmul, a sample's row does not depend on
the batch it came in.
"""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np
import torch

__all__ = ["ENTRY", "FusedInteraction", "fused_interaction", "interaction_rewrite"]

ENTRY = "HybridrecInteraction"
RTOL, ATOL = 1e-4, 1e-5  # the fused tower's logits against the exported graph's, at load

_ATEN = torch.ops.aten


class FusedInteraction:
    """`(dense [B, D], sparse [B, F, D]) -> [B, D + F (F + 1) / 2]` fp32, as
    `InteractionArch.forward` (dense first, then the upper triangle of the pairwise dots
    of `[dense, f_1, ..., f_F]`, row-major), by the library's C entry on the calling thread."""

    __name__ = __qualname__ = "fused_interaction"  # the graph node's name (torch.fx)

    def __init__(self, entry):
        self._entry = entry

    def __call__(self, dense: torch.Tensor, sparse: torch.Tensor) -> torch.Tensor:
        batch, features, dim = sparse.shape
        if dense.dtype != torch.float32 or sparse.dtype != torch.float32:
            raise TypeError(
                f"the fused interaction takes float32 (got dense {dense.dtype}, sparse {sparse.dtype})"
            )
        if dense.stride(-1) != 1:
            dense = dense.contiguous()
        if sparse.stride(-1) != 1 or sparse.stride(1) != dim:
            sparse = sparse.contiguous()
        width = dim + features * (features + 1) // 2
        out = np.empty((batch, width), np.float32)
        status = self._entry(
            dense.data_ptr(),
            dense.stride(0),
            sparse.data_ptr(),
            sparse.stride(0),
            batch,
            features,
            dim,
            out.ctypes.data,
            width,
        )
        if status:
            raise ValueError(
                f"{ENTRY} refused dense {tuple(dense.shape)} / sparse {tuple(sparse.shape)}: "
                "the dense output must be [B, D] for sparse [B, F, D] with F + 1 <= 1024"
            )
        return torch.from_numpy(out)


def fused_interaction(library) -> FusedInteraction | str:
    """The fused interaction of the kernel `library` (`_kernel.library()`), or why not."""
    if isinstance(library, str):
        return library
    fn = getattr(library, ENTRY, None)
    if fn is None:
        return f"the C++ kernel library has no {ENTRY} (built from an older source)"
    p, i = ctypes.c_void_p, ctypes.c_int64
    fn.argtypes = [p, i, p, i, i, i, i, p, i]
    fn.restype = i
    return FusedInteraction(fn)


def _call(node: Any, target) -> bool:
    return isinstance(node, torch.fx.Node) and node.op == "call_function" and node.target is target


def _fp32_shape(node: Any) -> tuple | None:
    """The shape of the float32 tensor `node` computes (its traced value), else None."""
    val = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    return (
        tuple(val.shape) if isinstance(val, torch.Tensor) and val.dtype is torch.float32 else None
    )


def _interaction_inputs(node: torch.fx.Node, attrs: dict[str, Any]):
    """(dense output, stacked features) when `node` is `cat([A, dots], 1)` with `dots` the
    upper triangle of `bmm(C, C^T)` for `C = cat([A.unsqueeze(1), S], 1)`, `A` float32
    `[B, D]` and `S` float32 `[B, F, D]`; else None."""
    if not _call(node, _ATEN.cat.default) or len(node.args) != 2 or node.args[1] != 1:
        return None
    parts = node.args[0]
    if not (isinstance(parts, list | tuple) and len(parts) == 2):
        return None
    dense, dots = parts
    if not _call(dots, _ATEN.index_select.default) or dots.args[1] != 1:
        return None
    flat, index = dots.args[0], dots.args[2]
    if not _call(flat, _ATEN.flatten.using_ints) or tuple(flat.args[1:]) != (1,):
        return None
    gram = flat.args[0]
    if not _call(gram, _ATEN.bmm.default):
        return None
    stacked, transposed = gram.args
    if not (
        _call(transposed, _ATEN.transpose.int)
        and transposed.args[0] is stacked
        and sorted(transposed.args[1:]) == [1, 2]
        and _call(stacked, _ATEN.cat.default)
        and len(stacked.args) == 2
        and stacked.args[1] == 1
    ):
        return None
    pieces = stacked.args[0]
    if not (isinstance(pieces, list | tuple) and len(pieces) == 2):
        return None
    head, sparse = pieces
    if not (_call(head, _ATEN.unsqueeze.default) and head.args == (dense, 1)):
        return None
    a, s = _fp32_shape(dense), _fp32_shape(sparse)
    if not (
        a is not None
        and s is not None
        and len(a) == 2
        and len(s) == 3
        and isinstance(a[1], int)
        and all(isinstance(x, int) for x in s[1:])
        and s[2] == a[1]
    ):
        return None
    n = s[1] + 1
    rows, cols = torch.triu_indices(n, n, offset=1)
    if not (
        isinstance(index, torch.fx.Node)
        and index.op == "get_attr"
        and torch.equal(attrs[index.target].long(), rows * n + cols)
    ):
        return None
    return dense, sparse


def interaction_rewrite(
    graph: torch.fx.Graph, attrs: dict[str, Any], fused: FusedInteraction
) -> int:
    """Each DLRM interaction of `graph` (`_interaction_inputs`'s pattern, after
    `_gather_rewrite`) as one call of `fused`; returns how many it replaced."""
    replaced = 0
    for node in list(graph.nodes):
        found = _interaction_inputs(node, attrs)
        if found is None:
            continue
        with graph.inserting_before(node):
            call = graph.call_function(fused, found)
        node.replace_all_uses_with(call)
        graph.erase_node(node)
        replaced += 1
    if replaced:
        graph.eliminate_dead_code()
    return replaced
