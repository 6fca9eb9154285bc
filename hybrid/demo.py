"""`python -m hybrid.demo`: a DLRM learns a planted signal on synthetic click data.

Four Zipf-distributed sparse features (JAX tables, row-wise Adagrad applied inside
backward) and four dense features feed `dense_torch.DLRM` through `hybrid.Model`; torch's
Adam steps the dense tower. Prints the training loss, then the held-out AUC
(`hybrid.training._metrics.binary_auc`) beside the Bayes AUC of the data (the AUC of the true logits).
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

import dense_torch
import hybrid
from hybrid.data._planted import planted_signal_data
from hybrid.training._metrics import binary_auc
from sparse_jax import EmbeddingBagConfig
from sparse_jax.optim import rowwise_adagrad

__all__ = ["main", "train"]


MAX_BAG = 3  # ids per bag: 1..MAX_BAG (planted_signal_data's default)
EVAL_BATCH = 2048


def evaluate(model: hybrid.Model, data, batch_size: int = EVAL_BATCH) -> float:
    """Held-out AUC; eval mode, no grad (the tables are not touched)."""
    model.eval()
    scores = []
    with torch.no_grad():
        for start in range(0, len(data), batch_size):
            dense, sparse, _ = data.batch(start, min(start + batch_size, len(data)))
            scores.append(model(dense, sparse).squeeze(-1))
    model.train()
    return binary_auc(torch.cat(scores), torch.from_numpy(data.labels))


def train(
    *,
    steps: int = 300,
    batch_size: int = 256,
    embedding_dim: int = 16,
    num_embeddings: int = 1000,
    sparse_lr: float = 0.1,
    dense_lr: float = 3e-3,
    eval_samples: int = 8192,
    seed: int = 0,
    log_every: int = 0,
    torch_threads: int | None = 1,
) -> dict[str, float]:
    """Train for `steps` batches; returns losses, held-out AUC, Bayes AUC and wall time.

    `torch_threads`: torch's intra-op threads while training (restored after). On a CPU
    host torch's thread pool and XLA's compete for the same cores; with small dense layers
    one torch thread is ~2.5x faster on 2 cores. None keeps torch's setting.
    """
    previous = torch.get_num_threads()
    if torch_threads is not None:
        torch.set_num_threads(torch_threads)
    try:
        return _train(
            steps,
            batch_size,
            embedding_dim,
            num_embeddings,
            sparse_lr,
            dense_lr,
            eval_samples,
            seed,
            log_every,
        )
    finally:
        torch.set_num_threads(previous)


def _train(
    steps,
    batch_size,
    embedding_dim,
    num_embeddings,
    sparse_lr,
    dense_lr,
    eval_samples,
    seed,
    log_every,
):
    t0 = time.perf_counter()
    torch.manual_seed(seed)
    train_data = planted_signal_data(steps * batch_size, num_embeddings=num_embeddings, seed=seed)
    eval_data = planted_signal_data(eval_samples, num_embeddings=num_embeddings, seed=seed + 1)
    keys = train_data.keys
    tables = [
        EmbeddingBagConfig(
            name=f"t_{k}",
            num_embeddings=num_embeddings,
            embedding_dim=embedding_dim,
            feature_names=[k],
        )
        for k in keys
    ]
    dense = dense_torch.DLRM(
        embedding_dim=embedding_dim,
        num_sparse_features=len(keys),
        dense_in_features=train_data.dense.shape[1],
        dense_arch_layer_sizes=[32, embedding_dim],
        over_arch_layer_sizes=[32, 1],
        feature_names=list(keys),
    )
    # two capacities: the largest possible training and eval batches (one program each)
    max_ids = len(keys) * MAX_BAG
    ladder = sorted({batch_size * max_ids, EVAL_BATCH * max_ids})
    model = hybrid.Model(
        tables,
        dense,
        sparse_optimizer=rowwise_adagrad(lr=sparse_lr),
        seed=seed,
        capacity_ladder=ladder,
    )
    opt = torch.optim.Adam(model.dense_parameters(), lr=dense_lr)
    loss_fn = torch.nn.BCEWithLogitsLoss()
    losses = []
    for step in range(steps):
        dense_x, sparse, labels = train_data.batch(step * batch_size, (step + 1) * batch_size)
        loss = loss_fn(model(dense_x, sparse).squeeze(-1), labels)
        loss.backward()  # dense grads + the fused sparse update
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
        if log_every and (step + 1) % log_every == 0:
            print(f"step {step + 1:4d}  loss {np.mean(losses[-log_every:]):.4f}", flush=True)
    train_seconds = time.perf_counter() - t0
    auc = evaluate(model, eval_data)
    bayes = binary_auc(torch.from_numpy(eval_data.logits), torch.from_numpy(eval_data.labels))
    window = max(1, min(50, steps // 5))
    return {
        "steps": steps,
        "first_loss": float(np.mean(losses[:window])),
        "last_loss": float(np.mean(losses[-window:])),
        "eval_auc": auc,
        "bayes_auc": bayes,
        "train_seconds": train_seconds,
        "seconds": time.perf_counter() - t0,
        "compiles": model.compile_counts(),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m hybrid.demo", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    hybrid.configure_gpu_env()  # before JAX starts; harmless on CPU
    result = train(steps=args.steps, batch_size=args.batch_size, seed=args.seed, log_every=50)
    print(
        f"eval AUC {result['eval_auc']:.4f} (Bayes AUC of the data {result['bayes_auc']:.4f}); "
        f"loss {result['first_loss']:.4f} -> {result['last_loss']:.4f}; "
        f"{result['steps']} steps in {result['train_seconds']:.1f} s"
    )


if __name__ == "__main__":
    main()
