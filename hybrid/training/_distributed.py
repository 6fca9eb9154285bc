"""Process setup: torch.distributed and jax.distributed from torchrun's environment.

    torchrun --nproc-per-node N -m hybrid.train ...

starts N processes with RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT set.
`init_distributed()` turns them into
- torch.distributed: nccl on GPU (after `torch.cuda.set_device(LOCAL_RANK)`), gloo on CPU;
  `env://` under torchrun (its agent hosts the store on MASTER_PORT), `tcp://` when the
  environment is passed explicitly;
- jax.distributed: the same rank and world size, coordinator at MASTER_ADDR:MASTER_PORT+1
  (the port beside torch's), one local GPU per process (`local_device_ids=[LOCAL_RANK]`,
  modulo the visible GPUs), gloo cross-process collectives on CPU.
Call it before the first JAX operation. With WORLD_SIZE unset or 1 it does nothing.

Timeouts are short enough that a dead peer is not waited for for minutes (JAX's heartbeat
and shutdown barrier, torch's collectives); the fast path is `hybrid.training._watchdog`, which
`python -m hybrid.train` starts right after `init_distributed()`: when one process dies,
the others exit non-zero within seconds, naming the lost rank.
"""

from __future__ import annotations

import dataclasses
import datetime
import inspect
import os
import random
import socket
from collections.abc import Mapping

import jax
import torch
import torch.distributed as dist

__all__ = ["DistributedEnv", "free_master_port", "init_distributed", "read_torchrun_env"]

_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")

# backstops behind hybrid.training._watchdog (seconds): JAX's coordination service declares a process
# dead after this long without heartbeats (default 100), its shutdown barrier gives up after
# this long (default 300), torch's collectives after this long (default 30 min for gloo)
JAX_HEARTBEAT_TIMEOUT_S = 20
JAX_SHUTDOWN_TIMEOUT_S = 60
TORCH_TIMEOUT_S = 300


@dataclasses.dataclass(frozen=True, kw_only=True)
class DistributedEnv:
    """One process's place in the job, as torchrun describes it."""

    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int

    @property
    def coordinator_address(self) -> str:
        """jax.distributed's coordinator: MASTER_ADDR, the port after MASTER_PORT."""
        return f"{self.master_addr}:{self.master_port + 1}"


def free_master_port(host: str = "127.0.0.1") -> int:
    """A MASTER_PORT for processes started by hand on `host`: free, and so is the port after
    it (jax.distributed's coordinator). Drawn below the kernel's ephemeral range (read from
    /proc where it can be), so that no outgoing connection (gloo's, the store's) takes either
    port between this check and the job's own binds: `bind(("", 0))` hands out ephemeral
    ports, and Linux gives even ones to `connect()` first, so the port after one of those is
    exactly what a connection opened meanwhile may get."""
    low, high = 20000, _ephemeral_start() - 2
    if high <= low:  # an unusual range: the ports the kernel hands out, checked as before
        return _bound_pair(host, lambda: 0)
    draw = random.SystemRandom()
    return _bound_pair(host, lambda: draw.randrange(low, high))


def _ephemeral_start(path: str = "/proc/sys/net/ipv4/ip_local_port_range") -> int:
    """The first port of the kernel's ephemeral range (32768, Linux's default, when it
    cannot be read)."""
    try:
        with open(path) as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _bound_pair(host: str, candidate) -> int:
    """The first of up to 50 `candidate()` ports (0: one the kernel picks) that binds on
    `host`, with the port after it binding too."""
    for _ in range(50):
        with socket.socket() as s:
            try:
                s.bind((host, candidate()))
            except OSError:
                continue
            port = s.getsockname()[1]
        if port >= 65534:
            continue
        with socket.socket() as s:
            try:
                s.bind((host, port + 1))
            except OSError:
                continue
        return port
    raise RuntimeError(f"no two free adjacent ports on {host}")


def _int_var(env: Mapping[str, str], name: str) -> int:
    value = env[name]
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {name}={value!r} must be an integer") from None


def read_torchrun_env(environ: Mapping[str, str] | None = None) -> DistributedEnv | None:
    """The torchrun variables as a `DistributedEnv`, or None for a single process."""
    env = os.environ if environ is None else environ
    if "WORLD_SIZE" not in env or _int_var(env, "WORLD_SIZE") == 1:
        return None
    missing = [v for v in _VARS if v not in env]
    if missing:
        raise ValueError(
            f"WORLD_SIZE={env['WORLD_SIZE']} but {', '.join(missing)} not set; launch with torchrun, "
            f"or set all of {', '.join(_VARS)}"
        )
    out = DistributedEnv(
        rank=_int_var(env, "RANK"),
        world_size=_int_var(env, "WORLD_SIZE"),
        local_rank=_int_var(env, "LOCAL_RANK"),
        master_addr=env["MASTER_ADDR"],
        master_port=_int_var(env, "MASTER_PORT"),
    )
    if out.world_size < 1:
        raise ValueError(f"WORLD_SIZE={out.world_size} must be >= 1")
    if not 0 <= out.rank < out.world_size:
        raise ValueError(f"RANK={out.rank} must be in [0, WORLD_SIZE={out.world_size})")
    if out.local_rank < 0:
        raise ValueError(f"LOCAL_RANK={out.local_rank} must be >= 0")
    if not 0 < out.master_port < 65535:
        raise ValueError(
            f"MASTER_PORT={out.master_port}: jax.distributed uses MASTER_PORT+1, so MASTER_PORT must be "
            "in [1, 65534]"
        )
    return out


def init_distributed(
    environ: Mapping[str, str] | None = None, *, backend: str | None = None
) -> DistributedEnv | None:
    """Initialize torch.distributed and jax.distributed for this process (see module doc).

    Returns the `DistributedEnv`, or None (and does nothing) for a single process.
    `backend` overrides torch's ("nccl" on GPU, "gloo" otherwise). Already-initialized
    frameworks are left as they are.
    """
    env = read_torchrun_env(environ)
    if env is None:
        return None
    gpu = torch.cuda.is_available()
    # LOCAL_RANK indexes the node's GPUs; with CUDA_VISIBLE_DEVICES narrowed to one GPU per
    # process, that GPU is index 0
    gpu_index = env.local_rank % torch.cuda.device_count() if gpu else None
    if not dist.is_initialized():
        if gpu:
            torch.cuda.set_device(gpu_index)
        init_method = "env://" if environ is None else f"tcp://{env.master_addr}:{env.master_port}"
        dist.init_process_group(
            backend or ("nccl" if gpu else "gloo"),
            init_method=init_method,
            rank=env.rank,
            world_size=env.world_size,
            timeout=datetime.timedelta(seconds=TORCH_TIMEOUT_S),
        )
    if not jax.distributed.is_initialized():
        if not gpu:
            jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(
            coordinator_address=env.coordinator_address,
            num_processes=env.world_size,
            process_id=env.rank,
            local_device_ids=[gpu_index] if gpu else None,
            **_jax_timeouts(),
        )
    return env


def _jax_timeouts() -> dict:
    """The timeout arguments this JAX's `jax.distributed.initialize` takes."""
    params = inspect.signature(jax.distributed.initialize).parameters
    wanted = {
        "heartbeat_timeout_seconds": JAX_HEARTBEAT_TIMEOUT_S,
        "shutdown_timeout_seconds": JAX_SHUTDOWN_TIMEOUT_S,
    }
    return {k: v for k, v in wanted.items() if k in params}
