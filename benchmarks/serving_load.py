"""Load test: `python -m hybrid.serving serve` under concurrent clients, against TorchRec's
quantized DLRM behind the same server and batching.

    python -m benchmarks.serving_load                     # ~3 min: 8 int8 tables of 100k x 64
    python -m benchmarks.serving_load --tiny              # seconds (the suite runs it with --format binary)
    python -m benchmarks.serving_load --format binary     # the clients send safetensors bodies
    python -m benchmarks.serving_load --update-results    # into benchmarks/results/

An int8 DLRM (`benchmarks.serving_latency`'s model: `--tables` tables of `--rows` x `--dim`,
bags of `--pooling` ids, 13 dense features) is exported and served by
`python -m hybrid.serving serve` in a subprocess on 127.0.0.1; TorchRec's quantized DLRM
from the same weights is served by the same server code through
`benchmarks.torchrec_predictor` (same request checks, same dynamic batching). For each
request size (`--sizes`, samples per request) each server gets `--clients` concurrent
keep-alive clients for `--seconds` (`benchmarks.load_client`, asyncio): requests/s,
samples/s, p50 / p99 / p999 latency, errors; then ours / TorchRec. Last, one more phase
on ours: the same load while the model is reloaded twice (`POST /admin/reload`, another
copy of the artifact, then back) and a client sends garbage (malformed JSON, unknown
feature, out-of-range id, oversize batch, bytes that are not HTTP): no client request may
fail and every garbage request must get a 4xx; then /healthz must answer.

The clients run in this process, so they share the 2 cores with the server: the figures
are the whole system's, and meaningful only on a quiet machine (the probe runs before and
after; NOT QUIET marks them void). Writes serving_load.json and serving_load.md to a fresh
runs/bench/serving_load-<time>/ (or `--out`, or benchmarks/results/ with
`--update-results`). Exit code 1 when a correctness check fails (failed requests in the
reload phase, a garbage request not answered 4xx, the server down after it).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

from benchmarks import load_client, report

NAME = "serving_load"
START_S = 300  # a server's start on a loaded 2-core machine (imports, load, warm-up)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.serving_load",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--tables", type=int, default=8)
    p.add_argument("--rows", type=int, default=100_000)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--pooling", type=int, default=10)
    p.add_argument("--sizes", default="1,16,64", help="samples per request, comma-separated")
    p.add_argument("--clients", type=int, default=16, help="concurrent clients")
    p.add_argument("--seconds", type=float, default=10.0, help="each phase's duration")
    p.add_argument("--max-batch-size", type=int, default=64, help="the server's batch limit")
    p.add_argument("--max-wait-us", type=int, default=2000, help="the server's batching wait")
    p.add_argument("--server-threads", type=int, default=1, help="OMP/torch threads of each server")
    p.add_argument(
        "--format",
        choices=["json", "binary"],
        default="json",
        help="the clients' request body: JSON, or the server's binary form (safetensors)",
    )
    p.add_argument(
        "--no-torchrec", action="store_true", help="serve ours only (no TorchRec comparison)"
    )
    p.add_argument(
        "--tiny",
        action="store_true",
        help="2 small tables, sizes 1 and 4, 3 clients, 0.3 s phases, no TorchRec, no probe: "
        "a smoke run (what the suite runs)",
    )
    report.add_output_args(p, NAME)
    return p


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(threads: int) -> dict:
    return {
        **os.environ,
        "JAX_PLATFORMS": "cpu",
        "OMP_NUM_THREADS": str(threads),
        "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])),
    }


class _Server:
    """A server subprocess on 127.0.0.1; always stopped by `stop` (SIGTERM, then SIGKILL)."""

    def __init__(self, command: list[str], log_path: str, threads: int):
        self.port = _free_port()
        self.log_path = log_path
        self._log = open(log_path, "w")
        self.proc = subprocess.Popen(
            [*command, "--port", str(self.port), "--log-level", "warning"],
            cwd=ROOT,
            env=_env(threads),
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )

    def get(self, path: str) -> int:
        try:
            with _OPENER.open(f"http://127.0.0.1:{self.port}{path}", timeout=30) as r:
                return r.status
        except OSError:
            return 0

    def wait_ready(self) -> None:
        deadline = time.monotonic() + START_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                break
            if self.get("/readyz") == 200:
                return
            time.sleep(0.2)
        self.stop()
        with open(self.log_path) as f:
            raise RuntimeError(f"the server did not become ready:\n{f.read()[-3000:]}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(60)
        self._log.close()


def _model_args(args) -> argparse.Namespace:
    return argparse.Namespace(
        tables=args.tables, rows=args.rows, dim=args.dim, pooling=args.pooling
    )


def _export(args, directory: str) -> str:
    """The int8 DLRM exported (max_batch_size: the server's limit) to `directory`/a."""
    import torch

    import hybrid
    from benchmarks import serving_latency as sl

    m = _model_args(args)
    model = sl.ours_model(m, sl.weights(m))
    dense, sparse = sl.requests(m, args.max_batch_size)
    example = (torch.from_numpy(dense), {f: (v, n) for f, (v, n) in sparse.items()})
    path = os.path.join(directory, "a")
    ladder = sorted({1 << k for k in range(4, 24)} | {args.max_batch_size * m.tables * m.pooling})
    hybrid.export(
        hybrid.quantize(model.eval(), "int8"),
        path,
        example=example,
        max_batch_size=args.max_batch_size,
        id_capacities=[c for c in ladder if c <= args.max_batch_size * m.tables * m.pooling],
        platforms=("cpu",),
    )
    return path


def _body(args, samples: int, seed: int = 7) -> bytes:
    """A request of `samples` samples in `--format`: JSON, or safetensors (the same values)."""
    import numpy as np
    import safetensors.numpy

    from benchmarks import serving_latency as sl

    m = _model_args(args)
    rng = np.random.default_rng([seed, samples])
    sparse = {f: rng.integers(0, m.rows, (samples, m.pooling)) for _, f in sl._config(m)}
    dense = rng.standard_normal((samples, sl.N_DENSE)).round(4)
    if getattr(args, "format", "json") == "json":
        lists = {f: ids.tolist() for f, ids in sparse.items()}
        return json.dumps({"dense": dense.tolist(), "sparse": lists}).encode()
    arrays = {"dense": dense.astype(np.float32)}
    for f, ids in sparse.items():
        arrays[f"{f}.values"] = ids.reshape(-1)
        arrays[f"{f}.lengths"] = np.full(samples, m.pooling, np.int64)
    return safetensors.numpy.save(arrays)


def _content_type(args) -> str:
    return "application/x-safetensors" if args.format == "binary" else "application/json"


def _bad_bodies(args) -> list[bytes]:
    from benchmarks import serving_latency as sl

    m = _model_args(args)
    good = json.loads(_body(argparse.Namespace(**{**vars(args), "format": "json"}), 1))
    feature = sl._config(m)[0][1]
    out_of_range = {**good, "sparse": {**good["sparse"], feature: [[m.rows]]}}
    unknown = {**good, "sparse": {**good["sparse"], "no_such_feature": [[1]]}}
    oversize = json.loads(
        _body(argparse.Namespace(**{**vars(args), "format": "json"}), args.max_batch_size + 1)
    )
    wide = {**good, "dense": [[0.0] * (sl.N_DENSE + 1)]}
    return [
        b'{"dense": [[0.1, ',
        json.dumps(unknown).encode(),
        json.dumps(out_of_range).encode(),
        json.dumps(oversize).encode(),
        json.dumps(wide).encode(),
        b"\xff\xfe not json",
    ]


async def _reload_under_load(args, server: _Server, body: bytes, paths: list[str]) -> dict:
    """Clients at load and a garbage client while the server reloads to each of `paths` in
    turn (each after `--seconds / 3` of load; the load goes on `--seconds / 3` after the
    last, and until every client had an answer from the last model); what each saw."""
    stop = asyncio.Event()
    pause = args.seconds / 3
    seen = load_client.LoadResult()
    bound = START_S * len(paths) + args.seconds  # the phase's longest possible duration

    async def answered_by(generation: int, count: int) -> None:
        """Until `count` answers came from model `generation`, or the phase's bound passed (a
        loaded machine may starve the clients for a whole pause)."""
        give_up = time.perf_counter() + bound
        while seen.generations[generation] < count and time.perf_counter() < give_up:
            await asyncio.sleep(0.05)

    async def reloads():
        outcomes = []
        try:
            for k, path in enumerate(paths):
                await asyncio.sleep(pause)
                await answered_by(k + 1, 1)  # the model before this reload served someone
                start = time.perf_counter()
                status, _ = await load_client.post(
                    server.port, "/admin/reload", json.dumps({"artifact": path}).encode(), START_S
                )
                outcomes.append(
                    {
                        "artifact": os.path.basename(path),
                        "status": status,
                        "seconds": time.perf_counter() - start,
                    }
                )
            await asyncio.sleep(pause)
            await answered_by(len(paths) + 1, args.clients)  # the last model, as many answers
        finally:
            stop.set()
        return outcomes

    load, bad, reloaded = await asyncio.gather(
        load_client.closed_loop(
            server.port,
            body,
            clients=args.clients,
            seconds=bound,
            stop=stop,
            result=seen,
            content_type=_content_type(args),
        ),
        load_client.garbage(server.port, _bad_bodies(args), seconds=bound, stop=stop),
        reloads(),
    )
    return {"load": load.summary(), "garbage": bad, "reloads": reloaded}


def _markdown(result: dict) -> str:
    lines = [
        f"# {NAME}",
        "",
        result["probe"],
        "",
        result["setup"],
        "",
        "| server | samples / request | QPS | samples/s | p50 ms | p99 ms | p999 ms | errors |",
        "|---|---|---|---|---|---|---|---|",
    ]

    def fmt(v):
        return "-" if v is None else f"{v:.2f}"

    for row in result["phases"]:
        s = row["summary"]
        lines.append(
            f"| {row['server']} | {row['samples']} | {s['qps']:.0f} | {s['samples_per_s']:.0f} | "
            f"{fmt(s['p50_ms'])} | {fmt(s['p99_ms'])} | {fmt(s['p999_ms'])} | {s['errors']} |"
        )
    if result["ratios"]:
        lines += [
            "",
            "| samples / request | ours / TorchRec QPS | ours / TorchRec p50 | ours / TorchRec p99 |",
            "|---|---|---|---|",
        ]
        for r in result["ratios"]:
            lines.append(
                f"| {r['samples']} | {fmt(r['qps'])}x | {fmt(r['p50'])}x | {fmt(r['p99'])}x |"
            )
    rl = result["reload_phase"]
    s = rl["load"]
    lines += [
        "",
        f"Reload under load ({rl['samples']} samples / request): {s['requests']} requests answered, "
        f"{s['errors']} failed {s['errors_by_kind'] or ''}, model generations served "
        f"{s['model_generations']}; reloads {[(r['status'], round(r['seconds'], 1)) for r in rl['reloads']]} "
        "(status, seconds); garbage client: "
        f"{rl['garbage']['sent']} sent, {rl['garbage']['answered_4xx']} answered 4xx, other "
        f"{rl['garbage']['other']}; /healthz after: {rl['healthz_after']}.",
        "",
        f"Checks: {'passed' if result['ok'] else 'FAILED: ' + '; '.join(result['failures'])}",
    ]
    return "\n".join(lines) + "\n"


def _ratio(a, b):
    return None if a is None or not b else a / b


def _probe_line(before: dict | None, after: dict | None) -> str:
    from benchmarks.e2e_step import quietness_line

    if before is None:
        return "quietness probe: not run (--tiny: a smoke run, its figures mean nothing)"
    return quietness_line(before, after)


def main(argv=None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.tiny:
        args.tables, args.rows, args.dim, args.pooling = 2, 1000, 16, 4
        args.sizes, args.clients, args.seconds, args.max_batch_size = "1,4", 3, 0.3, 16
        args.no_torchrec = True
    out_dir = report.output_dir(parser, args, NAME)
    sizes = [int(s) for s in args.sizes.split(",")]
    if any(not 1 <= s <= args.max_batch_size for s in sizes):
        parser.error(
            f"--sizes {args.sizes} must lie in [1, --max-batch-size {args.max_batch_size}]"
        )
    from benchmarks.e2e_step import quietness_probe

    probe = None if args.tiny else (lambda: quietness_probe(rows=200_000, bags=4096, L=20))
    before = probe and probe()
    os.makedirs(out_dir, exist_ok=True)
    work = tempfile.mkdtemp(prefix="serving_load-")
    servers: dict[str, _Server] = {}
    try:
        first = _export(args, work)
        second = shutil.copytree(first, os.path.join(work, "b"))  # the model to reload to
        serve = [
            "--max-batch-size",
            str(args.max_batch_size),
            "--max-wait-us",
            str(args.max_wait_us),
        ]
        # every id capacity a batch can need, compiled at load (not while timed); --tiny: the
        # smallest only (the rest compile as the smoke run meets them)
        warm_ids = 0 if args.tiny else args.max_batch_size * args.tables * args.pooling
        warm = ["--warm-ids", str(warm_ids)]
        servers["ours"] = _Server(
            [sys.executable, "-m", "hybrid.serving", "serve", "--artifact", first, *serve, *warm],
            os.path.join(out_dir, "server_ours.log"),
            args.server_threads,
        )
        if not args.no_torchrec:
            m = _model_args(args)
            servers["torchrec"] = _Server(
                [
                    sys.executable,
                    "-m",
                    "benchmarks.torchrec_predictor",
                    *("--tables", str(m.tables), "--rows", str(m.rows), "--dim", str(m.dim)),
                    *("--pooling", str(m.pooling), "--max-batch-size", str(args.max_batch_size)),
                    "--",
                    *("--artifact", work, *serve),
                ],
                os.path.join(out_dir, "server_torchrec.log"),
                args.server_threads,
            )
        for server in servers.values():
            server.wait_ready()
        phases = []
        for samples in sizes:
            body = _body(args, samples)
            for server in servers.values():  # untimed: compiles the shapes this load meets
                asyncio.run(
                    load_client.closed_loop(
                        server.port,
                        body,
                        clients=args.clients,
                        seconds=args.seconds / 4,
                        content_type=_content_type(args),
                    )
                )
            for name, server in servers.items():
                got = asyncio.run(
                    load_client.closed_loop(
                        server.port,
                        body,
                        clients=args.clients,
                        seconds=args.seconds,
                        content_type=_content_type(args),
                    )
                )
                phases.append({"server": name, "samples": samples, "summary": got.summary(samples)})
                print(
                    f"{name:8s} {samples:4d} samples/request: {json.dumps(phases[-1]['summary'])}"
                )
        reload_phase = asyncio.run(
            _reload_under_load(args, servers["ours"], _body(args, sizes[0]), [second, first])
        )
        reload_phase["samples"] = sizes[0]
        reload_phase["healthz_after"] = servers["ours"].get("/healthz")
    finally:
        for server in servers.values():
            server.stop()
        shutil.rmtree(work, ignore_errors=True)
    after = probe and probe()

    ratios = []
    for samples in sizes if "torchrec" in servers else []:
        ours, theirs = (
            next(p["summary"] for p in phases if p["server"] == s and p["samples"] == samples)
            for s in ("ours", "torchrec")
        )
        ratios.append(
            {
                "samples": samples,
                "qps": _ratio(ours["qps"], theirs["qps"]),
                "p50": _ratio(ours["p50_ms"], theirs["p50_ms"]),
                "p99": _ratio(ours["p99_ms"], theirs["p99_ms"]),
            }
        )
    failures = []
    load = reload_phase["load"]
    if load["errors"]:
        failures.append(f"{load['errors']} client requests failed during the reloads")
    if any(r["status"] != 200 for r in reload_phase["reloads"]):
        failures.append(f"a reload was refused: {reload_phase['reloads']}")
    bad = reload_phase["garbage"]
    if bad["answered_4xx"] != bad["sent"] or not bad["sent"]:
        failures.append(f"garbage requests not all answered 4xx: {bad}")
    generations = load["model_generations"]
    if len(generations) != len(reload_phase["reloads"]) + 1:
        failures.append(f"requests did not reach every reloaded model: {generations}")
    if reload_phase["healthz_after"] != 200:
        failures.append("the server did not answer /healthz after the garbage")
    if any(p["summary"]["errors"] for p in phases):
        failures.append("client requests failed under plain load")
    m = _model_args(args)
    result = {
        "probe": _probe_line(before, after),
        "quiet": bool(before and after and before["quiet"] and after["quiet"]),
        "setup": (
            f"{m.tables} int8 tables of {m.rows} x {m.dim}, bags of {m.pooling}, DLRM; server "
            f"--max-batch-size {args.max_batch_size} --max-wait-us {args.max_wait_us}, "
            f"{args.server_threads} thread(s) each; {args.clients} keep-alive clients in one "
            f"asyncio process on the same cores, {args.seconds:g} s per phase, {args.format} "
            "requests"
        ),
        "args": vars(args),
        "phases": phases,
        "ratios": ratios,
        "reload_phase": reload_phase,
        "ok": not failures,
        "failures": failures,
    }
    with open(os.path.join(out_dir, f"{NAME}.json"), "w") as f:
        json.dump(result, f, indent=1)
    text = _markdown(result)
    with open(os.path.join(out_dir, f"{NAME}.md"), "w") as f:
        f.write(text)
    print(text)
    print(f"results: {out_dir}")
    return 0 if not failures else 1


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so `finally` stops the servers
    sys.exit(main())
