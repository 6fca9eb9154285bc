"""Plain-loop oracles. Slow, obvious, and independent of the code they check.

Every fast path in the library is compared against one of these. They use Python lists
and numpy scalars only: no vectorized tricks.
"""

from __future__ import annotations

import math

import numpy as np

# ---------------------------------------------------------------- jagged data


def bags(keys, values, lengths, stride, cast=int):
    """{key: [[ids of bag 0], [ids of bag 1], ...]} by walking key-major lengths (`cast`:
    each value's type; float for per-id weights)."""
    out, pos = {}, 0
    for k_index, key in enumerate(keys):
        out[key] = []
        for b in range(stride):
            n = int(lengths[k_index * stride + b])
            out[key].append([cast(v) for v in values[pos : pos + n]])
            pos += n
    return out


def padded_dense(bag_list, length, padding_value=0):
    rows = []
    for bag in bag_list:
        row = list(bag[:length]) + [padding_value] * max(0, length - len(bag))
        rows.append(row)
    return rows


def segment_ids(lengths, capacity):
    ids = []
    for bag_index, n in enumerate(lengths):
        ids.extend([bag_index] * int(n))
    ids.extend([len(lengths)] * (capacity - len(ids)))
    return ids


# ---------------------------------------------------------------- pooled lookup


def pooled_lookup(weights, features, bag_ids, bag_weights=None):
    """[B, sum dims] by loops.

    weights: {table: [E, D] array}; features: list of (feature, table, pooling) in output
    order; bag_ids: {feature: [[ids], ...]}; bag_weights: {feature: [[w], ...]} or None.
    """
    blocks = []
    for feature, table, pooling in features:
        w = np.asarray(weights[table], dtype=np.float64)
        rows = []
        for b, ids in enumerate(bag_ids[feature]):
            acc = np.zeros(w.shape[1])
            for j, i in enumerate(ids):
                scale = 1.0 if bag_weights is None else float(bag_weights[feature][b][j])
                acc = acc + scale * w[i]
            if pooling == "MEAN" and ids:
                acc = acc / len(ids)
            rows.append(acc)
        blocks.append(np.array(rows).reshape(len(bag_ids[feature]), w.shape[1]))
    return np.concatenate(blocks, axis=1)


def row_gradients(features, bag_ids, grad_blocks, bag_weights=None):
    """{table: {row: summed grad}}: the deduplicated per-row gradient, by loops."""
    out = {}
    for feature, table, pooling in features:
        for b, ids in enumerate(bag_ids[feature]):
            for j, i in enumerate(ids):
                scale = 1.0 if bag_weights is None else float(bag_weights[feature][b][j])
                if pooling == "MEAN":
                    scale /= len(ids)
                g = scale * np.asarray(grad_blocks[feature][b], np.float64)
                out.setdefault(table, {})
                out[table][i] = out[table].get(i, 0.0) + g
    return out


def sorted_runs(entries):
    """The row-sorted id stream by loops: `entries` is a list of (row, bag, scale) in batch
    order; ids are ordered by row, ties in batch order. Returns unique rows, run offsets, and
    bag and scale per sorted position (lists)."""
    order = sorted(range(len(entries)), key=lambda i: (entries[i][0], i))
    unique, offsets, bag, scale = [], [], [], []
    for p, i in enumerate(order):
        row, b, s = entries[i]
        if not unique or unique[-1] != row:
            unique.append(row)
            offsets.append(p)
        bag.append(b)
        scale.append(s)
    offsets.append(len(order))
    return unique, offsets, bag, scale


def run_buckets(unique, offsets, bag, scale, classes, chunk):
    """The runs of `sorted_runs` by length class, by loops: {cap: [(row, bags, scales)]} for
    the runs of at most `cap` ids (and more than the class below; rows ascending), and the
    longer runs as [(row, [(chunk bags, chunk scales), ...])] with chunks of `chunk` ids."""
    buckets = {c: [] for c in classes}
    long = []
    for u, row in enumerate(unique):
        a, b = offsets[u], offsets[u + 1]
        n = b - a
        fits = [c for c in classes if c >= n]
        if fits:
            buckets[fits[0]].append((row, bag[a:b], scale[a:b]))
        else:
            parts = [
                (bag[p : min(p + chunk, b)], scale[p : min(p + chunk, b)])
                for p in range(a, b, chunk)
            ]
            long.append((row, parts))
    return buckets, long


def run_chunks(unique, offsets, size):
    """Every run of `sorted_runs` cut into chunks of at most `size` consecutive sorted
    positions, by loops: (chunk starts with the stream's end appended, each run's first
    chunk with the chunk count appended)."""
    starts, first = [], []
    for u in range(len(unique)):
        first.append(len(starts))
        p = offsets[u]
        while p < offsets[u + 1]:
            starts.append(p)
            p += size
    return starts + [offsets[-1]], first + [len(starts)]


def sorted_chunks_loop(rows, num_rows, size):
    """What `_kernels._pallas.sorted_chunks` finds, by loops: per run (ascending rows, ids
    outside `[0, num_rows)` left out) its row, its sorted positions, and for runs longer
    than `size` their chunks of `size` positions (lists of (start, end))."""
    order = sorted((r, i) for i, r in enumerate(rows) if 0 <= r < num_rows)
    runs, p = [], 0
    while p < len(order):
        q = p
        while q < len(order) and order[q][0] == order[p][0]:
            q += 1
        chunks = [(a, min(a + size, q)) for a in range(p, q, size)] if q - p > size else []
        runs.append((order[p][0], p, q, chunks))
        p = q
    return runs


def chunk_sums_loop(starts, bag, scale, bag_grads):
    """Per chunk `starts[c] : starts[c + 1]`, the sum of `scale * bag_grads[bag]` in order
    (bags outside `bag_grads` add nothing), by loops, fp64."""
    g = np.asarray(bag_grads, np.float64)
    out = np.zeros((len(starts) - 1, g.shape[1]))
    for c in range(len(starts) - 1):
        for i in range(starts[c], starts[c + 1]):
            if 0 <= bag[i] < g.shape[0]:
                out[c] += scale[i] * g[bag[i]]
    return out


# ---------------------------------------------------------------- row rules


def rule_step(name, hp, row, state, grad, step):
    """One row through one optimizer rule (FBGEMM's formulas). Returns (row, state)."""
    row = np.asarray(row, np.float64)
    grad = np.asarray(grad, np.float64)
    if name == "sgd":
        return row - hp["lr"] * grad, state
    if name == "adagrad":
        s = state["momentum1"] + grad * grad
        return row - hp["lr"] * grad / (np.sqrt(s) + hp["eps"]), {"momentum1": s}
    if name == "rowwise_adagrad":
        s = state["momentum1"] + sum(g * g for g in grad) / len(grad)
        return row - hp["lr"] * grad / (math.sqrt(s) + hp["eps"]), {"momentum1": s}
    if name == "adam":
        b1, b2 = hp["beta1"], hp["beta2"]
        m = b1 * state["momentum1"] + (1 - b1) * grad
        v = b2 * state["momentum2"] + (1 - b2) * grad * grad
        m_hat, v_hat = m / (1 - b1**step), v / (1 - b2**step)
        new = row - hp["lr"] * (m_hat / (np.sqrt(v_hat) + hp["eps"]) + hp["weight_decay"] * row)
        return new, {"momentum1": m, "momentum2": v}
    raise ValueError(name)


def initial_row_state(name, dim):
    if name == "sgd":
        return {}
    if name == "rowwise_adagrad":
        return {"momentum1": 0.0}
    if name == "adagrad":
        return {"momentum1": np.zeros(dim)}
    return {"momentum1": np.zeros(dim), "momentum2": np.zeros(dim)}


def fused_step(name, hp, weights, states, row_grads, step):
    """Apply `rule_step` to every touched row; weights/states are dicts updated in place.

    weights: {table: [E, D] float64 array}; states: {table: {row: state}} (missing = fresh).
    """
    for table, grads in row_grads.items():
        for i, g in grads.items():
            dim = weights[table].shape[1]
            state = states.setdefault(table, {}).get(i, initial_row_state(name, dim))
            weights[table][i], states[table][i] = rule_step(
                name, hp, weights[table][i], state, g, step
            )


def _murmur_mix(h):
    h &= 0xFFFFFFFF
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & 0xFFFFFFFF
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & 0xFFFFFFFF
    return h ^ (h >> 16)


def stochastic_round_loop(x, dtype, seed, step, rows):
    """Element by element: the narrow neighbours lo <= x <= hi (numpy's nextafter in the
    narrow type), a 24-bit uniform u from the hash of (seed, step, row, column), and hi when
    u < (x - lo) / (hi - lo); exact values stay, non-finite neighbours round to nearest."""
    out = np.empty(x.shape, dtype)
    quiet = np.errstate(
        over="ignore", invalid="ignore"
    )  # casts and nextafter past the largest value
    quiet.__enter__()
    key = _murmur_mix(seed ^ ((step * 0x9E3779B9) & 0xFFFFFFFF))
    for i, row in enumerate(rows):
        for j in range(x.shape[1]):
            v = float(x[i, j])
            near = np.asarray(v, np.float32).astype(dtype)
            toward = np.asarray(-np.inf if float(near) > v else np.inf, dtype)
            other = np.nextafter(near, toward)
            lo, hi = sorted([float(near), float(other)])
            if not (math.isfinite(lo) and math.isfinite(hi)):
                out[i, j] = near
                continue
            h = _murmur_mix(
                _murmur_mix(key ^ ((int(row) * 0x85EBCA6B) & 0xFFFFFFFF))
                ^ ((j * 0xC2B2AE35) & 0xFFFFFFFF)
            )
            u = (h >> 8) / 2.0**24
            out[i, j] = np.asarray(hi if u < (v - lo) / (hi - lo) else lo, dtype)
    quiet.__exit__(None, None, None)
    return out


# ---------------------------------------------------------------- quantized rows (FBGEMM IntN TBE layout)

_QUANT_BITS = {"int8": 8, "int4": 4, "int2": 2}


def _half_bytes(value):
    """The two little-endian bytes of float32 `value` rounded to fp16 (half to even, inf past 65504)."""
    with np.errstate(over="ignore"):
        bits = int(np.float16(np.float32(value)).view(np.uint16))
    return [bits & 0xFF, bits >> 8]


def _half_value(low, high):
    return float(np.uint16(low | (high << 8)).view(np.float16))


def quantize_rows_loop(table, weight_type, row_alignment=1):
    """uint8 [rows, row_bytes] by loops, following FBGEMM's FloatOrHalfToFusedNBitRowwiseQuantizedSBHalfRef
    (float32 scalar arithmetic), with scale and bias moved to the front of the row as the TBE stores it."""
    out = []
    for row in np.asarray(table, np.float32):
        data = []
        if weight_type == "fp16":
            for x in row:
                data += _half_bytes(x)
        else:
            bits = _QUANT_BITS[weight_type]
            top = 2**bits - 1
            smallest, largest = row[0], row[0]
            for x in row:
                smallest, largest = min(smallest, x), max(largest, x)
            bias = _half_bytes(smallest)
            low = np.float32(_half_value(*bias))
            with np.errstate(all="ignore"):
                span = np.float32(largest - low)
                scale = np.float32(1.0) if span == 0 else np.float32(span / np.float32(top))
                scale = np.float32(_half_value(*_half_bytes(scale)))
                if scale == 0:
                    scale = np.float32(1.0)
                inverse = np.float32(np.float32(1.0) / scale)
                if math.isinf(inverse):
                    scale, inverse = np.float32(1.0), np.float32(1.0)
                codes = []
                for x in row:
                    v = float(np.float32(np.float32(x - low) * inverse))
                    codes.append(
                        0 if math.isnan(v) or v < 0 else min(round(v), top)
                    )  # round: half to even
            data = _half_bytes(scale) + bias
            per_byte = 8 // bits
            for start in range(0, len(codes), per_byte):
                byte = 0
                for i in range(per_byte):
                    byte |= codes[start + i] << (i * bits)
                data.append(byte)
        data += [0] * (-len(data) % row_alignment)
        out.append(data)
    return np.array(out, np.uint8).reshape(len(out), -1)


def dequantize_rows_loop(packed, weight_type, dim):
    """float32 [rows, dim] by loops: scale * q + bias in float64, rounded once to float32
    (FBGEMM's FusedNBitRowwiseQuantizedSBHalfToFloatOrHalfRef)."""
    out = np.zeros((len(packed), dim), np.float32)
    for r, row in enumerate(packed):
        row = [int(b) for b in row]
        for j in range(dim):
            if weight_type == "fp16":
                out[r, j] = _half_value(row[2 * j], row[2 * j + 1])
                continue
            bits = _QUANT_BITS[weight_type]
            scale, bias = _half_value(row[0], row[1]), _half_value(row[2], row[3])
            byte = row[4 + j * bits // 8]
            q = (byte >> (j * bits % 8)) & (2**bits - 1)
            out[r, j] = np.float32(scale * q + bias)
    return out


def bounded_ids(ids, rows: int, bounds_check: str) -> np.ndarray:
    """The ids a lookup with `bounds_check` reads from a table of `rows` rows: clamped into
    it ("clamp"), or -1 (read as nothing) where outside it ("skip")."""
    ids = np.asarray(ids)
    if bounds_check == "clamp":
        return np.clip(ids, 0, rows - 1)
    return np.where((ids >= 0) & (ids < rows), ids, -1)


def position_rows_loop(bag_ids, bag_weights, features, cap):
    """One length-cap class of the XLA lookup's position matrices, by loops: `(rows,
    weights)` as `[cap][B * n]` lists, bag b * n + k being sample b of the k-th feature.

    bag_ids / bag_weights: {feature: [[ids of bag 0], ...]} (bag_weights None: all 1);
    features: (feature, row_offset, num_rows, pooling, bounds_check) per class member.
    A position past the bag's end, or holding a skipped id, is row 0 with weight 0; an id
    is clamped or skipped as `bounded_ids` says; MEAN divides the weight by the bag's
    length (in float32, at least 1)."""
    stride = len(bag_ids[features[0][0]])
    rows = [[0] * (stride * len(features)) for _ in range(cap)]
    weights = [[np.float32(0.0)] * (stride * len(features)) for _ in range(cap)]
    for b in range(stride):
        for k, (feature, row_offset, num_rows, pooling, bounds_check) in enumerate(features):
            bag = bag_ids[feature][b]
            for p, raw in enumerate(bag):
                (kept,) = bounded_ids([raw], num_rows, bounds_check)
                if kept < 0:
                    continue
                w = (
                    np.float32(1.0)
                    if bag_weights is None
                    else np.float32(bag_weights[feature][b][p])
                )
                if pooling == "MEAN":
                    w = np.float32(w / np.float32(max(len(bag), 1)))
                rows[p][b * len(features) + k] = int(kept) + row_offset
                weights[p][b * len(features) + k] = w
    return rows, weights


def quantized_pooled_loop(
    packed, weight_type, dim, ids, offsets, pooling="SUM", per_sample_weights=None
):
    """float64 [B, dim] by loops over bags of dequantized rows; id -1 (a pruned row) adds
    nothing, MEAN divides by the bag's full length, an empty bag is zeros."""
    rows = dequantize_rows_loop(packed, weight_type, dim)
    out = np.zeros((len(offsets) - 1, dim))
    for b in range(len(offsets) - 1):
        start, end = int(offsets[b]), int(offsets[b + 1])
        for i in range(start, end):
            if int(ids[i]) == -1:
                continue
            w = 1.0 if per_sample_weights is None else float(per_sample_weights[i])
            out[b] += w * rows[int(ids[i])].astype(np.float64)
        if pooling == "MEAN" and end > start:
            out[b] /= end - start
    return out


def distance_lfu_score(count, last, step, decay_exponent):
    """TorchRec's DistanceLFU score, in float32 as torch computes it:
    `count / (step - last + 1) ** decay_exponent`."""
    distance = np.float32(step - last + 1)
    return np.float32(np.float32(count) / np.power(distance, np.float32(decay_exponent)))


class ManagedCollisionLoop:
    """TorchRec's MCH remapping (sorted ZCH with LRU / LFU / DistanceLFU eviction, and a TTL in
    steps) with Python lists and dicts: the oracle for `sparse_jax.MCHManagedCollisionModule`.
    Ids are Python ints."""

    def __init__(
        self, zch_size, policy="lru", interval=1, threshold=1, decay_exponent=1.0, single_ttl=None
    ):
        self.z, self.policy, self.interval, self.threshold = zch_size, policy, interval, threshold
        self.decay_exponent, self.single_ttl = decay_exponent, single_ttl
        # TorchRec's sorted buffers: resident ids ascending, empty slots (None) after them in
        # the order a stable sort leaves them; the reserved default slot z-1 is always last
        self.entries = [{"raw": None, "slot": s, "count": 0, "last": 0} for s in range(zch_size)]
        self.step, self.last_eviction, self.window = 0, 0, []

    def remap(self, ids):
        owner = {e["raw"]: e["slot"] for e in self.entries if e["raw"] is not None}
        return [owner.get(i, self.z - 1) for i in ids]

    def profile(self, ids):
        """Record a training batch; the set of slots given to new ids when it evicts."""
        self.step += 1
        self.window += [(i, self.step) for i in ids]
        if self.step - self.last_eviction != self.interval:
            return set()
        count, last = {}, {}
        for i, s in self.window:
            count[i] = count.get(i, 0) + 1
            last[i] = max(last.get(i, 0), s)
        ranked = sorted(
            (i for i in sorted(count) if count[i] >= self.threshold), key=lambda i: -count[i]
        )
        where = {e["raw"]: n for n, e in enumerate(self.entries) if e["raw"] is not None}
        for i in ranked:
            if i in where:
                e = self.entries[where[i]]
                e["count"] += count[i]
                e["last"] = last[i]
        reserved = self.entries[-1]
        reserved["count"], reserved["last"] = float("inf"), self.step
        new = [i for i in ranked if i not in where]
        scores = self._scores(new, count, last)
        order = sorted(range(len(scores)), key=lambda k: -scores[k])  # stable: residents win ties
        winners = [k - self.z for k in order[: self.z] if k >= self.z]
        losers = [k for k in order[self.z :] if k < self.z]
        evicted = set()
        for w, n in zip(winners, losers, strict=True):
            slot = self.entries[n]["slot"]
            self.entries[n] = {
                "raw": new[w],
                "slot": slot,
                "count": count[new[w]],
                "last": last[new[w]],
            }
            evicted.add(slot)
        self.entries.sort(key=lambda e: (e["raw"] is None, e["raw"] if e["raw"] is not None else 0))
        self.window, self.last_eviction = [], self.step
        return evicted

    def _scores(self, new, count, last):
        """Eviction scores of the entries then the new ids (in `new`'s order), higher kept;
        `new` is reordered in place to the order the policy ranks new ids in (a stable sort
        by score keeps it among equal scores)."""
        if self.policy == "lfu":
            return [e["count"] for e in self.entries] + [count[i] for i in new]
        if self.policy == "distance_lfu":

            def score(c, t):  # (the reserved entry's count is inf: it scores inf)
                return distance_lfu_score(c, t, self.step, self.decay_exponent)

            return [score(e["count"], e["last"]) for e in self.entries] + [
                score(count[i], last[i]) for i in new
            ]
        new.sort(key=lambda i: -last[i])  # last seen descending (stable: then count, raw id)
        if self.policy == "lru":
            return [e["last"] for e in self.entries] + [last[i] for i in new]
        # ttl: only an expired resident (not seen for more than single_ttl steps) or an empty
        # entry can lose, the least recently seen first; every new id ranks above them
        inf = float("inf")

        def resident(e):
            if e is self.entries[-1]:  # the reserved entry never loses
                return inf
            if e["raw"] is None:
                return 0
            return e["last"] if self.step - e["last"] > self.single_ttl else inf

        return [resident(e) for e in self.entries] + [self.step for _ in new]


def serving_request_loop(bags, features, batch_rungs, max_batch_size, capacities, weights=None):
    """What `hybrid.serving._request.read_sparse` packs, by plain loops: (ids [capacity],
    offsets [features * rung + 1], weights [capacity] or None, batch) from per-sample id
    lists `bags[feature][sample]` (and `weights[feature][sample]`); ids already checked."""
    batch = len(bags[features[0]])
    rung = max_batch_size
    for r in batch_rungs:
        if r >= batch:
            rung = r
            break
    ids, w, offsets = [], [], [0]
    for f in features:
        for b in range(rung):
            bag = bags[f][b] if b < batch else []
            for k, i in enumerate(bag):
                ids.append(int(i))
                if weights is not None:
                    w.append(float(weights[f][b][k]))
            offsets.append(len(ids))
    capacity = next(c for c in capacities if c >= len(ids))
    out_ids = np.zeros(capacity, np.int32)
    out_ids[: len(ids)] = ids
    out_w = None
    if weights is not None:
        out_w = np.zeros(capacity, np.float32)
        out_w[: len(w)] = w
    return out_ids, np.array(offsets, np.int32), out_w, batch


def threefry2x32_loop(key, x0, x1):
    """Threefry-2x32 with 20 rounds (Random123; jax's `threefry2x32`) of one counter pair
    under `key` (two uint32), by plain integer arithmetic: (y0, y1)."""
    mask = 0xFFFFFFFF
    rotations = ((13, 15, 26, 6), (17, 29, 16, 24))
    ks = (int(key[0]), int(key[1]), int(key[0]) ^ int(key[1]) ^ 0x1BD11BDA)
    x0, x1 = (x0 + ks[0]) & mask, (x1 + ks[1]) & mask
    for block in range(5):
        for r in rotations[block % 2]:
            x0 = (x0 + x1) & mask
            x1 = ((x1 << r) | (x1 >> (32 - r))) & mask
            x1 ^= x0
        x0 = (x0 + ks[(block + 1) % 3]) & mask
        x1 = (x1 + ks[(block + 2) % 3] + block + 1) & mask
    return x0, x1


def uniform_table_loop(key, first, count, dim, lo, hi):
    """Rows `first : first + count` of `jax.random.uniform(key, (rows, dim), float32, lo,
    hi)` under partitionable threefry (jax's default), element by element: the bits of flat
    index n are threefry2x32 of the words (n >> 32, n & 0xffffffff), the two outputs xor-ed;
    the float is `(bitcast(bits >> 9 | 1.0) - 1) * (hi - lo) + lo`, at least lo, in float32,
    the product and sum fused (one rounding) as XLA:CPU contracts them on an FMA machine."""
    lo32, hi32 = np.float32(lo), np.float32(hi)
    out = np.zeros((count, dim), np.float32)
    for i in range(count):
        for j in range(dim):
            n = (first + i) * dim + j
            y0, y1 = threefry2x32_loop(key, n >> 32, n & 0xFFFFFFFF)
            one = np.array([((y0 ^ y1) >> 9) | 0x3F800000], np.uint32).view(np.float32)[0]
            fused = np.float64(one - np.float32(1.0)) * np.float64(hi32 - lo32) + np.float64(lo32)
            out[i, j] = max(lo32, np.float32(fused))
    return out


# ---------------------------------------------------------------- dense interaction


def interaction_loop(dense, sparse):
    """TorchRec's `InteractionArch` forward, sample by sample in float64: row b is dense[b]
    then dot(v_i, v_j) for i < j (row-major) over v_0 = dense[b], v_f = sparse[b][f - 1]."""
    out = []
    for b in range(len(dense)):
        vectors = [[float(x) for x in dense[b]]] + [[float(x) for x in f] for f in sparse[b]]
        row = list(vectors[0])
        for i in range(len(vectors)):
            for j in range(i + 1, len(vectors)):
                row.append(math.fsum(a * c for a, c in zip(vectors[i], vectors[j], strict=True)))
        out.append(row)
    return np.array(out, dtype=np.float64).reshape(len(dense), -1)
