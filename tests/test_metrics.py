"""hybrid.training._metrics against hand computations (pairwise AUC, log loss by the formula)."""

import itertools
import math

import pytest
import torch

from hybrid.training._metrics import LossTracker, binary_auc, eval_metrics, normalized_entropy


def _pairwise_auc(scores, labels):
    pos = [s for s, y in zip(scores, labels, strict=True) if y == 1]
    neg = [s for s, y in zip(scores, labels, strict=True) if y == 0]
    wins = sum(1.0 if p > n else 0.5 if p == n else 0.0 for p, n in itertools.product(pos, neg))
    return wins / (len(pos) * len(neg))


def test_eval_metrics_match_hand_computation():
    logits = [2.0, -1.0, 0.5, 0.5, -3.0, 1.5, -0.2, 0.0]
    labels = [1, 0, 1, 0, 0, 1, 1, 0]
    got = eval_metrics(torch.tensor(logits), torch.tensor(labels, dtype=torch.float32))
    assert got["auc"] == pytest.approx(_pairwise_auc(logits, labels), abs=1e-7)
    p = [1 / (1 + math.exp(-z)) for z in logits]
    ll = (
        -sum(y * math.log(q) + (1 - y) * math.log(1 - q) for q, y in zip(p, labels, strict=True))
        / 8
    )
    assert got["log_loss"] == pytest.approx(ll, rel=1e-9)
    base = 0.5
    assert got["ne"] == pytest.approx(ll / -(base * math.log(base) * 2), rel=1e-9)
    assert got["accuracy"] == pytest.approx(
        sum((z > 0) == y for z, y in zip(logits, labels, strict=True)) / 8
    )
    assert got["base_rate"] == base and got["count"] == 8


def test_normalized_entropy_of_base_rate_predictor_is_one():
    p = 0.3
    ll = -(p * math.log(p) + (1 - p) * math.log(1 - p))
    assert normalized_entropy(ll, p) == pytest.approx(1.0)
    assert normalized_entropy(0.1, 0.0) == math.inf


def test_loss_tracker_window_and_lifetime():
    t = LossTracker(window=2)
    for v in (1.0, 2.0, 4.0):
        t.add(v)
    assert t.windowed == 3.0 and t.lifetime == pytest.approx(7 / 3) and t.last == 4.0
    u = LossTracker(window=2)
    u.load_state_dict(t.state_dict())
    u.add(0.0)
    assert u.windowed == 2.0 and u.lifetime == pytest.approx(7 / 4)


def test_eval_metrics_rejects_mismatched_lengths():
    with pytest.raises(ValueError, match="3 logits and 2 labels"):
        eval_metrics(torch.zeros(3), torch.zeros(2))


@pytest.mark.parametrize("seed", range(40))
def test_binary_auc_equals_the_pairwise_count(seed):
    """Random sizes, heavy ties (few distinct scores), both classes: the rank statistic
    equals counting every (positive, negative) pair, ties half."""
    g = torch.Generator().manual_seed(seed)
    n = int(torch.randint(2, 60, (1,), generator=g))
    scores = torch.randint(0, 1 + seed % 7, (n,), generator=g).to(torch.float32) / 3
    labels = torch.randint(0, 2, (n,), generator=g)
    labels[0], labels[1] = 0, 1
    assert binary_auc(scores, labels) == pytest.approx(
        _pairwise_auc(scores.tolist(), labels.tolist()), abs=1e-12
    )


def test_binary_auc_of_one_class_is_nan():
    assert math.isnan(binary_auc(torch.tensor([0.1, 0.2]), torch.tensor([1, 1])))
    assert math.isnan(binary_auc(torch.tensor([0.1, 0.2]), torch.tensor([0, 0])))


@pytest.mark.parity
def test_binary_auc_equals_torchmetrics():
    tm = pytest.importorskip("torchmetrics.functional.classification")
    g = torch.Generator().manual_seed(0)
    for _ in range(200):
        n = int(torch.randint(2, 300, (1,), generator=g))
        logits = torch.round(torch.randn(n, generator=g, dtype=torch.float64) * 4) / 4  # ties
        labels = torch.randint(0, 2, (n,), generator=g)
        labels[0], labels[1] = 0, 1
        want = float(tm.binary_auroc(logits, labels))
        assert binary_auc(logits, labels) == pytest.approx(
            want, abs=1e-6
        )  # torchmetrics sums in fp32
