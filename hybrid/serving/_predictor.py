"""`load(path) -> Predictor`: a serving artifact, verified, ready to score requests.

The host path of a call is kept small: the request is checked and packed by vectorised
numpy (`_request.read_sparse`) into the program's static shapes (ids padded to a rung of
the artifact's id capacities, bags to the smallest of its batch rungs that holds the
request: offsets `[features x rung + 1]`); the lookup runs as that rung's program compiled
ahead of time for that id capacity (once, cached; `warm` compiles ahead), the dense
tower as the `torch.export` program's graph made one plain function (`_lean_forward`: its
dead nodes dropped, each aten op called directly, its parameters constants, no pytree
wrapping, the interaction's advanced index as `index_select`; checked bit for bit at load;
then, by default, a DLRM interaction as one kernel call: `_fused_forward`, `_interaction`)
called under `torch.inference_mode` (the program's input-guard hook is skipped:
`read_dense` has already checked what it checks), on the pooled array as DLPack hands it
over (no copy; on CPU as the array's capsule).

Which lookup runs (`Predictor.lookup`): an artifact of a quantized model may hold its
lookups twice (`programs.sparse.cpu_kernel`), as XLA programs and as CPU programs whose
quantized tables are read by sparse_jax's fused C++ kernel (a custom call). `load(path,
lookup="auto")` runs the kernel's programs when JAX runs on CPU and the kernel library can
be registered here (`_kernel`: found without importing sparse_jax, built if missing), and
otherwise the XLA programs, with the reason in `Predictor.lookup_fallback` and a warning
on the `hybridrec.serving` logger; the scores are the same bit for bit either way.
`lookup="cpu_kernel"` refuses to fall back (ArtifactError), `lookup="xla"` never uses the
kernel. Where the kernel's programs run, the predictor calls the kernel directly instead
(`Predictor.direct`, `_direct`): the library's C entry pools every block of the request in
one call on the calling thread and writes the pooled array torch reads, without XLA's
dispatch and hand-over (at batch 1 they were most of the lookup's time). It is built from
the manifest and used only after it matched the programs bit for bit on probe requests at
load; otherwise, or with `load(direct=False)`, the programs run (`direct_fallback` says
why). The lookup and the dense tower stay two calls: the artifact holds one program of each
runtime, and nothing in `jax.export` or `torch.export` runs the other's program inside its
own.

Uses jax (the deserialized lookup program), numpy (the tables) and torch (the dense
program) and nothing of the training library: no `hybrid.Model`, no sparse_jax, no
optimizer, no planner.
"""

from __future__ import annotations

import logging
import operator
import os
import pathlib
import zipfile
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import torch

from hybrid.serving._artifact import (
    DENSE_FILE,
    ArtifactError,
    batch_rungs,
    kernel_program,
    read_manifest,
    sparse_file,
    verify_files,
)
from hybrid.serving._direct import direct_lookup
from hybrid.serving._interaction import (
    ATOL,
    RTOL,
    FusedInteraction,
    fused_interaction,
    interaction_rewrite,
)
from hybrid.serving._request import (
    RequestSpec,
    SparseArrays,
    probe_requests,
    read_dense,
    read_sparse,
    with_bounds,
)

__all__ = ["LOOKUPS", "Predictor", "load"]

log = logging.getLogger("hybridrec.serving")
LOOKUPS = ("auto", "cpu_kernel", "xla")


def _load_id_maps(path: pathlib.Path, where: str, manifest) -> dict[str, tuple]:
    """feature -> the frozen id map of its managed-collision table (ids, rows, the default
    row of each shard holding a map; none: {})."""
    maps = {}
    for entry in manifest["tables"]:
        mc = entry.get("managed_collision")  # absent in artifacts written before managed collision
        if mc is None:
            continue
        try:
            with np.load(path / mc["file"], allow_pickle=False) as z:
                ids, rows = z["ids"], z["rows"]
        except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile) as e:
            raise ArtifactError(
                f"{where}: {mc['file']} is unreadable ({type(e).__name__}: {e}); re-export the "
                "model"
            ) from None
        rows_ok = rows.size == 0 or (rows.min() >= 0 and rows.max() < int(entry["num_embeddings"]))
        default_rows = _default_rows(where, entry, mc)
        if (
            ids.dtype != np.int64
            or rows.dtype != np.int32
            or ids.shape != rows.shape
            or ids.shape != (int(mc["resident"]),)
            or not rows_ok
            or (np.diff(ids) <= 0).any()
        ):
            raise ArtifactError(
                f"{where}: {mc['file']} is not the id map the manifest describes for table "
                f"{entry['name']!r} ({mc['resident']} ascending int64 ids with int32 rows in "
                f"[0, {entry['num_embeddings']})); re-export the model"
            )
        for feature in entry["features"]:
            maps[feature] = (ids, rows, default_rows)
    return maps


def _default_rows(where: str, entry, mc) -> np.ndarray:
    """The default row of each shard holding a map of a managed table (int64, ascending):
    the manifest's `default_rows` (artifacts written before it: `shards` blocks of
    `default_row + 1` rows), checked to end the table's rows, but for the one row of an
    uneven row-wise split's last block that holds no map (10 rows over 4 shards: maps of 3,
    3, 3 and a row)."""
    num, default_row = int(entry["num_embeddings"]), int(mc["default_row"])
    shards = int(mc.get("shards", 1))  # absent in artifacts written before sharded maps: one map
    written = mc.get("default_rows", [(default_row + 1) * s + default_row for s in range(shards)])
    ints = isinstance(written, list) and all(type(v) is int for v in written)
    out = np.asarray(written if ints else [], np.int64)
    if not (
        shards >= 1
        and out.shape == (shards,)
        and out[0] == default_row >= 0
        and (np.diff(out) > 0).all()
        and num - 1 - out[-1] in (0, 1)
    ):
        raise ArtifactError(
            f"{where}: table {entry['name']!r}'s id map names {shards} shard(s) with default row "
            f"{mc['default_row']}, which does not split its {entry['num_embeddings']} rows (default "
            f"rows {written}); re-export the model"
        )
    return out


def _spec(manifest: dict[str, Any], id_maps=None) -> RequestSpec:
    tables_of: dict[str, list[tuple[str, int]]] = {f: [] for f in manifest["features"]}
    for t in manifest["tables"]:
        for f in t["features"]:
            tables_of[f].append((t["name"], int(t["num_embeddings"])))
    accepts = manifest["accepts"]
    spec = RequestSpec(
        features=tuple(manifest["features"]),
        tables_of={f: tuple(v) for f, v in tables_of.items()},
        is_weighted=manifest["is_weighted"],
        bounds_check=manifest["bounds_check"],
        max_batch_size=int(accepts["max_batch_size"]),
        id_capacities=tuple(int(c) for c in accepts["id_capacities"]),
        id_maps=id_maps,
        batch_rungs=tuple(batch_rungs(manifest)),
    )
    return with_bounds(spec)


def _load_table(path: pathlib.Path, where: str, entry: dict[str, Any]) -> np.ndarray:
    name = entry["file"]
    try:
        array = np.load(path / name, allow_pickle=False)
    except (OSError, ValueError, EOFError) as e:
        raise ArtifactError(
            f"{where}: {name} is unreadable ({type(e).__name__}: {e}); re-export the model"
        ) from None
    if str(array.dtype) != entry["file_dtype"] or list(array.shape) != list(entry["shape"]):
        raise ArtifactError(
            f"{where}: {name} holds {array.dtype} {list(array.shape)} but the manifest says table "
            f"{entry['name']!r} is {entry['file_dtype']} {list(entry['shape'])}; re-export the model"
        )
    if entry["dtype"] == "bfloat16":  # stored as its bits: .npy has no bfloat16
        array = array.view(jnp.bfloat16)
    return array


def _load_sparse(
    path: pathlib.Path,
    where: str,
    tables: Sequence[np.ndarray],
    manifest,
    batch: int,
    form: str = "xla",
) -> jax.export.Exported:
    """The lookup program taking `batch` bags per feature in `form`, checked against the tables."""
    name = sparse_file(batch, int(manifest["accepts"]["max_batch_size"]), form)
    try:
        exported = jax.export.deserialize(bytearray((path / name).read_bytes()))
    except ImportError:  # jax's serialization needs the flatbuffers package: say so as jax does
        raise
    except Exception as e:  # flatbuffers / MLIR raise many types for damaged bytes
        raise ArtifactError(
            f"{where}: {name} is unreadable ({type(e).__name__}: {e}); it was written with jax "
            f"{manifest['versions'].get('jax')}, this is jax {jax.__version__}: re-export the model"
        ) from None
    n_inputs = len(tables) + 2 + int(manifest["is_weighted"])
    avals = exported.in_avals
    if len(avals) != n_inputs:
        raise ArtifactError(
            f"{where}: {name} takes {len(avals)} inputs, the manifest implies {n_inputs}"
        )
    for entry, table, aval in zip(manifest["tables"], tables, avals, strict=False):
        if tuple(aval.shape) != table.shape or aval.dtype != table.dtype:
            raise ArtifactError(
                f"{where}: {name} expects table {entry['name']!r} as {aval.dtype} {list(aval.shape)} but "
                f"{entry['file']} holds {table.dtype} {list(table.shape)}; the files come from different exports"
            )
    offsets = tuple(avals[len(tables) + 1].shape)
    if offsets != (len(manifest["features"]) * batch + 1,):
        raise ArtifactError(
            f"{where}: {name} takes offsets of shape {list(offsets)}, not the "
            f"[{len(manifest['features'])} features x {batch} + 1] of a batch of {batch}; the files "
            "come from different exports"
        )
    return exported


def _load_dense(path: pathlib.Path, where: str) -> torch.nn.Module:
    try:
        program = torch.export.load(path / DENSE_FILE)
    except Exception as e:  # torch raises many types for a damaged archive
        raise ArtifactError(
            f"{where}: {DENSE_FILE} is unreadable ({type(e).__name__}: {e}); re-export the model"
        ) from None
    # no guard submodule: `read_dense` checks the inputs (shape, dtype, batch range) first
    return program.module(check_guards=False)


_ATEN = torch.ops.aten
INTERACTIONS = ("auto", "graph")  # load(interaction=...)


def _gather_rewrite(graph: torch.fx.Graph, attrs: dict[str, Any]) -> None:
    """Each `x[:, rows, cols]` of a 3-D `x` by constant index vectors (the interaction's
    upper triangle: `aten.index.Tensor`, an advanced index) becomes the same gather as
    `x.flatten(1).index_select(1, rows * x.shape[2] + cols)`: the same values (a gather
    moves them untouched) for a fraction of the advanced index's cost."""
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not _ATEN.index.Tensor:
            continue
        x, index = node.args
        val = x.meta.get("val") if isinstance(x, torch.fx.Node) else None
        if not (
            isinstance(index, list | tuple)
            and len(index) == 3
            and index[0] is None
            and all(isinstance(i, torch.fx.Node) and i.op == "get_attr" for i in index[1:])
            and isinstance(val, torch.Tensor)
            and val.ndim == 3
            and all(isinstance(d, int) for d in val.shape[1:])
        ):
            continue
        rows, cols = (attrs[i.target] for i in index[1:])
        d1, d2 = val.shape[1:]
        if not (
            rows.ndim == cols.ndim == 1
            and rows.shape == cols.shape
            and not rows.is_floating_point()
            and not cols.is_floating_point()
            and bool(((rows >= 0) & (rows < d1) & (cols >= 0) & (cols < d2)).all())
        ):
            continue
        name = f"_attr{len(attrs)}"
        attrs[name] = (rows.long() * d2 + cols.long()).contiguous()
        with graph.inserting_before(node):
            flat = graph.call_function(_ATEN.flatten.using_ints, (x, 1))
            where = graph.get_attr(name)
            gather = graph.call_function(_ATEN.index_select.default, (flat, 1, where))
        node.replace_all_uses_with(gather)
        graph.erase_node(node)


def _as_function(graph: torch.fx.Graph, attrs: dict[str, Any]) -> Callable:
    """`graph` as one plain Python function of its placeholders: each op called as the
    object the node names (no `torch.ops.aten...` lookups per call), each parameter and
    buffer a global of the function (not a `Module.__getattr__`), `aten.sym_size.int` as
    `Tensor.size`. Only placeholders, get_attr, call_function and one output."""
    consts: dict[str, Any] = {}

    def const(obj) -> str:
        name = f"_k{len(consts)}"
        consts[name] = obj
        return name

    names: dict[torch.fx.Node, str] = {}

    def arg(a) -> str:
        if isinstance(a, torch.fx.Node):
            return names[a]
        if isinstance(a, list):
            return "[" + ", ".join(map(arg, a)) + "]"
        if isinstance(a, tuple):
            return "(" + "".join(arg(x) + ", " for x in a) + ")"
        if a is None or type(a) in (bool, int):
            return repr(a)
        return const(a)

    params, lines = [], []
    for i, node in enumerate(graph.nodes):
        names[node] = f"v{i}"
        if node.op == "placeholder":
            params.append(names[node])
        elif node.op == "get_attr":
            names[node] = const(attrs[node.target])
        elif node.op == "call_function":
            fn = node.target
            if fn is _ATEN.sym_size.int:
                fn = torch.Tensor.size
            call = [arg(a) for a in node.args] + [f"{k}={arg(v)}" for k, v in node.kwargs.items()]
            lines.append(f"{names[node]} = {const(fn)}({', '.join(call)})")
        elif node.op == "output":
            lines.append(f"return {arg(node.args[0])}")
        else:
            raise NotImplementedError(f"graph node {node.op}")
    source = f"def forward({', '.join(params)}):\n" + "".join(f"    {line}\n" for line in lines)
    namespace = dict(consts)
    exec(compile(source, "<hybrid.serving lean tower>", "exec"), namespace)  # noqa: S102
    forward = namespace["forward"]
    forward.source = source
    return forward


def _lean_graph(module: torch.nn.Module) -> tuple[torch.fx.Graph, dict[str, Any]] | None:
    """`module`'s exported graph `(dense_features, pooled) -> logits` without its dead nodes
    and pytree wrapping, its interaction's advanced index as `index_select`
    (`_gather_rewrite`), its parameters as `attrs`; None for a graph not of that form."""
    graph = getattr(module, "graph", None)
    if not isinstance(graph, torch.fx.Graph):
        return None
    lean = torch.fx.Graph()
    out = lean.graph_copy(graph, {})
    inputs = [n for n in lean.nodes if n.op == "placeholder"]
    if not (
        isinstance(out, tuple | list)
        and len(out) == 1
        and isinstance(out[0], torch.fx.Node)
        and len(inputs) == 2
    ):
        return None
    lean.output(out[0])
    attrs = {}
    for node in lean.nodes:
        if node.op == "get_attr":
            name = f"_attr{len(attrs)}"
            attrs[name] = operator.attrgetter(node.target)(module)
            node.target = name
    lean.eliminate_dead_code()
    _gather_rewrite(lean, attrs)
    lean.eliminate_dead_code()
    return lean, attrs


def _probes(dense: tuple[int, torch.dtype], width: int, max_batch: int):
    """Probe inputs of 1, 2 and `max_batch` samples: dense features `dense` = (width,
    dtype), pooled `width` columns."""
    gen = torch.Generator().manual_seed(0)
    return [
        (
            torch.randn(batch, dense[0], generator=gen).to(dense[1]),
            torch.randn(batch, width, generator=gen),
        )
        for batch in sorted({1, min(2, max_batch), max_batch})
    ]


def _lean_forward(
    module: torch.nn.Module, dense: tuple[int, torch.dtype], width: int, max_batch: int
) -> Callable:
    """`module`'s forward `(dense_features, pooled) -> logits` as the same computation with
    less Python per call: nodes nothing reads dropped (the per-feature views of the
    KeyedTensor the wrapper builds), the interaction's advanced index as the same gather by
    `index_select` (`_gather_rewrite`), no pytree flattening of the inputs nor unflattening
    of the output, and the graph as one plain function (`_as_function`: ops called
    directly, parameters as constants). The result is checked equal (bit for bit) to the
    graph's on probe batches (`_probes`), else (or for a graph not of that form)
    `module.forward` itself is returned."""
    try:
        lean = _lean_graph(module)
        if lean is None:
            return module.forward
        forward = _as_function(*lean)
        with torch.inference_mode():
            for probe in _probes(dense, width, max_batch):
                if not torch.equal(forward(*probe), module.forward(*probe)):
                    return module.forward
    except Exception:  # any graph the rewrite does not handle runs as exported
        return module.forward
    return forward


def _fused_forward(
    module: torch.nn.Module,
    dense: tuple[int, torch.dtype],
    width: int,
    max_batch: int,
    fused: FusedInteraction,
) -> Callable | str:
    """`_lean_forward`'s function with the DLRM interaction as one call of `fused`
    (`_interaction`), checked on the probe batches: logits within `RTOL` / `ATOL` of the
    graph's; else why not."""
    try:
        lean = _lean_graph(module)
        if lean is None:
            return "the dense tower is not a graph of (dense_features, pooled) -> logits"
        if interaction_rewrite(*lean, fused) == 0:
            return "the dense tower holds no DLRM interaction (InteractionArch) the kernel takes"
        forward = _as_function(*lean)
        with torch.inference_mode():
            for probe in _probes(dense, width, max_batch):
                got, want = forward(*probe), module.forward(*probe)
                if not torch.allclose(got, want, rtol=RTOL, atol=ATOL):
                    diff = float((got - want).abs().max())
                    return f"the fused interaction's logits differ from the graph's by {diff:.3g}"
    except Exception as e:  # any graph the rewrite does not handle runs without it
        return f"the fused interaction failed on the probes ({type(e).__name__}: {e})"
    return forward


class Predictor:
    """Scores requests with an exported model: `predictor(dense_features, sparse) -> logits`.

    Built by `load`. The sparse lookup runs as the exported JAX program on JAX's default
    device (tables placed there once), or as the C++ kernel called directly (`direct`), the
    dense tower as the exported torch program on CPU.

    Attributes:
      manifest: the artifact's manifest (a dict).
      lookup: which lookup programs run: "cpu_kernel" (the C++ kernel's) or "xla".
      lookup_fallback: why the XLA programs run although the artifact holds the kernel's
        (None when it does not, or when the kernel's run).
      direct: True when the kernel is called directly, not through its programs.
      direct_fallback: why the kernel runs through its programs (None when it is called
        directly, or was not to be: `load(direct=False)`, or the XLA programs run).
      interaction: how the dense tower computes a DLRM interaction: "kernel" (one call of
        the kernel library, `_interaction`) or "graph" (the exported graph's ops).
      interaction_fallback: why the graph's ops run under `load(interaction="auto")` (no
        kernel library, no DLRM interaction in the tower, a failed check), else None.
      features: the sparse features a request must give, in the program's order.
      max_batch_size: the most samples one call takes (pad nothing: fewer is fine).
      n_dense: the width of `dense_features`.
      torch_threads: torch's intra-op threads while the dense tower runs (None: the
        process's setting, untouched).
    """

    def __init__(
        self,
        path: pathlib.Path,
        manifest: dict[str, Any],
        tables: Sequence[np.ndarray],
        exported: dict[int, jax.export.Exported],
        dense: torch.nn.Module,
        id_maps=None,
        lookup: str = "xla",
        lookup_fallback: str | None = None,
        torch_threads: int | None = 1,
        direct: bool = True,
        interaction: str = "auto",
    ):
        if torch_threads is not None and (
            isinstance(torch_threads, bool)
            or not isinstance(torch_threads, int)
            or torch_threads < 1
        ):
            raise ValueError(
                f"torch_threads={torch_threads!r}: give a positive int, or None to leave torch's "
                "thread count as the process set it"
            )
        self.path = path
        self.torch_threads = torch_threads
        self.lookup = lookup
        self.lookup_fallback = lookup_fallback
        self.manifest = manifest
        self._spec = _spec(manifest, id_maps)
        self._tables = [jax.device_put(t) for t in tables]
        # on CPU the pooled array is handed to torch as its DLPack capsule (no copy, none of
        # torch.from_dlpack's device and version negotiation); elsewhere by from_dlpack
        self._host = all(d.platform == "cpu" for t in self._tables for d in t.devices())
        self._exported = exported  # batch rung -> its lookup program
        self._compiled: dict[tuple[int, int], Any] = {}  # (batch rung, id capacity) -> compiled
        self._dense = dense
        self._dense_dtype = getattr(torch, manifest["dense"]["dtype"])
        # the graph itself: the module's __call__ adds torch.export's input-guard hook, which
        # re-checks (slowly) the shapes read_dense has checked
        pooled_width = sum(int(e["dim"]) for e in manifest["embeddings"])
        self._dense_forward = _lean_forward(
            dense, (self.n_dense, self._dense_dtype), pooled_width, self.max_batch_size
        )
        self.interaction, self.interaction_fallback = "graph", None
        if interaction == "auto":
            from hybrid.serving import _kernel

            found = fused_interaction(_kernel.library())
            if not isinstance(found, str):
                found = _fused_forward(
                    dense,
                    (self.n_dense, self._dense_dtype),
                    pooled_width,
                    self.max_batch_size,
                    found,
                )
            if isinstance(found, str):
                self.interaction_fallback = found
            else:
                self._dense_forward, self.interaction = found, "kernel"
        self._direct = None
        self.direct_fallback = None
        if lookup == "cpu_kernel" and direct:
            from hybrid.serving import _kernel

            found = direct_lookup(
                manifest,
                # the placed tables' own buffers (views, no copy: the loaded arrays go)
                [np.asarray(t) for t in self._tables],
                self._spec,
                _kernel.library(),
                [read_sparse(r, self._spec) for r in probe_requests(self._spec)],
                self._pool,
            )
            if isinstance(found, str):
                self.direct_fallback = found
                log.warning("%s: the kernel runs through its programs: %s", path, found)
            else:
                self._direct = found

    @property
    def features(self) -> list[str]:
        return list(self._spec.features)

    @property
    def max_batch_size(self) -> int:
        return self._spec.max_batch_size

    @property
    def n_dense(self) -> int:
        return int(self.manifest["dense"]["in_features"])

    @property
    def max_ids(self) -> int:
        """The most ids (all features of all samples) one call takes: the largest id capacity."""
        return self._spec.id_capacities[-1]

    def _program(self, batch: int, capacity: int):
        """The lookup for `batch` bags per feature and `capacity` ids, compiled once (cached)."""
        compiled = self._compiled.get((batch, capacity))
        if compiled is None:
            ids = jax.ShapeDtypeStruct((capacity,), jnp.int32)
            offsets = jax.ShapeDtypeStruct((len(self._spec.features) * batch + 1,), jnp.int32)
            args = [*self._tables, ids, offsets]
            if self.manifest["is_weighted"]:
                args.append(jax.ShapeDtypeStruct((capacity,), jnp.float32))
            compiled = jax.jit(self._exported[batch].call).lower(*args).compile()
            self._compiled[(batch, capacity)] = compiled
        return compiled

    @property
    def batch_rungs(self) -> list[int]:
        """The batch sizes with a lookup program of their own (a request runs the smallest
        that holds it)."""
        return sorted(self._exported)

    def compiled(self) -> list[tuple[int, int]]:
        """The (batch rung, id capacity) pairs compiled so far."""
        return sorted(self._compiled)

    def warm(self, max_ids: int | None = None) -> list[tuple[int, int]]:
        """Compile the lookup for every batch rung and id capacity up to `max_ids` (default:
        the smallest capacity only) now, not at the first request that needs it; returns
        the (batch rung, capacity) pairs. A predictor that calls the kernel directly
        (`direct`) runs no program: it compiles nothing and returns []."""
        if self._direct is not None:
            return []
        caps = self._spec.id_capacities
        caps = [c for c in caps if max_ids is not None and c <= max_ids] or [caps[0]]
        pairs = [(b, c) for b in self._exported for c in caps]
        for b, c in pairs:
            self._program(b, c)
        return pairs

    @property
    def direct(self) -> bool:
        """True when the kernel lookup is called directly (`_direct`), not through its
        programs (then `direct_fallback` says why, where it was tried)."""
        return self._direct is not None

    def _pool(self, arrays: SparseArrays) -> torch.Tensor:
        if self._direct is not None:
            return self._direct(arrays)
        batch = (arrays.offsets.shape[0] - 1) // len(self._spec.features)
        program = self._compiled.get((batch, arrays.values.shape[0]))
        if program is None:
            program = self._program(batch, arrays.values.shape[0])
        if arrays.weights is None:
            pooled = program(*self._tables, arrays.values, arrays.offsets)
        else:
            pooled = program(*self._tables, arrays.values, arrays.offsets, arrays.weights)
        if self._host:  # (no copy)
            pooled = torch.utils.dlpack.from_dlpack(pooled.__dlpack__())
        else:
            pooled = torch.from_dlpack(pooled).cpu()
        return pooled if arrays.batch_size == batch else pooled[: arrays.batch_size]

    def pooled(self, sparse) -> torch.Tensor:
        """The pooled embeddings `[B, sum of dims]` (fp32, the model's feature order) of a
        sparse request (any form `hybrid.serving` reads; ids checked)."""
        return self._pool(read_sparse(sparse, self._spec))

    def check(self, dense_features, sparse) -> tuple[int, int]:
        """(samples, ids) of a request, after every check `__call__` makes, without scoring it;
        a request it cannot score raises `RequestError` (a ValueError) naming the problem."""
        arrays = read_sparse(sparse, self._spec)
        read_dense(dense_features, self.n_dense, arrays.batch_size, self._dense_dtype)
        return arrays.batch_size, int(arrays.offsets[-1])

    def __call__(self, dense_features, sparse) -> torch.Tensor:
        """Logits `[B, outputs]` of the dense tower for `dense_features` `[B, n_dense]`
        (tensor or array-like) and `sparse` (module docstring of `hybrid.serving`). A request
        it cannot score raises `RequestError` (a ValueError) naming the problem."""
        arrays = read_sparse(sparse, self._spec)
        dense = read_dense(dense_features, self.n_dense, arrays.batch_size, self._dense_dtype)
        return self.tower(dense, self._pool(arrays))

    def tower(self, dense: torch.Tensor, pooled: torch.Tensor) -> torch.Tensor:
        """The dense tower on read dense features and pooled embeddings, under
        `inference_mode`, with `torch_threads` intra-op threads (the process's count given
        back after)."""
        threads, prev = self.torch_threads, torch.get_num_threads()
        if threads is not None and threads != prev:
            torch.set_num_threads(threads)
        try:
            with torch.inference_mode():
                return self._dense_forward(dense, pooled)
        finally:
            if threads is not None and threads != prev:
                torch.set_num_threads(prev)

    def __repr__(self) -> str:
        return (
            f"Predictor({str(self.path)!r}: {self.manifest['model']}, features {self.features}, "
            f"max_batch_size {self.max_batch_size}, lookup {self.lookup})"
        )


def _choose_lookup(where: str, manifest, lookup: str) -> tuple[str, str | None]:
    """(the form to run, why not the kernel's when the artifact holds it) for `lookup`."""
    if lookup not in LOOKUPS:
        raise ValueError(f"lookup={lookup!r} is not one of {LOOKUPS}")
    kernel = kernel_program(manifest)
    if lookup == "xla":
        return "xla", None
    if kernel is None:
        problem = "the artifact holds no C++ kernel lookup (a float model, or exported where the kernel was not built)"
    else:
        from hybrid.serving import _kernel

        problem = _kernel.register(kernel["target"])
    if problem is None:
        return "cpu_kernel", None
    if lookup == "cpu_kernel":
        raise ArtifactError(f"{where}: lookup='cpu_kernel' was asked for, but {problem}")
    if kernel is not None:
        log.warning("%s: running the XLA lookup programs: %s", where, problem)
        return "xla", problem
    return "xla", None


def load(
    path: str | os.PathLike,
    *,
    lookup: str = "auto",
    torch_threads: int | None = 1,
    direct: bool = True,
    interaction: str = "auto",
) -> Predictor:
    """Load the serving artifact `path` (a directory `hybrid.export` wrote).

    Every file is checked against the manifest's sha256 first; a missing, damaged or
    truncated file, a malformed manifest or one of another format version, or a table
    whose shape is not the manifest's raises `ArtifactError` naming the file.

    lookup: "auto" runs the artifact's C++ kernel lookups when it holds them and the kernel
    can be registered here, else its XLA programs (module docstring); "cpu_kernel" the
    kernel's or ArtifactError; "xla" the XLA programs.

    direct: call the kernel directly where its programs would run (checked against them at
    load; module docstring); False always runs the programs.

    interaction: "auto" computes a DLRM tower's interaction (`InteractionArch`: the pairwise
    dots and their upper triangle) by one call of the kernel library (`_interaction`) where
    the library loads and the fused tower passes its check at load (`Predictor.interaction`
    is then "kernel", else "graph" with the reason in `interaction_fallback`): at batch 512
    a quarter of the call's time, logits within 1e-4 relative of the graph's (the dots sum
    in another order). "graph" runs the exported graph's ops: the logits are the in-process
    model's bit for bit.

    torch_threads: torch's intra-op threads while a call's dense tower runs (the process's
    count is restored after it); None leaves them alone. One by default: beside JAX's CPU
    threads (which the lookup kernel's bags also run on), torch's second thread waited for a
    core on a 2-core machine, and a call took 2.4x (batch 1), 3.2x (64) and 1.7x (512) its
    time with one (benchmarks.serving_latency's int8 DLRM, each alone in a fresh process);
    two lost at every batch again once the kernel left OpenMP (benchmarks/NOTES.md)."""
    if interaction not in INTERACTIONS:
        raise ValueError(
            f"interaction={interaction!r}: give one of {', '.join(map(repr, INTERACTIONS))}"
        )
    path = pathlib.Path(path)
    where = f"serving artifact {str(path)!r}"
    manifest = read_manifest(path)
    verify_files(path, manifest)
    tables = [_load_table(path, where, entry) for entry in manifest["tables"]]
    rungs = batch_rungs(manifest)
    # the XLA programs are always read and checked: they are the fallback
    exported = {b: _load_sparse(path, where, tables, manifest, b) for b in rungs}
    form, fallback = _choose_lookup(where, manifest, lookup)
    if form != "xla":
        exported = {b: _load_sparse(path, where, tables, manifest, b, form) for b in rungs}
    id_maps = _load_id_maps(path, where, manifest)
    return Predictor(
        path,
        manifest,
        tables,
        exported,
        _load_dense(path, where),
        id_maps,
        form,
        fallback,
        torch_threads=torch_threads,
        direct=direct,
        interaction=interaction,
    )
