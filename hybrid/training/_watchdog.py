"""Dead-peer watchdog: when one process of a job dies, the others exit within seconds.

A process blocked in a collective (gloo, NCCL, JAX's cross-process all-reduce) waits for
a peer that will never come: under torchrun until the agent's SIGTERM-then-SIGKILL (30 s),
without torchrun until JAX's shutdown barrier gives up and aborts (minutes). A thread cannot
interrupt the blocked call, so the watchdog, a daemon thread started by
`start_watchdog()` right after `init_distributed()`, ends the process itself:

- every `interval` seconds it bumps `heartbeat/<rank>` in torch.distributed's TCPStore at
  MASTER_ADDR:MASTER_PORT (the torchrun agent's store, or rank 0's without torchrun), over
  its own connection, so no collective and no lock the main thread may hold is involved;
- it reads the peers' heartbeats; a peer is lost when its counter has not moved for
  `timeout` seconds, when its process is gone (same host and pid namespace: /proc says so,
  at once), or when it published `abort` (it saw a loss first, or its main thread ended in
  an error);
- an unreachable store means its host died: rank 0 without torchrun, the agent under it;
- on a loss it writes `hybridrec: rank R (pid P on HOST) ...; exiting` to stderr, publishes
  `abort` for the other survivors and calls `os._exit(EXIT_PEER_LOST)`.

`Watchdog.finish()` (the end of a successful run) marks `done/<rank>`, waits until every
rank is done -- still exiting if one dies first -- and stops the thread, so peers that
finish normally and exit are never reported. If the main thread ends without `finish()`
(an exception, an error return, SIGTERM), the watchdog marks `ended/<rank>`: peers still
running report that rank and exit (they are likely blocked in a collective it left); once
every peer is done or ended too (the same error everywhere) the process exits as it
would have, with its own status; if a peer is lost meanwhile it exits with status 1
rather than wait in JAX's shutdown barrier.

Some deaths are faster than the thread: when rank 0 dies, JAX's coordination client in
every other process aborts at once (SIGABRT, its log names no rank). So `start()` also
starts a sentinel, a tiny child Python process sharing stderr and reading a pipe from this
one: the watchdog tells it the peers' pids (those on this host) and "ok" when it exits on
purpose or through Python's own shutdown (a finished run, an error whose traceback says
why); at end of file without "ok" (this process died: SIGKILL, JAX's abort), the sentinel
writes which peer is dead, if one is. (torchrun's stop of a failed job, a signal to each
worker's process group, takes the sentinel along: torchrun's own summary names the rank.)

Environment: HYBRIDREC_WATCHDOG=0 turns it off; HYBRIDREC_WATCHDOG_TIMEOUT (seconds,
default 5) sets how long a silent heartbeat is tolerated.
"""

from __future__ import annotations

import atexit
import datetime
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable

__all__ = ["EXIT_PEER_LOST", "Watchdog", "start_watchdog"]

EXIT_PEER_LOST = 75  # this process exits because a peer was lost (EX_TEMPFAIL)
EXIT_ERROR = 1  # ... while its own main thread had already ended without finish()

_PREFIX = "hybridrec/watchdog"


def _identity() -> str:
    """Host and pid namespace: two processes with the same identity see each other's /proc."""
    try:
        ns = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        ns = 0
    return f"{socket.gethostname()}:{ns}"


def _start_time(pid: int) -> str | None:
    """The process's start time in clock ticks (field 22 of /proc/PID/stat), None if gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2 :].split()
    if fields[0] in ("Z", "X"):  # a zombie: dead, its parent has not reaped it yet
        return None
    return fields[19]


def pid_alive(pid: int, start_time: str) -> bool:
    """Whether the process PID that started at `start_time` still runs (on this host)."""
    return _start_time(pid) == start_time


# the sentinel: stdlib only; argv: this process's rank
_SENTINEL = r"""
import os, sys
def alive(pid, start):
    try:
        stat = open(f"/proc/{pid}/stat").read()
    except OSError:
        return False
    fields = stat[stat.rindex(")") + 2:].split()
    return fields[0] not in ("Z", "X") and fields[19] == start
rank, peers, ok = sys.argv[1], {}, False
for line in sys.stdin:
    word = line.split()
    if word and word[0] == "ok":
        ok = True
    elif word and word[0] == "peer":
        peers[word[1]] = (int(word[2]), word[3], word[4])
if not ok:
    for r, (pid, host, start) in sorted(peers.items(), key=lambda kv: int(kv[0])):
        if not alive(pid, start):
            os.write(2, f"hybridrec: rank {rank} ended: rank {r} (pid {pid} on {host}) died\n".encode())
"""


def _die(message: str, code: int) -> None:
    # os.write: no Python lock that a blocked main thread could hold
    try:
        os.write(2, f"hybridrec: {message}; exiting\n".encode())
    finally:
        os._exit(code)


class Watchdog:
    """Heartbeats of one process and the decision that a peer is lost (see module doc).

    `store` needs `add`, `set`, `get` and `check` (a torch.distributed Store). `clock`,
    `alive` (pid, start time -> bool), `identity` and `exit` are injectable for tests;
    `exit(message, code)` must not return in production.
    """

    def __init__(
        self,
        store,
        *,
        rank: int,
        world_size: int,
        interval: float = 1.0,
        timeout: float = 5.0,
        store_host: str = "rank 0",
        clock: Callable[[], float] = time.monotonic,
        alive: Callable[[int, str], bool] = pid_alive,
        identity: str | None = None,
        exit: Callable[[str, int], None] = _die,
        main_thread_alive: Callable[[], bool] = lambda: threading.main_thread().is_alive(),
    ):
        self.store, self.rank, self.world_size = store, rank, world_size
        self.interval, self.timeout, self.store_host = interval, timeout, store_host
        self.clock, self.alive, self.exit = clock, alive, exit
        self.main_thread_alive = main_thread_alive
        self.identity = _identity() if identity is None else identity
        self.peers = [r for r in range(world_size) if r != rank]
        self._last: dict[int, tuple[int, float]] = {}  # rank -> (counter, when it last moved)
        self._info: dict[int, tuple[int, str, str]] = {}  # rank -> (pid, identity, start)
        self._finishing = False  # finish() was called
        self._ended = False  # the main thread ended without finish()
        self._all_done = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._sentinel: subprocess.Popen | None = None

    def _key(self, name: str, rank: int | None = None) -> str:
        return f"{_PREFIX}/{name}" if rank is None else f"{_PREFIX}/{name}/{rank}"

    def describe(self, rank: int) -> str:
        info = self._info.get(rank)
        return f"rank {rank}" if info is None else f"rank {rank} (pid {info[0]} on {info[1]})"

    # --- one step of the loop (tests call these directly) ---------------------------------

    def announce(self) -> None:
        """Publish this process's pid, so peers on the same host can see it die at once."""
        pid = os.getpid()
        start = _start_time(pid) or ""
        hostname = self.identity.split(":")[0]
        self.store.set(self._key("pid", self.rank), f"{pid} {hostname} {self.identity} {start}")

    def beat(self) -> None:
        self.store.add(self._key("heartbeat", self.rank), 1)

    def check(self) -> str | None:
        """Read the peers; the reason to exit, or None. Sets `_all_done` once every rank is."""
        store = self.store
        if store.check([self._key("abort")]):
            reason = store.get(self._key("abort")).decode()
            mine = f"rank {self.rank}"
            if self._ended and (reason == mine or reason.startswith(mine + " ")):
                # a peer reported this rank's own error: it is not news to this rank
                return "stopped after an error (its traceback is above); the other ranks were told to exit"
            return reason
        now = self.clock()
        done = self._finishing or self._ended
        for r in self.peers:
            if store.add(self._key("done", r), 0):
                continue
            if store.add(self._key("ended", r), 0):
                if self._finishing or self._ended:
                    continue
                return f"{self.describe(r)} stopped after an error"
            done = False
            self._learn(r)
            if self._dead_here(r):
                return f"{self.describe(r)} died"
            count = store.add(self._key("heartbeat", r), 0)
            last = self._last.get(r)
            if last is None or count != last[0]:
                self._last[r] = (count, now)
            elif now - last[1] > self.timeout:
                return f"{self.describe(r)} stopped responding (no heartbeat for {now - last[1]:.1f} s)"
        if done:
            self._all_done.set()
        return None

    def _learn(self, r: int) -> None:
        """Peer r's pid, host and start time, once it has published them (and the sentinel
        told of a peer on this host)."""
        if r not in self._info and self.store.check([self._key("pid", r)]):
            pid, hostname, ident, start = self.store.get(self._key("pid", r)).decode().split(" ")
            self._info[r] = (int(pid), hostname, f"{ident} {start}")
            if ident == self.identity and start:
                self._tell(f"peer {r} {pid} {hostname} {start}")

    def meet(self, wait: float) -> bool:
        """Learn every peer's pid, waiting up to `wait` seconds (real time) for those not yet
        announced; True once all are known. Every rank announces right after
        `init_distributed`, so this takes milliseconds; without it a peer killed in the first
        steps could die before the loop's first read of it, and the sentinel (which names the
        dead peer when JAX aborts this process first) would not know whom to name."""
        deadline = time.monotonic() + wait
        while True:
            try:
                for r in self.peers:
                    self._learn(r)
            except Exception:  # noqa: BLE001 - an unreachable store: the loop reports it
                return False
            if all(r in self._info for r in self.peers):
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.02)

    def step(self) -> bool:
        """Beat, check, act. False once the watchdog should stop (every rank done)."""
        if not self._finishing and not self._ended and not self.main_thread_alive():
            self._ended = True
            try:
                self.store.add(self._key("ended", self.rank), 1)
            except Exception:  # noqa: BLE001 - the check below reports the store
                pass
        code = EXIT_ERROR if self._ended else EXIT_PEER_LOST
        try:
            self.beat()
            reason = self.check()
        except Exception as e:  # noqa: BLE001 - any store failure means its host is gone
            if self._all_done.is_set():
                return False
            # a dead store host on this machine is named as dead, not as unreachable
            lost = next((r for r in self.peers if self._dead_here(r)), None)
            if lost is not None:
                reason = f"{self.describe(lost)} died"
            else:
                reason = f"{self.store_host} is unreachable ({type(e).__name__}: {e}); it died"
            self.exit(f"rank {self.rank}: {reason}", code)
            return False
        if reason is not None:
            self._abort(reason)
            self.exit(f"rank {self.rank}: {reason}", code)
            return False
        return not self._all_done.is_set()

    def _dead_here(self, rank: int) -> bool:
        if not self._here(rank):
            return False
        pid, _, ident_start = self._info[rank]
        start = ident_start.split(" ")[1]
        return bool(start) and not self.alive(pid, start)

    def _tell(self, line: str) -> None:
        if self._sentinel is not None:
            try:
                self._sentinel.stdin.write(f"{line}\n".encode())
                self._sentinel.stdin.flush()
            except (OSError, ValueError):
                pass

    def _at_exit(self, wait: float = 1.0) -> None:
        """This process leaves through Python's shutdown: mark it (peers then know it left on
        purpose), name a peer on this host that died without leaving so (its death may be
        why this one ends, and JAX may abort this process next), then quiet the sentinel.

        A peer killed a moment ago may still be exiting (its sockets already closed, its
        /proc entry not yet a zombie), so each local peer neither gone nor marked is watched
        for up to `wait` seconds; one still running then is no news."""
        try:
            self.store.set(self._key("exited", self.rank), "1")
        except Exception:  # noqa: BLE001 - a store gone with its host (a dead rank 0)
            pass
        watched = [r for r in self.peers if self._here(r)]
        deadline = time.monotonic() + wait
        while watched:
            for r in list(watched):
                try:
                    left = self._left(r)
                except Exception:  # noqa: BLE001 - the store died with its host
                    left = False
                if left:
                    watched.remove(r)
                elif self._dead_here(r):
                    os.write(2, f"hybridrec: rank {self.rank}: {self.describe(r)} died\n".encode())
                    watched = []
                    break
            if not watched or time.monotonic() >= deadline:
                break
            time.sleep(0.02)
        self._tell("ok")

    def _here(self, rank: int) -> bool:
        """Whether `rank` is known to run on this host (its /proc entry can be read)."""
        info = self._info.get(rank)
        return info is not None and info[2].split(" ")[0] == self.identity

    def _left(self, rank: int) -> bool:
        """Whether `rank` left on purpose: finished, or exited through Python or this watchdog."""
        return bool(
            self.store.check([self._key("exited", rank)])
            or self.store.add(self._key("done", rank), 0)
        )

    def _abort(self, reason: str) -> None:
        """Publish `reason` for the other survivors, unless one was published first (the
        first is the root cause; a later one may only be this rank's echo of it), and mark
        this rank as leaving on purpose."""
        try:
            self.store.set(self._key("exited", self.rank), "1")
            if not self.store.check([self._key("abort")]):
                self.store.set(self._key("abort"), reason)
        except Exception:  # noqa: BLE001 - best effort; the exit is what matters
            pass

    # --- the thread ---------------------------------------------------------------------------

    def start(self, sentinel: bool = True) -> Watchdog:
        if sentinel and os.path.exists("/proc/self/stat"):
            self._sentinel = subprocess.Popen(
                [sys.executable, "-c", _SENTINEL, str(self.rank)],
                stdin=subprocess.PIPE,
                stdout=subprocess.DEVNULL,
            )
            # a process that exits through Python's own shutdown (a finished run, an error
            # with its traceback, sys.exit) says why itself: the sentinel is for the deaths
            # Python does not see (SIGKILL, JAX's abort). Run before JAX's shutdown.
            atexit.register(self._at_exit)
            real_exit = self.exit

            def exit(message: str, code: int) -> None:
                self._tell("ok")  # this process says why itself
                real_exit(message, code)

            self.exit = exit
        self.announce()
        self.beat()
        self.meet(self.timeout)
        self._thread = threading.Thread(target=self._run, name="hybridrec-watchdog", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set() and self.step():
            self._stop.wait(self.interval)
        if self._all_done.is_set():
            self._tell("ok")  # every rank done or ended: their exits are no news
        self._all_done.set()

    def finish(self) -> None:
        """This rank finished: wait until all have (exiting if one dies first), then stop."""
        self._finishing = True
        self.store.add(self._key("done", self.rank), 1)
        self._all_done.wait()
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2 * self.interval + 1)
        self._tell("ok")

    def stop(self) -> None:
        """Stop watching without the end-of-run handshake (tests)."""
        self._finishing = True
        self._stop.set()
        self._all_done.set()


def start_watchdog(env=None, *, interval: float = 1.0, timeout: float | None = None):
    """Start the watchdog for this process of the job `env` (a `DistributedEnv`; default:
    read from the environment). None for a single process or with HYBRIDREC_WATCHDOG=0."""
    import torch.distributed as dist

    from hybrid.training._distributed import read_torchrun_env

    env = read_torchrun_env() if env is None else env
    if env is None or os.environ.get("HYBRIDREC_WATCHDOG", "1") == "0":
        return None
    if timeout is None:
        timeout = float(os.environ.get("HYBRIDREC_WATCHDOG_TIMEOUT", "5"))
    torchrun = "TORCHELASTIC_RUN_ID" in os.environ
    store = dist.TCPStore(
        env.master_addr,
        env.master_port,
        is_master=False,
        timeout=datetime.timedelta(seconds=max(timeout, 2.0)),
        wait_for_workers=False,
    )
    # keys of an earlier run on torchrun's store (a restart) must not count
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    store = dist.PrefixStore(f"restart{restart}", store)
    host = (
        f"the torchrun agent's store at {env.master_addr}:{env.master_port}"
        if torchrun
        else (f"rank 0 (hosting the store at {env.master_addr}:{env.master_port})")
    )
    return Watchdog(
        store,
        rank=env.rank,
        world_size=env.world_size,
        interval=interval,
        timeout=timeout,
        store_host=host,
    ).start()
