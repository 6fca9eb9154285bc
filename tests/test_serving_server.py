"""`python -m hybrid.serving serve`: an exported model over real HTTP on 127.0.0.1.

The small DLRM of test_export is exported twice (fp32, then int8 rows: other scores) and
served from a subprocess. Over HTTP: scores equal the in-process predictor's; concurrent
requests share predictor calls (the batch histogram of /metrics shows it); every bad request
gets its 4xx naming the problem and the server stays up; a corrupted artifact is refused on
reload and the old model answers; a reload under a client loop fails nothing and the
requests sent after it use the new model; SIGTERM with requests queued scores them and exits
0, in a process that imported no training library. Every server is stopped in a finally;
loops are bounded in count and time.
"""

from __future__ import annotations

import asyncio
import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import safetensors.numpy
import torch

import dense_torch
import hybrid
import hybrid.serving as serving
from hybrid.inference import export
from hybrid.serving._batcher import Batcher
from hybrid.training._distributed import free_master_port
from sparse_jax.optim import rowwise_adagrad
from tests.test_export import BATCH, N_DENSE, TABLES, _request, _train

ROOT = pathlib.Path(__file__).resolve().parents[1]
START_S = 240  # a server's start (imports, load, warm-up) on a loaded 2-core machine
HTTP_S = 60  # one request
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # no proxy for 127.0.0.1


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory):
    """fp32 and int8 artifacts of one trained model, a request of BATCH samples, and the
    in-process predictors of both."""
    rng = np.random.default_rng(0)
    torch.manual_seed(0)
    model = hybrid.Model(
        TABLES,
        dense_torch.DLRM(4, 3, N_DENSE, [8, 4], [8, 1]),
        sparse_optimizer=rowwise_adagrad(lr=0.1),
    )
    _train(model, rng)
    dense, lists, _ = _request(rng, BATCH)
    root = tmp_path_factory.mktemp("served")
    fp32 = export(model, root / "fp32", example=(dense, lists))
    int8 = export(hybrid.quantize(model, "int8"), root / "int8", example=(dense, lists))
    return {
        "fp32": fp32,
        "int8": int8,
        "dense": dense.tolist(),
        "lists": lists,
        "fp32_predictor": serving.load(fp32),
        "int8_predictor": serving.load(int8),
    }


def _http(method: str, url: str, body=None, timeout: float = HTTP_S):
    """(status, parsed json or text) of one request; 4xx/5xx are answers, not exceptions."""
    data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    req = urllib.request.Request(
        url, data=data, method=method, headers={"Content-Type": "application/json"}
    )
    try:
        with _OPENER.open(req, timeout=timeout) as r:
            status, raw = r.status, r.read()
    except urllib.error.HTTPError as e:
        status, raw = e.code, e.read()
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, raw.decode()


class _Served:
    def __init__(self, proc: subprocess.Popen, port: int, log: pathlib.Path):
        self.proc, self.port, self.log = proc, port, log

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def tail(self) -> str:
        return self.log.read_text()[-4000:] if self.log.exists() else ""

    def predict(self, body, timeout: float = HTTP_S):
        return _http("POST", self.url("/predict"), body, timeout)

    def metrics(self) -> str:
        status, text = _http("GET", self.url("/metrics"))
        assert status == 200, text
        return text


def _start(command: list[str], tmp_path: pathlib.Path, name: str) -> _Served:
    """Start a server subprocess (`command` plus --port) and wait for /readyz."""
    port = free_master_port()
    log = tmp_path / f"{name}.log"
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "OMP_NUM_THREADS": "1"}
    env.pop("XLA_FLAGS", None)  # one CPU device is enough to serve
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [*command, "--host", "127.0.0.1", "--port", str(port)],
            cwd=ROOT,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    served = _Served(proc, port, log)
    try:
        deadline = time.monotonic() + START_S
        while True:
            assert proc.poll() is None, f"the server exited ({proc.returncode}):\n{served.tail()}"
            try:
                if _http("GET", served.url("/readyz"), timeout=5)[0] == 200:
                    return served
            except OSError:  # not listening yet
                pass
            assert time.monotonic() < deadline, f"not ready after {START_S} s:\n{served.tail()}"
            time.sleep(0.25)
    except BaseException:
        _stop(served)
        raise


def _stop(served: _Served) -> None:
    if served.proc.poll() is None:
        served.proc.send_signal(signal.SIGTERM)
        try:
            served.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            served.proc.kill()
            served.proc.wait(timeout=30)


def _serve_command(artifact, *args: str) -> list[str]:
    return [sys.executable, "-m", "hybrid.serving", "serve", "--artifact", str(artifact), *args]


@pytest.fixture(scope="module")
def server(artifacts, tmp_path_factory):
    served = _start(
        _serve_command(artifacts["fp32"], "--max-batch-size", "8", "--max-wait-us", "100000"),
        tmp_path_factory.mktemp("server"),
        "server",
    )
    try:
        yield served
    finally:
        _stop(served)


def _sample(artifacts, i: int) -> dict:
    """The single-sample request of sample i of the fixture's batch."""
    return {
        "dense": artifacts["dense"][i],
        "sparse": {f: bags[i] for f, bags in artifacts["lists"].items()},
    }


def _expected(artifacts, which: str) -> list[float]:
    logits = artifacts[f"{which}_predictor"](artifacts["dense"], artifacts["lists"])
    return logits[:, 0].tolist()


def _histogram(metrics: str, name: str) -> dict[str, float]:
    """{le: cumulative count} of a histogram in Prometheus text."""
    out = {}
    for line in metrics.splitlines():
        if line.startswith(f"{name}_bucket{{"):
            le = line.split('le="', 1)[1].split('"', 1)[0]
            out[le] = float(line.rsplit(" ", 1)[1])
    return out


def test_scores_equal_the_in_process_predictor(server, artifacts):
    want = _expected(artifacts, "fp32")
    status, answer = server.predict({"dense": artifacts["dense"], "sparse": artifacts["lists"]})
    assert status == 200, answer
    np.testing.assert_allclose(answer["logits"], want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(
        answer["scores"], torch.sigmoid(torch.tensor(want)).tolist(), rtol=1e-5, atol=1e-6
    )
    assert answer["model"] == {"artifact": str(artifacts["fp32"]), "generation": 1}
    status, one = server.predict(_sample(artifacts, 3))  # the one-sample form
    assert status == 200, one
    np.testing.assert_allclose(one["logits"], want[3:4], rtol=1e-5, atol=1e-6)


def test_concurrent_requests_share_predictor_calls(server, artifacts):
    want = _expected(artifacts, "fp32")
    n = 16
    for _attempt in range(3):  # a loaded machine may spread one burst over several windows
        barrier = threading.Barrier(n, timeout=HTTP_S)

        def send(i, barrier=barrier):
            barrier.wait()
            if i % 2:  # every other request binary: the two formats share predictor calls
                j = i % BATCH
                lists = {f: bags[j : j + 1] for f, bags in artifacts["lists"].items()}
                status, _, raw = _post_binary(server, _binary(artifacts["dense"][j : j + 1], lists))
                return status, json.loads(raw)
            return server.predict(_sample(artifacts, i % BATCH))

        with ThreadPoolExecutor(n) as pool:
            answers = list(pool.map(send, range(n)))
        for i, (status, answer) in enumerate(answers):
            assert status == 200, answer
            np.testing.assert_allclose(answer["logits"], [want[i % BATCH]], rtol=1e-5, atol=1e-6)
        buckets = _histogram(server.metrics(), "hybridrec_serving_batch_requests")
        if buckets["+Inf"] > buckets["1.0"]:
            break
    assert buckets["+Inf"] > buckets["1.0"], (
        f"no predictor call took more than one request: {buckets}"
    )
    sizes = _histogram(server.metrics(), "hybridrec_serving_batch_size")
    assert sizes["+Inf"] > sizes["1.0"] and sizes["8.0"] == sizes["+Inf"]  # never over 8
    # the loaded model, jax and torch are frozen out of the collector's full scans (~0.2 s each)
    (frozen,) = [
        float(line.rsplit(" ", 1)[1])
        for line in server.metrics().splitlines()
        if line.startswith("hybridrec_serving_gc_frozen_objects ")
    ]
    assert frozen > 100_000, frozen


def test_every_bad_request_gets_its_4xx_and_the_server_stays_up(server, artifacts):
    good = _sample(artifacts, 0)
    nine = {
        "dense": [[0.0] * N_DENSE] * 9,
        "sparse": {f: [[1]] * 9 for f in ("a", "b", "c")},
    }
    bad = {
        "unknown feature": (
            {**good, "sparse": {**good["sparse"], "zz": [1]}},
            422,
            "unknown feature(s) ['zz']",
        ),
        "id out of range": (
            {**good, "sparse": {**good["sparse"], "c": [1, 30]}},
            422,
            "id 30 at sample 0, position 1",
        ),
        "negative id": ({**good, "sparse": {**good["sparse"], "a": [-1]}}, 422, "id -1"),
        "ids not integers": ({**good, "sparse": {**good["sparse"], "a": ["x"]}}, 422, "integers"),
        "wrong dense width": (
            {**good, "dense": [0.0] * (N_DENSE - 1)},
            422,
            f"dense_features has shape (1, {N_DENSE - 1})",
        ),
        "dense not numbers": ({**good, "dense": ["x"] * N_DENSE}, 422, "not a numeric array"),
        "missing feature": (
            {**good, "sparse": {"a": [1], "c": [2]}},
            422,
            "the request lacks features ['b']",
        ),
        "malformed json": (b'{"dense": [0.0, ', 400, "not valid json"),
        "not a request": (b"[1, 2]", 400, "a request is"),
        "oversize batch": (nine, 413, "9 samples, more than this artifact's max_batch_size 8"),
    }
    for name, (body, status, message) in bad.items():
        got, answer = server.predict(body)
        assert got == status, (name, answer)
        assert message in answer["detail"], (name, answer)
        assert _http("GET", server.url("/healthz"))[0] == 200, name
    status, answer = server.predict(good)
    assert status == 200, answer
    metrics = server.metrics()
    for kind in (
        "unknown_feature",
        "id_out_of_range",
        "dense_shape",
        "malformed_json",
        "oversize_batch",
    ):
        assert f'hybridrec_serving_errors_total{{kind="{kind}"}}' in metrics, kind


def _binary(dense, lists: dict | None = None, **members) -> bytes:
    """A binary request (safetensors) of `dense` and the per-sample id lists `lists`, with
    `members` added (or replacing)."""
    arrays = {"dense": np.asarray(dense, np.float32)}
    for f, bags in (lists or {}).items():
        arrays[f"{f}.values"] = np.array([i for bag in bags for i in bag], np.int32)
        arrays[f"{f}.lengths"] = np.array([len(bag) for bag in bags], np.int64)
    arrays.update(members)
    return safetensors.numpy.save(arrays)


def _post_binary(server, body: bytes, accept: str = "application/json"):
    """(status, headers, body bytes) of a binary POST /predict."""
    req = urllib.request.Request(
        server.url("/predict"),
        data=body,
        method="POST",
        headers={"Content-Type": "application/x-safetensors", "Accept": accept},
    )
    try:
        with _OPENER.open(req, timeout=HTTP_S) as r:
            return r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()


def test_a_binary_request_scores_as_json_does_and_gets_a_binary_answer(server, artifacts):
    """A safetensors request (int32 ids, float32 dense) scores what the JSON request scores;
    with `Accept: application/x-safetensors` the answer is safetensors of float32 scores and
    logits, bit for bit the in-process predictor's, the model in its metadata and headers."""
    body = _binary(artifacts["dense"], artifacts["lists"])
    status, _, raw = _post_binary(server, body)
    assert status == 200, raw
    _, as_json = server.predict({"dense": artifacts["dense"], "sparse": artifacts["lists"]})
    assert json.loads(raw)["logits"] == as_json["logits"]
    status, headers, raw = _post_binary(server, body, accept="application/x-safetensors")
    assert status == 200, raw
    assert headers["content-type"] == "application/x-safetensors"
    assert headers["x-model-artifact"] == str(artifacts["fp32"])
    generation = headers["x-model-generation"]
    answer = safetensors.numpy.load(raw)
    header = json.loads(raw[8 : 8 + int.from_bytes(raw[:8], "little")])
    assert header["__metadata__"] == {"artifact": str(artifacts["fp32"]), "generation": generation}
    want = artifacts["fp32_predictor"](artifacts["dense"], artifacts["lists"])[:, 0]
    assert answer["logits"].dtype == np.float32 and answer["logits"].shape == (BATCH,)
    assert np.array_equal(answer["logits"], want.numpy())
    assert np.array_equal(answer["scores"], torch.sigmoid(want).numpy())


def _raw_safetensors(header: dict, data: bytes) -> bytes:
    text = json.dumps(header).encode()
    return len(text).to_bytes(8, "little") + text + data


def test_every_bad_binary_request_gets_its_4xx_and_the_server_stays_up(server, artifacts):
    dense, lists = artifacts["dense"][:2], {f: bags[:2] for f, bags in artifacts["lists"].items()}
    good = _binary(dense, lists)
    lone = safetensors.numpy.load(good)
    del lone["b.lengths"]
    bf16 = {"dense": {"dtype": "BF16", "shape": [2, N_DENSE], "data_offsets": [0, 4 * N_DENSE]}}
    bad = {
        "not a buffer": (b"garbage", 400, "not a safetensors buffer"),
        "cut short": (good[: len(good) // 2], 400, "not a safetensors buffer"),
        "a dtype numpy lacks": (
            _raw_safetensors(bf16, bytes(4 * N_DENSE)),
            400,
            "not a safetensors buffer",
        ),
        "no dense": (
            safetensors.numpy.save({k: v for k, v in lone.items() if k != "dense"}),
            400,
            "no 'dense' tensor",
        ),
        "odd member": (_binary(dense, lists, **{"a.ids": np.zeros(1)}), 400, "'a.ids'"),
        "unknown feature": (
            _binary(dense, lists, **{"zz.values": np.zeros(1), "zz.lengths": np.ones(2)}),
            422,
            "unknown feature(s) ['zz']",
        ),
        "values without lengths": (
            safetensors.numpy.save(lone),
            400,
            "needs both 'b.values' and 'b.lengths'",
        ),
        "lengths past the ids": (
            _binary(dense, lists, **{"c.lengths": np.array([50, 50])}),
            400,
            "feature 'c'",
        ),
        "ids not integers": (
            _binary(dense, lists, **{"a.values": np.full(len(lone["a.values"]), 0.5)}),
            422,
            "integers",
        ),
        "wrong dense width": (
            _binary(np.zeros((2, N_DENSE + 1)), lists),
            422,
            "dense_features has shape",
        ),
    }
    for name, (body, status, message) in bad.items():
        got, _, raw = _post_binary(server, body)
        answer = json.loads(raw)
        assert got == status, (name, answer)
        assert message in answer["detail"], (name, answer)
        assert _http("GET", server.url("/healthz"))[0] == 200, name
    status, _, raw = _post_binary(server, good)
    assert status == 200, raw


def test_json_and_binary_payloads_scored_in_one_call_score_as_alone(artifacts):
    """`_wire.score` on a batch mixing a JSON request (per-sample lists, float64 dense) and
    a binary one (flat int32 ids, float32 dense): bit for bit the predictor on the same
    samples as one request, and each what it gets alone to rounding."""
    from hybrid.serving import _wire

    predictor = artifacts["int8_predictor"]
    dense, lists = artifacts["dense"], artifacts["lists"]
    features, weighted = predictor.features, predictor.manifest["is_weighted"]
    a = {f: bags[:3] for f, bags in lists.items()}
    body = _binary(dense[3:], {f: bags[3:] for f, bags in lists.items()})
    b_dense, b_sparse = _wire.parse(body, "application/x-safetensors; q=1", features)
    assert b_dense.dtype == np.float32 and b_sparse["a"][0].dtype == np.int32
    payloads = [
        _wire.payload(dense[:3], a, 3, features, weighted),
        _wire.payload(b_dense, b_sparse, BATCH - 3, features, weighted),
    ]
    both = _wire.score(predictor, payloads)
    alone = [_wire.score(predictor, [p])[0] for p in payloads]
    whole = predictor(dense, lists)[:, 0].numpy()
    for got, want, rows in zip(both, alone, (slice(0, 3), slice(3, BATCH)), strict=True):
        assert np.array_equal(got["logits"], whole[rows])  # the same 8 samples in one call
        # alone, the tower's matmuls see other batch shapes: the same to rounding
        np.testing.assert_allclose(got["logits"], want["logits"], rtol=1e-6, atol=1e-7)


def test_a_weighted_request_reads_the_same_from_json_and_binary():
    """A weighted model's feature: `{"ids", "weights"}` per sample in JSON, `.values`,
    `.lengths` and `.weights` in the safetensors buffer: the same payload arrays."""
    from hybrid.serving import _wire

    bags, weights = [[1, 2], [], [3]], [[0.5, -1.0], [], [2.25]]
    body = json.dumps(
        {"dense": [[0.0, 1.0]] * 3, "sparse": {"a": {"ids": bags, "weights": weights}}}
    )
    dense, sparse = _wire.parse(body.encode(), None, ["a"])
    from_json = _wire.payload(dense, sparse, 3, ["a"], True)
    binary = _binary(
        [[0.0, 1.0]] * 3,
        **{
            "a.values": np.array([1, 2, 3]),
            "a.lengths": np.array([2, 0, 1]),
            "a.weights": np.array([0.5, -1.0, 2.25], np.float32),
        },
    )
    dense, sparse = _wire.parse(binary, "application/x-safetensors", ["a"])
    from_binary = _wire.payload(dense, sparse, 3, ["a"], True)
    for got, want in zip(from_binary.sparse["a"], from_json.sparse["a"], strict=True):
        assert got.dtype == want.dtype and np.array_equal(got, want)
    assert np.array_equal(from_binary.dense, from_json.dense)


def _corrupt(artifacts, tmp_path) -> pathlib.Path:
    path = pathlib.Path(shutil.copytree(artifacts["int8"], tmp_path / "corrupt"))
    table = path / "tables/00_t0.npy"
    data = bytearray(table.read_bytes())
    data[-3] ^= 0x01
    table.write_bytes(bytes(data))
    return path


def test_a_corrupted_artifact_is_refused_and_the_old_model_answers(server, artifacts, tmp_path):
    status, answer = _http(
        "POST", server.url("/admin/reload"), {"artifact": str(_corrupt(artifacts, tmp_path))}
    )
    assert status == 422, answer
    assert (
        answer["error"] == "artifact_refused"
        and "tables/00_t0.npy hash mismatch" in answer["detail"]
    )
    assert answer["model"] == {"artifact": str(artifacts["fp32"]), "generation": 1}
    status, answer = server.predict(_sample(artifacts, 2))
    assert status == 200 and answer["model"]["generation"] == 1, answer
    np.testing.assert_allclose(
        answer["logits"], _expected(artifacts, "fp32")[2:3], rtol=1e-5, atol=1e-6
    )
    assert _http("GET", server.url("/readyz"))[0] == 200
    assert 'hybridrec_serving_reloads_total{outcome="refused"} 1.0' in server.metrics()


def test_a_reload_under_load_fails_nothing_and_later_requests_use_the_new_model(server, artifacts):
    fp32, int8 = _expected(artifacts, "fp32"), _expected(artifacts, "int8")
    assert not np.allclose(fp32, int8, rtol=1e-5, atol=1e-6)  # the models are told apart
    stop = threading.Event()
    reloaded_at = [float("inf")]
    log: list[tuple] = []  # (client, sample, sent, status, answer)
    errors: list[BaseException] = []
    deadline = time.monotonic() + 180

    def client(c: int):
        try:
            # bounded by the deadline first (~10 requests a second a client, so a slow reload
            # cannot run the clients out of requests before it lands), and by count
            for k in range(5000):
                if stop.is_set() or time.monotonic() > deadline:
                    return
                i = (c + k) % BATCH
                sent = time.monotonic()
                status, answer = server.predict(_sample(artifacts, i))
                log.append((c, i, sent, status, answer))
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    def after_reload(c):
        return sum(1 for entry in list(log) if entry[0] == c and entry[2] > reloaded_at[0])

    clients = [threading.Thread(target=client, args=(c,)) for c in range(3)]
    for t in clients:
        t.start()
    try:
        while len(log) < 6 and time.monotonic() < deadline and not errors:
            time.sleep(0.05)
        status, answer = _http(
            "POST", server.url("/admin/reload"), {"artifact": str(artifacts["int8"])}
        )
        reloaded_at[0] = time.monotonic()
        assert status == 200, answer
        assert answer["model"] == {"artifact": str(artifacts["int8"]), "generation": 2}
        while (
            min(after_reload(c) for c in range(3)) < 4
            and time.monotonic() < deadline
            and not errors
            and all(t.is_alive() for t in clients)
        ):
            time.sleep(0.05)
    finally:
        stop.set()
        for t in clients:
            t.join(timeout=HTTP_S * 2)
    assert not errors, errors
    assert min(after_reload(c) for c in range(3)) >= 4, "the clients stopped early"
    generations = set()
    for c, i, sent, status, answer in log:
        assert status == 200, answer
        generation = answer["model"]["generation"]
        generations.add(generation)
        want = fp32 if generation == 1 else int8
        np.testing.assert_allclose(answer["logits"], [want[i]], rtol=1e-5, atol=1e-6)
        if sent > reloaded_at[0]:
            assert generation == 2, (c, i, answer)
    assert generations == {1, 2}


class _FakeModel:
    max_batch_size = 4
    max_ids = 10


def test_the_batcher_never_mixes_models_and_keeps_the_sample_and_id_limits():
    calls = []

    def run(model, payloads):
        calls.append((model, list(payloads)))
        return [(model, p) for p in payloads]

    old, new = _FakeModel(), _FakeModel()
    queued = [(old, i, 2) for i in range(4)] + [
        (new, 10, 2),
        (new, 11, 2),
        (old, 20, 6),
        (old, 21, 6),
    ]

    async def serve():
        batcher = Batcher(run, max_batch_size=3, max_wait_s=60.0)
        batcher.start()
        tasks = [
            asyncio.ensure_future(batcher.submit(m, p, samples=1, ids=ids)) for m, p, ids in queued
        ]
        while len(calls) < 4:  # the last one waits for company (60 s) until close flushes it
            await asyncio.sleep(0.01)
        assert len(calls) == 4 and batcher.queued_samples == 1
        await batcher.close()
        return await asyncio.gather(*tasks)

    results = asyncio.run(asyncio.wait_for(serve(), timeout=HTTP_S))
    assert results == [(m, p) for m, p, _ in queued]
    assert [(m is new, payloads) for m, payloads in calls] == [
        (False, [0, 1, 2]),  # 3 samples: --max-batch-size
        (False, [3]),  # the next request arrived under another model
        (True, [10, 11]),
        (False, [20]),  # 6 + 6 ids > the model's 10
        (False, [21]),  # run by close()
    ]


# The server through hybrid.serving's own modules, `hybrid` a bare namespace (no hybrid/__init__,
# so no training library); after it exits, the modules it had loaded.
BARE = """
import json, sys, types
hybrid = types.ModuleType("hybrid")
hybrid.__path__ = [sys.argv[1] + "/hybrid"]
sys.modules["hybrid"] = hybrid
from hybrid.serving._cli import main
code = main(sys.argv[3:])
json.dump(sorted(sys.modules), open(sys.argv[2], "w"))
raise SystemExit(code)
"""


def test_sigterm_scores_the_queued_requests_and_exits_0(artifacts, tmp_path):
    script = tmp_path / "bare.py"
    script.write_text(BARE)
    modules = tmp_path / "modules.json"
    command = [sys.executable, str(script), str(ROOT), str(modules), "serve"]
    command += ["--artifact", str(artifacts["fp32"]), "--max-batch-size", "8"]
    command += ["--max-wait-us", "60000000"]  # a minute: they stay queued until the signal
    served = _start(command, tmp_path, "sigterm")
    n = 4
    try:
        with ThreadPoolExecutor(n) as pool:
            futures = [pool.submit(served.predict, _sample(artifacts, i)) for i in range(n)]
            deadline = time.monotonic() + HTTP_S
            while f"hybridrec_serving_queued_samples {float(n)}" not in served.metrics():
                assert time.monotonic() < deadline, served.metrics()
                time.sleep(0.1)
            served.proc.send_signal(signal.SIGTERM)
            answers = [f.result(timeout=HTTP_S * 2) for f in futures]
        assert served.proc.wait(timeout=HTTP_S) == 0, served.tail()
    finally:
        _stop(served)
    want = _expected(artifacts, "fp32")
    for i, (status, answer) in enumerate(answers):
        assert status == 200, answer
        np.testing.assert_allclose(answer["logits"], want[i : i + 1], rtol=1e-5, atol=1e-6)
    loaded = set(json.loads(modules.read_text()))
    assert {"fastapi", "uvicorn", "prometheus_client", "hybrid.serving._server"} <= loaded
    ours = {
        m for m in loaded if m.split(".")[0] in ("hybrid", "sparse_jax", "dense_torch", "optax")
    }
    assert ours <= {"hybrid", "hybrid._files"} | {
        m for m in ours if m.startswith("hybrid.serving")
    }, ours


def test_the_server_loads_with_its_torch_threads_and_refuses_a_negative_count(artifacts, capsys):
    """`serve --torch-threads N` reaches the predictor it loads (and each reload): 1 by
    default, 0 leaves torch's own count (None); a negative count is refused before loading."""
    from hybrid.serving import _server

    for given, want in (([], 1), (["--torch-threads", "2"], 2), (["--torch-threads", "0"], None)):
        args = _server._parser().parse_args(["--artifact", "x", "--port", "1", *given])
        assert _server._loader(args)(str(artifacts["int8"])).torch_threads == want, given
    assert _server.main(["--artifact", "x", "--port", "1", "--torch-threads", "-1"]) == 2
    assert "--torch-threads >= 0" in capsys.readouterr().out


def test_the_server_loads_with_its_interaction(artifacts):
    """`serve --interaction graph` reaches the predictor it loads (the exported graph's ops);
    by default a DLRM tower's interaction is the kernel's call; another choice is refused."""
    from hybrid.serving import _server

    for given, want in (([], "kernel"), (["--interaction", "graph"], "graph")):
        args = _server._parser().parse_args(["--artifact", "x", "--port", "1", *given])
        predictor = _server._loader(args)(str(artifacts["int8"]))
        assert (predictor.interaction, predictor.interaction_fallback) == (want, None), given
    with pytest.raises(SystemExit):
        _server._parser().parse_args(["--artifact", "x", "--port", "1", "--interaction", "bmm"])


_LOG_PROBE = """
import logging, jax
from hybrid.serving._server import _configure_logging
_configure_logging("info")
logging.getLogger("hybrid.serving").info("served line")
logging.getLogger("hybridrec.serving").info("predictor line")
jax.devices()  # jax's backend probe logs at INFO (a TPU it cannot open) without JAX_PLATFORMS
logging.getLogger("jax._src.xla_bridge").info("a jax line")
"""


def test_the_server_logs_its_own_lines_not_other_libraries_info():
    """`serve --log-level info` printed jax's 'Unable to initialize backend tpu' on every start."""
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "XLA_FLAGS")}
    done = subprocess.run(
        [sys.executable, "-c", _LOG_PROBE],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=START_S,
    )
    assert done.returncode == 0, done.stderr
    assert "INFO:hybrid.serving: served line" in done.stderr
    assert "INFO:hybridrec.serving: predictor line" in done.stderr
    assert "jax" not in done.stderr, done.stderr
