// Managed-collision id maps on CPU (XLA FFI): the fused training remap (`profile`) and the
// eval lookup (`remap`) of `sparse_jax.MCHManagedCollisionModule`, bit for bit the state and
// outputs of its XLA form (sparse_jax/managed/_id_map.py), without sorting the table.
//
// The state is the checkpointed layout: resident ids ascending as (hi int32, lo uint32)
// words (INT64_MAX marks an empty entry; the last entry is the default slot's), the slot,
// LFU count and LRU last access of each entry, and the eviction window. A raw id is the
// int64 `hi << 32 | lo`, so the words' order is the int64 order.
//
// MchProfile: append the batch's valid ids to the window; when an eviction is due, coalesce
//   the window with an open-addressing hash table keyed by the 64-bit id (count, last
//   access), sort only its distinct ids, find them among the residents by galloping search
//   (the ids ascend), update the residents' metadata, rank the new ids, select the weakest
//   residents by a radix selection over their scores (no sort of the table), give the losing
//   entries' slots to the winning ids and move the entries in place to keep the order
//   (only entries between changes move, each once). State buffers are aliased to the
//   outputs (updated in place). Also returns how many entries an id held before the call.
// MaskPositions: the positions of a bool mask's first `size` set entries, ascending, then
//   `fill` (jnp.nonzero(mask, size=size, fill_value=fill)): which rows a reset draws afresh.
// MchRemap: the slot of each id (the default slot when not resident): the ids sorted by a
//   radix sort, then found by galloping search, the sorted run split over threads.
// (The fresh rows' random bits, `HybridrecRowBits`, are random_cpu.cc's.)
#include <omp.h>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <cstring>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kEmpty = INT64_MAX;  // the id of an empty entry
constexpr uint64_t kSign = uint64_t(1) << 63;

inline int64_t Key(int32_t hi, uint32_t lo) {
  return static_cast<int64_t>((static_cast<uint64_t>(static_cast<uint32_t>(hi)) << 32) | lo);
}

// The sorted resident ids, read as int64 keys.
struct Residents {
  const int32_t* hi;
  const uint32_t* lo;
  inline int64_t at(int64_t j) const { return Key(hi[j], lo[j]); }
};

// First j in [from, n) with ids[j] >= k (n when none), given ids[from - 1] < k: exponential
// steps from `from`, then bisection.
int64_t Gallop(const Residents& r, int64_t from, int64_t n, int64_t k) {
  int64_t lo = from, hi = n, bound = 1;
  while (true) {
    const int64_t probe = from + bound - 1;
    if (probe >= n) break;
    if (r.at(probe) >= k) {
      hi = probe;
      break;
    }
    lo = probe + 1;
    bound <<= 1;
  }
  while (lo < hi) {
    const int64_t mid = lo + (hi - lo) / 2;
    if (r.at(mid) < k)
      lo = mid + 1;
    else
      hi = mid;
  }
  return lo;
}

// Stable LSD radix sort of `n` (uint64 key, uint32 payload) pairs, ascending by key, in
// 11-bit digits; digits that are the same for every key are skipped. `key`, `val` are
// sorted in place (`tmp_key`, `tmp_val`: scratch of n).
void RadixSort(uint64_t* key, uint32_t* val, uint64_t* tmp_key, uint32_t* tmp_val, int64_t n) {
  constexpr int kBits = 11, kPasses = 6, kBins = 1 << kBits;
  if (n <= 1) return;
  std::vector<int64_t> hist(static_cast<size_t>(kPasses) * kBins, 0);
  for (int64_t i = 0; i < n; ++i) {
    const uint64_t k = key[i];
    for (int p = 0; p < kPasses; ++p) ++hist[p * kBins + ((k >> (p * kBits)) & (kBins - 1))];
  }
  for (int p = 0; p < kPasses; ++p) {
    int64_t* h = hist.data() + p * kBins;
    const int shift = p * kBits;
    if (h[(key[0] >> shift) & (kBins - 1)] == n) continue;  // one digit value: nothing moves
    int64_t sum = 0;
    for (int b = 0; b < kBins; ++b) {
      const int64_t c = h[b];
      h[b] = sum;
      sum += c;
    }
    for (int64_t i = 0; i < n; ++i) {
      const int64_t at = h[(key[i] >> shift) & (kBins - 1)]++;
      tmp_key[at] = key[i];
      tmp_val[at] = val[i];
    }
    std::memcpy(key, tmp_key, sizeof(uint64_t) * n);
    std::memcpy(val, tmp_val, sizeof(uint32_t) * n);
  }
}

inline uint64_t Mix(uint64_t x) {  // splitmix64's finalizer
  x ^= x >> 30;
  x *= 0xbf58476d1ce4e5b9ULL;
  x ^= x >> 27;
  x *= 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

// The window's distinct ids with their counts and last access, in order of first
// appearance: open addressing (linear probing) keyed by the 64-bit id.
struct Coalesced {
  std::vector<int64_t> ids;
  std::vector<int32_t> count, last;
};

void Coalesce(const int32_t* whi, const uint32_t* wlo, const int32_t* wstep, int64_t n,
              Coalesced& out) {
  int64_t cap = 16;
  while (cap < 2 * n) cap <<= 1;
  static thread_local std::vector<int64_t> keys;
  static thread_local std::vector<int32_t> index;
  keys.resize(cap);
  index.assign(cap, -1);
  out.ids.clear();
  out.count.clear();
  out.last.clear();
  const uint64_t mask = cap - 1;
  constexpr int64_t kAhead = 8;  // the table's slot of the id kAhead on is prefetched
  for (int64_t i = 0; i < n; ++i) {
    if (i + kAhead < n) {
      const uint64_t ahead = Mix(static_cast<uint64_t>(Key(whi[i + kAhead], wlo[i + kAhead]))) & mask;
      __builtin_prefetch(&index[ahead]);
      __builtin_prefetch(&keys[ahead]);
    }
    const int64_t k = Key(whi[i], wlo[i]);
    uint64_t h = Mix(static_cast<uint64_t>(k)) & mask;
    while (true) {
      const int32_t u = index[h];
      if (u < 0) {
        index[h] = static_cast<int32_t>(out.ids.size());
        keys[h] = k;
        out.ids.push_back(k);
        out.count.push_back(1);
        out.last.push_back(wstep[i]);
        break;
      }
      if (keys[h] == k) {
        ++out.count[u];
        out.last[u] = std::max(out.last[u], wstep[i]);
        break;
      }
      h = (h + 1) & mask;
    }
  }
}

// The state as the kernel updates it (the output buffers, holding the input's values).
struct State {
  int32_t* hi;
  uint32_t* lo;
  int32_t* slots;
  int32_t* counts;
  int32_t* last;
  int32_t* whi;
  uint32_t* wlo;
  int32_t* wstep;
  int32_t* used;
  int32_t* step;
  int32_t* last_eviction;
  int64_t z, h;
};

// Positions of the `m` weakest of the resident entries [0, n) by `score` (lowest first;
// among equal scores the later position first), by radix selection over the scores' range
// (most often one histogram pass; wider ranges a second one within the bucket holding the
// m-th), then one pass collecting the entries below the m-th score, and the latest ones at
// it scanning back from the end; only those m are sorted. The passes over every entry are
// split over the threads.
std::vector<int64_t> Weakest(const int32_t* score, int64_t n, int64_t m) {
  std::vector<int64_t> out;
  if (m <= 0) return out;
  const int threads = std::max(1, std::min(omp_get_max_threads(), static_cast<int>(n >> 10)));
  int32_t low = INT32_MAX, high = INT32_MIN;
#pragma omp parallel for num_threads(threads) reduction(min : low) reduction(max : high) schedule(static)
  for (int64_t j = 0; j < n; ++j) {
    low = std::min(low, score[j]);
    high = std::max(high, score[j]);
  }
  // v = score - low in [0, range]; the first histogram is of v >> shift (at most 2^16 bins)
  const uint32_t range = static_cast<uint32_t>(static_cast<int64_t>(high) - low);
  int range_bits = 0;
  while (range_bits < 32 && (range >> range_bits) != 0) ++range_bits;
  const int shift = std::max(0, range_bits - 16);
  const int64_t bins = static_cast<int64_t>(range >> shift) + 1;
  auto v = [score, low](int64_t j) {
    return static_cast<uint32_t>(static_cast<int64_t>(score[j]) - low);
  };
  std::vector<int64_t> hist(static_cast<size_t>(threads) * bins, 0);
#pragma omp parallel num_threads(threads)
  {
    int64_t* mine = hist.data() + static_cast<size_t>(omp_get_thread_num()) * bins;
#pragma omp for schedule(static)
    for (int64_t j = 0; j < n; ++j) ++mine[v(j) >> shift];
  }
  int64_t below = 0, bucket = 0;
  for (; bucket < bins; ++bucket) {
    int64_t c = 0;
    for (int t = 0; t < threads; ++t) c += hist[static_cast<size_t>(t) * bins + bucket];
    if (below + c >= m) break;
    below += c;
  }
  uint32_t t = static_cast<uint32_t>(bucket) << shift;  // the m-th lowest v
  if (shift > 0) {  // within the bucket, by the low `shift` bits
    const uint32_t mask = (uint32_t(1) << shift) - 1;
    std::vector<int64_t> fine(size_t(1) << shift, 0);
    for (int64_t j = 0; j < n; ++j) {
      const uint32_t x = v(j);
      if ((x >> shift) == static_cast<uint32_t>(bucket)) ++fine[x & mask];
    }
    for (uint32_t b = 0;; ++b) {
      if (below + fine[b] >= m) {
        t |= b;
        break;
      }
      below += fine[b];
    }
  }
  // the entries below t (all of them, per thread chunk), then the latest m - below at t
  // (scanning back from the end: often the first entries seen, e.g. the empty ones)
  std::vector<std::vector<int64_t>> under(threads);
#pragma omp parallel for num_threads(threads) schedule(static, 1)
  for (int id = 0; id < threads; ++id) {
    const int64_t begin = n * id / threads, end = n * (id + 1) / threads;
    for (int64_t j = begin; j < end; ++j)
      if (v(j) < t) under[id].push_back(j);
  }
  out.reserve(m);
  for (int64_t j = n - 1, ties = m - below; j >= 0 && ties > 0; --j)
    if (v(j) == t) out.push_back(j), --ties;
  for (int id = 0; id < threads; ++id) out.insert(out.end(), under[id].begin(), under[id].end());
  // lowest score first, then the later position first
  std::vector<uint64_t> key(m), tmp_key(m);
  std::vector<uint32_t> val(m), tmp_val(m);
  for (int64_t i = 0; i < m; ++i) {
    key[i] = (static_cast<uint64_t>(v(out[i])) << 32) | (0xFFFFFFFFu - static_cast<uint32_t>(out[i]));
    val[i] = static_cast<uint32_t>(out[i]);
  }
  RadixSort(key.data(), val.data(), tmp_key.data(), tmp_val.data(), m);
  for (int64_t i = 0; i < m; ++i) out[i] = val[i];
  return out;
}

// Moves `a`'s surviving entries to their places once the `lost` positions (ascending) leave
// and winners join before the old entries `below` (ascending): runs moving right are moved
// right to left, then runs moving left left to right, so no entry is overwritten before it
// moved. The winners' places are left for the caller.
struct Run {
  int64_t begin, end, shift;
};

std::vector<Run> Runs(const std::vector<int64_t>& lost, const std::vector<int64_t>& below, int64_t z) {
  std::vector<Run> runs;
  size_t li = 0, wi = 0;
  int64_t shift = 0, at = 0;
  while (at < z) {
    while (wi < below.size() && below[wi] <= at) ++shift, ++wi;
    if (li < lost.size() && lost[li] == at) {
      --shift, ++li, ++at;
      continue;
    }
    int64_t next = z;
    if (li < lost.size()) next = std::min(next, lost[li]);
    if (wi < below.size()) next = std::min(next, below[wi]);
    if (shift != 0) runs.push_back({at, next, shift});
    at = next;
  }
  return runs;
}

template <typename T>
void MoveRuns(T* a, const std::vector<Run>& runs) {
  for (auto r = runs.rbegin(); r != runs.rend(); ++r)
    if (r->shift > 0) std::memmove(a + r->begin + r->shift, a + r->begin, sizeof(T) * (r->end - r->begin));
  for (const Run& r : runs)
    if (r.shift < 0) std::memmove(a + r.begin + r.shift, a + r.begin, sizeof(T) * (r.end - r.begin));
}

// Eviction policies (the `policy` attribute): `sparse_jax.managed._id_map._KERNEL_POLICIES`.
// "distance_lfu" (float scores) is not here: its CPU lowering is the XLA form.
enum Policy : int32_t { kLru = 0, kLfu = 1, kTtl = 2 };

void Evict(State& s, bool* evicted, int32_t policy, int32_t threshold, int32_t ttl) {
  const bool lfu = policy == kLfu;
  const int64_t z = s.z;
  const int32_t step = *s.step;
  const int64_t n = std::min<int64_t>(std::max<int32_t>(*s.used, 0), s.h);
  static thread_local Coalesced scratch;  // (kept between calls: no reallocation)
  Coalesced& win = scratch;  // the calling thread's, also inside the parallel regions below
  Coalesce(s.whi, s.wlo, s.wstep, n, win);
  const int64_t u = static_cast<int64_t>(win.ids.size());
  // distinct ids ascending (int64 order)
  std::vector<uint64_t> key(u), tmp_key(u);
  std::vector<uint32_t> order(u), tmp_val(u);
  for (int64_t i = 0; i < u; ++i) {
    key[i] = static_cast<uint64_t>(win.ids[i]) ^ kSign;
    order[i] = static_cast<uint32_t>(i);
  }
  RadixSort(key.data(), order.data(), tmp_key.data(), tmp_val.data(), u);
  // residents' metadata; the admitted ids that are not resident, ascending, with the count
  // of residents below each
  // (the ids split over the threads in order; each gallops through its part)
  const Residents res{s.hi, s.lo};
  const int threads = std::max(1, std::min(omp_get_max_threads(), static_cast<int>(u >> 9)));
  std::vector<std::vector<uint32_t>> fresh_of(threads);
  std::vector<std::vector<int64_t>> below_of(threads);
#pragma omp parallel for num_threads(threads) schedule(static, 1)
  for (int id = 0; id < threads; ++id) {
    int64_t from = 0;
    for (int64_t i = u * id / threads; i < u * (id + 1) / threads; ++i) {
      const uint32_t w = order[i];
      if (win.count[w] < threshold) continue;
      const int64_t k = win.ids[w];
      const int64_t pos = Gallop(res, from, z - 1, k);
      from = pos;
      if (res.at(pos) == k) {
        const int32_t c = s.counts[pos];
        s.counts[pos] = c > INT32_MAX - win.count[w] ? INT32_MAX : c + win.count[w];
        s.last[pos] = win.last[w];
      } else {
        fresh_of[id].push_back(w);
        below_of[id].push_back(pos);
      }
    }
  }
  std::vector<uint32_t> fresh;  // window index of each new id, ascending by id
  std::vector<int64_t> fresh_below;
  for (int id = 0; id < threads; ++id) {
    fresh.insert(fresh.end(), fresh_of[id].begin(), fresh_of[id].end());
    fresh_below.insert(fresh_below.end(), below_of[id].begin(), below_of[id].end());
  }
  s.counts[z - 1] = INT32_MAX;
  s.last[z - 1] = step;
  // the new ids best first: LFU count descending, LRU last access descending then count
  // descending; ties keep the id order (the sort is stable)
  const int64_t f = static_cast<int64_t>(fresh.size());
  std::vector<uint64_t> rank_key(f), rank_tmp(f);
  std::vector<uint32_t> best(f), best_tmp(f);
  for (int64_t i = 0; i < f; ++i) {
    const uint32_t w = fresh[i];
    const uint64_t by_count = 0xFFFFFFFFu - static_cast<uint32_t>(win.count[w]);
    rank_key[i] = lfu ? by_count : (static_cast<uint64_t>(static_cast<uint32_t>(step - win.last[w])) << 32) | by_count;
    best[i] = static_cast<uint32_t>(i);
  }
  RadixSort(rank_key.data(), best.data(), rank_tmp.data(), best_tmp.data(), f);
  // the i-th best new id wins iff it beats the i-th weakest resident (a resident wins ties);
  // TTL: an expired (step - last > ttl) or empty entry scores its last access (empty: 0), a
  // live one INT32_MAX, a new id the step
  std::vector<int32_t> ttl_score;
  if (policy == kTtl) {
    ttl_score.resize(z);
    for (int64_t j = 0; j < z; ++j) {
      const bool empty = res.at(j) == kEmpty;
      ttl_score[j] = empty ? 0 : step - s.last[j] > ttl ? s.last[j] : INT32_MAX;
    }
  }
  const int32_t* score = policy == kTtl ? ttl_score.data() : lfu ? s.counts : s.last;
  const int64_t m = std::min<int64_t>(f, z - 1);
  const std::vector<int64_t> weak = Weakest(score, z - 1, m);
  int64_t won = 0;
  while (won < m) {
    const uint32_t w = fresh[best[won]];
    const int32_t mine = policy == kTtl ? step : lfu ? win.count[w] : win.last[w];
    if (!(mine > score[weak[won]])) break;
    ++won;
  }
  std::memset(evicted, 0, sizeof(bool) * z);
  *s.used = 0;
  std::memset(s.wstep, 0, sizeof(int32_t) * s.h);
  *s.last_eviction = step;
  if (won == 0) return;
  // the best winner takes the best loser's (the won-th weakest) entry, and so on down
  std::vector<int32_t> won_slot(f, -1);
  std::vector<uint64_t> lost_bits((z + 63) / 64, 0);
  for (int64_t i = 0; i < won; ++i) {
    const int64_t loser = weak[won - 1 - i];
    won_slot[best[i]] = s.slots[loser];
    evicted[s.slots[loser]] = true;
    lost_bits[loser >> 6] |= uint64_t(1) << (loser & 63);
  }
  std::vector<int64_t> lost, below, winner;  // ascending; winners in id order
  lost.reserve(won);
  below.reserve(won);
  winner.reserve(won);
  for (size_t b = 0; b < lost_bits.size(); ++b)
    for (uint64_t bits = lost_bits[b]; bits; bits &= bits - 1)
      lost.push_back(static_cast<int64_t>(b) * 64 + __builtin_ctzll(bits));
  for (int64_t i = 0; i < f; ++i)
    if (won_slot[i] >= 0) {
      below.push_back(fresh_below[i]);
      winner.push_back(i);
    }
  const std::vector<Run> runs = Runs(lost, below, z);
#pragma omp parallel sections if (z >= (1 << 15))
  {
#pragma omp section
    MoveRuns(s.hi, runs);
#pragma omp section
    MoveRuns(s.lo, runs);
#pragma omp section
    MoveRuns(s.slots, runs);
#pragma omp section
    MoveRuns(s.counts, runs);
#pragma omp section
    MoveRuns(s.last, runs);
  }
  // winner j (in id order) lands after the survivors below it and the winners before it
  size_t li = 0;
  for (int64_t j = 0; j < won; ++j) {
    while (li < lost.size() && lost[li] < below[j]) ++li;
    const int64_t at = j + below[j] - static_cast<int64_t>(li);
    const int64_t i = winner[j];
    const uint32_t w = fresh[i];
    const int64_t k = win.ids[w];
    s.hi[at] = static_cast<int32_t>(static_cast<uint64_t>(k) >> 32);
    s.lo[at] = static_cast<uint32_t>(static_cast<uint64_t>(k));
    s.slots[at] = won_slot[i];
    s.counts[at] = win.count[w];
    s.last[at] = win.last[w];
  }
}

template <ffi::DataType T>
auto* Take(ffi::Buffer<T> in, ffi::Result<ffi::Buffer<T>> out) {
  auto* dst = out->typed_data();
  if (dst != in.typed_data()) std::memcpy(dst, in.typed_data(), in.size_bytes());
  return dst;
}

ffi::Error MchProfileImpl(ffi::Buffer<ffi::S32> hi, ffi::Buffer<ffi::U32> lo, ffi::Buffer<ffi::S32> slots,
                          ffi::Buffer<ffi::S32> counts, ffi::Buffer<ffi::S32> last,
                          ffi::Buffer<ffi::S32> whi, ffi::Buffer<ffi::U32> wlo,
                          ffi::Buffer<ffi::S32> wstep, ffi::Buffer<ffi::S32> used,
                          ffi::Buffer<ffi::S32> step, ffi::Buffer<ffi::S32> last_eviction,
                          ffi::Buffer<ffi::S32> ids_hi, ffi::Buffer<ffi::U32> ids_lo,
                          ffi::Buffer<ffi::PRED> valid, ffi::Result<ffi::Buffer<ffi::S32>> o_hi,
                          ffi::Result<ffi::Buffer<ffi::U32>> o_lo, ffi::Result<ffi::Buffer<ffi::S32>> o_slots,
                          ffi::Result<ffi::Buffer<ffi::S32>> o_counts,
                          ffi::Result<ffi::Buffer<ffi::S32>> o_last, ffi::Result<ffi::Buffer<ffi::S32>> o_whi,
                          ffi::Result<ffi::Buffer<ffi::U32>> o_wlo,
                          ffi::Result<ffi::Buffer<ffi::S32>> o_wstep,
                          ffi::Result<ffi::Buffer<ffi::S32>> o_used,
                          ffi::Result<ffi::Buffer<ffi::S32>> o_step,
                          ffi::Result<ffi::Buffer<ffi::S32>> o_last_eviction,
                          ffi::Result<ffi::Buffer<ffi::PRED>> evicted,
                          ffi::Result<ffi::Buffer<ffi::S32>> occupied, int32_t policy, int32_t interval,
                          int32_t threshold, int32_t ttl) {
  State s{Take(hi, o_hi),         Take(lo, o_lo),       Take(slots, o_slots), Take(counts, o_counts),
          Take(last, o_last),     Take(whi, o_whi),     Take(wlo, o_wlo),     Take(wstep, o_wstep),
          Take(used, o_used),     Take(step, o_step),   Take(last_eviction, o_last_eviction),
          static_cast<int64_t>(hi.element_count()), static_cast<int64_t>(whi.element_count())};
  bool* ev = evicted->typed_data();
  // the entries an id holds before this call: where the first empty entry is
  *occupied->typed_data() = static_cast<int32_t>(Gallop(Residents{s.hi, s.lo}, 0, s.z - 1, kEmpty));
  const int64_t n = ids_hi.element_count();
  const int32_t now = *s.step + 1;
  *s.step = now;
  const int32_t* ih = ids_hi.typed_data();
  const uint32_t* il = ids_lo.typed_data();
  const bool* ok = valid.typed_data();
  int64_t at = *s.used;
  int32_t taken = 0;
  for (int64_t i = 0; i < n; ++i) {
    if (!ok[i]) continue;
    if (at >= 0 && at < s.h) {  // (a window that would overflow is refused at trace time)
      s.whi[at] = ih[i];
      s.wlo[at] = il[i];
      s.wstep[at] = now;
    }
    ++at;
    ++taken;
  }
  *s.used += taken;
  if (now - *s.last_eviction == interval) {
    Evict(s, ev, policy, threshold, ttl);
  } else {
    std::memset(ev, 0, sizeof(bool) * s.z);
  }
  return ffi::Error::Success();
}

ffi::Error MchRemapImpl(ffi::Buffer<ffi::S32> hi, ffi::Buffer<ffi::U32> lo, ffi::Buffer<ffi::S32> slots,
                        ffi::Buffer<ffi::S32> ids_hi, ffi::Buffer<ffi::U32> ids_lo,
                        ffi::Result<ffi::Buffer<ffi::S32>> out) {
  const int64_t z = hi.element_count(), n = ids_hi.element_count();
  const Residents res{hi.typed_data(), lo.typed_data()};
  const int32_t* slot = slots.typed_data();
  const int32_t* ih = ids_hi.typed_data();
  const uint32_t* il = ids_lo.typed_data();
  int32_t* o = out->typed_data();
  std::vector<uint64_t> key(n), tmp_key(n);
  std::vector<uint32_t> at(n), tmp_val(n);
  for (int64_t i = 0; i < n; ++i) {
    key[i] = static_cast<uint64_t>(Key(ih[i], il[i])) ^ kSign;
    at[i] = static_cast<uint32_t>(i);
  }
  RadixSort(key.data(), at.data(), tmp_key.data(), tmp_val.data(), n);
  const int threads = std::max(1, std::min(omp_get_max_threads(), static_cast<int>(n >> 9)));
#pragma omp parallel num_threads(threads)
  {
    const int t = omp_get_thread_num(), nt = omp_get_num_threads();
    const int64_t begin = n * t / nt, end = n * (t + 1) / nt;
    int64_t from = 0, pos = 0;
    int64_t prev = 0;
    bool have = false;
    int32_t answer = 0;
    for (int64_t i = begin; i < end; ++i) {
      const int64_t k = static_cast<int64_t>(key[i] ^ kSign);
      if (!have || k != prev) {
        pos = Gallop(res, from, z - 1, k);
        from = pos;
        answer = res.at(pos) == k ? slot[pos] : static_cast<int32_t>(z - 1);
        prev = k;
        have = true;
      }
      o[at[i]] = answer;
    }
  }
  return ffi::Error::Success();
}

ffi::Error MaskPositionsImpl(ffi::Buffer<ffi::PRED> mask, ffi::Result<ffi::Buffer<ffi::S32>> out,
                             int32_t fill) {
  const bool* m = mask.typed_data();
  const int64_t n = mask.element_count(), size = out->element_count();
  int32_t* o = out->typed_data();
  int64_t k = 0;
  for (int64_t i = 0; i < n && k < size; ++i)
    if (m[i]) o[k++] = static_cast<int32_t>(i);
  for (; k < size; ++k) o[k] = fill;
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(HybridrecMaskPositions, MaskPositionsImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::PRED>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Attr<int32_t>("fill"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(HybridrecMchProfile, MchProfileImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::U32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::U32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::U32>>()
                                  .Arg<ffi::Buffer<ffi::PRED>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::U32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::U32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::PRED>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Attr<int32_t>("policy")
                                  .Attr<int32_t>("interval")
                                  .Attr<int32_t>("threshold")
                                  .Attr<int32_t>("ttl"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(HybridrecMchRemap, MchRemapImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::U32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::U32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>());
