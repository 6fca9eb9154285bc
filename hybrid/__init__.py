"""hybrid: JAX embedding tables and PyTorch dense towers in one model (the only package
importing both).

- `Model`: the user's entry point, a `torch.nn.Module` (sparse update inside backward);
  `model.prepare(sparse)` prepares a batch once (checked, padded, split, placed).
- `TrainPipeline`: TorchRec's `TrainPipelineSparseDist`: batch i+1 is prepared while step
  i runs (`pipeline.progress(batch_iter)` once per step).
- `torch_device`: the torch device of this process's JAX device (dense tower, features, labels).
- `jax_to_torch` / `torch_to_jax` / `torch_ids_to_jax`: the DLPack bridge (zero-copy where
  possible, copies counted in `bridge_stats()`).
- `torch_kjt` / `as_kjt`: sparse batches from torch tensors (ids range-checked to int32).
- `from_torchrec_state_dict`: a TorchRec DLRM checkpoint's keys renamed for `Model`.
- `make_mesh`: a named device mesh from "data=2,model=4".
- `init_distributed` / `read_torchrun_env`: torch.distributed + jax.distributed from torchrun.
- `configure_gpu_env`: GPU environment for torch and JAX sharing a device (before JAX starts).
- `reexec_with_hugepages` / `hugepage_env`: XLA:CPU's per-call buffers in transparent huge
  pages (glibc's `glibc.malloc.hugetlb=1`, set from process start).
- `python -m hybrid.demo`: a DLRM learning a planted signal on synthetic data.
- `python -m hybrid.train --config configs/movielens.toml --mesh data=2,model=4`: the
  training script (data in `hybrid.data`, metrics, checkpoints with reshard on load).
- `save_checkpoint` / `load_checkpoint` / `latest_checkpoint`, `eval_metrics`, `LossTracker`.
- `export`: a `Model` or `QuantizedModel` as one serving directory (a `jax.export` lookup,
  a `torch.export` dense tower, tables, a manifest with hashes); `hybrid.serving.load` and
  `python -m hybrid.serving` score requests from it.
- `quantize`: a trained `Model` as an inference `QuantizedModel` with int8/int4/int2/fp16
  row-wise quantized tables (FBGEMM's layout).

One folder per concept, each with its contract in its `__init__`: `hybrid.model`,
`hybrid.training`, `hybrid.checkpoint`, `hybrid.inference`, `hybrid.data`, `hybrid.serving`
(importable without `sparse_jax`); `_files` (crash-safe writes, shared by checkpoints, data
and serving) and `_errors` (`ConfigError`) sit at the top; `train.py` and `demo.py` are the
scripts.
"""

from hybrid import _cpu_env

if _cpu_env.started_as_module("hybrid.train"):
    # `python -m hybrid.train` imports this package first: restart with huge-page buffers now,
    # before jax and torch load (~2 s here), not in the script, after they did
    _cpu_env.reexec_with_hugepages()

from hybrid.inference import QuantizedModel, export, quantize
from hybrid.model import (
    BridgeStats,
    Model,
    as_kjt,
    bridge_stats,
    from_torchrec_state_dict,
    jax_to_torch,
    torch_device,
    torch_ids_to_jax,
    torch_kjt,
    torch_to_jax,
)
from hybrid.training import (
    BatchPreparationError,
    DistributedEnv,
    NonFiniteError,
    PipelineStats,
    TrainPipeline,
    configure_gpu_env,
    hugepage_env,
    init_distributed,
    make_mesh,
    parse_mesh,
    read_torchrun_env,
    reexec_with_hugepages,
)

__all__ = [
    "BatchPreparationError",
    "BridgeStats",
    "DistributedEnv",
    "Model",
    "NonFiniteError",
    "PipelineStats",
    "TrainPipeline",
    "as_kjt",
    "bridge_stats",
    "configure_gpu_env",
    "export",
    "from_torchrec_state_dict",
    "hugepage_env",
    "init_distributed",
    "jax_to_torch",
    "make_mesh",
    "parse_mesh",
    "QuantizedModel",
    "quantize",
    "read_torchrun_env",
    "reexec_with_hugepages",
    "torch_ids_to_jax",
    "torch_device",
    "torch_kjt",
    "torch_to_jax",
]

from hybrid.checkpoint import CheckpointError, latest_checkpoint, load_checkpoint, save_checkpoint  # noqa: E402
from hybrid.training import LossTracker, eval_metrics  # noqa: E402

__all__ += [
    "CheckpointError",
    "LossTracker",
    "eval_metrics",
    "latest_checkpoint",
    "load_checkpoint",
    "save_checkpoint",
]
