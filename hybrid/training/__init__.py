"""Training: the step loop around `hybrid.Model` and the job it runs in.

- `TrainPipeline` (`_pipeline`): TorchRec's `TrainPipelineSparseDist`; batch i+1 is
  prepared while step i runs (`BatchPreparationError`, `PipelineStats`).
- `NonFiniteError` (`_nonfinite`): a non-finite batch never reaches the weights (the
  sparse update skips it on the device, `DenseGuard` restores the dense step).
- `eval_metrics` / `LossTracker` (`_metrics`): AUC, log loss, NE over an eval set;
  windowed and lifetime training loss.
- `load_config` / `TrainConfig` / `ConfigError` (`_train_config`): the training script's
  TOML config with `--set` overrides, checked (`ConfigError` lives in `hybrid._errors`).
- The job: `make_mesh` / `parse_mesh` (`_mesh`), `init_distributed` / `read_torchrun_env` /
  `DistributedEnv` (`_distributed`: torch.distributed + jax.distributed from torchrun),
  `start_watchdog` (`_watchdog`: a dead peer ends the job within seconds),
  `configure_gpu_env` (`_gpu_env`: before JAX starts its backends), `hugepage_env` /
  `reexec_with_hugepages` (`hybrid._cpu_env`, outside this package so that `hybrid` can
  use it before anything heavy loads: XLA:CPU's buffers in huge pages, from process start).

`hybrid` re-exports the public names; the script is `python -m hybrid.train`.
"""

from hybrid._cpu_env import hugepage_env, reexec_with_hugepages
from hybrid._errors import ConfigError
from hybrid.training._distributed import DistributedEnv, init_distributed, read_torchrun_env
from hybrid.training._gpu_env import configure_gpu_env
from hybrid.training._mesh import make_mesh, parse_mesh
from hybrid.training._metrics import LossTracker, eval_metrics
from hybrid.training._nonfinite import NonFiniteError
from hybrid.training._pipeline import BatchPreparationError, PipelineStats, TrainPipeline
from hybrid.training._train_config import TrainConfig, load_config
from hybrid.training._watchdog import start_watchdog

__all__ = [
    "BatchPreparationError",
    "ConfigError",
    "DistributedEnv",
    "LossTracker",
    "NonFiniteError",
    "PipelineStats",
    "TrainConfig",
    "TrainPipeline",
    "configure_gpu_env",
    "eval_metrics",
    "hugepage_env",
    "init_distributed",
    "load_config",
    "make_mesh",
    "parse_mesh",
    "read_torchrun_env",
    "reexec_with_hugepages",
    "start_watchdog",
]
