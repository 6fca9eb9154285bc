"""Inference: a trained `hybrid.Model` made ready to serve.

- `quantize` / `QuantizedModel` (`_quantize`): the tables as int8 / int4 / int2 / fp16
  row-wise quantized rows (FBGEMM's layout) on one JAX device, the dense tower frozen;
  called like the model in eval mode, never trains.
- `export` (`_export`): a `Model` or `QuantizedModel` as one serving directory: the pooled
  lookup as a serialized `jax.export` program (`_export_lookup`), the dense tower as a
  `torch.export` program (`_export_dense`), the tables, and a manifest with hashes,
  written under a temporary name and renamed into place (`_export_files`).

The directory is read by `hybrid.serving` (`hybrid.serving.load`, `python -m
hybrid.serving`), which never imports this package: serving needs jax, numpy and torch
alone. `hybrid` re-exports the public names.
"""

from hybrid.inference._export import export
from hybrid.inference._quantize import QuantizedModel, quantize

__all__ = ["QuantizedModel", "export", "quantize"]
