"""Click-model metrics: exact over an eval set, windowed and lifetime for training loss.

`eval_metrics(logits, labels)` over the whole eval set (not averaged per batch):
- `auc`: ROC AUC (`binary_auc`: the rank statistic, ties counted half, as torchmetrics'
  `binary_auroc`; NaN when the labels are all one class);
- `log_loss`: mean binary cross-entropy of `sigmoid(logits)`;
- `ne`: normalized entropy, `log_loss / H(p)` with `p` the eval set's click rate and
  `H(p) = -p log p - (1-p) log(1-p)` (1.0 = no better than predicting the base rate);
- `accuracy`: share of samples with `(logit > 0) == label`;
- `base_rate`, `count`.
`LossTracker` keeps the mean training loss over the last `window` steps and over all steps.
"""

from __future__ import annotations

import collections
import math

import torch

__all__ = ["LossTracker", "binary_auc", "eval_metrics", "normalized_entropy"]


def normalized_entropy(log_loss: float, base_rate: float) -> float:
    """`log_loss / H(base_rate)`; inf when the labels are all one class (H = 0)."""
    if base_rate <= 0.0 or base_rate >= 1.0:
        return math.inf
    entropy = -(base_rate * math.log(base_rate) + (1 - base_rate) * math.log(1 - base_rate))
    return log_loss / entropy


def binary_auc(scores: torch.Tensor, labels: torch.Tensor) -> float:
    """ROC AUC of `scores [N]` against 0/1 `labels [N]`: the probability that a random
    positive scores above a random negative, a tie counting half (the Mann-Whitney rank
    statistic, with tied scores given their average rank). Equals torchmetrics'
    `binary_auroc`; NaN when the labels hold one class only (no pair to compare; torchmetrics
    warns and returns 0 there)."""
    s = scores.detach().reshape(-1).to(torch.float64)
    pos = labels.detach().reshape(-1) > 0.5
    n_pos = int(pos.sum())
    n_neg = s.numel() - n_pos
    if n_pos == 0 or n_neg == 0:
        return math.nan
    order = torch.argsort(s)
    _, inverse, counts = torch.unique_consecutive(s[order], return_inverse=True, return_counts=True)
    last = torch.cumsum(counts, 0).to(torch.float64)  # 1-based rank of each tie group's last member
    average = last - (counts.to(torch.float64) - 1) / 2
    ranks = torch.empty_like(s)
    ranks[order] = average[inverse]
    return float((ranks[pos].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


def eval_metrics(logits: torch.Tensor, labels: torch.Tensor) -> dict[str, float]:
    """Metrics of `logits [N]` (pre-sigmoid) against 0/1 `labels [N]` (module docstring)."""
    logits = logits.detach().reshape(-1).to(torch.float64)
    labels = labels.detach().reshape(-1).to(torch.float64)
    if logits.shape != labels.shape or logits.numel() == 0:
        raise ValueError(
            f"eval_metrics: {logits.numel()} logits and {labels.numel()} labels; need as many, > 0"
        )
    log_loss = float(torch.nn.functional.binary_cross_entropy_with_logits(logits, labels))
    base_rate = float(labels.mean())
    return {
        "auc": binary_auc(logits, labels),
        "log_loss": log_loss,
        "ne": normalized_entropy(log_loss, base_rate),
        "accuracy": float(((logits > 0).to(torch.float64) == labels).to(torch.float64).mean()),
        "base_rate": base_rate,
        "count": int(labels.numel()),
    }


class LossTracker:
    """Training loss: the last value, the mean of the last `window` steps, the lifetime mean."""

    def __init__(self, window: int = 100):
        if window < 1:
            raise ValueError(f"LossTracker window={window} must be >= 1")
        self._recent: collections.deque[float] = collections.deque(maxlen=window)
        self.total, self.count, self.last = 0.0, 0, math.nan

    def add(self, loss: float) -> None:
        self._recent.append(loss)
        self.total += loss
        self.count += 1
        self.last = loss

    @property
    def windowed(self) -> float:
        return sum(self._recent) / len(self._recent) if self._recent else math.nan

    @property
    def lifetime(self) -> float:
        return self.total / self.count if self.count else math.nan

    def state_dict(self) -> dict:
        return {
            "recent": list(self._recent),
            "total": self.total,
            "count": self.count,
            "last": self.last,
        }

    def load_state_dict(self, state: dict) -> None:
        self._recent.clear()
        self._recent.extend(state["recent"])
        self.total, self.count, self.last = state["total"], state["count"], state["last"]
