"""Checkpoints written by every process: the sparse side through Orbax, asynchronously.

`step_<NNNNNNNN>/` of the "orbax" format holds

- `sparse/`: an Orbax checkpoint (`PyTreeCheckpointHandler`, OCDBT + zarr) of the sparse
  state as the model holds it: `params/<buffer>`, `opt/<buffer>/<leaf>`, `count`, and for
  managed-collision tables `mc/<table>/<field>`, `mc/<table>/counters`, `mc_key`. Each
  process writes only the shards its devices hold (one replica of each), from a host copy
  taken while `save` blocks; the bytes are written by Orbax's background thread while
  training goes on, and Orbax commits `sparse/` atomically once every process is done;
- `dense.pt` and `meta.json`, written by process 0 (the dense tower is replicated): the
  dense tower's and torch optimizer's state dicts, process 0's torch RNG; the meta as the
  "npz" format's plus `"format": "orbax"`, `"tables"` (`{table: [rows, dim]}`) and
  `"layout"` (each buffer's shape and `StoredBlock`s: how to read the tables back onto
  another plan);
- `manifest.json`, written last by process 0 once Orbax has committed: sha256 and size of
  every other file, each file of `sparse/` included, so a damaged or missing shard file
  is found by `verify_checkpoint` as any other file.

Everything is written under `.tmp-step_<N>-<run id>/` and renamed into place by process 0
after the manifest (the commit: a process killed at any point leaves only the `.tmp-*`
folder, ignored and removed at the next `--resume`). `AsyncCheckpointer.save` returns
after the host copy; `wait()` (called by the next save and by `close()`) waits for the
commit and raises what it failed with.

Restore: a checkpoint of the same layout (the same buffers and blocks: same tables, plan
and mesh shape, whatever the process count) is read by Orbax straight into the current
shardings, each process reading only its shards. Another layout is read whole on every
process (`checkpoint_arrays`, the plan-independent form of `_arrays`) and placed by the
"npz" format's restore (reshard on load, managed maps moved onto the new split).
"""

from __future__ import annotations

import json
import logging
import os
import pathlib
import shutil
import threading

import jax
import numpy as np
import torch

from hybrid._files import fsync_dir, publish_dir, sha256_file, write_fsynced
from hybrid.checkpoint._arrays import (
    _leaves,
    _restore_sparse,
    dense_state_bytes,
    place_state_rows,
)
from hybrid.checkpoint._format import _MANIFEST, CheckpointError, _write_json_atomic
from hybrid.checkpoint._managed import _managed
from sparse_jax import MCH_STATE_FIELDS, MCHState
from sparse_jax.optim import SparseOptState

__all__ = ["AsyncCheckpointer", "checkpoint_arrays"]


_log = logging.getLogger("hybrid.checkpoint")


def _orbax():
    try:
        import orbax.checkpoint as ocp  # the "checkpoint" extra; imported when first used
    except ImportError as e:
        raise ImportError(
            f'the "orbax" checkpoint format needs orbax-checkpoint ({e}); install the '
            "checkpoint extra: pip install -e '.[checkpoint]'"
        ) from None
    return ocp


# -- the sparse state as the model holds it -------------------------------------------------
def _sparse_tree(model) -> dict:
    """The sparse state's device arrays, as saved under `sparse/` (module docstring)."""
    opt_state = model.sparse_opt_state
    tree = {
        "params": dict(model.sparse_params),
        "opt": {b: dict(_leaves(opt_state, b)) for b in opt_state.tables if _leaves(opt_state, b)},
        "count": opt_state.count,
    }
    managed = _managed(model)
    if managed is not None:
        tree["mc"] = {
            table: {
                **dict(zip(MCH_STATE_FIELDS, managed.mc_state[table], strict=True)),
                "counters": managed.mc_counters[table],
            }
            for table in managed.managed_tables
        }
        tree["mc_key"] = jax.random.key_data(managed.draw_key)
    return tree


def _layout(model) -> dict:
    """Where each table's rows are in the saved buffers, and every leaf's shape and dtype
    (two checkpoints with the same layout restore shard by shard)."""
    blocks: dict[str, list] = {}
    for b in model.sparse_module.stored_blocks():  # sparse_jax.StoredBlock
        blocks.setdefault(b.buffer, []).append(list(b[1:]))
    return {
        "blocks": blocks,
        "leaves": {k: [list(x.shape), str(x.dtype)] for k, x in _flat(_sparse_tree(model)).items()},
    }


def _flat(tree: dict, prefix: str = "") -> dict:
    """`{"params/<buffer>": leaf, ...}` of a nested dict."""
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}/"))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _nest(flat: dict) -> dict:
    tree: dict = {}
    for key, leaf in flat.items():
        *parents, name = key.split("/")
        node = tree
        for p in parents:
            node = node.setdefault(p, {})
        node[name] = leaf
    return tree


def _tables(model) -> dict[str, list[int]]:
    return {t.name: [t.num_embeddings, t.embedding_dim] for t in model.sparse_module.tables}


# -- saving ---------------------------------------------------------------------------------
class AsyncCheckpointer:
    """Saves "orbax" checkpoints from every process of a run (every process calls `save`
    with the same arguments); one save in flight at a time. See the module docstring."""

    def __init__(self):
        ocp = _orbax()
        self._orbax = ocp.AsyncCheckpointer(ocp.PyTreeCheckpointHandler())
        self._commit: threading.Thread | None = None
        self._error: BaseException | None = None
        self.last_committed: pathlib.Path | None = None

    def save(
        self,
        directory: str | os.PathLike,
        *,
        step: int,
        model,
        dense_optimizer: torch.optim.Optimizer,
        meta: dict | None = None,
        run_id: str | None = None,
        keep: int = 2,
    ) -> pathlib.Path:
        """Start saving `directory/step_<step>/` (a collective: every process calls it);
        returns the path it will have once committed. Waits for the previous save first.
        `run_id`: the run this save belongs to, as `save_checkpoint`'s (process 0 claims the
        directory for it); several processes must pass it (the same on every process)."""
        from hybrid.checkpoint._preflight import _claim

        meta = dict(meta or {})
        self.wait()
        root = pathlib.Path(directory)
        rank = jax.process_index()
        if run_id is None and jax.process_count() > 1:
            raise ValueError(
                "AsyncCheckpointer.save: several processes must pass run_id (the same on every "
                "process, e.g. prepare_run's on process 0, broadcast), so they write one run"
            )
        if rank == 0:
            root.mkdir(parents=True, exist_ok=True)
            run_id = _claim(root, run_id, meta.get("config"))
        final = root / f"step_{step:08d}"
        tmp = root / f".tmp-{final.name}-{run_id[:12]}"  # the same name on every process
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)  # a killed save of this step
            tmp.mkdir()
        _barrier(f"hybrid_checkpoint_mkdir_{step}")
        dense = None
        info = None
        if rank == 0:  # snapshots taken now; written by the commit thread
            dense = dense_state_bytes(model, dense_optimizer)
            plan = model.sparse_module.plan
            info = {
                "step": step,
                "run_id": run_id,
                "format": "orbax",
                "processes": jax.process_count(),
                "sparse_optimizer": model.sparse_optimizer.name,
                "mesh": model.sparse_module.mesh_axes,
                "plan": None if plan is None else json.loads(plan.to_json()),
                "tables": _tables(model),
                "layout": _layout(model),
                **meta,
            }
        ocp = _orbax()
        # returns once this process's shards are on the host; the bytes are written and
        # committed in Orbax's background thread
        self._orbax.save(tmp / "sparse", args=ocp.args.PyTreeSave(_sparse_tree(model)))

        def commit():
            try:
                self._orbax.wait_until_finished()  # every process's shards written, committed
                if rank == 0:
                    _commit(tmp, final, dense, info, root, run_id, keep)
                    self.last_committed = final
            except BaseException as e:  # raised by the next wait()
                self._error = e

        self._commit = threading.Thread(target=commit, name="hybrid-checkpoint-commit")
        self._commit.start()
        return final

    def in_flight(self) -> bool:
        """Whether a save is still being written or committed."""
        return self._commit is not None and self._commit.is_alive()

    def wait(self) -> None:
        """Wait for the save in flight (if any) to commit; raise what it failed with."""
        if self._commit is not None:
            self._commit.join()
            self._commit = None
        if self._error is not None:
            error, self._error = self._error, None
            raise CheckpointError(f"an asynchronous checkpoint save failed: {error}") from error

    def close(self) -> None:
        try:
            self.wait()
        finally:
            self._orbax.close()


def _barrier(name: str) -> None:
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


def _commit(tmp, final, dense: bytes, info: dict, root, run_id: str, keep: int) -> None:
    """Process 0, once Orbax has committed `tmp/sparse`: the dense state and meta, the
    manifest of every file (last), the rename into place, rotation."""
    from hybrid.checkpoint._store import _rotate

    write_fsynced(tmp / "dense.pt", dense)
    write_fsynced(tmp / "meta.json", json.dumps(info, indent=1, default=str).encode())
    files = {}
    for path in sorted(p for p in tmp.rglob("*") if p.is_file()):
        name = path.relative_to(tmp).as_posix()
        files[name] = {"sha256": sha256_file(path), "size": path.stat().st_size}
    _write_json_atomic(tmp / _MANIFEST, {"version": 1, "format": "orbax", "files": files})
    fsync_dir(tmp)
    publish_dir(tmp, final)
    _rotate(root, run_id, final, keep)


# -- restoring ------------------------------------------------------------------------------
def _restore_tree(path: pathlib.Path, like: dict, on_host=lambda key: True):
    """`sparse/` restored with `like`'s structure: leaf `key` whole as numpy on every
    process when `on_host(key)`, else onto `like`'s sharding (each process reads its shards)."""
    ocp = _orbax()

    def args(key, leaf):
        if on_host(key):
            return ocp.RestoreArgs(restore_type=np.ndarray)
        return ocp.ArrayRestoreArgs(
            sharding=leaf.sharding, global_shape=leaf.shape, dtype=leaf.dtype
        )

    restore_args = _nest({k: args(k, leaf) for k, leaf in _flat(like).items()})
    try:
        return ocp.PyTreeCheckpointer().restore(
            path / "sparse", args=ocp.args.PyTreeRestore(item=like, restore_args=restore_args)
        )
    except Exception as e:  # tensorstore / orbax raise many types for a damaged file
        raise CheckpointError(
            f"checkpoint {path}: sparse/ is unreadable ({type(e).__name__}: {e})"
        ) from None


def checkpoint_arrays(path: str | os.PathLike) -> dict[str, np.ndarray]:
    """The sparse state of an "orbax" checkpoint in the plan-independent form of the "npz"
    format's `tables.npz` (`weight/<table>`, `state/<table>/<leaf>[/cols_<c0>_<cn>]`,
    `count`, `mc/...`, `mc_key`), read whole on this process."""
    path = pathlib.Path(path)
    meta = json.loads((path / "meta.json").read_text())
    like = _nest({k: jax.ShapeDtypeStruct(s, d) for k, (s, d) in meta["layout"]["leaves"].items()})
    saved = _restore_tree(path, like)
    out: dict[str, np.ndarray] = {}
    dims = meta["tables"]
    for buffer, blocks in meta["layout"]["blocks"].items():
        weight = saved["params"][buffer]
        for table, start, r0, rn, c0, cn in blocks:
            full = out.setdefault(f"weight/{table}", np.zeros(dims[table], weight.dtype))
            full[r0 : r0 + rn, c0 : c0 + cn] = weight[start : start + rn, :cn]
            for leaf_name, host in saved.get("opt", {}).get(buffer, {}).items():
                rows = host[start : start + rn]
                place_state_rows(out, dims[table], table, leaf_name, rows, r0, c0, cn)
    out["count"] = np.asarray(saved["count"])
    for table, fields in saved.get("mc", {}).items():
        for field, leaf in fields.items():
            out[f"mc/{table}/{field}"] = np.asarray(leaf)
    if "mc_key" in saved:
        out["mc_key"] = np.asarray(saved["mc_key"])
    return out


def load_sharded(path: pathlib.Path, meta: dict, model, where: str) -> None:
    """Restore the sparse side of "orbax" checkpoint `path` (its verified `meta`) into
    `model`: shard by shard when the layout matches, else through `checkpoint_arrays`."""
    if meta.get("layout") != _layout(model) or meta.get("tables") != _tables(model):
        _restore_sparse(model, checkpoint_arrays(path), where)
        return
    like = _sparse_tree(model)
    # the id maps (small beside the tables) whole on every process, the rest shard by shard
    restored = _restore_tree(path, like, on_host=lambda key: key.startswith("mc"))
    # fresh buffers: an array Orbax built over host memory cannot be donated to the update
    placed = jax.jit(lambda t: jax.tree.map(lambda x: x + 0, t))(
        {k: restored[k] for k in ("params", "opt", "count")}
    )
    opt_state = model.sparse_opt_state
    tables = {
        b: placed["opt"][b] if _leaves(opt_state, b) else opt_state.tables[b]
        for b in opt_state.tables
    }
    model.load_sparse_buffers(
        placed["params"], SparseOptState(count=placed["count"], tables=tables)
    )
    managed = _managed(model)
    if managed is not None:
        mc = restored["mc"]
        managed.load_mc_state(
            {t: MCHState(*(mc[t][f] for f in MCH_STATE_FIELDS)) for t in mc},
            {t: mc[t]["counters"] for t in mc},
            jax.random.wrap_key_data(np.asarray(restored["mc_key"])),
        )
