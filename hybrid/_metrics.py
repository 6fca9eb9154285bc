"""Click-model metrics: exact over an eval set, windowed and lifetime for training loss.

`eval_metrics(logits, labels)` over the whole eval set (not averaged per batch):
- `auc`: ROC AUC (torchmetrics' `binary_auroc`, ties counted half);
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
from torchmetrics.functional.classification import binary_auroc

__all__ = ["LossTracker", "eval_metrics", "normalized_entropy"]


def normalized_entropy(log_loss: float, base_rate: float) -> float:
    """`log_loss / H(base_rate)`; inf when the labels are all one class (H = 0)."""
    if base_rate <= 0.0 or base_rate >= 1.0:
        return math.inf
    entropy = -(base_rate * math.log(base_rate) + (1 - base_rate) * math.log(1 - base_rate))
    return log_loss / entropy


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
        "auc": float(binary_auroc(logits, labels.long())),
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
