"""hybridrec's side: `EmbeddingBagCollection` (any `kernel`) + `make_update`.

Kernels: "auto" (the library default: the fused C++ CPU kernels through `jax.ffi` for fp32
tables when they are built, else "xla"), "ffi", "xla" (pure-XLA per-position pooling and the
update over the runs `prepare` sorted on the host), "xla_insort" (the same with the sort inside
the update program, as before the host sort) and "reference" (gather + segment_sum forward;
its update is the in-program-sort "xla" update). `resolved` says which code a side actually runs.

The T tables (one feature each, same dim and dtype) stack into one buffer, as in the
library. The buffer is built straight from the workload's tables with
`jnp.array(..., copy=True)`, so it owns its memory and donation works (a zero-copy import
from numpy would make every donated step copy the table). Timed calls are the raw jitted
functions: `jax.jit(ebc._apply)` and `update.jitted` (no eager id checks), and each
timing case blocks on its results with `jax.block_until_ready`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.workloads import Batch, Workload
from sparse_jax import (
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    KeyedJaggedTensor,
    _lookup,
    make_update,
    optim,
)

__all__ = ["RULES", "XlaSide", "make_rule"]

RULES = ("rowwise_adagrad", "adagrad", "sgd")
_DATA_TYPE = {"fp32": "FP32", "fp16": "FP16", "bf16": "BF16"}


def make_rule(name: str, *, lr: float, eps: float):
    if name == "rowwise_adagrad":
        return optim.rowwise_adagrad(lr=lr, eps=eps)
    if name == "adagrad":
        return optim.adagrad(lr=lr, eps=eps)
    if name == "sgd":
        return optim.sgd(lr=lr)
    raise ValueError(f"optimizer {name!r} is not one of {RULES}")


# benchmark paths that are a kernel with an option: "xla_insort" is the pure-XLA path as it
# was before the host sort (the ids sorted inside the update program), timed beside "xla"
PATH_OPTIONS = {"xla_insort": ("xla", dict(sort_ids=False))}


class XlaSide:
    """Args: workload, batch, path (a kernel name, or a key of `PATH_OPTIONS`), optimizer
    name or None (forward only)."""

    def __init__(
        self,
        w: Workload,
        batch: Batch,
        kernel: str,
        optimizer: str | None,
        *,
        lr: float,
        eps: float,
    ):
        self.w, self.kernel, self.optimizer = w, kernel, optimizer
        tables = [
            EmbeddingBagConfig(
                name=f"t{t}",
                num_embeddings=w.E,
                embedding_dim=w.D,
                feature_names=[f"f{t}"],
                data_type=_DATA_TYPE[w.dtype],
            )
            for t in range(w.T)
        ]
        path = kernel
        kernel, options = PATH_OPTIONS.get(path, (path, {}))
        self.ebc = EmbeddingBagCollection(tables, is_weighted=w.weighted, kernel=kernel, **options)
        layout = self.ebc.layout
        if len(layout.groups) != 1:
            raise AssertionError(f"expected one stacked buffer, got groups {layout.groups}")
        (self.group,) = layout.groups
        for t in range(w.T):
            assert layout.table_group[f"t{t}"] == (self.group, t * w.E)
        np_dtype = tables[0].data_type.numpy_dtype
        self.params = {
            self.group: jnp.array(batch.tables.reshape(w.T * w.E, w.D).astype(np_dtype), copy=True)
        }
        psw = batch.per_sample_weights
        # checked, padded and placed once, as a training step's `prepare` does (timed calls skip it)
        self.batch = self.ebc.prepare(
            KeyedJaggedTensor(
                [f"f{t}" for t in range(w.T)],
                batch.ids.astype(np.int32),
                lengths=batch.lengths,
                weights=None if psw is None else psw,
            )
        )
        self.grad = jnp.array(batch.pooled_grad, copy=True)
        table_of_id = np.repeat(np.arange(w.T), w.B * w.L)  # bags are key-major, L ids each
        self.unique_rows = int(np.unique(table_of_id * w.E + batch.ids).size)
        self.update = None
        self.state = None
        if optimizer is not None:
            self.update = make_update(self.ebc, make_rule(optimizer, lr=lr, eps=eps))
            self.state = self.update.rule.init(self.params)
            self._operands = self.ebc.update_operands(
                self.batch, self.grad
            )  # what update(...) feeds its jitted step
        ffi = kernel in ("auto", "ffi") and _lookup.use_ffi(kernel, self.params[self.group])
        self.resolved = "ffi (C++)" if ffi else ("reference" if kernel == "reference" else "xla")
        if path in PATH_OPTIONS:
            self.resolved = f"{self.resolved} ({path})"
        self.in_place: list[bool] = []  # per step: did the donated table keep its buffer?

    def table_bytes(self) -> int:
        return int(self.params[self.group].nbytes)

    def state_bytes(self) -> int:
        return int(sum(x.nbytes for x in jax.tree_util.tree_leaves(self.state)))

    # -- compute -----------------------------------------------------------------------------
    def forward(self) -> jax.Array:
        return self.ebc.apply(self.params, self.batch).values()

    def pooled(self) -> np.ndarray:
        return np.array(self.forward(), dtype=np.float32, copy=True)

    def _dispatch_update(self) -> int:
        """Dispatch one update (not waited for); returns the table's buffer address before it."""
        before = self.params[self.group].unsafe_buffer_pointer()
        self.params, self.state = self.update.jitted(self.params, self.state, self._operands)
        return before

    def _note_in_place(self, before: int) -> None:
        self.in_place.append(self.params[self.group].unsafe_buffer_pointer() == before)

    def run_update(self) -> None:
        """One update, waited for."""
        before = self._dispatch_update()
        jax.block_until_ready((self.params, self.state))
        self._note_in_place(before)

    def step(self) -> None:
        self.forward().block_until_ready()
        self.run_update()

    # -- timing cases (`timing.clocked`: each mark waits for the arrays it is given) ------------
    def time_forward(self, clock):
        clock.mark("fwd", self.forward())

    def time_step(self, clock):
        clock.mark("fwd", self.forward())
        before = self._dispatch_update()
        clock.mark("bwd", self.params, self.state)
        self._note_in_place(before)

    def update_phases(self, warmup: int, repeats: int) -> dict:
        """The C++ update's phases (medians over `repeats` updates, each waited for), with
        the bytes each one moves at least: records (ids in, 16 B per id out), sort (two
        8-byte moves per id per radix pass), apply (record + gradient row per id; row and
        optimizer state read and written per unique row)."""
        from sparse_jax import _kernels

        for _ in range(warmup):
            self.step()
        seen: dict[str, list[float]] = {}
        for _ in range(repeats):
            self.step()
            for name, sec in _kernels.last_update_phases().items():
                seen.setdefault(name, []).append(sec)
        w, n = self.w, self.w.num_ids
        rows = self.w.T * self.w.E
        passes = -(-max(1, int(rows).bit_length()) // 11)
        state_row = {"rowwise_adagrad": 4, "adagrad": 4 * w.D, "sgd": 0}[self.optimizer]
        moved = {
            "records": n * (4 + 16),
            "sort": n * 16 * passes,
            "apply": n * (12 + 4 * w.D) + self.unique_rows * 2 * (4 * w.D + state_row),
        }
        return {
            name: {"median_ms": float(np.median(v) * 1e3), "bytes": moved[name]}
            for name, v in seen.items()
        } | {"unique_rows": self.unique_rows, "radix_passes": passes}

    # -- compiled-program facts -------------------------------------------------------------------
    def update_memory(self) -> dict[str, int] | None:
        """XLA's own accounting of the update program: temp bytes, donated (aliased) bytes."""
        if self.update is None:
            return None
        args = (self.params, self.state, self._operands)
        ma = self.update.jitted.lower(*args).compile().memory_analysis()
        if ma is None:
            return None
        return {
            "argument_bytes": int(ma.argument_size_in_bytes),
            "output_bytes": int(ma.output_size_in_bytes),
            "alias_bytes": int(ma.alias_size_in_bytes),
            "temp_bytes": int(ma.temp_size_in_bytes),
        }

    def forward_memory(self) -> dict[str, int] | None:
        ma = self.ebc._apply_jit.lower(self.params, self.batch.kjt).compile().memory_analysis()
        if ma is None:
            return None
        return {
            "temp_bytes": int(ma.temp_size_in_bytes),
            "output_bytes": int(ma.output_size_in_bytes),
        }

    # -- state --------------------------------------------------------------------------------------
    def tables(self) -> np.ndarray:
        x = np.array(self.params[self.group].astype(jnp.float32), copy=True)
        return x.reshape(self.w.T, self.w.E, self.w.D)

    def row_state(self) -> np.ndarray | None:
        """The Adagrad state as FbgemmSide.row_state gives it; None for SGD."""
        if self.optimizer not in ("rowwise_adagrad", "adagrad"):
            return None
        m = self.state.tables[self.group]["momentum1"]
        shape = (
            (self.w.T, self.w.E)
            if self.optimizer == "rowwise_adagrad"
            else (self.w.T, self.w.E, self.w.D)
        )
        return np.array(m, dtype=np.float32, copy=True).reshape(shape)
