"""An asyncio HTTP/1.1 load generator for `benchmarks.serving_load` (standard library only).

    result = await closed_loop(port, body, clients=16, seconds=10.0)
    result.summary()   # requests, QPS, p50 / p99 / p999 ms, errors by status

`closed_loop`: `clients` keep-alive connections to 127.0.0.1, each sending the request, waiting
for its answer, and sending the next, until `seconds` have passed (one request at least) or
`max_requests` each (bounded in count and time; every request has `timeout_s`). A non-200 answer, a timeout or a
dropped connection is an error (the connection is then opened again). `garbage`: a client
sending bad requests (malformed JSON, unknown feature, out-of-range id, oversize batch,
bytes that are not HTTP) and counting the answers that are a 4xx, as they should be.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import json
import time

import numpy as np

__all__ = ["LoadResult", "closed_loop", "garbage", "post"]

HOST = "127.0.0.1"


@dataclasses.dataclass
class LoadResult:
    """Latencies of the answered requests and what went wrong, over `seconds` of wall time."""

    seconds: float = 0.0
    latencies: list[float] = dataclasses.field(default_factory=list)  # seconds, 200s only
    errors: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    generations: collections.Counter = dataclasses.field(default_factory=collections.Counter)

    def summary(self, samples_per_request: int = 1) -> dict:
        lat = np.array(self.latencies) * 1e3
        ok = len(lat)
        pct = (
            {
                f"p{k}_ms": float(np.percentile(lat, q))
                for k, q in (("50", 50), ("99", 99), ("999", 99.9))
            }
            if ok
            else {"p50_ms": None, "p99_ms": None, "p999_ms": None}
        )
        return {
            "requests": ok,
            "qps": ok / self.seconds if self.seconds else 0.0,
            "samples_per_s": ok * samples_per_request / self.seconds if self.seconds else 0.0,
            **pct,
            "errors": sum(self.errors.values()),
            "errors_by_kind": dict(self.errors),
            "model_generations": {str(k): v for k, v in sorted(self.generations.items())},
        }


def _request_bytes(
    path: str, body: bytes, method: str = "POST", content_type: str = "application/json"
) -> bytes:
    head = (
        f"{method} {path} HTTP/1.1\r\nHost: {HOST}\r\nContent-Type: {content_type}\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


async def _exchange(reader, writer, data: bytes) -> tuple[int, bytes]:
    """Send one request on a keep-alive connection; (status, body) of its answer."""
    writer.write(data)
    await writer.drain()
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    length = 0
    for line in lines[1:]:
        name, _, value = line.partition(":")
        if name.strip().lower() == "content-length":
            length = int(value)
    return status, await reader.readexactly(length)


async def post(port: int, path: str, body: bytes, timeout_s: float = 60.0) -> tuple[int, bytes]:
    """One request on its own connection: (status, body)."""
    reader, writer = await asyncio.open_connection(HOST, port)
    try:
        return await asyncio.wait_for(
            _exchange(reader, writer, _request_bytes(path, body)), timeout_s
        )
    finally:
        writer.close()


async def _client(port, data, deadline, stop, max_requests, timeout_s, result) -> None:
    conn = None
    for n in range(max_requests):  # at least one request each, however late it starts
        if n and (time.perf_counter() >= deadline or (stop is not None and stop.is_set())):
            break
        try:
            if conn is None:
                conn = await asyncio.wait_for(asyncio.open_connection(HOST, port), timeout_s)
            start = time.perf_counter()
            status, body = await asyncio.wait_for(_exchange(*conn, data), timeout_s)
            took = time.perf_counter() - start
        except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError) as e:
            result.errors[f"connection: {type(e).__name__}"] += 1
            conn = _drop(conn)
            continue
        except TimeoutError:
            result.errors["timeout"] += 1
            conn = _drop(conn)
            continue
        if status != 200:
            result.errors[f"http {status}"] += 1
            continue
        result.latencies.append(took)
        model = json.loads(body).get("model", {})
        result.generations[model.get("generation")] += 1
    _drop(conn)


def _drop(conn):
    if conn is not None:
        conn[1].close()
    return None


async def closed_loop(
    port: int,
    body: bytes,
    *,
    clients: int,
    seconds: float,
    max_requests: int = 1_000_000,
    timeout_s: float = 60.0,
    stop: asyncio.Event | None = None,
    result: LoadResult | None = None,
    content_type: str = "application/json",
) -> LoadResult:
    """`clients` concurrent keep-alive clients POSTing `body` (of `content_type`: JSON, or
    the server's binary safetensors) to /predict (module docstring); with `stop`, until it is set
    (`seconds` then bounds the run). `result`: fill this one (others may watch it while the
    clients run). The answers are JSON either way."""
    result = LoadResult() if result is None else result
    data = _request_bytes("/predict", body, content_type=content_type)
    start = time.perf_counter()
    deadline = start + seconds
    await asyncio.gather(
        *(
            _client(port, data, deadline, stop, max_requests, timeout_s, result)
            for _ in range(clients)
        )
    )
    result.seconds = time.perf_counter() - start
    return result


async def garbage(
    port: int,
    bad_bodies: list[bytes],
    *,
    seconds: float,
    pause_s: float = 0.01,
    max_requests: int = 100_000,
    timeout_s: float = 60.0,
    stop: asyncio.Event | None = None,
) -> dict:
    """Send each of `bad_bodies` in turn (and, every round, bytes that are not HTTP on a
    fresh connection) until `seconds` pass or `stop` is set, one round at least;
    {"sent", "answered_4xx", "other": {what: n}}."""
    sent, fine, other = 0, 0, collections.Counter()
    deadline = time.perf_counter() + seconds
    junk = b"\x16\x03\x01 this is not http\r\n\r\n"
    for i in range(max_requests):  # at least one of each kind, however short the time
        over = time.perf_counter() >= deadline or (stop is not None and stop.is_set())
        if over and i > len(bad_bodies):
            break
        sent += 1
        try:
            if i % (len(bad_bodies) + 1) == len(bad_bodies):  # not HTTP at all: 400 or a close
                reader, writer = await asyncio.open_connection(HOST, port)
                try:
                    writer.write(junk)
                    await writer.drain()
                    line = await asyncio.wait_for(reader.readline(), timeout_s)
                finally:
                    writer.close()
                if not line or b" 400 " in line:
                    fine += 1
                else:
                    other[line[:40].decode("latin-1")] += 1
            else:
                status, _ = await post(port, "/predict", bad_bodies[i % (len(bad_bodies) + 1)])
                if 400 <= status < 500:
                    fine += 1
                else:
                    other[f"http {status}"] += 1
        except (OSError, TimeoutError, asyncio.IncompleteReadError, ValueError) as e:
            other[type(e).__name__] += 1
        await asyncio.sleep(pause_s)
    return {"sent": sent, "answered_4xx": fine, "other": dict(other)}
