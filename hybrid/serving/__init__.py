"""hybrid.serving: score requests with a model `hybrid.export` wrote, without the training library.

    predictor = hybrid.serving.load("artifacts/dlrm")       # every file checked against its sha256
    logits = predictor(dense_features, {"product": [[1, 2], [5]], "user": [[4], []]})
    python -m hybrid.serving --artifact artifacts/dlrm --requests requests.jsonl --out scores.jsonl
    python -m hybrid.serving serve --artifact artifacts/dlrm --port 8000   # HTTP (`_server`)

`sparse` is given by raw feature ids: `{feature: [[ids of sample 0], [ids of sample 1], ...]}`
(weighted models: `{feature: {"ids": [[...]], "weights": [[...]]}}`), `{feature: (values,
lengths[, weights])}` arrays, a KJT-like object or a `(keys, values, lengths[, weights])`
tuple (see `_request`). Ids are checked as in training (an id outside its table raises,
naming feature, sample and id); a request with more samples than the artifact's
`max_batch_size`, or more ids than its largest id capacity, is refused with what to
re-export with. A refused request raises `RequestError` (a ValueError; its `kind` names
the check).

What it imports: this package's modules need only jax, numpy, torch and the standard
library (plus `hybrid._files` for sha256): no `hybrid.Model`, sparse_jax, optimizer,
planner or training script (to run an int8 artifact's C++ kernel lookup, `_kernel` runs
sparse_jax's `_kernels/build.py` file alone to find the built library, without importing
the sparse_jax package, and `_direct` calls its C entry, `_interaction` the fused DLRM
interaction's; without it the XLA lookup and the tower's own ops run);
the HTTP server (`_server`, `_batcher`, `_wire`) adds fastapi, uvicorn, prometheus-client
and safetensors (the `serve` extra), imported only by `serve`. `import hybrid.serving`
still runs `hybrid/__init__.py`, which imports the training library (sparse_jax and its
optimizers, `hybrid.Model`); never the planner nor `hybrid.train`. `tests/test_export.py`
loads this package without `hybrid/__init__` in a fresh process to check its own needs.
"""

from hybrid.serving._artifact import FORMAT, FORMAT_VERSION, ArtifactError
from hybrid.serving._predictor import Predictor, load
from hybrid.serving._request import RequestError

__all__ = ["FORMAT", "FORMAT_VERSION", "ArtifactError", "Predictor", "RequestError", "load"]
