"""`PYTHONPATH=. python tools/gpu_probe.py`: hybrid.Model + TrainPipeline on whatever device
JAX and torch see (a GPU when there is one): six steps of the tests' small model with a NaN
batch in the middle, printing where the tables and the dense tower live, the losses (compare
with a CPU run: `JAX_PLATFORMS=cpu`), the skipped batches and the bridge's zero-copy count.
Not part of the suite."""

import math

import jax
import torch

import hybrid
from hybrid.model._bridge import bridge_stats
from tests.test_pipeline import _batches, _loss, _model

print("jax backend", jax.default_backend(), jax.devices())
model = _model()
model.dense.to(hybrid.torch_device())
print("torch device of the dense tower", next(model.dense_parameters()).device)
opt = torch.optim.Adam(model.dense_parameters(), lr=0.01)
pipeline = hybrid.TrainPipeline(model, opt, _loss)
batches = _batches(6)
dense_x, sparse, labels = batches[3]
dense_x = dense_x.clone()
dense_x[0, 0] = float("nan")  # one poisoned batch: the guard must skip it
batches[3] = (dense_x, sparse, labels)
bridge_stats().reset()
it = iter(batches)
losses = []
for _ in range(6):
    losses.append(float(pipeline.progress(it)))
model.wait_for_sparse_update()
print("losses", [round(x, 4) if not math.isnan(x) else "nan" for x in losses])
print("nonfinite", pipeline.nonfinite())
st = bridge_stats()
print("bridge zero_copy", st.zero_copy, "copies", dict(st.copies))
tables = model.sparse_params
print("tables on", {k: str(v.devices()) for k, v in list(tables.items())[:2]})
