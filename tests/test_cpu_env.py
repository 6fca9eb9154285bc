"""`hybrid._cpu_env`: the glibc tunable that puts XLA:CPU's per-call buffers in
transparent huge pages, and the re-execution that applies it from process start."""

import os
import subprocess
import sys

import pytest

from hybrid._cpu_env import HUGEPAGE_TUNABLE, _thp_mode, hugepage_env, started_as_module

FACTS = dict(thp_mode="madvise", glibc_ok=True)


def test_the_tunable_is_added_and_other_tunables_kept():
    assert hugepage_env({}, **FACTS)["GLIBC_TUNABLES"] == HUGEPAGE_TUNABLE
    env = hugepage_env({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2", "A": "1"}, **FACTS)
    assert env["GLIBC_TUNABLES"] == f"glibc.malloc.arena_max=2:{HUGEPAGE_TUNABLE}"
    assert env["A"] == "1"


@pytest.mark.parametrize(
    "environ, facts",
    [
        ({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"}, FACTS),  # the user's own choice
        ({"GLIBC_TUNABLES": HUGEPAGE_TUNABLE}, FACTS),  # already started with it
        ({"HYBRIDREC_HUGEPAGES": "0"}, FACTS),  # turned off
        ({}, dict(thp_mode="always", glibc_ok=True)),  # the kernel backs big blocks already
        ({}, dict(thp_mode="never", glibc_ok=True)),
        ({}, dict(thp_mode="", glibc_ok=True)),  # no THP mode read (not Linux, or no sysfs)
        ({}, dict(thp_mode="madvise", glibc_ok=False)),  # musl, or glibc < 2.35
    ],
)
def test_nothing_changes_where_it_would_not_help(environ, facts):
    assert hugepage_env(environ, **facts) is None


def test_the_mode_is_read_from_sysfs(tmp_path):
    path = tmp_path / "enabled"
    path.write_text("always [madvise] never\n")
    assert _thp_mode(str(path)) == "madvise"
    path.write_text("[always] madvise never\n")
    assert _thp_mode(str(path)) == "always"
    assert _thp_mode(str(tmp_path / "missing")) is None


SCRIPT = """
import os, sys
print("before", os.getpid(), os.environ.get("GLIBC_TUNABLES", ""), flush=True)
from hybrid._cpu_env import reexec_with_hugepages
reexec_with_hugepages()
print("after", os.getpid(), os.environ.get("GLIBC_TUNABLES", ""), sys.argv[1:], flush=True)
"""


@pytest.mark.skipif(
    hugepage_env({}) is None, reason="the tunable would change nothing on this host"
)
def test_the_process_restarts_itself_with_it(tmp_path):
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    env = {
        k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", "HYBRIDREC_HUGEPAGES")
    }
    out = subprocess.run(
        [sys.executable, str(script), "x", "--flag"],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=True,
    ).stdout.splitlines()
    # once without, then (same pid: the image was replaced) with the tunable, arguments kept
    assert len(out) == 3, out
    first, second, last = (line.split(" ", 3) for line in out)
    assert first[0] == "before" and first[2] == ""
    assert second[0] == "before" and second[2] == HUGEPAGE_TUNABLE
    assert last[0] == "after" and last[2] == HUGEPAGE_TUNABLE and last[3] == "['x', '--flag']"
    assert first[1] == second[1] == last[1]
    # turned off: no restart
    env["HYBRIDREC_HUGEPAGES"] = "0"
    out = subprocess.run(
        [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=600
    ).stdout.splitlines()
    assert [line.split(" ")[0] for line in out] == ["before", "after"]


@pytest.mark.parametrize(
    "argv, started",
    [
        (["py", "-m", "hybrid.train", "--config", "x.toml"], True),
        (["py", "-mhybrid.train"], True),
        (["py", "-u", "-X", "importtime", "-W", "error", "-m", "hybrid.train"], True),
        (["py", "-m", "hybrid.demo"], False),
        (["py", "-m", "hybrid"], False),
        (["py", "hybrid/train.py", "-m", "hybrid.train"], False),  # a script's own arguments
        (["py", "-c", "import hybrid", "-m", "hybrid.train"], False),
    ],
)
def test_started_as_the_training_module(monkeypatch, argv, started):
    monkeypatch.setattr(sys, "argv", ["-m"])  # as while `python -m` locates the module
    assert started_as_module("hybrid.train", argv) is started
    monkeypatch.setattr(sys, "argv", ["hybrid/train.py"])  # the module itself running
    assert not started_as_module("hybrid.train", argv)


@pytest.mark.skipif(
    hugepage_env({}) is None, reason="the tunable would change nothing on this host"
)
def test_the_training_script_restarts_before_jax_and_torch_load():
    """`python -m hybrid.train` imports the `hybrid` package first, which imports jax and
    torch (~2 s); the restart with the tunable happens before them, so each loads once."""
    env = {
        k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", "HYBRIDREC_HUGEPAGES")
    }
    done = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "hybrid.train", "--help"],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=True,
    )
    loads = [line.split("|")[-1].strip() for line in done.stderr.splitlines() if "|" in line]
    assert loads.count("hybrid._cpu_env") == 2  # two processes: before and after the restart
    assert loads.count("jax") == 1 and loads.count("torch") == 1, done.stderr[-3000:]
    assert "--config" in done.stdout
