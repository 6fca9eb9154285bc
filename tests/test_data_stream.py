"""hybrid.data.CriteoStream: the per-process split, exact resume, flat memory, .gz, errors."""

import gzip
import json
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from hybrid.data import CriteoFormatError, CriteoStream, read_criteo_tsv

# cat_0 read as raw ids: its hex value is the row's number, so every row is recognizable
SIZES = [0] + [1000] * 25


def write_criteo(path, rows, *, first=0, seed=0, blank_every=0):
    """`rows` Criteo lines (row r's C1 is r in hex), written with numpy in blocks."""
    rng = np.random.default_rng(seed)
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "wt") as f:
        for start in range(first, first + rows, 100_000):
            m = min(100_000, first + rows - start)
            labels = rng.integers(0, 2, m)
            ints = rng.integers(-5, 1000, (m, 13)).astype(str)
            ints[rng.random((m, 13)) < 0.1] = ""
            cats = np.char.mod("%08x", rng.integers(0, 2**32, (m, 25)))
            ids = np.char.mod("%x", np.arange(start, start + m))
            table = np.column_stack([labels.astype(str), ints, ids, cats])
            lines = ["\t".join(row) for row in table.tolist()]
            if blank_every:
                lines = [
                    x
                    for i, line in enumerate(lines)
                    for x in ((line, "") if i % blank_every == 1 else (line,))
                ]
            f.write("\n".join(lines) + "\n")
    return path


def row_ids(batch):
    _, (_, values, lengths), labels = batch
    n = labels.shape[0]
    assert lengths[:n].tolist() == [1] * n  # cat_0 is always present here
    return values[:n].tolist()


def drain(stream):
    return list(stream)


def assert_same_batches(a, b):
    assert len(a) == len(b)
    for (d1, (k1, v1, l1), y1), (d2, (k2, v2, l2), y2) in zip(a, b, strict=True):
        assert k1 == k2
        for x, y in ((d1, d2), (v1, v2), (l1, l2), (y1, y2)):
            assert x.dtype == y.dtype and x.shape == y.shape
            assert x.numpy().tobytes() == y.numpy().tobytes()


@pytest.mark.parametrize("files", [3, 4])  # 3 over 2 processes: row blocks; 4: whole files
def test_two_processes_see_every_row_once_disjointly(tmp_path, files):
    paths = [
        write_criteo(tmp_path / f"day_{i}.tsv", 100 + 17 * i, first=1000 * i, seed=i)
        for i in range(files)
    ]
    every = sorted(r for i in range(files) for r in range(1000 * i, 1000 * i + 100 + 17 * i))
    seen = []
    for p in (0, 1):
        stream = CriteoStream(
            paths,
            16,
            process_index=p,
            process_count=2,
            num_embeddings=SIZES,
            num_epochs=1,
            block_rows=7,
            shuffle_window=50,
            seed=3,
        )
        seen.append([r for batch in drain(stream) for r in row_ids(batch)])
    assert not set(seen[0]) & set(seen[1])
    assert sorted(seen[0] + seen[1]) == every
    if files == 4:  # whole files: process 0 reads day_0 and day_2 only
        assert {r // 1000 for r in seen[0]} == {0, 2}
    else:  # row blocks: within a block per file of even
        assert abs(len(seen[0]) - len(seen[1])) <= 7 * files


def test_unshuffled_stream_is_read_criteo_tsv_in_batches(tmp_path):
    path = write_criteo(tmp_path / "day_0.tsv", 300, blank_every=50)
    whole = read_criteo_tsv(path, num_embeddings=SIZES)
    batches = drain(CriteoStream(path, 64, num_embeddings=SIZES, num_epochs=1, shuffle_window=1))
    expect = [whole.rows(np.arange(s, min(s + 64, 300))) for s in range(0, 300, 64)]
    assert_same_batches(batches, expect)


@pytest.mark.parametrize(
    "cut", [0, 1, 3, 7, 12]
)  # before any batch, mid window, window edge, 2nd epoch
def test_restored_stream_yields_exactly_the_remaining_batches(tmp_path, cut):
    paths = [
        write_criteo(tmp_path / "day_0.tsv", 250),
        write_criteo(tmp_path / "day_1.tsv.gz", 120, first=500),
    ]
    settings = dict(num_embeddings=SIZES, num_epochs=2, shuffle_window=64, seed=11, batch_size=32)
    stream = CriteoStream(paths, **settings)
    head = [next(stream) for _ in range(cut)]
    state = json.loads(json.dumps(stream.state()))  # JSON round trip, as in a checkpoint
    rest = drain(stream)
    assert len(head) + len(rest) == 2 * 370 // 32 + 1
    resumed = CriteoStream(paths, **settings)
    resumed.restore(state)
    assert_same_batches(drain(resumed), rest)
    # shuffled: not file order, and a different order in the second epoch
    ids = [r for b in head + rest for r in row_ids(b)]
    assert sorted(ids) == sorted([*range(250), *range(500, 620)] * 2)
    assert ids[:370] != sorted(ids[:370]) and ids[:370] != ids[370:]


def test_restore_refuses_a_position_of_other_settings(tmp_path):
    path = write_criteo(tmp_path / "day_0.tsv", 50)
    state = CriteoStream(path, 8, num_embeddings=SIZES, seed=1).state()
    with pytest.raises(ValueError, match=r"saved with seed = 1, this stream has 2"):
        CriteoStream(path, 8, num_embeddings=SIZES, seed=2).restore(state)
    with pytest.raises(ValueError, match=r"not a stream position"):
        CriteoStream(path, 8, num_embeddings=SIZES).restore({"step": 3})


def test_gzip_stream_equals_the_plain_one(tmp_path):
    plain = write_criteo(tmp_path / "day_0.tsv", 200, seed=4)
    packed = tmp_path / "day_0.tsv.gz"
    packed.write_bytes(gzip.compress(plain.read_bytes()))
    settings = dict(num_embeddings=SIZES, num_epochs=1, shuffle_window=40, seed=5)
    assert_same_batches(
        drain(CriteoStream(packed, 24, **settings)), drain(CriteoStream(plain, 24, **settings))
    )


def test_a_bad_line_names_file_and_line(tmp_path):
    path = write_criteo(tmp_path / "day_0.tsv", 40)
    lines = path.read_text().splitlines(keepends=True)
    lines[29] = "1\t2\t3\n"  # line 30: truncated
    path.write_text("".join(lines))
    stream = CriteoStream(path, 8, num_embeddings=SIZES, num_epochs=1, shuffle_window=1)
    with pytest.raises(
        CriteoFormatError, match=r"day_0\.tsv, line 30: 3 tab-separated fields, expected 40"
    ):
        drain(stream)


def test_a_truncated_gz_names_the_line_it_broke_at(tmp_path):
    plain = write_criteo(tmp_path / "day_0.tsv", 2000)
    packed = tmp_path / "day_0.tsv.gz"
    data = gzip.compress(plain.read_bytes())
    packed.write_bytes(data[: len(data) // 2])
    stream = CriteoStream(packed, 64, num_embeddings=SIZES, num_epochs=1)
    with pytest.raises(
        CriteoFormatError, match=r"day_0\.tsv\.gz, line \d+: the gzip stream ends early"
    ):
        drain(stream)


def test_a_process_without_rows_is_told_so(tmp_path):
    path = write_criteo(tmp_path / "day_0.tsv", 5)
    stream = CriteoStream(
        [path], 4, process_index=1, process_count=2, num_embeddings=SIZES, block_rows=8
    )
    with pytest.raises(CriteoFormatError, match=r"process 1 of 2 gets no rows .* lower block_rows"):
        next(stream)


# Peak RSS growth (KiB) while streaming a file once. The peak is reset after the imports
# and the stream's construction (Linux: clear_refs 5 resets the address space's high-water
# mark, VmHWM), so what remains is the shuffle window, the read-ahead queue and whatever
# grows with the rows. (ru_maxrss is not used: Linux carries it over fork + exec from the
# parent, here pytest, so a child's figure is at least the parent's RSS; see
# benchmarks/memory.py.)
_PEAK = textwrap.dedent(
    """
    import sys
    from hybrid.data import CriteoStream

    def hwm():
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))

    stream = CriteoStream(sys.argv[1], 512, num_embeddings=1000, num_epochs=1, shuffle_window=8192)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = hwm()
    rows = sum(batch[2].shape[0] for batch in stream)
    print(rows, hwm() - before)
    """
)


def peak_growth_kib(path) -> tuple[int, int]:
    out = subprocess.run(
        [sys.executable, "-c", _PEAK, str(path)],
        capture_output=True,
        text=True,
        check=True,
        timeout=600,
    )
    rows, growth = out.stdout.split()
    return int(rows), int(growth)


@pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="resets the peak RSS through /proc"
)
def test_memory_stays_flat_from_20k_to_200k_rows(tmp_path):
    """Streaming 10x the rows (20k vs 200k: `benchmarks`-sized 1M vs 10M takes minutes on a
    2-core machine) grows the peak RSS alike, by a few MiB (the 200k rows parsed whole take
    ~56 MiB, so a reader that holds them fails both bounds)."""
    block = write_criteo(tmp_path / "block.tsv", 10_000).read_bytes()
    (tmp_path / "small.tsv").write_bytes(block * 2)
    (tmp_path / "large.tsv").write_bytes(block * 20)
    (n_small, small), (n_large, large) = (
        peak_growth_kib(tmp_path / "small.tsv"),
        peak_growth_kib(tmp_path / "large.tsv"),
    )
    assert (n_small, n_large) == (20_000, 200_000)
    print(
        f"peak RSS growth: {small / 1024:.1f} MiB streaming 20k rows, {large / 1024:.1f} MiB streaming 200k rows"
    )
    assert large - small < 16 * 1024 and large < 48 * 1024, (small, large)
