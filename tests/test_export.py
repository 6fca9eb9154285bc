"""Export and serving: `hybrid.export` writes one directory, `hybrid.serving.load` serves it.

A small DLRM trained a few steps is exported (fp32 tables) and, after `hybrid.quantize`,
again (int8 rows). A fresh process that loads `hybrid.serving` without `hybrid/__init__`
(so without the training library) predicts what the in-memory models predict: fp32 to
1e-6 relative, int8 bit for bit; its `sys.modules` holds no sparse_jax, dense_torch,
optimizer, planner, `hybrid.Model` or training module. The CLI, run as `python -m` runs it,
scores a JSON-lines file as the predictor does. Damaged artifacts (a flipped byte, a missing
or truncated file, a manifest of another version, a table of another shape) are refused
naming the file; out-of-range ids name the feature, sample and id; requests larger than the
exported shapes say what to re-export with. A weighted model with tables sharded over a
2-device mesh exports from the gathered tables.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest
import torch

import dense_torch
import hybrid
import hybrid.serving as serving
from hybrid.inference import export
from hybrid.serving._interaction import FusedInteraction
from sparse_jax import EmbeddingBagConfig, _kernels
from sparse_jax.optim import rowwise_adagrad

ROOT = pathlib.Path(__file__).resolve().parents[1]
# (the suite's shared compilation cache: a half-written entry read by another process warns,
# and jax compiles instead; pyproject.toml ignores the same two warnings)
CACHE_WARNINGS = (
    "-W",
    "ignore:Error reading persistent compilation cache entry:UserWarning",
    "-W",
    "ignore:Error writing persistent compilation cache entry:UserWarning",
)
ROWS = {"a": 50, "b": 50, "c": 30}
TABLES = [
    EmbeddingBagConfig(name="t0", num_embeddings=50, embedding_dim=4, feature_names=["a", "b"]),
    EmbeddingBagConfig(
        name="t1", num_embeddings=30, embedding_dim=4, feature_names=["c"], pooling="MEAN"
    ),
]
N_DENSE, BATCH = 5, 8


def _request(rng, n: int, *, weighted: bool = False):
    """(dense [n, 5], {feature: per-sample id lists}, the same as {feature: (values, lengths[, weights])}).
    Features in another order than the model's; some bags empty, some with repeated ids."""
    lists = {
        f: [rng.integers(0, ROWS[f], rng.integers(0, 6)).tolist() for _ in range(n)]
        for f in ("c", "a", "b")
    }
    lists["a"][0] = []
    lists["b"][1] = [3, 3, 3]
    flat = _flat(lists)
    if weighted:
        for f, (values, lengths) in flat.items():
            weights = torch.rand(len(values), generator=torch.Generator().manual_seed(1))
            flat[f] = (values, lengths, weights)
    return torch.randn(n, N_DENSE, generator=torch.Generator().manual_seed(n)), lists, flat


def _flat(lists: dict[str, list[list[int]]]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Bags per feature as the (values, lengths) form a model takes."""
    return {
        f: (
            torch.tensor([i for bag in bags for i in bag], dtype=torch.int64),
            torch.tensor([len(bag) for bag in bags]),
        )
        for f, bags in lists.items()
    }


def _train(model, rng, steps: int = 3):
    opt = torch.optim.Adam(model.dense_parameters(), lr=1e-2)
    for _ in range(steps):
        dense, _, flat = _request(rng, BATCH, weighted=model.sparse_module.is_weighted())
        logits = model(dense, flat).squeeze(-1)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, torch.ones(BATCH))
        opt.zero_grad()
        loss.backward()
        opt.step()


def _eval(model, dense, sparse) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        out = model(dense, sparse)
    model.train()
    return out


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """Two artifacts of one trained model (fp32 and int8), a request, and the in-memory predictions."""
    rng = np.random.default_rng(0)
    torch.manual_seed(0)
    model = hybrid.Model(
        TABLES,
        dense_torch.DLRM(4, 3, N_DENSE, [8, 4], [8, 1]),
        sparse_optimizer=rowwise_adagrad(lr=0.1),
    )
    _train(model, rng)
    qmodel = hybrid.quantize(model, "int8")
    dense, lists, flat = _request(rng, BATCH)
    root = tmp_path_factory.mktemp("export")
    float_dir = export(model, root / "fp32", example=(dense, lists))
    quant_dir = export(
        qmodel,
        root / "int8",
        example=(dense[:3], {f: v[:3] for f, v in lists.items()}),
        max_batch_size=BATCH,
        id_capacities=(64, 128),
    )
    return {
        "fp32": float_dir,
        "int8": quant_dir,
        "dense": dense,
        "lists": lists,
        "flat": flat,
        "root": root,
        "expected_fp32": _eval(model, dense, flat),
        "expected_int8": _eval(qmodel, dense, flat),
        # the in-memory model on the first 5 samples alone: on some CPUs MKL's gemm rounds a
        # row differently at another batch size (Intel Xeon, torch 2.13: Linear(5, 8) on 5
        # rows differs from the first 5 of 8 by 2.4e-7), so fewer samples are compared with
        # the model run on as many
        "expected_int8_few": _eval(qmodel, dense[:5], _flat({f: b[:5] for f, b in lists.items()})),
    }


def _run(
    script: str, tmp_path: pathlib.Path, *args: str, env=(), warnings_as_errors: bool = True
) -> subprocess.CompletedProcess:
    """`script` in a fresh Python (CPU JAX, one thread, `env` added), which must succeed."""
    path = tmp_path / "script.py"
    path.write_text(script)
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "OMP_NUM_THREADS": "1", **dict(env)}
    flags = ["-W", "error", *CACHE_WARNINGS] if warnings_as_errors else []
    done = subprocess.run(
        [sys.executable, *flags, str(path), *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,  # generous: a loaded machine slows a fresh jax + torch process many times
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done


# The loader alone: `hybrid` is a bare namespace, so `hybrid/__init__` (the training library) never runs.
FRESH = """
import json, sys, types
hybrid = types.ModuleType("hybrid")
hybrid.__path__ = [sys.argv[1] + "/hybrid"]
sys.modules["hybrid"] = hybrid
import numpy as np, torch
import hybrid.serving
request = json.load(open(sys.argv[2]))
dense = torch.tensor(request["dense"])
lookups = {}
for name in ("fp32", "int8"):
    predictor = hybrid.serving.load(request[name])
    np.save(request["out"] + f"/{name}.npy", predictor(dense, request["sparse"]).numpy())
    lookups[name] = [predictor.lookup, predictor.lookup_fallback, predictor.direct]
json.dump(lookups, open(request["out"] + "/lookups.json", "w"))
json.dump(sorted(sys.modules), open(request["out"] + "/modules.json", "w"))
"""


def test_a_fresh_process_serves_both_artifacts_without_the_training_library(exported, tmp_path):
    request = {
        "fp32": str(exported["fp32"]),
        "int8": str(exported["int8"]),
        "out": str(tmp_path),
        "dense": exported["dense"].tolist(),
        "sparse": exported["lists"],
    }
    (tmp_path / "request.json").write_text(json.dumps(request))
    _run(FRESH, tmp_path, str(ROOT), str(tmp_path / "request.json"))

    got = torch.from_numpy(np.load(tmp_path / "fp32.npy"))
    want = exported["expected_fp32"]
    assert got.shape == want.shape == (BATCH, 1)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    assert torch.equal(torch.from_numpy(np.load(tmp_path / "int8.npy")), exported["expected_int8"])
    assert not torch.equal(
        exported["expected_fp32"], exported["expected_int8"]
    )  # int8 rows differ from fp32

    modules = set(json.loads((tmp_path / "modules.json").read_text()))
    assert {"jax", "torch", "numpy", "hybrid.serving"} <= modules
    ours = {
        m for m in modules if m.split(".")[0] in ("hybrid", "sparse_jax", "dense_torch", "optax")
    }
    assert ours <= {"hybrid", "hybrid._files"} | {
        m for m in ours if m.startswith("hybrid.serving")
    }, ours
    assert not {"hybrid.train", "hybrid.model", "sparse_jax.planner", "sparse_jax.optim"} & modules
    # the int8 lookup ran the C++ kernel there too, found without importing sparse_jax and
    # called directly
    lookups = json.loads((tmp_path / "lookups.json").read_text())
    assert lookups == {
        "fp32": ["xla", None, False],
        "int8": [_KERNEL, None, _KERNEL == "cpu_kernel"],
    }, lookups


_KERNEL = "cpu_kernel" if _kernels.available() else "xla"


def test_an_int8_artifact_carries_the_kernel_lookup_and_runs_it_with_the_same_scores(exported):
    """The int8 artifact holds each rung's lookup twice, the kernel's form holding the custom
    call; a plain load runs that form (and says so), `lookup="xla"` the XLA one, same scores."""
    if not _kernels.available():
        pytest.skip("the C++ kernels are not built here")
    path = exported["int8"]
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["programs"]["sparse"]["cpu_kernel"] == {
        "target": "HybridrecQuantPooled",
        "platforms": ["cpu"],
    }
    for name, holds in (
        ("sparse_lookup.cpu_kernel.jaxexport", True),
        ("sparse_lookup.b1.cpu_kernel.jaxexport", True),
        ("sparse_lookup.jaxexport", False),
        ("sparse_lookup.b1.jaxexport", False),
    ):
        program = jax.export.deserialize(bytearray((path / name).read_bytes()))
        assert ("HybridrecQuantPooled" in program.mlir_module()) is holds, name
    fast, plain = serving.load(path), serving.load(path, lookup="xla")
    programs = serving.load(path, direct=False)
    assert (fast.lookup, fast.lookup_fallback) == ("cpu_kernel", None)
    assert (fast.direct, fast.direct_fallback) == (True, None)  # the kernel called directly
    # it reads the tables placed for the programs, not a second copy of them
    assert all(
        d.ctypes.data == j.unsafe_buffer_pointer()
        for d, j in zip(fast._direct._tables, fast._tables, strict=True)
    )
    assert (programs.lookup, programs.direct, programs.direct_fallback) == (
        "cpu_kernel",
        False,
        None,
    )
    assert (plain.lookup, plain.lookup_fallback, plain.direct) == ("xla", None, False)
    # the tower runs as the lean copy of its graph (dead views dropped, one plain function),
    # its DLRM interaction one call of the kernel library; with interaction="graph" the
    # interaction's own ops, the advanced index as index_select
    exact = serving.load(path, interaction="graph")
    assert (fast.interaction, fast.interaction_fallback) == ("kernel", None)
    assert (exact.interaction, exact.interaction_fallback) == ("graph", None)
    aten = torch.ops.aten
    ops = {id(v) for v in fast._dense_forward.__globals__.values()}
    assert not ops & {id(aten.index_select.default), id(aten.index.Tensor), id(aten.bmm.default)}
    assert any(isinstance(v, FusedInteraction) for v in fast._dense_forward.__globals__.values())
    ops = {id(v) for v in exact._dense_forward.__globals__.values()}
    assert id(aten.index_select.default) in ops and id(aten.bmm.default) in ops
    assert id(aten.index.Tensor) not in ops
    dense, lists = exported["dense"], exported["lists"]
    want = exported["expected_int8"]
    assert torch.equal(exact(dense, lists), want)  # the in-process model's, bit for bit
    got = fast(dense, lists)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    assert torch.equal(programs(dense, lists), got)  # every lookup path: the same pooled rows
    assert torch.equal(plain(dense, lists), got)
    one = {f: bags[2:3] for f, bags in lists.items()}  # the 1-sample rung
    assert torch.equal(exact(dense[2:3], one), want[2:3])
    torch.testing.assert_close(fast(dense[2:3], one), want[2:3], rtol=1e-4, atol=1e-5)
    assert torch.equal(programs(dense[2:3], one), fast(dense[2:3], one))
    assert fast.warm() == []  # no program to compile
    # a float model has no quantized lookup to hand to the kernel
    fp32 = serving.load(exported["fp32"])
    assert (fp32.lookup, fp32.lookup_fallback) == ("xla", None)
    assert (
        json.loads((exported["fp32"] / "manifest.json").read_text())["programs"]["sparse"][
            "cpu_kernel"
        ]
        is None
    )
    with pytest.raises(serving.ArtifactError, match="lookup='cpu_kernel' was asked for"):
        serving.load(exported["fp32"], lookup="cpu_kernel")


# A serving process where the kernel cannot be had (no library in its cache, no compiler to
# build one): the int8 artifact falls back to its XLA programs, says why, scores the same.
NO_KERNEL = """
import json, sys, types
hybrid = types.ModuleType("hybrid")
hybrid.__path__ = [sys.argv[1] + "/hybrid"]
sys.modules["hybrid"] = hybrid
import numpy as np, torch
import hybrid.serving
request = json.load(open(sys.argv[2]))
predictor = hybrid.serving.load(request["int8"])
np.save(request["out"] + "/int8.npy", predictor(torch.tensor(request["dense"]), request["sparse"]).numpy())
try:
    hybrid.serving.load(request["int8"], lookup="cpu_kernel")
    refused = None
except hybrid.serving.ArtifactError as e:
    refused = str(e)
json.dump([predictor.lookup, predictor.lookup_fallback, refused], open(request["out"] + "/lookup.json", "w"))
"""


def test_without_the_kernel_the_int8_artifact_falls_back_to_its_xla_lookup(exported, tmp_path):
    request = {
        "int8": str(exported["int8"]),
        "out": str(tmp_path),
        "dense": exported["dense"].tolist(),
        "sparse": exported["lists"],
    }
    (tmp_path / "request.json").write_text(json.dumps(request))
    done = _run(
        NO_KERNEL,
        tmp_path,
        str(ROOT),
        str(tmp_path / "request.json"),
        env={
            "HYBRIDREC_CACHE": str(tmp_path / "empty_cache"),
            "CXX": str(tmp_path / "no-such-compiler"),
        },
        warnings_as_errors=False,
    )
    lookup, fallback, refused = json.loads((tmp_path / "lookup.json").read_text())
    assert lookup == "xla"
    assert "no C++ compiler" in fallback, fallback
    assert "running the XLA lookup programs" in done.stderr  # the warning says so
    assert "lookup='cpu_kernel' was asked for" in refused and "no C++ compiler" in refused
    got = torch.from_numpy(np.load(tmp_path / "int8.npy"))
    assert torch.equal(got, exported["expected_int8"])


def test_every_sparse_form_gives_the_same_predictions(exported):
    predictor = serving.load(exported["int8"])
    dense, lists, flat = exported["dense"], exported["lists"], exported["flat"]
    want = exported["expected_int8"]
    keys = ["a", "b", "c"]
    values = torch.cat([flat[k][0] for k in keys])
    lengths = torch.cat([flat[k][1] for k in keys])
    assert torch.equal(predictor(dense, lists), want)
    assert torch.equal(predictor(dense.numpy(), flat), want)
    assert torch.equal(predictor(dense, (keys, values, lengths)), want)
    assert torch.equal(
        predictor(dense, hybrid.torch_kjt(keys, values, lengths)), want
    )  # padded values
    # fewer samples than max_batch_size: as the in-memory model gives them for those samples
    few = {f: bags[:5] for f, bags in lists.items()}
    assert torch.equal(predictor(dense[:5], few), exported["expected_int8_few"])


def test_the_tower_runs_with_its_torch_threads_and_gives_the_process_its_own_back(
    exported, monkeypatch
):
    """`load(torch_threads=1)` (the default) runs the dense tower with one intra-op thread and
    restores the process's count; None leaves it alone; the scores do not change."""
    dense, lists, want = exported["dense"], exported["lists"], exported["expected_int8"]
    seen = []
    prev = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for threads, during in ((1, 1), (None, 2), (2, 2)):
            predictor = serving.load(exported["int8"], torch_threads=threads)
            assert predictor.torch_threads == threads
            forward = predictor._dense_forward

            def spy(*args, forward=forward):
                seen.append(torch.get_num_threads())
                return forward(*args)

            monkeypatch.setattr(predictor, "_dense_forward", spy)
            assert torch.equal(predictor(dense, lists), want)
            assert seen[-1] == during and torch.get_num_threads() == 2, (threads, seen)
    finally:
        torch.set_num_threads(prev)
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match=r"torch_threads=.*give a positive int, or None"):
            serving.load(exported["int8"], torch_threads=bad)


def test_a_small_request_runs_the_program_of_its_batch_rung_with_the_same_pooling(exported):
    """max_batch_size 8 gives lookup programs for 1 and 8 bags per feature; one sample runs
    the first (compiled on its own) and pools exactly what the 8-bag program pools."""
    predictor = serving.load(exported["int8"], direct=False)
    assert predictor.batch_rungs == [1, BATCH]
    lists = exported["lists"]
    whole = predictor.pooled(lists)
    assert {b for b, _ in predictor.compiled()} == {BATCH}
    for i in (0, 3):
        one = predictor.pooled({f: bags[i : i + 1] for f, bags in lists.items()})
        assert torch.equal(one, whole[i : i + 1])
    assert {b for b, _ in predictor.compiled()} == {1, BATCH}


def test_a_direct_lookup_that_differs_from_the_program_is_not_used(exported, monkeypatch):
    """The direct lookup is checked against the artifact's kernel program at load: a plan
    with two blocks' columns swapped (a planted bug) is refused, the programs run, and the
    scores are the program's."""
    if not _kernels.available():
        pytest.skip("the C++ kernels are not built here")
    from hybrid.serving import _direct

    plan = _direct._plan

    def swapped(manifest, tables):
        rows, width = plan(manifest, tables)
        rows[[0, 1], 5] = rows[[1, 0], 5]
        return rows, width

    monkeypatch.setattr(_direct, "_plan", swapped)
    predictor = serving.load(exported["int8"])
    assert predictor.lookup == "cpu_kernel" and not predictor.direct
    assert predictor.direct_fallback == (
        "the direct lookup differs from the artifact's program on a probe of 1 samples"
    )
    assert torch.equal(predictor(exported["dense"], exported["lists"]), exported["expected_int8"])


# `python -m hybrid.serving`, run as -m runs it (through hybrid/__init__), then the modules it loaded.
CLI = """
import runpy, sys
sys.argv = ["hybrid.serving", *sys.argv[1:]]
try:
    runpy.run_module("hybrid.serving", run_name="__main__", alter_sys=True)
except SystemExit as e:
    assert e.code in (0, None), e.code
loaded = [m for m in ("hybrid.train", "sparse_jax.planner") if m in sys.modules]
assert not loaded, loaded
"""


def test_the_cli_scores_a_requests_file_as_the_predictor_does(exported, tmp_path):
    rng = np.random.default_rng(5)
    dense, lists, _ = _request(rng, 11)  # two batches: 8 lines, then 3
    lines = [
        {"dense": dense[i].tolist(), "sparse": {f: bags[i] for f, bags in lists.items()}}
        for i in range(11)
    ]
    requests = tmp_path / "requests.jsonl"
    requests.write_text("\n".join(json.dumps(line) for line in lines) + "\n\n")
    out = tmp_path / "scores.jsonl"
    _run(
        CLI,
        tmp_path,
        "--artifact",
        str(exported["fp32"]),
        "--requests",
        str(requests),
        "--out",
        str(out),
    )

    scores = [json.loads(line) for line in out.read_text().splitlines()]
    predictor = serving.load(exported["fp32"])
    logits = torch.cat(
        [
            predictor(dense[:8], {f: b[:8] for f, b in lists.items()}),
            predictor(dense[8:], {f: b[8:] for f, b in lists.items()}),
        ]
    ).squeeze(-1)
    assert [s["logit"] for s in scores] == logits.tolist()
    assert [s["score"] for s in scores] == torch.sigmoid(logits).tolist()


def test_the_cli_names_a_bad_line(exported, tmp_path, capsys):
    from hybrid.serving._cli import main

    requests = tmp_path / "requests.jsonl"
    good = {"dense": [0.0] * N_DENSE, "sparse": {"a": [1], "b": [], "c": [2]}}
    requests.write_text(
        json.dumps(good) + "\n" + json.dumps({**good, "sparse": {"a": [1], "c": [2]}}) + "\n"
    )
    assert main(["--artifact", str(exported["fp32"]), "--requests", str(requests)]) == 2
    assert "line 2 lacks features ['b']" in capsys.readouterr().err


def test_the_cli_refuses_a_feature_the_model_does_not_read(exported, tmp_path, capsys):
    """A request line is the HTTP server's wire form, and is refused as the server refuses
    it: a misspelled key is not scored as if the feature were absent."""
    from hybrid.serving._cli import main

    requests = tmp_path / "requests.jsonl"
    good = {"dense": [0.0] * N_DENSE, "sparse": {"a": [1], "b": [], "c": [2]}}
    typo = {**good, "sparse": {"a": [1], "b": [], "c": [2], "cc": [3]}}
    requests.write_text(json.dumps(good) + "\n" + json.dumps(typo) + "\n")
    assert main(["--artifact", str(exported["fp32"]), "--requests", str(requests)]) == 2
    assert "line 2: unknown feature(s) ['cc']; this model reads ['a', 'b', 'c']" in (
        capsys.readouterr().err
    )


def _copy(exported, tmp_path, name="fp32") -> pathlib.Path:
    return pathlib.Path(shutil.copytree(exported[name], tmp_path / "artifact"))


def _flip_byte(path: pathlib.Path) -> None:
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x01
    path.write_bytes(bytes(data))


def _set_version(path: pathlib.Path) -> None:
    manifest = json.loads(path.read_text())
    manifest["format_version"] = 2
    path.write_text(json.dumps(manifest))


DAMAGE = {
    "table byte flipped": ("tables/00_t0.npy", _flip_byte, "tables/00_t0.npy hash mismatch"),
    "dense program deleted": ("dense_tower.pt2", pathlib.Path.unlink, "dense_tower.pt2 is missing"),
    "manifest of another version": (
        "manifest.json",
        _set_version,
        "manifest.json has format_version 2",
    ),
    "sparse program truncated": (
        "sparse_lookup.jaxexport",
        lambda p: p.write_bytes(p.read_bytes()[:100]),
        "sparse_lookup.jaxexport is truncated",
    ),
    "manifest not json": (
        "manifest.json",
        lambda p: p.write_text("{"),
        "manifest.json is not valid json",
    ),
}


@pytest.mark.parametrize("damage", DAMAGE, ids=list(DAMAGE))
def test_a_damaged_artifact_is_refused_naming_the_file(exported, tmp_path, damage):
    name, spoil, message = DAMAGE[damage]
    path = _copy(exported, tmp_path)
    spoil(path / name)
    with pytest.raises(serving.ArtifactError, match=message):
        serving.load(path)


def _rewrite(path: pathlib.Path, name: str, data: bytes) -> None:
    """Replace a file and its manifest entry (so only the deeper checks can catch it)."""
    import hashlib

    (path / name).write_bytes(data)
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["files"][name] = {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}
    (path / "manifest.json").write_text(json.dumps(manifest))


def test_a_table_of_another_shape_or_an_unreadable_program_is_refused(exported, tmp_path):
    import io

    path = _copy(exported, tmp_path)
    buffer = io.BytesIO()
    np.save(buffer, np.zeros((49, 4), np.float32))
    _rewrite(path, "tables/00_t0.npy", buffer.getvalue())
    with pytest.raises(
        serving.ArtifactError,
        match=r"tables/00_t0.npy holds float32 \[49, 4\] but the manifest says "
        r"table 't0' is float32 \[50, 4\]",
    ):
        serving.load(path)
    path = _copy(exported, tmp_path / "again")
    _rewrite(path, "sparse_lookup.jaxexport", b"not a program")
    with pytest.raises(serving.ArtifactError, match="sparse_lookup.jaxexport is unreadable"):
        serving.load(path)
    path = _copy(exported, tmp_path / "rung")  # the 1-sample rung's file holds the 8-sample program
    _rewrite(path, "sparse_lookup.b1.jaxexport", (path / "sparse_lookup.jaxexport").read_bytes())
    with pytest.raises(
        serving.ArtifactError,
        match=r"sparse_lookup.b1.jaxexport takes offsets of shape \[25\], not the \[3 features x 1 \+ 1\]",
    ):
        serving.load(path)


def test_out_of_range_ids_are_refused_naming_feature_sample_and_id(exported):
    predictor = serving.load(exported["fp32"])
    dense, lists = exported["dense"], exported["lists"]
    bad = {**lists, "c": [*lists["c"][:3], [1, 30], *lists["c"][4:]]}
    with pytest.raises(
        ValueError,
        match=r"feature 'c' \(table 't1', num_embeddings=30\): id 30 at sample 3, "
        r"position 1 in its bag",
    ):
        predictor(dense, bad)
    with pytest.raises(ValueError, match=r"feature 'a' .* id -1 at sample 0"):
        predictor(dense, {**lists, "a": [[-1], *lists["a"][1:]]})
    with pytest.raises(ValueError, match=r"the request lacks features \['b'\]"):
        predictor(dense, {"a": lists["a"], "c": lists["c"]})
    with pytest.raises(  # a misspelled key is named beside the feature it should have been
        ValueError,
        match=r"lacks features \['b'\].*; it has \['bb'\], which the artifact does not read",
    ):
        predictor(dense, {"a": lists["a"], "bb": lists["b"], "c": lists["c"]})


def test_requests_larger_than_the_exported_shapes_say_what_to_re_export(exported):
    predictor = serving.load(exported["int8"])  # max_batch_size 8, id capacities 64 and 128
    assert predictor.max_batch_size == BATCH
    rng = np.random.default_rng(3)
    dense, lists, _ = _request(rng, BATCH + 1)
    with pytest.raises(
        ValueError,
        match=r"9 samples, more than this artifact's max_batch_size 8; split the request, "
        r"or re-export with hybrid.export\(..., max_batch_size=9\)",
    ):
        predictor(dense, lists)
    many = {f: [[1] * 20 for _ in range(BATCH)] for f in ("a", "b", "c")}  # 480 ids
    with pytest.raises(
        ValueError,
        match=r"480 ids, more than this artifact's largest id capacity 128.*id_capacities",
    ):
        predictor(exported["dense"], many)


def test_export_refuses_to_overwrite_unless_asked(exported):
    with pytest.raises(FileExistsError, match="overwrite=True"):
        export(_small_model(), exported["int8"], example=(exported["dense"], exported["lists"]))


def _small_model(**kwargs):
    return hybrid.Model(TABLES, dense_torch.DLRM(4, 3, N_DENSE, [8, 4], [8, 1]), **kwargs)


def test_a_weighted_model_sharded_over_a_mesh_exports_its_gathered_tables(tmp_path):
    rng = np.random.default_rng(7)
    torch.manual_seed(7)
    model = _small_model(
        mesh=hybrid.make_mesh("model=2", devices=jax.devices()[:2]),
        plan={"t0": "row_wise", "t1": "table_wise"},
        is_weighted=True,
        sparse_optimizer=rowwise_adagrad(lr=0.1),
    )
    _train(model, rng, steps=2)
    dense, lists, flat = _request(rng, BATCH, weighted=True)
    weighted = {f: {"ids": bags, "weights": [[] for _ in bags]} for f, bags in lists.items()}
    for f, (_, lengths, w) in flat.items():  # the same weights as per-sample lists
        weighted[f]["weights"] = [part.tolist() for part in torch.split(w, lengths.tolist())]
    path = export(model, tmp_path / "weighted", example=(dense, flat))
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["is_weighted"] and [t["shape"] for t in manifest["tables"]] == [
        [50, 4],
        [30, 4],
    ]
    predictor = serving.load(path)
    want = _eval(model, dense, flat)
    torch.testing.assert_close(predictor(dense, weighted), want, rtol=1e-6, atol=0)
    with pytest.raises(ValueError, match="feature 'a' has no weights, but the model is weighted"):
        predictor(dense, lists)
