"""Build, train and drop managed-collision models one after another in one process, and
print (as JSON) the process's memory mappings and RSS after each is dropped
(tests/test_managed_programs.py runs it in a subprocess; `python -m tests.managed_churn N`).

Each model: `hybrid.Model` with one managed table (raw 64-bit ids) and one plain table,
three training steps and one eval batch, then `del model; gc.collect()`."""

import gc
import json
import sys

import numpy as np
import torch

import dense_torch
import hybrid
from sparse_jax import EmbeddingBagConfig, MCHManagedCollisionModule
from sparse_jax.optim import rowwise_adagrad

Z, ITEMS, DIM, BATCH = 16, 10, 4, 8


def mappings() -> int:
    with open("/proc/self/maps") as f:
        return sum(1 for _ in f)


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def one_model(seed: int) -> None:
    tables = [
        EmbeddingBagConfig(
            name="users", num_embeddings=Z, embedding_dim=DIM, feature_names=["user"]
        ),
        EmbeddingBagConfig(
            name="items", num_embeddings=ITEMS, embedding_dim=DIM, feature_names=["item"]
        ),
    ]
    torch.manual_seed(0)
    dense = dense_torch.DLRM(DIM, 2, 3, [4, DIM], [4, 1])
    model = hybrid.Model(
        tables,
        dense,
        sparse_optimizer=rowwise_adagrad(lr=0.1),
        managed_collision_modules={"users": MCHManagedCollisionModule(Z, history_capacity=64)},
    )
    opt = torch.optim.SGD(model.dense_parameters(), lr=0.1)
    rng = np.random.default_rng(seed)
    pool = rng.integers(-(2**62), 2**62, size=40)
    for step in range(4):
        users = pool[rng.integers(0, 40, BATCH)]
        items = rng.integers(0, ITEMS, BATCH)
        sparse = (
            ("user", "item"),
            torch.from_numpy(np.concatenate([users, items]).astype(np.int64)),
            torch.ones(2 * BATCH, dtype=torch.int32),
        )
        dense_in = torch.from_numpy(rng.normal(size=(BATCH, 3)).astype(np.float32))
        if step == 3:
            model.eval()
            with torch.no_grad():
                model(dense_in, sparse)
            continue
        labels = torch.from_numpy(rng.integers(0, 2, BATCH).astype(np.float32))
        loss = torch.nn.functional.binary_cross_entropy_with_logits(
            model(dense_in, sparse).squeeze(-1), labels
        )
        loss.backward()
        opt.step()
        opt.zero_grad()


def main(models: int) -> None:
    rows = []
    for i in range(models):
        one_model(i)
        gc.collect()
        rows.append({"maps": mappings(), "rss_mib": rss_mib()})
    print(json.dumps(rows))


if __name__ == "__main__":
    main(int(sys.argv[1]))
