"""A dead process takes the job down within seconds (hybrid.training._watchdog), with or without torchrun."""

import os
import pathlib
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from hybrid.training._distributed import free_master_port
from hybrid.training._watchdog import EXIT_ERROR, EXIT_PEER_LOST, Watchdog

ROOT = pathlib.Path(__file__).resolve().parents[1]

# what `python -m hybrid.train` does around the watchdog, with training replaced by a loop of
# cross-process collectives (torch gloo all-reduce and a JAX cross-process sum), the calls a
# survivor blocks in when its peer dies
WORKER = textwrap.dedent(
    """
    import os, pathlib, sys, time
    import numpy as np, torch, torch.distributed as dist, jax
    from jax.sharding import NamedSharding, PartitionSpec as P
    import hybrid
    from hybrid.training._watchdog import start_watchdog

    steps, out = int(sys.argv[1]), pathlib.Path(sys.argv[2])
    env = hybrid.init_distributed()
    watchdog = start_watchdog(env)
    (out / f"pid{env.rank}").write_text(str(os.getpid()))
    mesh = hybrid.make_mesh("data=2")
    total = jax.jit(lambda a: a.sum())
    for step in range(steps):
        t = torch.tensor([1.0])
        dist.all_reduce(t)
        x = jax.make_array_from_process_local_data(
            NamedSharding(mesh, P("data")), np.ones((2, 2), np.float32)
        )
        assert float(total(x).addressable_data(0)) == 8.0
        if step == 2:
            (out / f"training{env.rank}").write_text("")
        time.sleep(0.01)
    watchdog.finish()
    print("finished", env.rank, flush=True)
    """
)


def _base_env(watchdog_s: float = 5) -> dict:
    """The workers' environment: a 5 s watchdog where a test waits for a dead peer to be
    noticed, a long one where nothing may be reported (a busy machine can hold a beat)."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update(
        JAX_PLATFORMS="cpu",
        XLA_FLAGS="--xla_force_host_platform_device_count=1",
        PYTHONPATH=str(ROOT),
        HYBRIDREC_WATCHDOG_TIMEOUT=str(watchdog_s),
    )
    return env


def _wait_for(paths, procs, timeout=180.0):
    deadline = time.monotonic() + timeout
    while not all(p.exists() for p in paths):
        for proc in procs:
            if proc.poll() is not None:
                out, err = proc.communicate()
                pytest.fail(f"exited early ({proc.returncode}): {err[-3000:]}")
        if time.monotonic() > deadline:
            for proc in procs:
                proc.kill()
            pytest.fail("workers did not start training")
        time.sleep(0.05)


def _exit_within(proc, seconds: float) -> tuple[int, str, float]:
    start = time.monotonic()
    try:
        _, err = proc.communicate(timeout=seconds)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, err = proc.communicate()
        pytest.fail(f"still running {seconds} s after its peer was killed: {err[-3000:]}")
    return proc.returncode, err, time.monotonic() - start


def _explicit(tmp_path, steps, watchdog_s: float = 5):
    port = free_master_port()
    procs = []
    for rank in range(2):
        env = _base_env(watchdog_s)
        env.update(
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE="2",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
        )
        procs.append(
            subprocess.Popen(
                [sys.executable, "-c", WORKER, str(steps), str(tmp_path)],
                cwd=ROOT,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    return procs


@pytest.mark.multiprocess
@pytest.mark.parametrize("victim", [1, 0])
def test_without_torchrun_the_survivor_exits(tmp_path, victim):
    procs = _explicit(tmp_path, steps=10**9)
    _wait_for([tmp_path / "training0", tmp_path / "training1"], procs)
    procs[victim].send_signal(signal.SIGKILL)
    procs[victim].communicate()  # reaps it and closes its pipes
    code, err, took = _exit_within(procs[1 - victim], 120)
    # EXIT_PEER_LOST, or EXIT_ERROR where the collective failed first (gloo: connection reset)
    assert code != 0, err[-3000:]
    # the watchdog's line, or the sentinel's where JAX aborted first (rank 0's coordinator died)
    assert f"rank {victim} (pid" in err and f"hybridrec: rank {1 - victim}" in err, err[-3000:]
    said = [line for line in err.splitlines() if "hybridrec:" in line]
    print(f"rank {victim} killed: rank {1 - victim} exited {code} after {took:.1f} s: {said}")


@pytest.mark.multiprocess
def test_under_torchrun_the_job_exits(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node=2",
            f"--master-port={free_master_port()}",
            str(script),
            str(10**9),
            str(tmp_path),
        ],
        cwd=ROOT,
        env=_base_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    _wait_for([tmp_path / "training0", tmp_path / "training1"], [proc])
    os.kill(int((tmp_path / "pid1").read_text()), signal.SIGKILL)
    code, err, took = _exit_within(proc, 120)
    assert code != 0, err[-3000:]
    # the survivor's watchdog (or torchrun's report, should its SIGTERM come first)
    assert "rank 1" in err or "local_rank: 1" in err, err[-3000:]
    said = [line for line in err.splitlines() if "hybridrec:" in line or "local_rank" in line]
    print(f"rank 1 killed: torchrun exited {code} after {took:.1f} s: {said}")


@pytest.mark.multiprocess
def test_a_clean_end_is_not_a_failure(tmp_path):
    procs = _explicit(tmp_path, steps=5, watchdog_s=120)
    for rank, proc in enumerate(procs):
        out, err = proc.communicate(timeout=180)
        assert proc.returncode == 0, err[-3000:]
        assert f"finished {rank}" in out
        assert "hybridrec:" not in err, err[-3000:]


# --- the decision logic, with a fake store and a fake clock ------------------------------------


class FakeStore:
    def __init__(self):
        self.data: dict[str, bytes] = {}

    def add(self, key, n):
        value = int(self.data.get(key, b"0")) + n
        self.data[key] = str(value).encode()
        return value

    def set(self, key, value):
        self.data[key] = value.encode() if isinstance(value, str) else value

    def get(self, key):
        return self.data[key]

    def check(self, keys):
        return all(k in self.data for k in keys)


class Clock:
    now = 100.0

    def __call__(self):
        return self.now


def _dogs(n=2, **kwargs):
    store, clock, exits, alive = FakeStore(), Clock(), [], {}
    dogs = [
        Watchdog(
            store,
            rank=r,
            world_size=n,
            timeout=5.0,
            clock=clock,
            alive=lambda pid, start: alive.get(pid, True),
            identity="host:1",
            exit=lambda msg, code: exits.append((msg, code)),
            **kwargs,
        )
        for r in range(n)
    ]
    return store, clock, exits, alive, dogs


def test_start_meets_every_peer_so_the_sentinel_can_name_one_that_dies_early():
    """`meet` (run by `start` before the loop) learns each peer's pid once it is announced,
    waiting a bounded time for late ones, and tells the sentinel of those on this host: a
    peer killed in the first steps is named even when JAX aborts this process first."""
    _, _, _, _, (a, b) = _dogs()
    told = []
    a._tell = told.append
    start = time.monotonic()
    assert not a.meet(0.2)  # b has not announced: gives up after the wait
    assert 0.2 <= time.monotonic() - start < 60 and told == []
    b.announce()
    assert a.meet(5.0)
    ((line,),) = [told]
    assert line.startswith(f"peer 1 {os.getpid()} host ")
    assert a.describe(1) == f"rank 1 (pid {os.getpid()} on host)"
    assert a.meet(0.0) and len(told) == 1  # learned once


def test_a_silent_peer_is_lost_after_the_timeout():
    store, clock, exits, _, (a, b) = _dogs()
    for _ in range(10):  # both beating: nothing happens
        assert a.step() and b.step()
        clock.now += 1
    assert exits == []
    for _ in range(5):  # b stops beating: a waits out the timeout ...
        assert a.step()
        clock.now += 1
    clock.now += 0.5
    assert not a.step()  # ... and exits
    ((msg, code),) = exits
    assert code == EXIT_PEER_LOST and msg.startswith("rank 0: rank 1") and "heartbeat" in msg
    assert b"rank 1" in store.get("hybridrec/watchdog/abort")  # told the other survivors


def test_a_dead_pid_on_this_host_is_lost_at_once():
    _, _, exits, alive, (a, b) = _dogs()
    b.store.set("hybridrec/watchdog/pid/1", "4242 host host:1 77")
    assert a.step()
    alive[4242] = False
    assert not a.step()
    assert exits == [("rank 0: rank 1 (pid 4242 on host) died", EXIT_PEER_LOST)]


def test_a_pid_on_another_host_is_judged_by_heartbeat_only():
    _, clock, exits, alive, (a, b) = _dogs()
    b.store.set("hybridrec/watchdog/pid/1", "4242 other other:1 77")
    alive[4242] = False
    for _ in range(3):
        assert a.step() and b.step()
        clock.now += 1
    assert exits == []


def test_an_abort_from_another_survivor_ends_this_one():
    store, _, exits, _, (a, b, c) = _dogs(3)
    store.set("hybridrec/watchdog/abort", "rank 2 died")
    assert not a.step()
    assert exits == [("rank 0: rank 2 died", EXIT_PEER_LOST)]


def test_an_unreachable_store_names_its_host():
    store, _, exits, _, (a, b) = _dogs()

    def broken(*args):
        raise ConnectionError("Connection reset")

    store.add = broken
    assert not a.step()
    ((msg, code),) = exits
    assert code == EXIT_PEER_LOST and "rank 0 is unreachable" in msg


def test_finished_peers_are_not_failures():
    store, clock, exits, _, (a, b) = _dogs()
    a.step(), b.step()
    b._finishing = True  # b's finish(): done, then it stops beating and exits
    store.add("hybridrec/watchdog/done/1", 1)
    for _ in range(20):
        clock.now += 1
        if not a.step():
            break
    assert exits == [] and not a._all_done.is_set()  # a itself is not done yet
    a._finishing = True
    store.add("hybridrec/watchdog/done/0", 1)
    assert not a.step() and a._all_done.is_set() and exits == []


def test_a_peer_that_ended_in_an_error_is_reported_unless_all_did():
    store, _, exits, _, (a, b) = _dogs()
    main_alive = {0: True, 1: False}
    a.main_thread_alive = lambda: main_alive[0]
    b.main_thread_alive = lambda: main_alive[1]
    a.step()
    assert b.step()  # b's main thread ended without finish(): b marks itself ended
    assert store.add("hybridrec/watchdog/ended/1", 0) == 1
    assert not a.step()
    assert exits == [("rank 0: rank 1 stopped after an error", EXIT_PEER_LOST)]
    # the same error on every rank: all end, nobody is reported, each keeps its own status
    store, _, exits, _, (a, b) = _dogs()
    a.main_thread_alive = b.main_thread_alive = lambda: False
    assert b.step() and not a.step() and not b.step()
    assert exits == []


def test_a_lost_peer_after_this_rank_ended_exits_with_the_error_status():
    store, clock, exits, _, (a, b) = _dogs()
    a.main_thread_alive = lambda: False
    a.step(), b.beat()  # (b would report a's error and exit: here it is lost silently)
    for _ in range(7):
        clock.now += 1
        if not a.step():
            break
    ((msg, code),) = exits
    assert code == EXIT_ERROR and "rank 1" in msg


def test_the_rank_whose_error_ended_the_job_is_not_told_of_itself():
    """Rank 1's main thread ends in an error; rank 0 reports it and exits. Rank 1 then reads
    the abort naming itself: it exits with the error status and says so, instead of
    'rank 1: rank 1 stopped after an error'; the first abort stays published."""
    store, _, exits, _, (a, b) = _dogs()
    b.main_thread_alive = lambda: False
    a.step(), b.step()
    assert not a.step()
    assert exits == [("rank 0: rank 1 stopped after an error", EXIT_PEER_LOST)]
    assert not b.step()
    assert exits[1] == (
        "rank 1: stopped after an error (its traceback is above); the other ranks were told to exit",
        EXIT_ERROR,
    )
    assert store.get("hybridrec/watchdog/abort") == b"rank 1 stopped after an error"


_SENTINEL_PROBE = """
import os, sys
sys.path.insert(0, sys.argv[1])
from hybrid.training._watchdog import Watchdog
from tests.test_dead_peer import FakeStore
dead = os.fork()
if dead == 0:
    os._exit(0)
os.waitpid(dead, 0)  # a peer on this host that is gone
store = FakeStore()
store.set("hybridrec/watchdog/pid/1", f"{dead} host host:1 1")  # its start time: not alive
if sys.argv[2] == "left":
    store.set("hybridrec/watchdog/exited/1", "1")  # it left through Python, saying why
dog = Watchdog(store, rank=0, world_size=2, identity="host:1", exit=lambda m, c: None)
dog.step = lambda: True  # the loop stays out of it: only the exit is judged
dog.start()  # with its sentinel, told of the peer
sys.exit(2)  # e.g. a refused resume
"""


@pytest.mark.parametrize("peer", ["left", "killed"])
def test_an_exit_through_python_names_only_a_peer_that_died(peer):
    """A process ending through Python's shutdown (here sys.exit(2), as a refused resume)
    says why itself: a peer that also left on purpose is not reported (both ranks refusing
    printed two false 'died' lines before), a killed one is named once, by the process itself
    (the sentinel is then told all is said)."""
    done = subprocess.run(
        [sys.executable, "-c", _SENTINEL_PROBE, str(ROOT), peer],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )  # (the sentinel shares stderr: run() returns once it has exited too)
    assert done.returncode == 2, done.stderr[-3000:]
    said = [line for line in done.stderr.splitlines() if "died" in line]
    if peer == "left":
        assert said == [], done.stderr
    else:
        assert len(said) == 1 and said[0].startswith("hybridrec: rank 0: rank 1 (pid "), said
