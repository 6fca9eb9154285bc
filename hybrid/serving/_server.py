"""`python -m hybrid.serving serve`: an exported model over HTTP (FastAPI + uvicorn).

    python -m hybrid.serving serve --artifact artifacts/dlrm --port 8000 \\
        [--host 127.0.0.1] [--max-batch-size 64] [--max-wait-us 2000] [--warm-ids N]

Endpoints:
  POST /predict       `{"dense": [[n_dense floats], ...], "sparse": {feature: [[ids], ...]}}`
                      (several samples) or `{"dense": [floats], "sparse": {feature: [ids]}}`
                      (one); weighted models give `{"ids": ..., "weights": ...}` per feature.
                      -> `{"scores": [sigmoid(logit), ...], "logits": [...], "model": {...}}`
                      (a list per sample for a tower with several outputs). A request the model
                      cannot take gets `{"error": kind, "detail": what to fix}`: 400 malformed
                      (json, structure), 413 too large (samples, ids, body), 422 otherwise
                      (unknown or missing feature, id out of range, dense width, weights).
                      `Content-Type: application/x-safetensors`: the same request as a
                      safetensors buffer (`dense`, `<feature>.values`, `<feature>.lengths`
                      [, `.weights`]); `Accept: application/x-safetensors`: the answer too
                      (`_wire`).
  GET  /healthz       200 while the process is up.
  GET  /readyz        200 once a model is loaded and until shutdown begins, else 503.
  GET  /metrics       Prometheus text: requests, errors by kind, batch sizes (samples and
                      requests per predictor call), request and batch latency, reloads.
  POST /admin/reload  `{"artifact": DIR}` (or no body: the current directory again). The new
                      model is loaded, verified (every file against the manifest's sha256) and
                      warmed up beside the old one, then swapped in; requests already received
                      finish on the model they arrived under. A refused artifact (422) leaves
                      the old model serving. SIGHUP reloads the current directory.

Requests are checked on arrival by the predictor's own checks (`Predictor.check`, one set
with the Python API and the CLI), then batched (`_batcher`): concurrent requests share one
predictor call of at most --max-batch-size samples, waiting at most --max-wait-us for
company. SIGTERM / SIGINT: readiness drops, the listening socket closes, queued requests
are scored without further waiting, the process exits 0. The admin endpoint has no
authentication: bind to 127.0.0.1 (the default) or put it behind a proxy that guards it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import gc
import json
import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Sequence

import prometheus_client
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from hybrid.serving import _wire
from hybrid.serving._artifact import ArtifactError
from hybrid.serving._batcher import BatchDone, Batcher, BatcherClosed
from hybrid.serving._predictor import INTERACTIONS, Predictor, load
from hybrid.serving._request import RequestError

__all__ = ["create_app", "main"]

log = logging.getLogger("hybrid.serving")

_STATUS = {
    "malformed_json": 400,
    "malformed": 400,
    "payload_too_large": 413,
    "oversize_batch": 413,
    "too_many_ids": 413,
    "not_ready": 503,
    "shutting_down": 503,
    "internal": 500,
}  # every other kind (a value the model cannot take): 422
_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
_SECONDS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 30)


class _Metrics:
    def __init__(self):
        r = self.registry = prometheus_client.CollectorRegistry()
        p = "hybridrec_serving_"
        self.requests = prometheus_client.Counter(
            p + "requests", "Scoring requests received (POST /predict)", registry=r
        )
        self.errors = prometheus_client.Counter(
            p + "errors", "Scoring requests refused or failed, by kind", ["kind"], registry=r
        )
        self.batch_size = prometheus_client.Histogram(
            p + "batch_size", "Samples per predictor call", buckets=_SIZES, registry=r
        )
        self.batch_requests = prometheus_client.Histogram(
            p + "batch_requests", "Requests per predictor call", buckets=_SIZES, registry=r
        )
        self.latency = prometheus_client.Histogram(
            p + "request_latency_seconds",
            "POST /predict, from arrival to response (queueing included)",
            buckets=_SECONDS,
            registry=r,
        )
        self.batch_latency = prometheus_client.Histogram(
            p + "batch_latency_seconds", "One predictor call", buckets=_SECONDS, registry=r
        )
        self.reloads = prometheus_client.Counter(
            p + "reloads", "Model loads, by outcome (ok, refused)", ["outcome"], registry=r
        )
        self.generation = prometheus_client.Gauge(
            p + "model_generation", "How many models were loaded (1: the first)", registry=r
        )
        self.frozen = prometheus_client.Gauge(
            p + "gc_frozen_objects",
            "Objects the garbage collector no longer scans, frozen after the last model load",
            registry=r,
        )
        self.queued = prometheus_client.Gauge(
            p + "queued_samples", "Samples waiting for a predictor call", registry=r
        )

    def batch_done(self, done: BatchDone) -> None:
        self.batch_size.observe(done.samples)
        self.batch_requests.observe(done.requests)
        self.batch_latency.observe(done.seconds)


def _load_warm(
    path: str, warm_ids: int = 0, torch_threads: int | None = 1, interaction: str = "auto"
) -> Predictor:
    """`load(path, torch_threads=..., interaction=...)` (every file checked), its lookup
    compiled for every batch rung at each id capacity up to `warm_ids` (at least the
    smallest), and one call, so the first requests after a swap find their programs compiled
    and a model that cannot run is refused before it serves."""
    predictor = load(path, torch_threads=torch_threads, interaction=interaction)
    predictor.warm(warm_ids)
    weighted = predictor.manifest["is_weighted"]
    empty = {"ids": [[]], "weights": [[]]} if weighted else [[]]
    try:
        predictor([[0.0] * predictor.n_dense], dict.fromkeys(predictor.features, empty))
    except Exception as e:  # any failure means the model cannot serve
        raise ArtifactError(
            f"serving artifact {path!r} loads but fails a one-sample warm-up call "
            f"({type(e).__name__}: {e}); re-export the model"
        ) from None
    return predictor


def _settle_heap() -> int:
    """Collect what a model load left (a replaced model's reference cycles included), then
    freeze every surviving object: the model, jax, torch and the server are ~400,000
    objects, and a full collection scanning them took ~0.23 s, stalling every request in
    flight (the load test's p999 sat near it). Frozen objects are never scanned again (they
    are still freed when nothing refers to them); the next load unfreezes them first, so a
    replaced model's cycles are collected then. Returns how many objects are frozen."""
    gc.unfreeze()
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def _error(kind: str, detail: str) -> JSONResponse:
    return JSONResponse({"error": kind, "detail": detail}, status_code=_STATUS.get(kind, 422))


class _State:
    """The served model and what changes it; touched only from the event loop."""

    def __init__(
        self,
        artifact: str,
        *,
        max_batch_size: int,
        max_wait_s: float,
        max_body: int,
        loader: Callable[[str], Predictor] = _load_warm,
    ):
        self.path = os.path.abspath(artifact)
        self.loader = loader
        self.predictor: Predictor | None = None
        self.generation = 0
        self.draining = False
        self.fatal: str | None = None
        self.max_batch_size = max_batch_size
        self.max_wait_s = max_wait_s
        self.max_body = max_body
        self.metrics = _Metrics()
        self.batcher: Batcher | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self._reload_lock: asyncio.Lock | None = None
        self.on_fatal = lambda message: None

    def model_info(self) -> dict:
        return {"artifact": self.path, "generation": self.generation}

    async def reload(self, path: str | None = None) -> dict:
        """Load `path` (default: the current directory) beside the served model and swap it
        in; raises ArtifactError (the served model unchanged) if it is refused."""
        async with self._reload_lock:
            path = os.path.abspath(path or self.path)
            try:
                predictor = await asyncio.to_thread(self.loader, path)
            except ArtifactError as e:
                self.metrics.reloads.labels("refused").inc()
                log.error("model reload refused, the served model is unchanged: %s", e)
                raise
            # the swap: requests already queued keep the predictor they captured
            self.predictor, self.path = predictor, path
            self.generation += 1
            self.metrics.reloads.labels("ok").inc()
            self.metrics.generation.set(self.generation)
            self.metrics.frozen.set(await asyncio.to_thread(_settle_heap))
            log.info("serving %s (generation %d)", path, self.generation)
            return self.model_info()

    async def first_load(self) -> None:
        try:
            await self.reload()
        except ArtifactError as e:
            self.fatal = str(e)
            self.on_fatal(self.fatal)

    def begin_drain(self) -> None:
        """From a signal handler: readiness drops and queued requests run without waiting."""
        self.draining = True
        if self.loop is not None and self.batcher is not None:
            self.loop.call_soon_threadsafe(self.batcher.flush)


def create_app(
    artifact: str,
    *,
    max_batch_size: int = 64,
    max_wait_s: float = 0.002,
    max_body: int = 16 << 20,
    loader: Callable[[str], Predictor] | None = None,
) -> tuple[FastAPI, _State]:
    """The FastAPI app serving `artifact` and its state (module docstring). The model loads
    when the app starts (readiness waits for it). `loader(directory) -> predictor` loads
    (and reloads) the model: default `load`, verified and warmed up; another object with
    the `Predictor` interface the server uses (`features`, `n_dense`, `max_batch_size`,
    `max_ids`, `manifest["is_weighted"]`, `check`, `__call__`) may be served instead, e.g.
    a benchmark's competitor behind the same batching (`benchmarks.serving_load`)."""
    state = _State(
        artifact,
        max_batch_size=max_batch_size,
        max_wait_s=max_wait_s,
        max_body=max_body,
        loader=loader or _load_warm,
    )

    @contextlib.asynccontextmanager
    async def lifespan(app):
        state.loop = asyncio.get_running_loop()
        state._reload_lock = asyncio.Lock()
        state.batcher = Batcher(
            _wire.score,
            max_batch_size=max_batch_size,
            max_wait_s=max_wait_s,
            on_batch=state.metrics.batch_done,
        )
        state.metrics.queued.set_function(lambda: state.batcher.queued_samples)
        state.batcher.start()
        first = asyncio.create_task(state.first_load())
        sighup = getattr(signal, "SIGHUP", None)  # absent on Windows
        if sighup is not None:
            with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
                state.loop.add_signal_handler(
                    sighup, lambda: asyncio.ensure_future(_reload_quietly(state))
                )
        try:
            yield
        finally:
            state.draining = True
            await asyncio.gather(first, return_exceptions=True)
            await state.batcher.close()

    app = FastAPI(title="hybridrec serving", lifespan=lifespan)

    @app.get("/healthz")
    async def healthz():
        return {"status": "ok"}

    @app.get("/readyz")
    async def readyz():
        if state.predictor is None or state.draining:
            reason = "shutting down" if state.draining else "loading the model"
            return JSONResponse({"status": reason}, status_code=503)
        return {"status": "ready", "model": state.model_info()}

    @app.get("/metrics")
    async def metrics():
        return Response(
            prometheus_client.generate_latest(state.metrics.registry),
            media_type=prometheus_client.CONTENT_TYPE_LATEST,
        )

    @app.post("/predict")
    async def predict(request: Request):
        start = time.perf_counter()
        state.metrics.requests.inc()
        try:
            return await _predict(state, request)
        except RequestError as e:
            state.metrics.errors.labels(e.kind).inc()
            return _error(e.kind, str(e))
        except BatcherClosed as e:
            state.metrics.errors.labels("shutting_down").inc()
            return _error("shutting_down", str(e))
        except Exception as e:  # the server answers 500 and goes on
            log.exception("a scoring request failed")
            state.metrics.errors.labels("internal").inc()
            return _error("internal", f"{type(e).__name__}: {e}")
        finally:
            state.metrics.latency.observe(time.perf_counter() - start)

    @app.post("/admin/reload")
    async def reload(request: Request):
        body = await request.body()
        path = None
        if body.strip():
            try:
                path = json.loads(body).get("artifact")
            except (ValueError, AttributeError):
                path = 0  # not a string: refused below
            if not isinstance(path, str):
                return _error("malformed", 'the body is {"artifact": "DIR"} (or empty: reload DIR)')
        if state.predictor is None:
            return _error("not_ready", "the first model is still loading")
        try:
            return {"status": "reloaded", "model": await state.reload(path)}
        except ArtifactError as e:
            return JSONResponse(
                {"error": "artifact_refused", "detail": str(e), "model": state.model_info()},
                status_code=422,
            )

    return app, state


async def _reload_quietly(state: _State) -> None:
    with contextlib.suppress(ArtifactError):  # logged; the old model keeps serving
        await state.reload()


async def _predict(state: _State, request: Request):
    if state.draining:
        raise BatcherClosed("the server is shutting down")
    # the model this request is scored by, whatever reloads later (read together: no await)
    predictor, info = state.predictor, state.model_info()
    if predictor is None:
        raise RequestError("not_ready", "the model is still loading; retry when /readyz is 200")
    if int(request.headers.get("content-length") or 0) > state.max_body:
        raise RequestError("payload_too_large", f"the body is larger than {state.max_body} bytes")
    body = await request.body()
    if len(body) > state.max_body:
        raise RequestError("payload_too_large", f"the body is larger than {state.max_body} bytes")
    dense, sparse = _wire.parse(body, request.headers.get("content-type"), predictor.features)
    samples, ids = predictor.check(dense, sparse)
    weighted = predictor.manifest["is_weighted"]
    payload = _wire.payload(dense, sparse, samples, predictor.features, weighted)
    result = await state.batcher.submit(predictor, payload, samples=samples, ids=ids)
    # rendered here: a failure is caught
    return _wire.render(result, info, _wire.is_binary(request.headers.get("accept")))


class _Server(uvicorn.Server):
    """uvicorn's server, telling the app when shutdown begins, and exiting 0 after a
    graceful shutdown (uvicorn re-raises the signal once it is done)."""

    def __init__(self, config: uvicorn.Config, state: _State):
        super().__init__(config)
        self._state = state

    def handle_exit(self, sig, frame) -> None:
        self._state.begin_drain()
        super().handle_exit(sig, frame)

    @contextlib.contextmanager
    def capture_signals(self):
        """uvicorn's SIGINT/SIGTERM handlers (`handle_exit`: drain, then stop) without its
        re-raise of the signal once stopped: a drained shutdown exits 0."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {
            sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)
        }
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m hybrid.serving serve", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--artifact", required=True, help="the directory hybrid.export wrote")
    p.add_argument("--port", type=int, required=True, help="the TCP port to listen on")
    p.add_argument("--host", default="127.0.0.1", help="the address to bind (default 127.0.0.1)")
    p.add_argument(
        "--max-batch-size",
        type=int,
        default=64,
        help="most samples per predictor call (also capped by the artifact's max_batch_size)",
    )
    p.add_argument(
        "--max-wait-us",
        type=int,
        default=2000,
        help="longest a request waits for others to share its call, in microseconds",
    )
    p.add_argument(
        "--drain-timeout",
        type=float,
        default=30.0,
        help="seconds shutdown waits for queued requests before cancelling them",
    )
    p.add_argument(
        "--warm-ids",
        type=int,
        default=0,
        help="compile the lookup at load (and reload) for every id capacity up to this many ids "
        "(default: the smallest only; others compile when a batch first needs them, which stalls "
        "the batches behind it)",
    )
    p.add_argument(
        "--torch-threads",
        type=int,
        default=1,
        help="torch's intra-op threads while a call's dense tower runs (default 1: beside "
        "JAX's threads a second one waited for a core; 0: leave torch's own setting)",
    )
    p.add_argument(
        "--interaction",
        choices=INTERACTIONS,
        default="auto",
        help="a DLRM tower's interaction: 'auto' by one kernel call where it passes its check at "
        "load (logits within 1e-4 of the graph's), 'graph' by the exported graph's ops (the "
        "in-memory model's logits bit for bit)",
    )
    p.add_argument(
        "--log-level",
        default="info",
        help="the server's and uvicorn's log level (other libraries log from warning up)",
    )
    return p


def _loader(args) -> Callable[[str], Predictor]:
    """What loads (and reloads) the artifact for the command line's `args`."""
    threads = args.torch_threads or None  # 0: torch's own count
    return functools.partial(
        _load_warm, warm_ids=args.warm_ids, torch_threads=threads, interaction=args.interaction
    )


def _configure_logging(level: str) -> None:
    """The server's own log (and the predictor's) at `level`; other libraries' from WARNING
    up, or from `level` when it is quieter (jax logs its probe for a TPU at INFO on every
    start), everything at DEBUG."""
    level = level.upper()
    quietest = max(logging.getLevelName(level), logging.WARNING)  # error: only errors at all
    logging.basicConfig(
        level=level if level == "DEBUG" else logging.getLevelName(quietest),
        format="%(levelname)s:%(name)s: %(message)s",
    )
    for name in (log.name, "hybridrec.serving"):
        logging.getLogger(name).setLevel(level)


def main(
    argv: Sequence[str] | None = None, loader: Callable[[str], Predictor] | None = None
) -> int:
    """`python -m hybrid.serving serve ARGS`; `loader`: see `create_app`."""
    args = _parser().parse_args(argv)
    if args.max_batch_size < 1 or args.max_wait_us < 0 or args.torch_threads < 0:
        print(
            "python -m hybrid.serving serve: --max-batch-size must be >= 1, --max-wait-us >= 0 "
            "and --torch-threads >= 0",
            flush=True,
        )
        return 2
    _configure_logging(args.log_level)
    app, state = create_app(
        args.artifact,
        max_batch_size=args.max_batch_size,
        max_wait_s=args.max_wait_us / 1e6,
        loader=loader or _loader(args),
    )
    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        access_log=False,
        timeout_graceful_shutdown=args.drain_timeout,
    )
    server = _Server(config, state)

    def fatal(message: str) -> None:
        log.error("cannot serve: %s", message)
        server.should_exit = True

    state.on_fatal = fatal
    server.run()
    return 2 if state.fatal else 0
