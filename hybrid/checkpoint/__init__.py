"""Training checkpoints: save, find the latest, restore (onto any mesh and plan); see `_store`."""

from hybrid.checkpoint._store import (
    CheckpointError,
    latest_checkpoint,
    load_checkpoint,
    prepare_run,
    save_checkpoint,
    sparse_state_arrays,
    verify_checkpoint,
)

__all__ = [
    "CheckpointError",
    "latest_checkpoint",
    "load_checkpoint",
    "prepare_run",
    "save_checkpoint",
    "sparse_state_arrays",
    "verify_checkpoint",
]
