"""Fault injection for the data readers and the cached artifacts.

Criteo TSV: every broken input is a `CriteoFormatError` naming file and line (and column
and value for a bad field), never a raw OSError / EOFError / BadGzipFile. MovieLens: the
source wheel is checked against its pinned sha256, the prepared npz against its sidecar
record (a bad one is rebuilt). CPU kernels: an altered library or a stale build record
triggers a rebuild. Everything works on copies under tmp_path; the real caches are untouched.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import logging
import pathlib
import re
import shutil
import subprocess

import numpy as np
import pytest

from hybrid.data import CriteoFormatError, read_criteo_tsv
from hybrid.data import _movielens as ml
from hybrid.data._arrays import ClickData

# ---------------------------------------------------------------- Criteo TSV


def _line(cats=("ab",) * 26, ints=("1",) * 13, label="1"):
    return "\t".join([label, *ints, *cats]) + "\n"


_RNG = np.random.default_rng(0)
# 400 varied lines (so the gzip stream is long and a cut lands mid-file)
GOOD = "".join(
    _line(cats=tuple(f"{v:08x}" for v in _RNG.integers(0, 2**32, 26))) for _ in range(400)
)


def _gz_truncated(path: pathlib.Path) -> None:
    data = gzip.compress(GOOD.encode())
    path.write_bytes(data[: len(data) // 2])


def _gz_header_only(path: pathlib.Path) -> None:
    path.write_bytes(gzip.compress(GOOD.encode())[:12])


def _gz_corrupt(path: pathlib.Path) -> None:
    data = bytearray(gzip.compress(GOOD.encode()))
    data[20:40] = b"\xff" * 20
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(
    ("name", "make", "message"),
    [
        ("empty.tsv", lambda p: p.write_bytes(b""), r"line 1: no samples \(the file is empty\)"),
        ("blank.tsv", lambda p: p.write_text("\n \n"), r"line 3: no samples"),
        ("empty.gz", lambda p: p.write_bytes(gzip.compress(b"")), r"line 1: no samples"),
        ("cut.gz", _gz_truncated, r"line \d+: the gzip stream ends early \(truncated"),
        ("head.gz", _gz_header_only, r"line 1: the gzip stream ends early"),
        ("bad.gz", _gz_corrupt, r"line 1: corrupt gzip data"),
        ("adir", lambda p: p.mkdir(), r"line 1: is a directory"),
        ("missing.tsv", lambda p: None, r"line 1: no such file"),
    ],
)
def test_criteo_broken_file_is_a_format_error(tmp_path, name, make, message):
    path = tmp_path / name
    make(path)
    with pytest.raises(CriteoFormatError, match=re.escape(str(path)) + ", " + message) as info:
        read_criteo_tsv(path, num_embeddings=100)
    # the raw error never shows: not chained, and suppressed if it was the context
    assert info.value.__cause__ is None
    assert info.value.__context__ is None or info.value.__suppress_context__


def test_criteo_truncated_gz_names_the_line_it_broke_at(tmp_path):
    path = tmp_path / "day.gz"
    _gz_truncated(path)
    with pytest.raises(CriteoFormatError, match=r"line (\d+):") as info:
        read_criteo_tsv(path, num_embeddings=100)
    line = int(re.search(r"line (\d+):", str(info.value)).group(1))
    assert 100 < line < 400  # the complete lines before the cut were read


def test_criteo_empty_file_among_good_ones(tmp_path):
    good, empty = tmp_path / "a.tsv", tmp_path / "b.tsv"
    good.write_text(GOOD)
    empty.write_text("")
    with pytest.raises(CriteoFormatError, match=r"b\.tsv, line 1: no samples"):
        read_criteo_tsv([good, empty], num_embeddings=100)
    # a file never reached because max_rows was met is not read (nor judged)
    assert len(read_criteo_tsv([good, empty], num_embeddings=100, max_rows=10)) == 10


@pytest.mark.parametrize(
    "value",
    [
        "0x1f",
        "0X1F",
        "-ff",
        "+ff",
        "1" * 17,
        "0" * 17,
        "g1",
        "fz",
        " ff",
        "ff ",
        "f_f",
        "ａｂ",
        "1.5",
    ],
)
def test_criteo_bad_categorical_names_file_line_column_value(tmp_path, value):
    path = tmp_path / "cats.tsv"
    path.write_text(_line() + _line(cats=("ab",) * 3 + (value,) + ("ab",) * 22))
    expected = (
        re.escape(f"{path}, line 2: categorical feature C4 is {value!r} (column 18)")
        + r", not a hex string of 1-16 digits"
    )
    with pytest.raises(CriteoFormatError, match=expected):
        read_criteo_tsv(path, num_embeddings=100)


def test_criteo_categorical_accepted_forms(tmp_path):
    path = tmp_path / "ok.tsv"
    cats = ("0", "F", "ff", "FF", "68fd1e64", "68FD1E64", "f" * 16, "") + ("a",) * 18
    path.write_text(_line(cats=cats))
    values = [int(v[0]) for v in read_criteo_tsv(path, num_embeddings=1001).values]
    assert values[:8] == [
        1 + 0,
        1 + 15,
        1 + 255 % 1000,
        1 + 255 % 1000,
        1 + 0x68FD1E64 % 1000,
        1 + 0x68FD1E64 % 1000,
        1 + (16**16 - 1) % 1000,
        0,
    ]


@pytest.mark.parametrize("value", ["1_000", " 5", "٣", "0x10", "1e3"])
def test_criteo_bad_integer_names_column(tmp_path, value):
    path = tmp_path / "ints.tsv"
    path.write_text(_line(ints=("1",) * 12 + (value,)))
    with pytest.raises(
        CriteoFormatError, match=re.escape(f"line 1: integer feature I13 is {value!r} (column 14)")
    ):
        read_criteo_tsv(path, num_embeddings=100)


# ---------------------------------------------------------------- MovieLens artifacts


def _tiny_arrays() -> dict[str, np.ndarray]:
    def part(n, seed):
        rng = np.random.default_rng(seed)
        return ClickData(
            ("user", "item"),
            rng.normal(size=(n, 2)).astype(np.float32),
            (rng.integers(1, 5, n), rng.integers(1, 7, n)),
            np.ones((2, n), np.int64),
            (rng.random(n) < 0.5).astype(np.float32),
            (5, 7),
        )

    return {**part(8, 0).to_arrays("train_"), **part(2, 1).to_arrays("eval_")}


@pytest.fixture
def fake_wheel(tmp_path, monkeypatch):
    """A cache dir holding a stand-in wheel whose hash is pinned; `_prepare` is counted."""
    cache = tmp_path / "cache"
    cache.mkdir()
    wheel = cache / ml.WHEEL
    wheel.write_bytes(b"not really a wheel")
    monkeypatch.setattr(ml, "WHEEL_SHA256", hashlib.sha256(wheel.read_bytes()).hexdigest())
    calls = []

    def prepare(path):
        assert path == wheel
        calls.append(path)
        return _tiny_arrays()

    monkeypatch.setattr(ml, "_prepare", prepare)
    return cache, calls


def test_movielens_cache_written_with_record_and_reused(fake_wheel):
    cache, calls = fake_wheel
    train, evaluation = ml.load_movielens(cache)
    assert (len(train), len(evaluation), len(calls)) == (8, 2, 1)
    record = json.loads((cache / ml._RECORD_NAME).read_text())
    npz = cache / ml._CACHE_NAME
    assert record["npz_sha256"] == hashlib.sha256(npz.read_bytes()).hexdigest()
    assert record["wheel_sha256"] == ml.WHEEL_SHA256
    again, _ = ml.load_movielens(cache)
    assert len(calls) == 1  # reused, not rebuilt
    np.testing.assert_array_equal(again.dense, train.dense)
    assert not list(cache.glob("*.tmp"))


def _flip(path: pathlib.Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def _truncate(path: pathlib.Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _drop_record(path: pathlib.Path) -> None:
    path.with_name(ml._RECORD_NAME).unlink()


def _garbage_with_matching_record(path: pathlib.Path) -> None:
    """An npz that matches its record but does not load (e.g. written by a buggy tool)."""
    path.write_bytes(b"PK\x03\x04 garbage")
    record_path = path.with_name(ml._RECORD_NAME)
    record = json.loads(record_path.read_text())
    record["npz_sha256"] = hashlib.sha256(path.read_bytes()).hexdigest()
    record_path.write_text(json.dumps(record))


def _other_wheel_record(path: pathlib.Path) -> None:
    record_path = path.with_name(ml._RECORD_NAME)
    record = json.loads(record_path.read_text())
    record["wheel_sha256"] = "0" * 64
    record_path.write_text(json.dumps(record))


@pytest.mark.parametrize(
    ("damage", "reason"),
    [
        (_flip, "edited, truncated or corrupt"),
        (_truncate, "edited, truncated or corrupt"),
        (_drop_record, "checksum record"),
        (_garbage_with_matching_record, "does not load"),
        (_other_wheel_record, "different wheel"),
        (lambda p: p.with_name(ml._RECORD_NAME).write_text("{not json"), "checksum record"),
    ],
)
def test_movielens_bad_cache_is_rebuilt_with_a_log_line(fake_wheel, caplog, damage, reason):
    cache, calls = fake_wheel
    first, _ = ml.load_movielens(cache)
    npz = cache / ml._CACHE_NAME
    damage(npz)
    with caplog.at_level(logging.WARNING, logger="hybridrec.data"):
        train, evaluation = ml.load_movielens(cache)
    assert len(calls) == 2
    assert any(
        "rebuilding it from the wheel" in r.message and reason in r.message for r in caplog.records
    )
    np.testing.assert_array_equal(train.dense, first.dense)
    record = json.loads((cache / ml._RECORD_NAME).read_text())
    assert record["npz_sha256"] == hashlib.sha256(npz.read_bytes()).hexdigest()
    ml.load_movielens(cache)
    assert len(calls) == 2  # the rebuilt cache is reused


def test_movielens_wheel_with_wrong_hash_is_refused(fake_wheel):
    cache, calls = fake_wheel
    wheel = cache / ml.WHEEL
    wheel.write_bytes(b"tampered")
    actual = hashlib.sha256(b"tampered").hexdigest()
    with pytest.raises(RuntimeError) as info:
        ml.load_movielens(cache)
    message = str(info.value)
    assert str(wheel) in message and ml.WHEEL_SHA256 in message and actual in message
    assert "delete it to re-download" in message
    assert not calls and not (cache / ml._CACHE_NAME).exists()


def test_movielens_pinned_hash_is_the_real_wheels():
    wheel = ml.data_cache_dir() / ml.WHEEL
    if not wheel.is_file():
        pytest.skip(f"{wheel} not downloaded here")
    assert hashlib.sha256(wheel.read_bytes()).hexdigest() == ml.WHEEL_SHA256


def test_movielens_real_wheel_truncated_npz_rebuilt(tmp_path, caplog):
    wheel = ml.data_cache_dir() / ml.WHEEL
    if not wheel.is_file():
        pytest.skip(f"{wheel} not downloaded here")
    cache = tmp_path / "cache"
    cache.mkdir()
    shutil.copy(wheel, cache / ml.WHEEL)
    train, _ = ml.load_movielens(cache)
    assert len(train) == 80_000
    _truncate(cache / ml._CACHE_NAME)
    with caplog.at_level(logging.WARNING, logger="hybridrec.data"):
        again, evaluation = ml.load_movielens(cache)
    assert (len(again), len(evaluation)) == (80_000, 20_000)
    assert any("rebuilding" in r.message for r in caplog.records)


# ---------------------------------------------------------------- CPU-kernel library


@pytest.fixture
def kernel_cache(tmp_path, monkeypatch):
    from sparse_jax._kernels import build

    monkeypatch.setenv("HYBRIDREC_CACHE", str(tmp_path / "kernels"))
    return build


def _fake_compiles(build, monkeypatch):
    """Replace the compiler call by one writing a distinct stand-in library; count calls."""
    calls = []

    def compile_(compiler, out):
        calls.append(out)
        out.write_bytes(b"\x7fELF fake library %d" % len(calls))

    monkeypatch.setattr(build, "_compile", compile_)
    monkeypatch.setattr(build, "_compiler", lambda: "/usr/bin/fake-g++")
    return calls


@pytest.mark.parametrize(
    ("damage", "reason"),
    [
        (lambda so, rec: so.write_bytes(so.read_bytes()[:-3] + b"xyz"), "library bytes changed"),
        (lambda so, rec: so.write_bytes(so.read_bytes()[:4]), "library bytes changed"),
        (
            lambda so, rec: rec.write_text(
                json.dumps({**json.loads(rec.read_text()), "source_sha256": "0" * 64})
            ),
            "different source_sha256",
        ),
        (
            lambda so, rec: rec.write_text(
                json.dumps({**json.loads(rec.read_text()), "flags": ["-O0"]})
            ),
            "different flags",
        ),
        (lambda so, rec: rec.unlink(), "no readable build record"),
    ],
)
def test_kernel_library_stale_is_rebuilt(kernel_cache, monkeypatch, caplog, damage, reason):
    build = kernel_cache
    calls = _fake_compiles(build, monkeypatch)
    so = build.build()
    record = build.record_path(so)
    assert so.parent == pathlib.Path(build.cache_dir()) and len(calls) == 1
    assert build.build() == so and len(calls) == 1  # verified and reused
    damage(so, record)
    with caplog.at_level(logging.WARNING, logger="hybridrec.kernels"):
        assert build.build() == so
    assert len(calls) == 2
    assert any("rebuilding" in r.message and reason in r.message for r in caplog.records)
    recorded = json.loads(record.read_text())
    assert recorded["so_sha256"] == hashlib.sha256(so.read_bytes()).hexdigest()
    assert recorded["source_sha256"] == hashlib.sha256(build.source_bytes()).hexdigest()
    assert build.build() == so and len(calls) == 2


def test_kernel_library_stale_without_compiler_raises(kernel_cache, monkeypatch):
    build = kernel_cache
    _fake_compiles(build, monkeypatch)
    so = build.build()
    so.write_bytes(b"corrupt")
    monkeypatch.setattr(build, "_compiler", lambda: None)
    with pytest.raises(RuntimeError, match=r"no C\+\+ compiler .*library bytes changed"):
        build.build()  # _ffi turns this into the XLA fallback with a warning


def test_kernel_library_real_build_corrupted_so_is_rebuilt_and_loads(tmp_path, monkeypatch, caplog):
    import ctypes
    import shutil

    from sparse_jax._kernels import build

    if build._compiler() is None:
        pytest.skip("no g++ here: the kernels are not built (XLA path)")
    # the real library and its record, as `make`'s set-up built them (or built now), copied into
    # an empty cache: one real compile in this test (the rebuild), not two
    built = build.build()
    monkeypatch.setenv("HYBRIDREC_CACHE", str(tmp_path / "kernels"))
    so = build.library_path()
    so.parent.mkdir(parents=True)
    shutil.copyfile(built, so)
    shutil.copyfile(build.record_path(built), build.record_path(so))
    with caplog.at_level(logging.WARNING, logger="hybridrec.kernels"):
        assert build.build() == so  # the copy checks out: reused, not rebuilt
    assert not caplog.records
    good = so.read_bytes()  # (not loaded before the damage: overwriting a mapped .so crashes)
    data = bytearray(good)
    data[len(data) // 2 : len(data) // 2 + 64] = b"\0" * 64
    so.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING, logger="hybridrec.kernels"):
        assert build.build() == so
    assert any("library bytes changed" in r.message for r in caplog.records)
    assert (
        json.loads(build.record_path(so).read_text())["so_sha256"]
        == hashlib.sha256(so.read_bytes()).hexdigest()
    )
    lib = ctypes.CDLL(str(so))
    assert hasattr(lib, "HybridrecPooledSum")


def _fake_pip(monkeypatch, body: bytes, seen: list, cache: pathlib.Path):
    """`pip download` standing in: writes `body` as the wheel into its `-d` folder in two
    halves, noting between them whether a process reading `cache` would find a wheel."""

    def run(cmd, **kwargs):
        folder = pathlib.Path(cmd[cmd.index("-d") + 1])
        target = folder / ml.WHEEL
        with open(target, "wb") as f:
            f.write(body[: len(body) // 2])
            f.flush()
            seen.append((cache / ml.WHEEL).exists())
            f.write(body[len(body) // 2 :])
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(ml.subprocess, "run", run)


def test_movielens_wheel_appears_whole_or_not_at_all(tmp_path, monkeypatch):
    """Ranks of one job (or two test workers) may download at once: a half-written wheel in
    the cache would fail the other's hash check. The wheel appears in the cache only whole
    and verified, and the download's folder is removed."""
    body = b"a stand-in wheel, long enough to be written in two halves"
    monkeypatch.setattr(ml, "WHEEL_SHA256", hashlib.sha256(body).hexdigest())
    seen, cache = [], tmp_path / "cache"
    _fake_pip(monkeypatch, body, seen, cache)
    assert ml._wheel(cache) == cache / ml.WHEEL
    assert seen == [False]  # mid-download, the cache held no wheel
    assert (cache / ml.WHEEL).read_bytes() == body
    assert [p.name for p in cache.iterdir()] == [ml.WHEEL]
    # a download that does not verify leaves nothing behind, and says which file it read
    monkeypatch.setattr(ml, "WHEEL_SHA256", "0" * 64)
    other = tmp_path / "other"
    _fake_pip(monkeypatch, body, seen, other)
    with pytest.raises(RuntimeError, match="sha256 mismatch"):
        ml._wheel(other)
    assert list(other.iterdir()) == []
