"""Which torch device goes with this process's JAX device.

In the process model (one process per accelerator) the dense tower, the dense features and
the labels live on the torch device of the GPU that JAX uses for this process, so the
pooled embeddings cross DLPack zero-copy and the loss never mixes devices.

    device = hybrid.torch_device()          # cuda:N on a GPU process, cpu otherwise
    model.dense.to(device)

Only the logic below has run in this project (tests feed fake JAX devices); see the
README's GPU section for what has and has not run on a GPU.
"""

from __future__ import annotations

import jax
import torch

__all__ = ["torch_device"]

_GPU_PLATFORMS = ("gpu", "cuda", "rocm")  # torch names ROCm devices "cuda" as well


def torch_device(jax_device=None) -> torch.device:
    """The torch device holding the same memory as `jax_device` (default: this process's
    first local JAX device). GPU devices map to `cuda:<local hardware id>`; everything
    else (CPU, or a platform torch does not share) to `cpu`."""
    if jax_device is None:
        jax_device = jax.local_devices()[0]
    platform = str(getattr(jax_device, "platform", "cpu")).lower()
    if platform not in _GPU_PLATFORMS:
        return torch.device("cpu")
    index = getattr(jax_device, "local_hardware_id", None)
    if index is None:
        index = getattr(jax_device, "id", 0)
    return torch.device("cuda", int(index))
