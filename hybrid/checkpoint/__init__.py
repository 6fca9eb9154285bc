"""Training checkpoints: save, find the latest, restore (onto any mesh and plan).

A checkpoint is a directory `step_<NNNNNNNN>/` written under a temporary name and renamed
into place (atomic: a run killed mid-write leaves only a `.tmp-*` directory, ignored):

- `tables.npz` (`_arrays`): per table, in plan-independent form: `weight/<table>`
  `[rows, dim]`; each per-row optimizer state leaf `state/<table>/<leaf>` (`[rows, dim]`,
  elementwise rules) or `state/<table>/<leaf>/cols_<c0>_<cn>` (`[rows]`, one value per row
  of each column block: row-wise Adagrad); `count`, the sparse optimizer's step count; for
  managed-collision tables their id maps, counters and draw key (`mc/<table>/<field>`,
  `mc_key`; see `_managed`).
- `dense.pt`: the dense tower's and the torch optimizer's state dicts, torch's RNG state.
- `meta.json`: step, the sparse rule's name, the mesh and plan written on, the run id, and
  whatever the caller adds (the training script: loss tracker, config).
- `manifest.json` (`_format`), written last (temporary name, fsync, rename): sha256 and
  size of every other file. `load_checkpoint` verifies every file against it and raises
  `CheckpointError` naming the file and the reason (missing, truncated, hash mismatch,
  unreadable json); `latest_checkpoint` returns the newest *intact* checkpoint and logs the
  ones it skipped.

Run identity (`_preflight`): a checkpoint directory belongs to one run. The first save writes
`run.json` (run id, config, creation time) atomically; every checkpoint's meta carries
the run id. Rotation (`_store`) deletes only older checkpoints of the same run (by the
meta's run id), never another run's, never the checkpoint just written, and keeps the
newest intact ones. `prepare_run` (the training script's preflight, `_preflight`) refuses a
fresh run into a directory holding checkpoints, checks the directory is writable and has
room for two checkpoints, that the sparse optimizer can be checkpointed, and on resume
that the config keeps exact resumption possible; it raises `hybrid._errors.ConfigError`.

Two formats, one manifest: the layout above ("npz", `_store`: every array read whole on
one host, written synchronously; the training script's default for one process) and
"orbax" (`_sharded`: `sparse/`, an Orbax checkpoint each process writes its own shards of,
asynchronously, beside `dense.pt` and `meta.json` from process 0; the manifest lists every
shard file and is written once Orbax has committed; the default under torchrun).
`load_checkpoint` reads both, on any process count; everything below holds for both.
The "npz" format stays for one process: it needs no background thread or extra package,
writes one file a user can open with numpy, and the fault tests pin its behaviour.

Restore reads the tables by rows and columns and places them into the current model's
buffers, so a checkpoint written on one mesh/plan loads on another (reshard on load),
optimizer state included. Row-wise state of a column-sharded table is one value per row
per column block; loaded into coarser blocks it is the width-weighted mean of the saved
blocks (exact: `s` accumulates `mean(g*g)` over the block's columns); loaded into finer
blocks each takes its enclosing saved block's value (TorchRec's approximation).

Modules: `_format` (the directory layout, the manifest, verification, `CheckpointError`),
`_arrays` (the tables and optimizer state as arrays, restore), `_managed` (managed-collision
id maps), `_preflight` (run identity, the preflight), `_store` (save, rotation, latest, load),
`_sharded` (the "orbax" format: `AsyncCheckpointer`, `checkpoint_arrays`, its restore).
"""

from hybrid.checkpoint._arrays import estimate_bytes, saved_table_shapes, sparse_state_arrays
from hybrid.checkpoint._format import CheckpointError, scan_checkpoints, verify_checkpoint
from hybrid.checkpoint._preflight import RunCheckpoints, config_changes, prepare_run, read_run
from hybrid.checkpoint._sharded import AsyncCheckpointer, checkpoint_arrays
from hybrid.checkpoint._store import latest_checkpoint, load_checkpoint, save_checkpoint

__all__ = [
    "AsyncCheckpointer",
    "CheckpointError",
    "RunCheckpoints",
    "checkpoint_arrays",
    "config_changes",
    "estimate_bytes",
    "latest_checkpoint",
    "load_checkpoint",
    "prepare_run",
    "read_run",
    "save_checkpoint",
    "saved_table_shapes",
    "scan_checkpoints",
    "sparse_state_arrays",
    "verify_checkpoint",
]
