"""hybridrec's dense side, in PyTorch only (this package never imports jax).

The dense contract
------------------
A dense module is any `torch.nn.Module` called as

    logits = dense(dense_features, embeddings)

- `dense_features`: `Tensor[B, n_dense]`, the batch's dense (float) features.
- `embeddings`: a `KeyedTensor` of the pooled sparse features, as an
  EmbeddingBagCollection returns them (TorchRec's layout): `embeddings.values()` is
  `[B, sum of per-feature dims]` with `key_dim=1`, one block per feature, the features in
  the order of the table configs' `feature_names` (table by table, then feature by feature
  within a table); `embeddings[name]` is that feature's `[B, dim]` block.

`hybrid.Model` hands the sparse step's pooled output to its dense module in this form and
sends the gradient of `embeddings.values()` back to the sparse side. Any module keeping the
contract can be used; the ones here are TorchRec's, with TorchRec's arguments and
parameter names:

- building blocks: `MLP` / `Perceptron`, `CrossNet` / `LowRankCrossNet`,
  `InteractionArch` (DLRM dot interaction), `InteractionDCNArch` (DCN-v2 interaction);
- towers keeping the contract: `DLRM`, `DLRM_DCN` (logits `[B, O]`), `TwoTower` (logit `[B]`).

Initialization uses torch's global generator only, so it is deterministic under
`torch.manual_seed`.
"""

from ._crossnet import CrossNet, LowRankCrossNet
from ._dlrm import DLRM, DLRM_DCN, DenseArch, OverArch
from ._interaction import InteractionArch, InteractionDCNArch, interaction_output_size
from ._keyed_tensor import KeyedTensor
from ._mlp import MLP, Activation, Perceptron
from ._two_tower import TwoTower

__all__ = [
    "DLRM",
    "DLRM_DCN",
    "MLP",
    "Activation",
    "CrossNet",
    "DenseArch",
    "InteractionArch",
    "InteractionDCNArch",
    "KeyedTensor",
    "LowRankCrossNet",
    "OverArch",
    "Perceptron",
    "TwoTower",
    "interaction_output_size",
]
