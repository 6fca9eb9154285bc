"""The C++ lookup kernel called without XLA: `direct_lookup(...) -> DirectLookup | reason`.

An artifact's "cpu_kernel" lookup program is, for each output block (one feature pooled
from one packed table), a custom call of the kernel (`HybridrecQuantPooled`) on that
feature's slice of the offsets, then a concatenation. Around a kernel that takes
microseconds for a small request, running the program adds XLA's dispatch, the wait for its
thread and the hand-over of its output to torch: at batch 1 most of the lookup's time.
`DirectLookup` calls the library's plain C entry `HybridrecQuantServe` through ctypes
instead: every block in one call on the calling thread (a request of more than 4,096 ids
pools its later blocks on one helper thread), written straight into the columns of a numpy
`[batch, sum of dims]` array that torch then takes without a copy. The entry pools each
block with the custom call's own code (`QuantPoolInto` in `embedding_cpu.cc`), so the
scores are the program's bit for bit; `direct_lookup` builds the blocks from the manifest
and compares them with the program on probe requests before it is used.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from hybrid.serving._request import RequestSpec, SparseArrays

__all__ = ["DirectLookup", "direct_lookup"]

ENTRY = "HybridrecQuantServe"
KINDS = {"int8": 8, "int4": 4, "int2": 2, "fp16": 16}  # packed row types -> the kernel's kind
FIELDS = 10  # int64 per block in the plan (kQuantPlanFields in embedding_cpu.cc)


def _entry(lib: ctypes.CDLL):
    fn = getattr(lib, ENTRY, None)
    if fn is None:
        return None
    p, i = ctypes.c_void_p, ctypes.c_int64
    fn.argtypes = [p, i, p, i, p, i, i, i, p, p, i]
    fn.restype = i
    return fn


def _plan(
    manifest: Mapping[str, Any], tables: Sequence[np.ndarray]
) -> tuple[np.ndarray, int] | str:
    """(int64 `[blocks, FIELDS]` plan, pooled width), or why this artifact's lookup is not
    one the entry runs (a float table, blocks that do not tile the output)."""
    features = list(manifest["features"])
    by_name = {t["name"]: (k, t) for k, t in enumerate(manifest["tables"])}
    clamp = int(manifest["bounds_check"] == "clamp")
    weighted = int(bool(manifest["is_weighted"]))
    rows, column = [], 0
    for e in manifest["embeddings"]:
        k, entry = by_name[e["table"]]
        kind = KINDS.get(entry.get("weight_type")) if entry.get("packed") else None
        if kind is None:
            return f"table {e['table']!r} is not packed (int8 / int4 / int2 / fp16 rows)"
        table = tables[k]
        dim = int(e["dim"])
        if int(e["offset"]) != column or table.dtype != np.uint8 or not table.flags.c_contiguous:
            return f"block {e['name']!r} is not where the direct lookup would write it"
        rows.append(
            [
                table.ctypes.data,
                table.shape[0],
                table.shape[1],
                kind,
                dim,
                column,
                features.index(e["feature"]),
                clamp,
                int(entry["pooling"] == "MEAN"),
                weighted,
            ]
        )
        column += dim
    return np.array(rows, np.int64).reshape(-1, FIELDS), column


class DirectLookup:
    """`lookup(arrays) -> pooled` (torch fp32 `[arrays.batch_size, width]`): the artifact's
    lookup by the kernel's C entry (module docstring). Holds the tables it reads."""

    def __init__(
        self, entry, plan: np.ndarray, width: int, tables: Sequence[np.ndarray], features: int
    ):
        self._entry = entry
        self._plan = plan
        self._plan_at = plan.ctypes.data
        self._blocks = plan.shape[0]
        self.width = width
        self._tables = list(tables)  # the plan holds their addresses: keep them alive
        self._features = features  # offsets hold features x (bags per feature) + 1

    def __call__(self, arrays: SparseArrays) -> torch.Tensor:
        batch = arrays.batch_size
        out = np.empty((batch, self.width), np.float32)
        offsets, values = arrays.offsets, arrays.values
        weights = arrays.weights
        status = self._entry(
            self._plan_at,
            self._blocks,
            values.ctypes.data,
            values.shape[0],
            offsets.ctypes.data,
            offsets.shape[0],
            (offsets.shape[0] - 1) // self._features,
            batch,
            None if weights is None else weights.ctypes.data,
            out.ctypes.data,
            self.width,
        )
        if status:
            raise RuntimeError(
                f"{ENTRY} refused block {status - 1} of a request of {batch} samples "
                f"(offsets {offsets.shape[0]}, ids {values.shape[0]}): a bug, please report it"
            )
        return torch.from_numpy(out)


def direct_lookup(
    manifest: Mapping[str, Any],
    tables: Sequence[np.ndarray],
    spec: RequestSpec,
    library,
    probes: Sequence[SparseArrays],
    program: Callable[[SparseArrays], torch.Tensor],
) -> DirectLookup | str:
    """The direct lookup of this artifact, checked equal (bit for bit) to `program` (the
    artifact's kernel lookup program) on every probe request; else why not (a string)."""
    if isinstance(library, str):
        return library
    entry = _entry(library)
    if entry is None:
        return f"the C++ kernel library has no {ENTRY} (built from an older source)"
    tables = [np.ascontiguousarray(t) for t in tables]
    plan = _plan(manifest, tables)
    if isinstance(plan, str):
        return plan
    lookup = DirectLookup(entry, *plan, tables, len(spec.features))
    for arrays in probes:
        got, want = lookup(arrays), program(arrays)
        if got.shape != want.shape or not torch.equal(got, want):
            return (
                f"the direct lookup differs from the artifact's program on a probe of "
                f"{arrays.batch_size} samples"
            )
    return lookup
