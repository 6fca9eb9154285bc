"""The managed remap kernel's in-place moves split over two threads (`MoveAllRuns` in
`sparse_jax/_kernels/mc_remap_cpu.cc`): the halves may touch each other's sources in one
meeting window, saved before and written again after. The kernel source, built with
-DHYBRIDREC_SELFTEST, runs random evictions through it with the halves on two threads and in
either order (the race's two extremes), and checks every survivor's place."""

import ctypes
import subprocess

import jax
import pytest

from sparse_jax._kernels import build

_SOURCE = build.SOURCES[[p.name for p in build.SOURCES].index("mc_remap_cpu.cc")]


@pytest.fixture(scope="module")
def selftest(tmp_path_factory):
    compiler = build._compiler()
    if compiler is None:
        pytest.skip("no C++ compiler here")
    out = tmp_path_factory.mktemp("moves") / "libmoves_selftest.so"
    flags = [f for f in build.FLAGS if f != "-O3"] + ["-O1", "-DHYBRIDREC_SELFTEST"]
    subprocess.run(
        [compiler, *flags, f"-I{jax.ffi.include_dir()}", str(_SOURCE), "-o", str(out)],
        check=True,
        capture_output=True,
    )
    run = ctypes.CDLL(str(out)).HybridrecMovesSelftest
    run.restype = ctypes.c_int64
    run.argtypes = [ctypes.c_uint64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int, ctypes.c_int]
    return run


@pytest.mark.parametrize("order", [0, 1, 2])
def test_split_moves_put_every_survivor_in_its_place(selftest, order):
    """0: both halves on two threads; 1 / 2: the left / right half wholly first."""
    assert selftest(order + 1, 20_000, 300, order, 0) == 0


@pytest.mark.parametrize("order", [1, 2])
def test_without_the_meeting_windows_rewrite_survivors_are_misplaced(selftest, order):
    """The check can fail: with the window left as the halves leave it, the half that runs
    second reads sources the first already overwrote."""
    assert selftest(order + 1, 20_000, 300, order, 1) > 0
