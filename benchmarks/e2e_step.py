"""One DLRM training step, broken down: hybridrec (plain loop and `hybrid.TrainPipeline`) vs
TorchRec DistributedModelParallel (plain loop and `TrainPipelineSparseDist`).

    python -m benchmarks.e2e_step [--tiny] [--out DIR | --update-results] [--rounds N] [--steps N]

Workload W1 (PERF_NOTES.md): T=8 tables of E=1e5 rows, D=64, batch B=2048, L=20 uniform ids per
bag, 13 dense features; the DLRM of `benchmarks.e2e_vs_torchrec` (dense arch [128, D], over arch
[128, 1]), the same starting weights, fused rowwise Adagrad for the tables, SGD for the dense
tower. TorchRec runs under `e2e_vs_torchrec.torchrec_dmp` (1 gloo rank on CPU).

Four sides: "hybridrec plain" (`model.prepare(sparse)`, then `model(dense, prepared)` - what
`model(dense, sparse)` runs inside -, loss.backward(), dense SGD step), "hybridrec pipeline"
(`hybrid.TrainPipeline.progress`; skipped, saying so, in a tree without `hybrid.TrainPipeline`),
"torchrec plain" and "torchrec pipeline" (`TrainPipelineSparseDist` on its own DMP, fed TorchRec
`Batch`es). The plain sides are the models the correctness gate ran (2 steps each, same losses
and tables); each pipeline's first loss must equal its plain loop's. A round runs N steps of
every side (order rotated per round, an untimed 50 ms pause before each side); figures are
medians over rounds, ratios ours / TorchRec as ratio of medians and median of per-round ratios.
Our round's clock stops only once all the JAX work it started is finished
(`jax.block_until_ready` on the tables and the optimizer state); a pipeline's look-ahead batch
is let finish, untimed, before the next side runs.

Per-step segments (means over a round's steps, medians over rounds), stamped by the loop, by
forward hooks and by autograd node hooks (nothing extra blocks the loop):
- host_prep: collate + validate + pad + place of the sparse batch (plain ours: `model.prepare`,
  blocked until placed; TorchRec: `KeyedJaggedTensor.from_lengths_sync`); dense features and
  labels need no work on CPU. Pipelined ours: `pipeline.stats.prepare_s` per step (the
  background thread's time, dense and labels included).
- host_prep_critical: the part of it on the main thread's critical path: all of it in the plain
  loops and in TorchRec's CPU pipeline; pipelined ours: `pipeline.stats.wait_s` per step (the
  time `progress` waited for the next prepared batch).
- lookup: ours, from the model call to the dense tower's first input (JAX lookup + DLPack, which
  waits for the lookup and so also for a previous update still running); TorchRec, the
  `sparse_arch` forward (input dist where not pipelined, TBE lookup, output dist, cat).
- dense: the rest of forward, loss, backward up to the sparse gradient node, and the host work
  after that node (ours: rest of backward + dense SGD step; TorchRec: dense SGD step). Not for
  TorchRec's pipeline (its backward's end is not visible from outside).
- sparse_update: from the sparse gradient node starting to the tables and optimizer state being
  ready. Ours: dispatch to done, stamped by a waiter thread (plain loop: GIL switch interval
  0.5 ms so the stamp is not late; pipelined: default interval, since the pipeline's own thread
  competes for the GIL too), overlapping the dense SGD step and the next batch's preparation;
  TorchRec: synchronous, and it includes the bottom MLP's backward, which autograd runs after it.
- device_wait (ours): from the previous step's update being done to this step's lookup being
  dispatched, 0 when the update was still running. TorchRec on CPU is synchronous: its
  host_prep_critical is its device wait.

Fairness checks printed with the figures: the machine-quietness probe (`quietness_probe`:
pooled lookup with 1 vs 2 torch threads in a fresh process, before and after; figures are VOID
when 2 threads are not under 0.85x the 1-thread time), and TorchRec's two sides timed alone
in a fresh process, the same rounds, next to their time in this harness (must match within 15%,
else the Markdown says HARNESS CHECK FAILED).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import itertools
import json
import os
import pathlib
import queue
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np
import torch

from benchmarks import report
from benchmarks.timing import interleaved, paired_ratio, summarize

__all__ = ["main", "quietness_probe", "run"]

ROOT = pathlib.Path(__file__).resolve().parent.parent
PAIRS = {
    "plain": ("hybridrec plain", "torchrec plain"),
    "pipelined": ("hybridrec pipeline", "torchrec pipeline"),
}
SEGMENTS = ("host_prep", "host_prep_critical", "lookup", "dense", "sparse_update", "device_wait")
QUIET_RATIO = 0.85  # 2 threads must take under this fraction of the 1-thread time
ALONE_TOLERANCE = 0.15  # TorchRec in the harness vs alone
LR = 0.01
PAUSE_S = 0.05  # before every side's round, untimed: idle thread pools of the last side go quiet
now = time.perf_counter


# -- workload and batches -----------------------------------------------------------------------
def _workload(tiny: bool) -> dict:
    if tiny:
        return dict(
            T=3, E=500, D=16, B=64, L=4, n_dense=13, steps=2, rounds=3, warmup_rounds=1, pool=3
        )
    return dict(
        T=8, E=100_000, D=64, B=2048, L=20, n_dense=13, steps=5, rounds=9, warmup_rounds=1, pool=4
    )


def _batch_pool(w: dict, seed: int = 0) -> list[tuple]:
    """`w["pool"]` loader items `(dense [B, n_dense], (keys, values, lengths), labels [B])`:
    exactly L uniform ids per bag (W1), bags key-major as TorchRec lays them out."""
    rng = np.random.default_rng(seed)
    keys = [f"f{i}" for i in range(w["T"])]
    items = []
    for _ in range(w["pool"]):
        lengths = torch.full((w["T"] * w["B"],), w["L"], dtype=torch.int64)
        values = torch.from_numpy(rng.integers(0, w["E"], size=w["T"] * w["B"] * w["L"]))
        dense = torch.from_numpy(rng.normal(size=(w["B"], w["n_dense"])).astype(np.float32))
        labels = torch.from_numpy((rng.random(w["B"]) < 0.3).astype(np.float32))
        items.append((dense, (keys, values, lengths), labels))
    return items


def _bce(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.binary_cross_entropy_with_logits(logits.squeeze(-1), labels)


def _jax_state(model) -> tuple:
    """What a step's asynchronous JAX work ends in: the tables and the optimizer state."""
    return (model.sparse_params, model.sparse_opt_state)


# -- the machine-quietness probe (PERF_NOTES: "Contention on 2 cores") ----------------------------
def _probe_child(rows: int, bags: int, L: int, repeats: int) -> None:
    """In a fresh process: the same pooled lookup with 1 and with 2 torch threads, interleaved."""
    rng = np.random.default_rng(0)
    table = torch.from_numpy(rng.standard_normal((rows, 64), dtype=np.float32))
    ids = torch.from_numpy(rng.integers(0, rows, bags * L))
    offsets = torch.arange(0, bags * L, L)

    def case(threads: int):
        def one():
            torch.set_num_threads(threads)
            t0 = now()
            torch.nn.functional.embedding_bag(ids, table, offsets, mode="sum")
            return {"total": now() - t0}

        return one

    samples = interleaved({"1": case(1), "2": case(2)}, warmup=2, repeats=repeats)
    med = {k: float(np.median(v["total"])) for k, v in samples.items()}
    print(json.dumps({"one_thread_ms": med["1"] * 1e3, "two_threads_ms": med["2"] * 1e3}))


def _child_env(**extra: str) -> dict:
    env = {
        k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT", "XLA_FLAGS")
    }
    env.update(PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu", **extra)
    return env


def competitor_alone(module: str, side: str, argv) -> dict:
    """`python -m <module> --side <side> <the same arguments>` in a fresh process: the
    competitor timed by itself, with nothing of ours in the process (its last stdout line
    is JSON)."""
    passed = sys.argv[1:] if argv is None else list(argv)
    proc = subprocess.run(
        [sys.executable, "-m", module, "--side", side, *passed],
        capture_output=True,
        text=True,
        check=True,
        timeout=3600,  # a wedged competitor fails the run instead of hanging it
    )
    return json.loads(proc.stdout.strip().splitlines()[-1])


def quietness_line(before: dict, after: dict) -> str:
    """The line a benchmark prints about the probes taken before and after its timings."""
    quiet = before["quiet"] and after["quiet"]
    return (
        f"quietness probe (2 threads / 1 thread, < {QUIET_RATIO} is quiet): before {before['ratio_2_over_1']:.2f}, "
        f"after {after['ratio_2_over_1']:.2f}"
        + ("" if quiet else ": NOT QUIET, the figures below are void")
    )


def quietness_probe(
    rows: int = 800_000, bags: int = 16_384, L: int = 20, repeats: int = 11
) -> dict:
    """Pooled `embedding_bag` (W1-sized by default) with 1 and 2 torch threads, in a fresh
    subprocess. `quiet` is False when 2 threads are not under 0.85x the 1-thread time: another
    process is loading the cores, and timings taken now are void."""
    code = f"from benchmarks.e2e_step import _probe_child; _probe_child({rows}, {bags}, {L}, {repeats})"
    proc = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env=_child_env(),
        capture_output=True,
        text=True,
        timeout=600,
        check=True,
    )
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    out["ratio_2_over_1"] = out["two_threads_ms"] / out["one_thread_ms"]
    out["quiet"] = out["ratio_2_over_1"] < QUIET_RATIO
    out["loadavg"] = list(os.getloadavg())
    return out


def _probe_for(w: dict, tiny: bool) -> dict:
    """W1's pooled lookup; for --tiny a smaller one that still gains from a second thread."""
    if tiny:
        return quietness_probe(rows=200_000, bags=4096, L=20)
    return quietness_probe(rows=w["T"] * w["E"], bags=w["T"] * w["B"], L=w["L"])


# -- step clocks ---------------------------------------------------------------------------------
class _ReadyWaiter:
    """For one round: a thread that waits for each step's JAX state and stamps `ready` when it
    is, so the loop never blocks. Safe against donation: the next update donates a step's
    buffers only after the next lookup has read them, i.e. after they were ready."""

    def __enter__(self) -> _ReadyWaiter:
        self._jobs: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._jobs.put(None)
        self._thread.join()

    def _serve(self) -> None:
        import jax

        while (job := self._jobs.get()) is not None:
            record, arrays = job
            try:
                jax.block_until_ready(arrays)
                record["ready"] = now()
            except RuntimeError:  # deleted (donated) before this thread got to it: no stamp
                pass
            del job, arrays

    def submit(self, record: dict, arrays) -> None:
        self._jobs.put((record, arrays))


class _StepClock:
    """Timestamps of one round's steps, set by the loop (`start`, `prepared`, `end`), by hooks
    (`call`, `lookup_start`, `lookup_done`, `grad`, `dispatched`) and by the waiter (`ready`)."""

    def __init__(self):
        self.steps: list[dict[str, float]] = []

    def start(self) -> None:
        self.steps.append({"start": now()})

    def mark(self, name: str) -> None:
        if self.steps:
            self.steps[-1][name] = now()

    def take(self) -> list[dict[str, float]]:
        steps, self.steps = self.steps, []
        return steps


def _diff(step: dict, late: str, early: str) -> float | None:
    return step[late] - step[early] if late in step and early in step else None


def _step_segments(step: dict) -> dict[str, float | None]:
    lookup_start = step.get("lookup_start", step.get("call"))
    before_lookup = (
        lookup_start - step["call"] if lookup_start is not None and "call" in step else None
    )
    parts = [before_lookup, _diff(step, "grad", "lookup_done"), _diff(step, "end", "dispatched")]
    prep = _diff(step, "prepared", "start")
    return {
        "host_prep": prep,
        "host_prep_critical": prep,
        "lookup": None
        if lookup_start is None or "lookup_done" not in step
        else step["lookup_done"] - lookup_start,
        "dense": None if None in parts else sum(parts),
        "sparse_update": _diff(step, "ready", "grad"),
    }


def _mean(xs: list) -> float | None:
    xs = [x for x in xs if x is not None]
    return float(np.mean(xs)) if xs else None


def _round_segments(steps: list[dict], device_wait: bool) -> dict[str, float]:
    """Means over a round's steps; device_wait from consecutive steps of the round."""
    per_step = [_step_segments(s) for s in steps]
    out = {k: _mean([p[k] for p in per_step]) for k in per_step[0]} if per_step else {}
    if device_wait:
        gaps = [
            max(0.0, b["call"] - a["ready"]) if "call" in b and "ready" in a else None
            for a, b in itertools.pairwise(steps)
        ]
        out["device_wait"] = _mean(gaps)
    return {k: v for k, v in out.items() if v is not None}


def _grad_node_hooks(tensor: torch.Tensor, clock: _StepClock) -> None:
    """Stamp `grad` when autograd starts the node that made `tensor`, `dispatched` when it returns."""
    node = tensor.grad_fn
    if node is not None:
        node.register_prehook(lambda grads: clock.mark("grad"))
        node.register_hook(lambda grads_in, grads_out: clock.mark("dispatched"))


def _hybrid_hooks(model, clock: _StepClock) -> None:
    def on_dense(module, args):
        clock.mark("lookup_done")
        _grad_node_hooks(args[1].values(), clock)

    model.register_forward_pre_hook(lambda module, args: clock.mark("call"))
    model.dense.register_forward_pre_hook(on_dense)


def _torchrec_hooks(dmp, clock: _StepClock) -> None:
    def on_sparse_done(module, args, out):
        clock.mark("lookup_done")
        _grad_node_hooks(out, clock)

    sparse_arch = dmp.module.sparse_arch
    dmp.register_forward_pre_hook(lambda module, args: clock.mark("call"))
    sparse_arch.register_forward_pre_hook(lambda module, args: clock.mark("lookup_start"))
    sparse_arch.register_forward_hook(on_sparse_done)


@contextlib.contextmanager
def _fine_switch_interval(seconds: float = 5e-4):
    """The waiter thread needs the GIL to stamp `ready`: ask for it at 0.5 ms, not 5 ms."""
    old = sys.getswitchinterval()
    sys.setswitchinterval(seconds)
    try:
        yield
    finally:
        sys.setswitchinterval(old)


# -- hybridrec sides -------------------------------------------------------------------------------
def _hybrid_plain_case(model, opt, items, n: int):
    import jax

    clock = _StepClock()
    _hybrid_hooks(model, clock)

    def one_round() -> dict[str, float]:
        with _fine_switch_interval(), _ReadyWaiter() as waiter:
            t0 = now()
            for _ in range(n):
                dense, sparse, labels = next(items)
                clock.start()
                prepared = jax.block_until_ready(model.prepare(sparse))
                clock.mark("prepared")
                loss = _bce(model(dense, prepared), labels)
                opt.zero_grad()
                loss.backward()
                opt.step()
                clock.mark("end")
                waiter.submit(clock.steps[-1], _jax_state(model))
            jax.block_until_ready(_jax_state(model))
            total = now() - t0
        return {"step": total / n, **_round_segments(clock.take(), device_wait=True)}

    return one_round


def _pipeline_stats(pipeline) -> dict[str, float]:
    """The `hybrid.PipelineStats` counters a round reads (cumulative)."""
    return {k: float(getattr(pipeline.stats, k)) for k in ("wait_s", "prepare_s", "steps")}


def _per_step(before: dict, after: dict, counter: str) -> float:
    return (after[counter] - before[counter]) / max(after["steps"] - before["steps"], 1.0)


def _settle(pipeline, timeout_s: float = 10.0) -> None:
    """Outside the clock: let the pipeline finish preparing its look-ahead batch, so its
    background thread does not run into the next side's round."""
    deadline = now() + timeout_s
    while pipeline.stats.prepared < pipeline.stats.steps + 1 and now() < deadline:
        time.sleep(1e-3)


def _hybrid_pipeline_case(pipeline, model, items, n: int):
    import jax

    clock = _StepClock()
    _hybrid_hooks(model, clock)

    def one_round() -> dict[str, float]:
        with (
            _ReadyWaiter() as waiter
        ):  # default switch interval: the pipeline's own thread runs too
            before = _pipeline_stats(pipeline)
            t0 = now()
            for _ in range(n):
                clock.start()
                pipeline.progress(items)
                clock.mark("end")
                waiter.submit(clock.steps[-1], _jax_state(model))
            jax.block_until_ready(_jax_state(model))
            total = now() - t0
        # after the look-ahead batch is ready: the round's n steps submitted exactly n batches
        # (the first one it ran was prepared before t0), so prepare_s covers all n of them
        _settle(pipeline)
        after = _pipeline_stats(pipeline)
        return {
            "step": total / n,
            **_round_segments(clock.take(), device_wait=True),
            "host_prep": _per_step(before, after, "prepare_s"),
            "host_prep_critical": _per_step(before, after, "wait_s"),
        }

    return one_round


def _hybrid_sides(w: dict, gate: dict, pool: list) -> tuple[dict, dict]:
    """{name: round case} for our sides (plain: the gate's model; the pipeline, when the tree has
    it, on a fresh one) and {name: why skipped}. The pipeline's first loss must be the gate's."""
    import hybrid
    from benchmarks import e2e_vs_torchrec as e2e

    plain = _hybrid_plain_case(gate["model"], gate["opt_ours"], itertools.cycle(pool), w["steps"])
    cases = {"hybridrec plain": plain}
    pipeline_type = getattr(hybrid, "TrainPipeline", None)
    if pipeline_type is None:
        return cases, {"hybridrec pipeline": "hybrid.TrainPipeline is not in this tree yet"}
    model_p, opt_p = e2e._our_side(w, LR, gate["start"])
    pipeline, items = pipeline_type(model_p, opt_p, _bce), itertools.cycle(pool)
    first = float(pipeline.progress(items))
    _check_close(
        "hybridrec pipeline's first loss vs the plain loop's",
        first,
        gate["first_losses"]["hybridrec"],
    )
    cases["hybridrec pipeline"] = _hybrid_pipeline_case(pipeline, model_p, items, w["steps"])
    cases["hybridrec pipeline"].close = pipeline.close
    return cases, {}


# -- TorchRec sides --------------------------------------------------------------------------------
def _torchrec_plain_case(dmp, opt, items, n: int):
    from torchrec import KeyedJaggedTensor

    clock = _StepClock()
    _torchrec_hooks(dmp, clock)

    def one_round() -> dict[str, float]:
        t0 = now()
        for _ in range(n):
            dense, (keys, values, lengths), labels = next(items)
            clock.start()
            kjt = KeyedJaggedTensor.from_lengths_sync(keys=keys, values=values, lengths=lengths)
            clock.mark("prepared")
            loss = _bce(dmp(dense, kjt), labels)
            opt.zero_grad()
            loss.backward()
            clock.mark("ready")  # synchronous on CPU: the fused update is done
            opt.step()
            clock.mark("end")
        total = now() - t0
        steps = clock.take()
        for s in steps:  # the sparse chain is the last of backward: after it, only the dense tail
            s["dispatched"] = s["ready"]
        return {"step": total / n, **_round_segments(steps, device_wait=False)}

    return one_round


@functools.cache
def _dmp_batch_type():
    """TorchRec's `Batch`, plus what TrainPipelineSparseDist's tracer needs to feed a model whose
    forward is `(dense_features, sparse_features)`: each argument is the batch field of its name."""
    from torch.fx._symbolic_trace import PHWithMeta
    from torchrec.datasets.utils import Batch

    class DmpBatch(Batch):
        def to(self, device: torch.device, non_blocking: bool = False) -> DmpBatch:
            moved = super().to(device, non_blocking)
            return DmpBatch(moved.dense_features, moved.sparse_features, moved.labels)

        def to_proxy_tuple(self, model) -> dict:  # noqa: ARG002 (TorchRec's signature)
            return {name: PHWithMeta(ph_key=name) for name in ("dense_features", "sparse_features")}

    return DmpBatch


class _DmpLoader:
    """The loader for TrainPipelineSparseDist: cycles `pool`, building each KJT when the pipeline
    draws the batch (on the main thread, inside `progress`); `prep_s` sums that time."""

    def __init__(self, pool: list):
        self._items, self._batch_type, self.prep_s = itertools.cycle(pool), _dmp_batch_type(), 0.0

    def __iter__(self) -> _DmpLoader:
        return self

    def __next__(self):
        from torchrec import KeyedJaggedTensor

        dense, (keys, values, lengths), labels = next(self._items)
        t0 = now()
        kjt = KeyedJaggedTensor.from_lengths_sync(keys=keys, values=values, lengths=lengths)
        self.prep_s += now() - t0
        return self._batch_type(dense, kjt, labels)


def _torchrec_pipeline(dmp, opt):
    from torchrec.distributed.train_pipeline import TrainPipelineSparseDist

    def model_fwd(batch):
        loss = _bce(dmp(batch.dense_features, batch.sparse_features), batch.labels)
        return loss, loss.detach()

    return TrainPipelineSparseDist(dmp, opt, torch.device("cpu"), custom_model_fwd=model_fwd)


def _torchrec_pipeline_case(pipeline, dmp, items, n: int):
    clock = _StepClock()
    _torchrec_hooks(dmp, clock)

    def one_round() -> dict[str, float]:
        prep0, t0 = items.prep_s, now()
        for _ in range(n):
            clock.start()
            pipeline.progress(items)
            clock.mark("end")
        total = now() - t0
        prep = (items.prep_s - prep0) / n  # synchronous on CPU: on the critical path
        out = {"step": total / n, "host_prep": prep, "host_prep_critical": prep}
        lookup = _mean([_diff(s, "lookup_done", "lookup_start") for s in clock.take()])
        return out if lookup is None else {**out, "lookup": lookup}

    return one_round


def _torchrec_sides(w: dict, pool: list, dmp=None, opt=None) -> tuple[dict, dict]:
    """{name: round case} for TorchRec's plain loop and TrainPipelineSparseDist (each its own DMP),
    and facts about the pipeline (its first loss, how many modules it pipelines)."""
    from benchmarks import e2e_vs_torchrec as e2e

    if dmp is None:
        dmp, opt, _ = e2e._torchrec_side(w, LR)
    dmp_p, opt_p, _ = e2e.torchrec_dmp(w, LR, 1)
    pipeline, items = _torchrec_pipeline(dmp_p, opt_p), _DmpLoader(pool)
    first = float(pipeline.progress(items))
    info = {
        "first_loss": first,
        "pipelined_modules": len(getattr(pipeline, "_pipelined_modules", [])),
    }
    cases = {
        "torchrec plain": _torchrec_plain_case(dmp, opt, itertools.cycle(pool), w["steps"]),
        "torchrec pipeline": _torchrec_pipeline_case(pipeline, dmp_p, items, w["steps"]),
    }
    return cases, info


# -- the gate --------------------------------------------------------------------------------------
def _check_close(what: str, ours: float, theirs: float, rtol: float = 1e-4) -> float:
    err = abs(ours - theirs) / max(abs(theirs), 1e-12)
    if err > rtol:
        raise RuntimeError(
            f"correctness gate failed: {what}: {ours!r} vs {theirs!r} (relative error {err:.2e})"
        )
    return err


def _gate(w: dict, pool: list) -> dict:
    """Two plain steps on both sides from the same start: same losses and tables. Returns both
    models and optimizers (they are then timed as the plain sides), the start and the errors."""
    from benchmarks import e2e_vs_torchrec as e2e

    dmp, opt_t, start = e2e._torchrec_side(w, LR)
    model, opt_o = e2e._our_side(w, LR, start)
    losses = []
    for dense, sparse, labels in pool[:2]:
        keys, values, lengths = sparse
        batch = (keys, values, lengths, dense, labels)
        losses.append(
            (
                float(e2e._step_ours(model, opt_o, batch)),
                float(e2e._step_torchrec(dmp, opt_t, batch)),
            )
        )
    theirs = e2e._tables_of_dmp(dmp)
    ours = {k: v.numpy() for k, v in model.table_weights().items()}
    table_err = max(
        float(np.abs(ours[k] - theirs[k]).max() / (np.abs(theirs[k]).max() + 1e-12)) for k in theirs
    )
    loss_err = max(_check_close("plain-loop loss", a, b) for a, b in losses)
    if table_err > 1e-4:
        raise RuntimeError(
            f"correctness gate failed: tables after 2 steps differ by {table_err:.2e} (relative)"
        )
    return {
        "dmp": dmp,
        "opt": opt_t,
        "model": model,
        "opt_ours": opt_o,
        "start": start,
        "errors": {"loss_rel_err": loss_err, "table_rel_err": table_err},
        "first_losses": {"hybridrec": losses[0][0], "torchrec": losses[0][1]},
    }


# -- TorchRec alone, in a fresh process ---------------------------------------------------------------
def _after_pause(case):
    def paused() -> dict[str, float]:
        time.sleep(PAUSE_S)  # the case starts its own clock after this
        return case()

    return paused


def _rounds(cases: dict, w: dict) -> dict:
    """Interleaved rounds (order rotated per round), the same in the harness and alone."""
    paused = {name: _after_pause(case) for name, case in cases.items()}
    return interleaved(paused, warmup=w["warmup_rounds"], repeats=w["rounds"])


def _torchrec_alone_child(
    tiny: bool, threads: int, out: str, rounds: int | None, steps: int | None
) -> None:
    torch.set_num_threads(threads)
    w = _configured(tiny, rounds, steps)
    pool = _batch_pool(w)
    cases, _ = _torchrec_sides(w, pool)
    samples = _rounds(cases, w)
    pathlib.Path(out).write_text(json.dumps({k: v["step"] for k, v in samples.items()}))
    del cases
    import torch.distributed as dist

    if (
        dist.is_initialized()
    ):  # a gloo group left to interpreter exit can abort it ("terminate called ...")
        dist.destroy_process_group()


def _torchrec_alone(
    tiny: bool, threads: int, rounds: int | None, steps: int | None
) -> dict[str, list[float]]:
    with tempfile.TemporaryDirectory() as tmp:
        out = pathlib.Path(tmp, "alone.json")
        code = (
            f"from benchmarks.e2e_step import _torchrec_alone_child; "
            f"_torchrec_alone_child({tiny}, {threads}, {str(out)!r}, {rounds!r}, {steps!r})"
        )
        subprocess.run(
            [sys.executable, "-c", code],
            cwd=ROOT,
            check=True,
            timeout=1800,
            env=_child_env(),  # (one process: its gloo group needs no port)
        )
        return json.loads(out.read_text())


def _alone_vs_harness(alone: dict[str, list[float]], samples: dict) -> dict:
    out = {}
    for side, times in alone.items():
        harness, solo = float(np.median(samples[side]["step"])), float(np.median(times))
        out[side] = {
            "harness_ms": harness * 1e3,
            "alone_ms": solo * 1e3,
            "harness_over_alone": harness / solo,
            "within_tolerance": abs(harness / solo - 1.0) <= ALONE_TOLERANCE,
        }
    return out


# -- summary and files --------------------------------------------------------------------------------
def _side_summary(rounds: dict[str, list[float]], B: int) -> dict:
    step = summarize(rounds["step"])
    out = {"step": step, "samples_per_s": B / (step["median_ms"] / 1e3)}
    out["segments_ms"] = {k: summarize(rounds[k])["median_ms"] for k in SEGMENTS if rounds.get(k)}
    return out


def _fastest(samples: dict, prefix: str) -> str:
    return min(
        (s for s in samples if s.startswith(prefix)), key=lambda s: np.median(samples[s]["step"])
    )


def _ratios(samples: dict) -> dict:
    out = {}
    for name, (ours, theirs) in PAIRS.items():
        if ours in samples and theirs in samples:
            out[name] = paired_ratio(samples[ours]["step"], samples[theirs]["step"])
    best = (_fastest(samples, "hybridrec"), _fastest(samples, "torchrec"))
    out["best vs best"] = {
        "sides": list(best),
        **paired_ratio(samples[best[0]]["step"], samples[best[1]]["step"]),
    }
    return out


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f}"


def _verdict(r: dict) -> str:
    out = ""
    if not r["valid"]:
        out += " **VOID: the machine was not quiet (see the probe); do not use these figures.**"
    if not r["harness_fair"]:
        out += " **HARNESS CHECK FAILED: TorchRec's time here differs from its time alone by over 15%.**"
    return out


def _header(r: dict) -> list[str]:
    w, probe, m = r["workload"], r["probe"], r["machine"]
    probes = ", ".join(
        f"{k} {v['ratio_2_over_1']:.2f}x ({v['two_threads_ms']:.2f} / {v['one_thread_ms']:.2f} ms)"
        for k, v in probe.items()
    )
    return [
        f"# One DLRM training step: hybridrec vs TorchRec DMP{_verdict(r)}",
        "",
        f"Workload: T={w['T']} E={w['E']} D={w['D']} B={w['B']} L={w['L']} (uniform ids), "
        f"n_dense={w['n_dense']}; {w['rounds']} interleaved rounds of {w['steps']} steps per side "
        f"after {w['warmup_rounds']} warm-up round(s); medians over rounds. torch threads "
        f"{r['config']['torch_threads']}. Load average {m['loadavg_start'][0]:.2f} at start, "
        f"{m['loadavg_end'][0]:.2f} at end. Command: `{r['command']}`.",
        "Quietness probe (pooled lookup, 2 threads / 1 thread, fresh process; quiet when < "
        f"{QUIET_RATIO}): {probes}.",
        f"Gate: plain-loop losses rel err {r['gate']['loss_rel_err']:.1e}, tables "
        f"{r['gate']['table_rel_err']:.1e}; each pipeline's first loss matches its plain loop's.",
    ]


def _sides_table(r: dict) -> list[str]:
    lines = [
        "| side | step ms [IQR] | samples/s | host prep | prep on critical path | lookup | dense "
        "| sparse update | device waits for host |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for side, s in r["sides"].items():
        seg, st = s["segments_ms"], s["step"]
        lines.append(
            f"| {side} | {st['median_ms']:.1f} [{st['p25_ms']:.1f}-{st['p75_ms']:.1f}] | "
            f"{s['samples_per_s']:.0f} | " + " | ".join(_ms(seg.get(k)) for k in SEGMENTS) + " |"
        )
    lines += [f"| {side} | skipped: {why} | | | | | | | |" for side, why in r["skipped"].items()]
    return lines


def _ratios_table(r: dict) -> list[str]:
    lines = [
        "| ours / TorchRec (step time) | ratio of medians | paired median [IQR] |",
        "|---|---|---|",
    ]
    for name, q in r["ratios"].items():
        label = name if name != "best vs best" else f"best vs best ({' / '.join(q['sides'])})"
        lines.append(
            f"| {label} | {q['ratio_of_medians']:.2f}x | {q['paired_median']:.2f} "
            f"[{q['paired_p25']:.2f}-{q['paired_p75']:.2f}] |"
        )
    return lines


def _alone_table(r: dict) -> list[str]:
    lines = [
        f"TorchRec in this harness vs alone in a fresh process (must match within {ALONE_TOLERANCE:.0%}):",
        "",
        "| side | in harness ms | alone ms | harness / alone | within tolerance |",
        "|---|---|---|---|---|",
    ]
    for side, a in r["torchrec_alone"].items():
        ok = "yes" if a["within_tolerance"] else "**NO**"
        lines.append(
            f"| {side} | {a['harness_ms']:.1f} | {a['alone_ms']:.1f} | "
            f"{a['harness_over_alone']:.2f} | {ok} |"
        )
    return lines


def _markdown(r: dict) -> str:
    footer = (
        f"TorchRec's pipeline pipelined {r['torchrec_pipeline']['pipelined_modules']} sharded "
        "module(s). Segments (ms per step): see the docstring of `benchmarks/e2e_step.py`."
    )
    parts = [_header(r), _sides_table(r), _ratios_table(r), _alone_table(r), [footer]]
    return "\n\n".join("\n".join(p) for p in parts) + "\n"


def _write(result: dict, out_dir, tiny: bool) -> None:
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    name = "e2e_step_tiny" if tiny else "e2e_step"
    (out / f"{name}.json").write_text(json.dumps(result, indent=2))
    (out / f"{name}.md").write_text(_markdown(result))


# -- run ------------------------------------------------------------------------------------------------
def _configured(tiny: bool, rounds: int | None, steps: int | None) -> dict:
    w = _workload(tiny)
    w.update({k: v for k, v in (("rounds", rounds), ("steps", steps)) if v is not None})
    return w


def _harness(w: dict, pool: list) -> dict:
    """Gate, build the four sides, run the interleaved rounds."""
    gate = _gate(w, pool)
    first = gate["first_losses"]
    theirs, tr_info = _torchrec_sides(w, pool, gate["dmp"], gate["opt"])
    _check_close(
        "TorchRec pipeline first loss vs its plain loop", tr_info["first_loss"], first["torchrec"]
    )
    ours, skipped = _hybrid_sides(w, gate, pool)
    try:
        samples = _rounds({**ours, **theirs}, w)
    finally:
        for case in ours.values():
            getattr(case, "close", lambda: None)()
    return {
        "gate": gate["errors"],
        "samples": samples,
        "skipped": skipped,
        "torchrec_pipeline": tr_info,
    }


def run(
    tiny: bool = False,
    out_dir: str | os.PathLike | None = None,
    *,
    rounds: int | None = None,
    steps: int | None = None,
    command: str | None = None,
) -> dict:
    from benchmarks.xla_vs_fbgemm import machine_info, versions

    t_start, threads = now(), int(os.environ.get("HYBRIDREC_TORCH_THREADS", "2"))
    w, machine = _configured(tiny, rounds, steps), machine_info()
    probe = {"before": _probe_for(w, tiny)}
    alone = _torchrec_alone(tiny, threads, rounds, steps)
    prev_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        h = _harness(w, _batch_pool(w))
    finally:
        torch.set_num_threads(prev_threads)
    probe["after"] = _probe_for(w, tiny)
    machine["loadavg_end"] = list(os.getloadavg())
    fairness = _alone_vs_harness(alone, h["samples"])
    result = {
        "workload": w,
        "config": {"torch_threads": threads, "lr": LR, "pause_s": PAUSE_S},
        "machine": machine,
        "versions": versions(),
        "command": command
        or f"benchmarks.e2e_step.run(tiny={tiny}, rounds={rounds}, steps={steps})",
        "probe": probe,
        "valid": all(p["quiet"] for p in probe.values()),
        "gate": h["gate"],
        "sides": {k: _side_summary(v, w["B"]) for k, v in h["samples"].items()},
        "ratios": _ratios(h["samples"]),
        "torchrec_alone": fairness,
        "harness_fair": all(a["within_tolerance"] for a in fairness.values()),
        "torchrec_pipeline": h["torchrec_pipeline"],
        "skipped": h["skipped"],
        "samples_s": h["samples"],
        "elapsed_s": now() - t_start,
    }
    _write(
        result, out_dir or report.fresh_run_dir("e2e_step"), tiny
    )  # None: a fresh runs/bench/ directory
    return result


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", help="a seconds-long smoke run")
    report.add_output_args(parser, "e2e_step")
    parser.add_argument(
        "--rounds", type=int, default=None, help="interleaved rounds (default 9; tiny 3)"
    )
    parser.add_argument(
        "--steps", type=int, default=None, help="steps per side per round (default 5; tiny 2)"
    )
    args = parser.parse_args(argv)
    out = report.output_dir(parser, args, "e2e_step")
    command = " ".join(["python -m benchmarks.e2e_step", *(sys.argv[1:] if argv is None else argv)])
    result = run(args.tiny, out, rounds=args.rounds, steps=args.steps, command=command)
    print(_markdown(result))
    print(f"results: {out}")


if __name__ == "__main__":
    from hybrid._cpu_env import reexec_with_hugepages

    reexec_with_hugepages()  # XLA:CPU's fresh buffers in huge pages, both sides alike
    main()
