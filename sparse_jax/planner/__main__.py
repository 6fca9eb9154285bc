"""`python -m sparse_jax.planner`: plan a 26-table Criteo-like model on `data=2,model=4`.

Table sizes are the Criteo Kaggle (DLRM) cardinalities, dim 128, fp32, rowwise adagrad;
batch 16384, 1 id per feature; 8 GiB per device for the tables.
"""

from __future__ import annotations

import time

from sparse_jax._configs import EmbeddingBagConfig

from ._planner import Planner
from ._topology import GiB, Topology

CRITEO_KAGGLE_ROWS = (
    1460,
    583,
    10131227,
    2202608,
    305,
    24,
    12517,
    633,
    3,
    93145,
    5683,
    8351593,
    3194,
    27,
    14992,
    5461306,
    10,
    5652,
    2173,
    4,
    7046547,
    18,
    15,
    286181,
    105,
    142572,
)


def criteo_tables(dim: int = 128) -> list[EmbeddingBagConfig]:
    """26 tables `t_cat_0` .. `t_cat_25` with the Criteo Kaggle cardinalities."""
    return [
        EmbeddingBagConfig(
            name=f"t_cat_{i}", num_embeddings=rows, embedding_dim=dim, feature_names=[f"cat_{i}"]
        )
        for i, rows in enumerate(CRITEO_KAGGLE_ROWS)
    ]


def main() -> None:
    topology = Topology(axes={"data": 2, "model": 4}, device_memory_bytes=8 * GiB)
    tables = criteo_tables()
    start = time.perf_counter()
    plan = Planner(topology).plan(tables, batch_size=16384)
    elapsed = time.perf_counter() - start
    print(plan.stats_table())
    print(f"\nplanned {len(tables)} tables in {1e3 * elapsed:.0f} ms\n")
    print(plan.explain("t_cat_2"))


if __name__ == "__main__":
    main()
