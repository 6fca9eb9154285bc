"""The managed-collision CPU kernels (`sparse_jax/_kernels/mc_remap_cpu.cc`): the fused
training remap (`profile`) and the eval lookup (`remap`) give bit for bit the state and
outputs of the XLA form (the sorted form a GPU runs) and the slots of the plain-loop oracle
(tests/reference.py) over random streams; the CPU lowering of a managed training step takes
the kernels when they are built and the XLA form when not."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from sparse_jax import (
    EmbeddingBagConfig,
    MCHManagedCollisionModule,
    RawIds,
    _kernels,
)
from sparse_jax._kernels import _ffi
from sparse_jax.managed._reset import RowBlock, _fresh_rows, _marked_rows, reset_rows
from tests.reference import ManagedCollisionLoop

pytestmark = pytest.mark.skipif(
    not _kernels.available(), reason="the CPU kernels cannot be built here"
)


# The map's programs compute integers only (its eleven state arrays, mask, counts, slots):
# their results do not depend on LLVM's optimizations, so their XLA form is compiled at -O0
# (the same HLO; ~40% less compile time, most of this file's time). Not for float programs:
# -O0 contracts no multiply-adds, so fresh rows would differ in the last bit.
_INTEGER_ONLY = {"xla_backend_optimization_level": 0}


@pytest.fixture
def xla_form(monkeypatch):
    """`jax.jit(fn)` lowered as if the CPU kernels were not built (the XLA form)."""

    def jitted(fn, *, integer_only=False):
        compiled = {}

        def run(*args):
            shapes = tuple(np.shape(x) for x in jax.tree_util.tree_leaves(args))
            if shapes not in compiled:
                with monkeypatch.context() as m:
                    m.setattr(_ffi, "_register", lambda: "kernels switched off by the test")
                    # traced afresh (a new function): jax caches a traced function's
                    # lowering, and `jax.jit(fn)` would reuse the kernel program's
                    lowered = jax.jit(lambda *a: fn(*a)).lower(*args)
                    compiled[shapes] = lowered.compile(_INTEGER_ONLY if integer_only else None)
            return compiled[shapes](*args)

        return run

    return jitted


def _stream(seed, steps, batch, pool, zipf):
    """(ids, valid) batches of raw int64 ids from a pool of 64-bit values (high words set,
    negatives, equal low words); ~10% of positions are padding (id 0's words, not valid);
    one batch is empty and one is all padding. The popular ids drift, so LFU turns over too."""
    rng = np.random.default_rng(seed)
    values = rng.integers(-(2**63), 2**63 - 1, size=pool, dtype=np.int64)
    values[:4] = [5, 2**32 + 5, -1, -(2**63)]
    p = 1.0 / np.arange(1, pool + 1) ** (1.1 if zipf else 0.0)
    for step in range(steps):
        n = 0 if step == steps // 2 else batch
        ids = values[(rng.choice(pool, size=n, p=p / p.sum()) + 3 * step) % pool]  # drifting
        valid = (rng.random(n) < 0.9) & (step != steps // 3)
        yield np.where(valid, ids, 0), valid


# (policy, interval, threshold, zipf, zch, batch, pool, steps) of the random-stream
# comparisons (also the hashed form's, tests/test_managed_hashed.py)
STREAM_CASES = [
    ("ttl:2", 1, 1, True, 23, 20, 60, 40),
    ("ttl:4", 2, 2, False, 23, 20, 60, 40),
    ("lru", 1, 1, True, 23, 20, 60, 40),
    ("lfu", 1, 1, False, 23, 20, 60, 40),
    ("lru", 3, 2, False, 23, 20, 60, 40),
    ("lfu", 2, 2, True, 23, 20, 60, 40),
    # large enough for the kernels' threaded passes (selection, search, lookup)
    ("lru", 1, 1, False, 4096, 1536, 6000, 8),
]


@pytest.mark.parametrize(
    ("policy", "interval", "threshold", "zipf", "zch", "batch", "pool", "steps"), STREAM_CASES
)
def test_the_kernel_gives_the_xla_forms_state_and_the_oracles_slots(
    xla_form, policy, interval, threshold, zipf, zch, batch, pool, steps
):
    """Every step: all eleven state arrays, the evicted-slot mask and the remapped slots
    equal the XLA form's bit for bit, and the evicted slots and slots equal the loop
    oracle's; ids are new, resident, evicted and re-admitted (a pool over twice the map).
    The fused training call (`profile_remap`, kernel and XLA form, on maps of their own)
    gives the same state, mask, count and slots (padding included) as profile then remap.
    "ttl:N": the TTL policy with single_ttl=N."""
    policy, _, ttl = policy.partition(":")
    settings = {"single_ttl": int(ttl)} if ttl else {}
    mc = MCHManagedCollisionModule(
        zch,
        history_capacity=batch * interval,
        eviction_policy=policy,
        eviction_interval=interval,
        threshold=threshold,
        **settings,
    )
    oracle = ManagedCollisionLoop(zch, policy, interval, threshold, **settings)
    k_profile, k_remap = jax.jit(mc.profile_occupied), jax.jit(mc.remap)
    x_profile = xla_form(mc.profile_occupied, integer_only=True)
    x_remap = xla_form(mc.remap, integer_only=True)
    k_fused, x_fused = jax.jit(mc.profile_remap), xla_form(mc.profile_remap, integer_only=True)
    k_state = x_state = kf_state = xf_state = mc.init()
    resident, left, readmitted = set(), set(), 0
    for step, (raw, valid) in enumerate(_stream(zch, steps, batch, pool, zipf)):
        ids = RawIds.from_int64(raw)
        k_state, k_evicted, k_counts = k_profile(k_state, ids, valid)
        x_state, x_evicted, x_counts = x_profile(x_state, ids, valid)
        # entries held before the call and after it, slots given to new ids
        np.testing.assert_array_equal(np.asarray(k_counts), np.asarray(x_counts), str(step))
        assert int(k_counts[0]) == len(resident), step
        for field, a, b in zip(k_state._fields, k_state, x_state, strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=f"{field} {step}")
        np.testing.assert_array_equal(np.asarray(k_evicted), np.asarray(x_evicted), str(step))
        expected = oracle.profile([int(i) for i, v in zip(raw, valid, strict=True) if v])
        assert set(np.flatnonzero(np.asarray(k_evicted)).tolist()) == expected, step
        held = sum(e["raw"] is not None for e in oracle.entries)
        assert (int(k_counts[1]), int(k_counts[2])) == (held, len(expected)), step
        # the batch (padding included), then the reserved empty-entry id as raw words
        query = RawIds(
            jnp.concatenate([ids.hi, jnp.array([2**31 - 1], jnp.int32)]),
            jnp.concatenate([ids.lo, jnp.array([2**32 - 1], jnp.uint32)]),
        )
        slots = np.asarray(k_remap(k_state, query))
        for fused, f_state in ((k_fused, kf_state), (x_fused, xf_state)):
            f_state, f_evicted, f_counts, f_slots = fused(f_state, ids, valid)
            for field, a, b in zip(k_state._fields, f_state, k_state, strict=True):
                np.testing.assert_array_equal(np.asarray(a), np.asarray(b), f"fused {field} {step}")
            np.testing.assert_array_equal(np.asarray(f_evicted), np.asarray(k_evicted), str(step))
            np.testing.assert_array_equal(np.asarray(f_counts), np.asarray(k_counts), str(step))
            np.testing.assert_array_equal(np.asarray(f_slots), slots[:-1], f"fused slots {step}")
            kf_state, xf_state = (f_state, xf_state) if fused is k_fused else (kf_state, f_state)
        np.testing.assert_array_equal(slots, np.asarray(x_remap(x_state, query)), str(step))
        np.testing.assert_array_equal(slots[:-1], oracle.remap([int(i) for i in raw]), str(step))
        now = {e["raw"] for e in oracle.entries if e["raw"] is not None}
        readmitted += len((now - resident) & left)
        left |= resident - now
        resident = now
    assert len(left) >= 8 and readmitted > 0  # resident ids evicted, and some came back


@pytest.mark.parametrize(
    ("policy", "zipf", "batch", "steps"),
    [
        ("lru", False, 8192, 16),
        ("lfu", False, 8192, 16),
        ("lfu", True, 8192, 16),
        ("ttl:3", False, 8192, 16),
        # windows over 2^15 ids: the radix sorts split over two threads (unequal halves)
        ("lru", False, 40_003, 5),
    ],
)
def test_the_kernel_gives_the_xla_forms_state_on_a_map_large_enough_for_its_sampled_passes(
    xla_form, policy, zipf, batch, steps
):
    """65,600 slots, 8192 ids a batch: large enough for the kernel's sampled selection of the
    weakest entries (empty entries all tied at first, then turnover), its scan of the
    residents and its moves split over threads; every step's state, mask and slots (the
    fused call's) equal the XLA form's bit for bit."""
    policy, _, ttl = policy.partition(":")
    settings = {"single_ttl": int(ttl)} if ttl else {}
    zch = 65_600  # over 16 x 4096 resident entries: the sampled selection
    # torch's OpenMP runtime is the kernels' (one libgomp.so.1 per process): the suite's one
    # torch thread would leave the kernels' threaded passes unrun
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        _large_map_steps(xla_form, policy, settings, zipf, zch, batch, steps)
    finally:
        torch.set_num_threads(threads)


def _large_map_steps(xla_form, policy, settings, zipf, zch, batch, steps):
    mc = MCHManagedCollisionModule(zch, history_capacity=batch, eviction_policy=policy, **settings)
    kernel, xla = jax.jit(mc.profile_remap), xla_form(mc.profile_remap, integer_only=True)
    k_state = x_state = mc.init()
    for step, (raw, valid) in enumerate(_stream(1, steps, batch, 3 * zch, zipf)):
        ids = RawIds.from_int64(raw)
        k_state, *k_out = kernel(k_state, ids, valid)
        x_state, *x_out = xla(x_state, ids, valid)
        for field, a, b in zip(k_state._fields, k_state, x_state, strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=f"{field} {step}")
        for name, a, b in zip(("evicted", "counts", "slots"), k_out, x_out, strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=f"{name} {step}")
    assert zipf or int(k_out[1][1]) == zch - 1  # uniform ids: the map filled and turned over


@pytest.mark.parametrize("policy", ["lru", "lfu", "ttl", "distance_lfu"])
def test_each_policy_keeps_only_its_own_metadata_in_both_forms(xla_form, policy):
    """As TorchRec's policies (`metadata_info`): LFU keeps counts, LRU and TTL the last
    access, DistanceLFU both; the state's other column stays zero through evictions, in the
    kernel (it moves one column less) and in the XLA form alike."""
    settings = {"single_ttl": 2} if policy == "ttl" else {}
    mc = MCHManagedCollisionModule(64, history_capacity=48, eviction_policy=policy, **settings)
    assert (
        set(mc.metadata_fields)
        == {
            "lru": {"last_access"},
            "lfu": {"counts"},
            "ttl": {"last_access"},
            "distance_lfu": {"counts", "last_access"},
        }[policy]
    )
    for profile in (jax.jit(mc.profile_remap), xla_form(mc.profile_remap, integer_only=False)):
        state = mc.init()
        for raw, valid in _stream(5, 12, 48, 200, True):
            state, *_ = profile(state, RawIds.from_int64(raw), valid)
        assert int(mc.remap(state, RawIds.from_int64(raw)).min()) < 63  # ids are resident
        for field in ("counts", "last_access"):
            column = np.asarray(getattr(state, field))
            assert column.any() == (field in mc.metadata_fields), (field, column)


def test_the_kernel_gives_the_xla_forms_state_when_its_sampled_bound_is_too_low(xla_form):
    """LFU, 65,599 resident entries: the entries the kernel samples for its guess of the m-th
    weakest score (4096, evenly spaced) hold count 1 and every other entry count 2, and 5,000
    new ids seen 3 times each take the weakest 5,000 entries. The guess (count 1) has only
    the 4,096 sampled entries at it and none below: too low, so the kernel must select over
    every entry (the 4,096, then the latest 904 at count 2), as the XLA form's sort does."""
    zch, size = 65_600, 65_600
    n = zch - 1  # resident entries (the last is the default slot's)
    sampled = (2 * np.arange(4096) + 1) * n // (2 * 4096)  # the kernel's sample positions
    mc = MCHManagedCollisionModule(zch, history_capacity=size, eviction_policy="lfu")
    kernel, xla = jax.jit(mc.profile_remap), xla_form(mc.profile_remap, integer_only=True)

    def padded(ids):
        raw, valid = np.zeros(size, np.int64), np.zeros(size, bool)
        raw[: len(ids)], valid[: len(ids)] = ids, True
        return RawIds.from_int64(raw), valid

    fresh = n + 7 * np.arange(5000)  # not resident
    batches = [
        np.arange(n),  # fills the map: id i at entry i, count 1
        np.setdiff1d(np.arange(n), sampled),  # count 2 but at the sampled entries
        np.repeat(fresh, 3),  # 5,000 new ids, count 3: each beats a resident
    ]
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # the kernel's threaded passes (see above)
    try:
        k_state = x_state = mc.init()
        for step, ids in enumerate(batches):
            k_state, *k_out = kernel(k_state, *padded(ids))
            x_state, *x_out = xla(x_state, *padded(ids))
            for field, a, b in zip(k_state._fields, k_state, x_state, strict=True):
                np.testing.assert_array_equal(
                    np.asarray(a), np.asarray(b), err_msg=f"{field} {step}"
                )
            for name, a, b in zip(("evicted", "counts", "slots"), k_out, x_out, strict=True):
                np.testing.assert_array_equal(
                    np.asarray(a), np.asarray(b), err_msg=f"{name} {step}"
                )
    finally:
        torch.set_num_threads(threads)
    evicted = np.flatnonzero(np.asarray(k_out[0]))
    assert len(evicted) == 5000  # every new id won an entry


# the kernel reads 64 entries at a time (with AVX-512), then 8 at a time, then one by one
@pytest.mark.parametrize("n", [1000, 1003, 4096])
def test_reset_rows_are_the_masks_positions_as_nonzero_gives_them(xla_form, n):
    rng = np.random.default_rng(0)
    kernel = jax.jit(lambda m: _marked_rows(m, 64, n))
    xla = xla_form(lambda m: _marked_rows(m, 64, n))
    for density in (0.0, 0.01, 0.5, 1.0):  # fill only, some rows then fill, more rows than fit
        mask = rng.random(n) < density
        mask[-1] = density > 0  # the last entry (in the tail when n % 8)
        want = np.flatnonzero(mask)[:64]
        want = np.concatenate([want, np.full(64 - len(want), n)])
        np.testing.assert_array_equal(np.asarray(kernel(mask)), want)
        np.testing.assert_array_equal(np.asarray(xla(mask)), want)


@pytest.mark.parametrize("bounds", [None, (-0.5, 0.5)])  # a span of 1.0: XLA would fold it
def test_fresh_rows_drawn_only_where_used_are_the_rows_of_the_whole_draw(xla_form, bounds):
    """The reset's fresh rows on CPU (`row_bits`: only the rows a reset uses are drawn) are
    bit for bit the first rows of an eager `jax.random.uniform(key, (k, dim))`."""
    extra = {} if bounds is None else dict(weight_init_min=bounds[0], weight_init_max=bounds[1])
    config = EmbeddingBagConfig(
        name="t", num_embeddings=500, embedding_dim=6, feature_names=["f"], **extra
    )
    lo, hi = config.weight_init_min, config.weight_init_max
    mask = np.random.default_rng(1).random(500) < 0.05
    used = int(mask.sum())
    for key in (jax.random.key(3), jax.random.fold_in(jax.random.key(2**31 + 5), 7)):
        want = np.asarray(jax.random.uniform(key, (64, 6), jnp.float32, lo, hi))[:used]
        for form in (jax.jit, xla_form):
            got = form(lambda k, m: _fresh_rows(config, k, _marked_rows(m, 64, 500)))(key, mask)
            np.testing.assert_array_equal(np.asarray(got)[:used], want)


# (block, here): a whole table; rows 100-399 stored from buffer row 7, columns 2-5 of the
# draw in the buffer's first 4 columns; the same block on a device that does not store it
_BLOCKS = [
    (RowBlock("b", 0, 0, 500, 0, 6), True),
    (RowBlock("b", 7, 100, 300, 2, 4), True),
    (RowBlock("b", 7, 100, 300, 2, 4), False),
]


@pytest.mark.parametrize(("block", "here"), _BLOCKS)
# none used, some, more than fit; "edges": the rows around the block's first and last rows
# (outside it, some still inside the buffer: they must stay as they were)
@pytest.mark.parametrize("density", [0.0, 0.05, 1.0, "edges"])
@pytest.mark.parametrize("bounds", [(-0.5, 0.5), (-0.0447, 0.0447)])
def test_a_reset_writes_each_marked_rows_fresh_row_and_zero_state_in_its_block(
    xla_form, block, here, density, bounds
):
    """`reset_rows` on CPU (the fresh rows drawn, converted and written by one kernel call,
    only for the rows used) and in its XLA form set each marked row in the block to its row
    of an eager `jax.random.uniform(fold_in(key, 0), (limit, dim))` (the i-th marked row
    ascending takes draw row i, at most `limit` rows) and zero its state; nothing else
    changes, and nothing at all on a device that does not store the block. The state's
    rows are zeroed by a kernel call per buffer on CPU, by a scatter in the XLA form."""
    config = EmbeddingBagConfig(
        name="t", num_embeddings=500, embedding_dim=6, feature_names=["f"],
        weight_init_min=bounds[0], weight_init_max=bounds[1],
    )  # fmt: skip
    rng = np.random.default_rng(4)
    limit, height = 64, block.buffer_row + block.num_rows + 3
    if density == "edges":
        first, end = block.row_offset, block.row_offset + block.num_rows
        mask = np.zeros(500, bool)
        mask[max(first - 8, 0) : first + 3] = mask[end - 3 : min(end + 3, 500)] = True
    else:
        mask = rng.random(500) < density
    w0 = rng.standard_normal((height, block.num_cols + 1)).astype(np.float32)
    s0 = rng.random(height).astype(np.float32) + 1
    v0 = (rng.random((height, 3)) + 1).astype(jnp.bfloat16)  # a wider state row, 2 bytes a value
    key = jax.random.key(11)
    draw = jax.random.uniform(jax.random.fold_in(key, 0), (limit, 6), jnp.float32, *bounds)
    draw = np.asarray(draw)
    want_w, want_s, want_v = w0.copy(), s0.copy(), v0.copy()
    for i, r in enumerate(np.flatnonzero(mask)[:limit]):
        if here and block.row_offset <= r < block.row_offset + block.num_rows:
            at = block.buffer_row + r - block.row_offset
            want_w[at, : block.num_cols] = draw[
                i, block.col_offset : block.col_offset + block.num_cols
            ]
            want_s[at] = 0
            want_v[at] = 0

    def run(w, s, v, m, k, h):
        return reset_rows(
            {"b": w}, {"b": {"m": s, "v": v}}, {"t": m}, k,
            configs={"t": config}, limits={"t": limit}, blocks={"t": [block._replace(here=h)]},
        )  # fmt: skip

    for form in (jax.jit, xla_form):
        params, state = form(run)(w0, s0, v0, mask, key, np.bool_(here))
        np.testing.assert_array_equal(np.asarray(params["b"]), want_w)
        np.testing.assert_array_equal(np.asarray(state["b"]["m"]), want_s)
        np.testing.assert_array_equal(np.asarray(state["b"]["v"]), want_v)


def _training_remap_text(monkeypatch, built: bool, compiled: bool = False) -> str:
    """The CPU program of a managed training remap (profile, map, reset)."""
    from benchmarks.gpu_readiness import managed_remap_case
    from sparse_jax.managed._unsharded import RemapSpec, _build

    module, _, _, args = managed_remap_case(history_capacity=64)
    spec = RemapSpec(
        (("u", module.mc.modules["u"], "", 0),), module.mc.reset_plan(module.managed_tables)
    )
    with monkeypatch.context() as m:
        if not built:
            m.setattr(_ffi, "_register", lambda: "kernels switched off by the test")
        lowered = _build(spec).train.trace(*args).lower(lowering_platforms=("cpu",))
        return (lowered.compile() if compiled else lowered).as_text()


def test_the_cpu_training_step_updates_the_map_in_place_without_copying_it(monkeypatch):
    """The kernel updates the donated map in place; nothing else in the step may read the
    map from before the call (XLA would then copy it every step: 16 MB at 2^20 slots)."""
    compiled = _training_remap_text(monkeypatch, built=True, compiled=True)
    assert not re.search(r"[su]32\[32\]\{0\} copy\(", compiled), re.findall(r".*copy\(.*", compiled)


def test_the_cpu_training_step_takes_the_kernels_when_built_and_xla_when_not(monkeypatch):
    calls = r"custom_call @(HybridrecMch\w+|HybridrecMaskPositions|Hybridrec\w+Rows)\b"
    built = _training_remap_text(monkeypatch, built=True)
    assert sorted(set(re.findall(calls, built))) == [
        "HybridrecMaskPositions",
        "HybridrecMchProfileRemap",  # the profile and the batch's slots in one call
        "HybridrecResetRows",  # the fresh rows drawn and written in place, only those used
        "HybridrecZeroRows",  # their optimizer state zeroed in place
    ]
    assert "stablehlo.sort" not in built  # no sort of the table on the kernel path
    assert not re.search(calls, _training_remap_text(monkeypatch, built=False))


@pytest.mark.parametrize(("policy", "kernel"), [("ttl", True), ("distance_lfu", False)])
def test_a_policy_without_a_kernel_lowers_to_the_xla_form_on_cpu(policy, kernel):
    """The kernel has TTL but not DistanceLFU (float scores): with the kernels built, a
    "distance_lfu" map's CPU program is the XLA form (no kernel call, its eviction `cond`)."""
    settings = {"single_ttl": 3} if policy == "ttl" else {"decay_exponent": 1.5}
    mc = MCHManagedCollisionModule(
        16, history_capacity=16, eviction_policy=policy, eviction_interval=2, **settings
    )
    ids = RawIds.from_int64(np.arange(8))
    text = jax.jit(mc.profile).trace(mc.init(), ids).lower(lowering_platforms=("cpu",)).as_text()
    assert ("custom_call @HybridrecMchProfile" in text) is kernel
    assert ("stablehlo.case" in text) is not kernel
    # and it runs: the 8 ids admitted at the second call (the first eviction), a row each
    state, evicted = mc.profile(mc.profile(mc.init(), ids)[0], ids)
    slots = np.asarray(mc.remap(state, ids)).tolist()
    assert len(set(slots)) == 8 and mc.default_slot not in slots
    assert sorted(np.flatnonzero(np.asarray(evicted)).tolist()) == sorted(slots)
