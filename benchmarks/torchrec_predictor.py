"""TorchRec's quantized DLRM behind hybridrec's HTTP server, for `benchmarks.serving_load`.

    python -m benchmarks.torchrec_predictor --tables 8 --rows 100000 --dim 64 --pooling 10 \\
        --max-batch-size 512 -- --artifact UNUSED --port 8001 --max-batch-size 64 --max-wait-us 2000

`TorchRecPredictor` has the interface the server uses of a `hybrid.serving.Predictor`
(`features`, `n_dense`, `max_batch_size`, `max_ids`, `manifest["is_weighted"]`, `check`,
`__call__`): requests are read and checked by the same code as ours
(`hybrid.serving._request.read_sparse` / `read_dense`: ids against the tables, shapes), then
scored by `torchrec.models.dlrm.DLRM` over TorchRec's quantized EmbeddingBagCollection
(FBGEMM's IntN TBE) built by `benchmarks.serving_latency.torchrec_model` from the same
weights as ours. Everything after the arguments `--` is `python -m hybrid.serving serve`'s.
"""

from __future__ import annotations

import argparse
import sys

import numpy as np
import torch

from hybrid.serving._request import RequestSpec, read_dense, read_sparse

__all__ = ["TorchRecPredictor", "main"]


class TorchRecPredictor:
    """TorchRec's quantized DLRM with the `Predictor` interface the server uses."""

    def __init__(self, model, features, rows: int, n_dense: int, max_batch_size: int):
        self._model = model
        self.features = list(features)
        self.n_dense = n_dense
        self.max_batch_size = max_batch_size
        self.max_ids = 1 << 24
        self.manifest = {"is_weighted": False, "model": "torchrec.DLRM"}
        self._spec = RequestSpec(
            features=tuple(features),
            tables_of={f: ((f"t_{f}", rows),) for f in features},
            is_weighted=False,
            bounds_check="error",
            max_batch_size=max_batch_size,
            id_capacities=tuple(1 << k for k in range(4, 25)),
            batch_rungs=tuple(range(1, max_batch_size + 1)),  # no padding of bags
        )

    def check(self, dense_features, sparse) -> tuple[int, int]:
        arrays = read_sparse(sparse, self._spec)
        read_dense(dense_features, self.n_dense, arrays.batch_size, torch.float32)
        return arrays.batch_size, int(arrays.offsets[-1])

    def __call__(self, dense_features, sparse) -> torch.Tensor:
        from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

        arrays = read_sparse(sparse, self._spec)
        dense = read_dense(dense_features, self.n_dense, arrays.batch_size, torch.float32)
        n = int(arrays.offsets[-1])
        kjt = KeyedJaggedTensor(
            keys=self.features,
            values=torch.from_numpy(arrays.values[:n].astype(np.int64)),
            lengths=torch.from_numpy(np.diff(arrays.offsets).astype(np.int64)),
        )
        with torch.no_grad():
            return self._model(dense, kjt)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.torchrec_predictor")
    p.add_argument("--tables", type=int, required=True)
    p.add_argument("--rows", type=int, required=True)
    p.add_argument("--dim", type=int, required=True)
    p.add_argument("--pooling", type=int, required=True)
    p.add_argument("--max-batch-size", type=int, required=True)
    return p


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    split = argv.index("--") if "--" in argv else len(argv)
    args = _parser().parse_args(argv[:split])
    from benchmarks import serving_latency as sl
    from hybrid.serving._server import main as serve

    def loader(_directory: str) -> TorchRecPredictor:
        model = sl.torchrec_model(args, sl.weights(args))
        features = [f for _, f in sl._config(args)]
        predictor = TorchRecPredictor(model, features, args.rows, sl.N_DENSE, args.max_batch_size)
        predictor([[0.0] * sl.N_DENSE], {f: [[]] for f in features})  # warm-up, as ours
        return predictor

    return serve(argv[split + 1 :], loader=loader)


if __name__ == "__main__":
    sys.exit(main())
