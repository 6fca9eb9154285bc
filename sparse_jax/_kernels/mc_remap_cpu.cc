// Managed-collision id maps on CPU (XLA FFI): the fused training remap (`profile`) and the
// eval lookup (`remap`) of `sparse_jax.MCHManagedCollisionModule`, bit for bit the state and
// outputs of its XLA form (sparse_jax/managed/_id_map.py), without sorting the table.
//
// The state is the checkpointed layout: resident ids ascending as (hi int32, lo uint32)
// words (INT64_MAX marks an empty entry; the last entry is the default slot's), the slot,
// LFU count and LRU last access of each entry (each policy keeps one of the two, as
// TorchRec's policies keep only their own metadata: LFU the count, LRU and TTL the last
// access; the other column is left as it is), and the eviction window. A raw id is the
// int64 `hi << 32 | lo`, so the words' order is the int64 order.
//
// MchProfile: append the batch's valid ids to the window; when an eviction is due, coalesce
//   the window by one sort of (id, position) (a counting pass by the ids' top bits, then
//   small buckets: the distinct ids ascending, with their count and last access), find them
//   among the residents by a forward scan (blocks of 8 by the high words, galloping past
//   long gaps), update the
//   residents' metadata, rank the new ids, select the weakest residents (one pass over the
//   scores collecting those below a bound guessed from a sample; a radix selection over all
//   of them when the guess fails; never a sort of the table), give the losing entries'
//   slots to the winning ids and move the entries in place to keep the order (only entries
//   between changes move, each once, in the four columns the policy keeps, the runs split
//   over two threads at their middle, the few entries where the halves meet written again
//   afterwards). State buffers are aliased to the outputs
//   (updated in place). Also returns how many entries an id held before the call and after
//   it, and how many slots it gave to new ids (int32[3]).
// MchProfileRemap: MchProfile, then the slot of each of the batch's ids on the new state (what
//   MchRemap would answer): when the call evicts, read off the eviction (each valid id's
//   distinct window id: its entry's slot unless it lost it, a winner's new slot, else the
//   default), padding searched; else by MchRemap's lookup. The training step's one call.
// MaskPositions: the positions of a bool mask's first `size` set entries, ascending, then
//   `fill` (jnp.nonzero(mask, size=size, fill_value=fill)): which rows a reset draws afresh.
// MchRemap: the slot of each id (the default slot when not resident): the ids sorted by a
//   radix sort, then found by a forward scan of the residents, the sorted run split over
//   threads.
// (The fresh rows' random bits, `HybridrecRowBits`, are random_cpu.cc's.)
#include <omp.h>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "xla/ffi/api/ffi.h"

#ifdef __AVX512F__
#include <immintrin.h>  // the entries' moves (MoveWords)
#endif

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

// `Gallop` for a query close to the last one (the ids of a sorted run of queries, dense
// among the residents): a scan of 8 entries at a time by their high words (one
// mispredicted branch per query instead of one per probe), then a branch-free count in the
// block; after `kFar` blocks it gallops the rest.
int64_t Scan(const Residents& r, int64_t from, int64_t n, int64_t k) {
  constexpr int kFar = 8;
  const int32_t khi = static_cast<int32_t>(static_cast<uint64_t>(k) >> 32);
  for (int blocks = 0; from + 8 <= n; ++blocks) {
    if (r.hi[from + 7] < khi) {
      if (blocks == kFar) return Gallop(r, from + 8, n, k);
      from += 8;
      continue;
    }
    int c = 0;
    for (int j = 0; j < 8; ++j) c += r.at(from + j) < k;
    if (c < 8) return from + c;
    from += 8;
  }
  while (from < n && r.at(from) < k) ++from;
  return from;
}

// The bits in which the `n` keys differ (AND and OR of them all, compared), on `threads`
// threads: a digit with none of them set holds one value for every key.
uint64_t DifferingBits(const uint64_t* key, int64_t n, int threads) {
  uint64_t all = ~uint64_t(0), any = 0;
#pragma omp parallel for num_threads(threads) reduction(& : all) reduction(| : any) schedule(static)
  for (int64_t i = 0; i < n; ++i) all &= key[i], any |= key[i];
  return all ^ any;
}

// Stable LSD radix sort of `n` (uint64 key, uint32 payload) pairs, ascending by key, in
// 11-bit digits; digits that are the same for every key (no bit of them differs between
// the keys) are skipped. `key`, `val` are sorted in place (`tmp_key`, `tmp_val`: scratch of
// n). Large sorts run on two threads: each counts and places a contiguous half of the
// keys, the second half's places after the first's in every bin, so the order is the
// serial sort's.
void RadixSort(uint64_t* key, uint32_t* val, uint64_t* tmp_key, uint32_t* tmp_val, int64_t n) {
  constexpr int kBits = 11, kPasses = 6, kBins = 1 << kBits;
  if (n <= 1) return;
  const int threads = std::max(1, std::min(omp_get_max_threads(), static_cast<int>(n >> 14)));
  const uint64_t differ = DifferingBits(key, n, threads);
  std::vector<int64_t> hist(static_cast<size_t>(threads) * kBins);
  uint64_t *from_key = key, *to_key = tmp_key;  // the passes ping-pong between the buffers
  uint32_t *from_val = val, *to_val = tmp_val;
  for (int p = 0; p < kPasses; ++p) {
    const int shift = p * kBits;
    if (((differ >> shift) & (kBins - 1)) == 0) continue;  // one digit value: nothing moves
#pragma omp parallel num_threads(threads)
    {
      const int t = omp_get_thread_num();
      const int64_t begin = n * t / threads, end = n * (t + 1) / threads;
      int64_t* h = hist.data() + static_cast<size_t>(t) * kBins;
      std::fill(h, h + kBins, 0);
      for (int64_t i = begin; i < end; ++i) ++h[(from_key[i] >> shift) & (kBins - 1)];
#pragma omp barrier
#pragma omp single
      {
        int64_t sum = 0;
        for (int b = 0; b < kBins; ++b)
          for (int q = 0; q < threads; ++q) {
            int64_t& c = hist[static_cast<size_t>(q) * kBins + b];
            const int64_t count = c;
            c = sum;
            sum += count;
          }
      }
      for (int64_t i = begin; i < end; ++i) {
        const int64_t at = h[(from_key[i] >> shift) & (kBins - 1)]++;
        to_key[at] = from_key[i];
        to_val[at] = from_val[i];
      }
    }
    std::swap(from_key, to_key);
    std::swap(from_val, to_val);
  }
  if (from_key != key) {
    std::memcpy(key, from_key, sizeof(uint64_t) * n);
    std::memcpy(val, from_val, sizeof(uint32_t) * n);
  }
}

// `n` (uint64 key, uint32 payload) pairs ascending by key, equal keys in no particular
// order: one counting pass by the keys' highest differing bits (a bucket per ~4 keys),
// then each bucket by insertion, or, when many keys share a bucket (a hot id's copies), by
// a comparison sort. For the window's ids: one pass instead of up to six.
void SortKeys(uint64_t* key, uint32_t* val, uint64_t* tmp_key, uint32_t* tmp_val, int64_t n) {
  if (n <= 1) return;
  const uint64_t differ = DifferingBits(key, n, 1);
  if (differ == 0) return;
  int bits = 8;  // about four keys a bucket
  while (bits < 16 && (int64_t(4) << bits) < n) ++bits;
  const int top = 63 - __builtin_clzll(differ);
  const int shift = std::max(0, top + 1 - bits);
  const int64_t bins = int64_t(1) << bits;
  const uint64_t mask = static_cast<uint64_t>(bins - 1);
  std::vector<int32_t> start(bins + 1, 0);
  for (int64_t i = 0; i < n; ++i) ++start[((key[i] >> shift) & mask) + 1];
  for (int64_t b = 1; b <= bins; ++b) start[b] += start[b - 1];
  std::vector<int32_t> at(start.begin(), start.end() - 1);
  // each key's place is prefetched `kAhead` keys before it is written (its bucket's next
  // place then, a few entries off at most when keys between fill the same bucket): the
  // scratch is cold, the eviction's moves having passed through the cache since last call
  constexpr int64_t kAhead = 16;
  for (int64_t i = 0; i < n; ++i) {
    if (i + kAhead < n) {
      const int32_t ahead = at[(key[i + kAhead] >> shift) & mask];
      __builtin_prefetch(tmp_key + ahead, 1), __builtin_prefetch(tmp_val + ahead, 1);
    }
    const int32_t j = at[(key[i] >> shift) & mask]++;
    tmp_key[j] = key[i];
    tmp_val[j] = val[i];
  }
  for (int64_t b = 0; b < bins; ++b) {
    const int64_t begin = start[b], end = start[b + 1];
    if (end - begin > 64) {
      std::vector<std::pair<uint64_t, uint32_t>> crowd(end - begin);
      for (int64_t i = begin; i < end; ++i) crowd[i - begin] = {tmp_key[i], tmp_val[i]};
      // most often one hot id's copies: split around the middle entry's key (below, equal,
      // above), and sort only the two outer parts
      const uint64_t pivot = crowd[crowd.size() / 2].first;
      const auto less = std::partition(crowd.begin(), crowd.end(), [pivot](const auto& a) { return a.first < pivot; });
      const auto equal = std::partition(less, crowd.end(), [pivot](const auto& a) { return a.first == pivot; });
      const auto by_key = [](const auto& a, const auto& b) { return a.first < b.first; };
      std::sort(crowd.begin(), less, by_key);
      std::sort(equal, crowd.end(), by_key);
      for (int64_t i = begin; i < end; ++i) tmp_key[i] = crowd[i - begin].first, tmp_val[i] = crowd[i - begin].second;
      continue;
    }
    for (int64_t i = begin + 1; i < end; ++i) {
      const uint64_t k = tmp_key[i];
      const uint32_t x = tmp_val[i];
      int64_t j = i;
      for (; j > begin && tmp_key[j - 1] > k; --j) tmp_key[j] = tmp_key[j - 1], tmp_val[j] = tmp_val[j - 1];
      tmp_key[j] = k;
      tmp_val[j] = x;
    }
  }
  std::memcpy(key, tmp_key, sizeof(uint64_t) * n);
  std::memcpy(val, tmp_val, sizeof(uint32_t) * n);
}

// The window's distinct ids ascending (int64 order) with their counts and last access: one
// sort of (id, window position) (`SortKeys`), then its runs.
struct Coalesced {
  std::vector<int64_t> ids;
  std::vector<int32_t> count, last;
  std::vector<int32_t> of;  // per window position: its distinct id's index
};

void Coalesce(const int32_t* whi, const uint32_t* wlo, const int32_t* wstep, int64_t n,
              Coalesced& out) {
  static thread_local std::vector<uint64_t> key_buf, tmp_key_buf;
  static thread_local std::vector<uint32_t> at_buf, tmp_at_buf;
  key_buf.resize(n), tmp_key_buf.resize(n), at_buf.resize(n), tmp_at_buf.resize(n);
  // (plain pointers: a thread_local read inside a loop is a call per access in a shared library)
  uint64_t* const key = key_buf.data();
  uint32_t* const at = at_buf.data();
  int32_t first_step = n > 0 ? wstep[0] : 0;
  bool one_step = true;  // every id of the window seen at one step (an eviction every call)
  for (int64_t i = 0; i < n; ++i) {
    key[i] = static_cast<uint64_t>(Key(whi[i], wlo[i])) ^ kSign;
    at[i] = static_cast<uint32_t>(i);
    one_step &= wstep[i] == first_step;
  }
  SortKeys(key, at, tmp_key_buf.data(), tmp_at_buf.data(), n);
  out.ids.resize(n);
  out.count.resize(n);
  out.last.resize(n);
  out.of.resize(n);
  int64_t* const ids = out.ids.data();
  int32_t* const count = out.count.data();
  int32_t* const last = out.last.data();
  int32_t* const of = out.of.data();
  int32_t u = -1;
  constexpr int64_t kAhead = 16;  // each position's `of` prefetched this many keys ahead
  for (int64_t i = 0; i < n; ++i) {
    if (i + kAhead < n) __builtin_prefetch(of + at[i + kAhead], 1);
    const uint32_t j = at[i];
    if (i == 0 || key[i] != key[i - 1]) {
      ++u;
      ids[u] = static_cast<int64_t>(key[i] ^ kSign);
      count[u] = 0;
      last[u] = one_step ? first_step : wstep[j];
    }
    ++count[u];
    if (!one_step) last[u] = std::max(last[u], wstep[j]);
    of[j] = u;
  }
  out.ids.resize(u + 1);
  out.count.resize(u + 1);
  out.last.resize(u + 1);
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

// The weakest entries `out` in their order of loss: lowest score `v` first, then the later
// position first. `out` holds the first `ties` entries at the highest score `t`, latest
// first, then those below it by ascending position. Scores spanning under 2^16 values
// (LRU steps, most LFU counts) are placed by one counting pass (a score's entries come from
// one of the two lists, each walked latest first); wider ones by a radix sort.
template <class V>
void OrderWeakest(std::vector<int64_t>& out, size_t ties, V v, uint32_t t) {
  const size_t m = out.size();
  if (t < (uint32_t(1) << 16)) {
    std::vector<int64_t> start(static_cast<size_t>(t) + 2, 0);
    for (size_t i = 0; i < m; ++i) ++start[v(out[i]) + 1];
    for (size_t b = 1; b < start.size(); ++b) start[b] += start[b - 1];
    std::vector<int64_t> sorted(m);
    for (size_t i = 0; i < ties; ++i) sorted[start[t]++] = out[i];
    for (size_t i = m; i-- > ties;) sorted[start[v(out[i])]++] = out[i];
    out.swap(sorted);
    return;
  }
  std::vector<uint64_t> key(m), tmp_key(m);
  std::vector<uint32_t> val(m), tmp_val(m);
  for (size_t i = 0; i < m; ++i) {
    key[i] = (static_cast<uint64_t>(v(out[i])) << 32) | (0xFFFFFFFFu - static_cast<uint32_t>(out[i]));
    val[i] = static_cast<uint32_t>(out[i]);
  }
  RadixSort(key.data(), val.data(), tmp_key.data(), tmp_val.data(), static_cast<int64_t>(m));
  for (size_t i = 0; i < m; ++i) out[i] = val[i];
}

// The m-th lowest (m >= 1) of the `n` scores, `low + t`, and how many are below it
// (`below`), by radix selection over the scores' range (most often one histogram pass; wider
// ranges a second one within the bucket holding the m-th), the passes over every entry split
// over `threads`.
struct MthScore {
  int32_t low;
  uint32_t t;
  int64_t below;
};

MthScore MthLowest(const int32_t* score, int64_t n, int64_t m, int threads) {
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
  return {low, t, below};
}

// Positions of the `m` weakest of the resident entries [0, n) by `score` (lowest first;
// among equal scores the later position first): the m-th lowest score (`MthLowest`), then
// one pass collecting the entries below it, and the latest ones at it scanning back from
// the end; only those m are sorted. The passes over every entry are split over the threads.
std::vector<int64_t> WeakestOfAll(const int32_t* score, int64_t n, int64_t m) {
  std::vector<int64_t> out;
  if (m <= 0) return out;
  const int threads = std::max(1, std::min(omp_get_max_threads(), static_cast<int>(n >> 10)));
  const MthScore mth = MthLowest(score, n, m, threads);
  const int32_t low = mth.low;
  const uint32_t t = mth.t;
  const int64_t below = mth.below;
  auto v = [score, low](int64_t j) {
    return static_cast<uint32_t>(static_cast<int64_t>(score[j]) - low);
  };
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
  OrderWeakest(out, static_cast<size_t>(m - below), v, t);
  return out;
}

// `WeakestOfAll` among the candidate positions `cand` (ascending), which hold every entry
// whose score is at most the m-th lowest: the same positions in the same order.
std::vector<int64_t> WeakestAmong(const int32_t* score, const std::vector<int64_t>& cand, int64_t m) {
  const int64_t c = static_cast<int64_t>(cand.size());
  int32_t low = INT32_MAX, high = INT32_MIN;
  for (int64_t i = 0; i < c; ++i) {
    low = std::min(low, score[cand[i]]);
    high = std::max(high, score[cand[i]]);
  }
  const uint32_t range = static_cast<uint32_t>(static_cast<int64_t>(high) - low);
  int range_bits = 0;
  while (range_bits < 32 && (range >> range_bits) != 0) ++range_bits;
  const int shift = std::max(0, range_bits - 16);
  const int64_t bins = static_cast<int64_t>(range >> shift) + 1;
  auto v = [score, low](int64_t j) {
    return static_cast<uint32_t>(static_cast<int64_t>(score[j]) - low);
  };
  std::vector<int64_t> hist(bins, 0);
  for (int64_t i = 0; i < c; ++i) ++hist[v(cand[i]) >> shift];
  int64_t below = 0, bucket = 0;
  for (; bucket < bins; ++bucket) {
    if (below + hist[bucket] >= m) break;
    below += hist[bucket];
  }
  uint32_t t = static_cast<uint32_t>(bucket) << shift;  // the m-th lowest v
  if (shift > 0) {
    const uint32_t mask = (uint32_t(1) << shift) - 1;
    std::vector<int64_t> fine(size_t(1) << shift, 0);
    for (int64_t i = 0; i < c; ++i) {
      const uint32_t x = v(cand[i]);
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
  std::vector<int64_t> out;
  out.reserve(m);
  for (int64_t i = c - 1, ties = m - below; i >= 0 && ties > 0; --i)
    if (v(cand[i]) == t) out.push_back(cand[i]), --ties;
  for (int64_t i = 0; i < c; ++i)
    if (v(cand[i]) < t) out.push_back(cand[i]);
  OrderWeakest(out, static_cast<size_t>(m - below), v, t);
  return out;
}

// The entries of [0, n) whose score is below `bound`, ascending (room for about `expect`
// of them), and how many are at it (`at_bound`): one pass, split over the threads.
std::vector<int64_t> Below(const int32_t* score, int64_t n, int32_t bound, int64_t expect, int64_t* at_bound) {
  const int threads = std::max(1, std::min(omp_get_max_threads(), static_cast<int>(n >> 18)));
  std::vector<std::vector<int64_t>> part(threads);
  std::vector<int64_t> at_count(threads, 0);
#pragma omp parallel for num_threads(threads) schedule(static, 1)
  for (int id = 0; id < threads; ++id) {
    const int64_t begin = n * id / threads, end = n * (id + 1) / threads;
    std::vector<int64_t>& mine = part[id];
    mine.reserve(static_cast<size_t>(expect / threads + 1024));
    int64_t equal = 0, j = begin;
#ifdef __AVX512F__
    // 16 scores a step: one compare each way, the few below the bound collected by their
    // bits (a scalar loop with its two branches ran at a third of the memory's speed)
    const __m512i vbound = _mm512_set1_epi32(bound);
    for (; j + 16 <= end; j += 16) {
      const __m512i x = _mm512_loadu_si512(score + j);
      equal += __builtin_popcount(_mm512_cmpeq_epi32_mask(x, vbound));
      for (uint32_t lt = _mm512_cmplt_epi32_mask(x, vbound); lt != 0; lt &= lt - 1)
        mine.push_back(j + __builtin_ctz(lt));
    }
#endif
    for (; j < end; ++j) {
      const int32_t x = score[j];
      if (x < bound) mine.push_back(j);
      equal += x == bound;
    }
    at_count[id] = equal;
  }
  std::vector<int64_t> under;
  int64_t equal = 0;
  for (int id = 0; id < threads; ++id) {
    under.insert(under.end(), part[id].begin(), part[id].end());
    equal += at_count[id];
  }
  *at_bound = equal;
  return under;
}

// A score a little above the m-th lowest of the `n` scores, guessed from an evenly spaced
// sample (with a margin); false when there are too few entries or too many lose for a guess.
bool GuessBound(const int32_t* score, int64_t n, int64_t m, int32_t* bound) {
  constexpr int64_t kSample = 4096;
  if (n < 16 * kSample || m * 8 > n) return false;
  std::vector<int32_t> sample(kSample);
  for (int64_t i = 0; i < kSample; ++i) sample[i] = score[(2 * i + 1) * n / (2 * kSample)];
  const double expect = static_cast<double>(m) * kSample / n;  // sampled entries below the m-th
  const int64_t k = static_cast<int64_t>(expect * 1.25 + 4.0 * std::sqrt(expect) + 8.0);
  if (k >= kSample) return false;
  std::nth_element(sample.begin(), sample.begin() + k, sample.end());
  *bound = sample[k];
  return true;
}

// `WeakestOfAll` in one pass over the scores when few of many entries lose: a bound near
// the m-th lowest score is guessed from an evenly spaced sample (with a margin), and the
// entries below it are collected while those at it are counted. At least m below: the m
// weakest are among them. Fewer, but m with those at the bound: all of them lose, then the
// latest at the bound (scanning back from the end). Else (a guess too low): over all.
std::vector<int64_t> Weakest(const int32_t* score, int64_t n, int64_t m) {
  if (m <= 0) return {};
  int32_t bound;
  if (!GuessBound(score, n, m, &bound)) return WeakestOfAll(score, n, m);
  int64_t equal = 0;
  const std::vector<int64_t> under = Below(score, n, bound, 2 * m, &equal);
  const int64_t below = static_cast<int64_t>(under.size());
  if (below >= m) return WeakestAmong(score, under, m);
  if (below + equal < m) return WeakestOfAll(score, n, m);
  std::vector<int64_t> out = below > 0 ? WeakestAmong(score, under, below) : std::vector<int64_t>{};
  out.reserve(m);
  for (int64_t j = n - 1; j >= 0 && static_cast<int64_t>(out.size()) < m; --j)
    if (score[j] == bound) out.push_back(j);
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
  runs.reserve(lost.size() + below.size() + 1);
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

// One column's run moved by its shift, 16 words a step (an AVX-512 vector, the last step
// masked), from the right end when it moves right and from the left end when it moves left:
// each step's words are loaded before they are stored, so a run may overlap its own
// destination. (glibc's memmove took about twice as long for the runs of a Zipf stream on
// AMD EPYC, a few hundred words each; masked-off lanes never fault.)
#ifdef __AVX512F__
inline void MoveWords(uint32_t* col, const Run& r) {
  const int64_t len = r.end - r.begin;
  const uint32_t* src = col + r.begin;
  uint32_t* dst = col + r.begin + r.shift;
  const auto tail = [](int64_t n) { return static_cast<__mmask16>((1u << n) - 1); };
  if (r.shift > 0) {
    int64_t j = len;
    for (; j >= 16; j -= 16) _mm512_storeu_si512(dst + j - 16, _mm512_loadu_si512(src + j - 16));
    if (j > 0) _mm512_mask_storeu_epi32(dst, tail(j), _mm512_maskz_loadu_epi32(tail(j), src));
  } else {
    int64_t j = 0;
    for (; j + 16 <= len; j += 16) _mm512_storeu_si512(dst + j, _mm512_loadu_si512(src + j));
    if (j < len) _mm512_mask_storeu_epi32(dst + j, tail(len - j), _mm512_maskz_loadu_epi32(tail(len - j), src + j));
  }
}
#else
inline void MoveWords(uint32_t* col, const Run& r) {
  const int64_t len = r.end - r.begin;
  if (len >= 32) {  // (a memmove call costs more than a few words)
    std::memmove(col + r.begin + r.shift, col + r.begin, sizeof(uint32_t) * len);
  } else if (r.shift > 0) {
    for (int64_t j = r.end - 1; j >= r.begin; --j) col[j + r.shift] = col[j];
  } else {
    for (int64_t j = r.begin; j < r.end; ++j) col[j + r.shift] = col[j];
  }
}
#endif

// Runs [first, last) of `runs` moved in the `k` columns (a run's columns one after the
// other): runs moving right right to left, then runs moving left left to right, so no entry
// is overwritten before it moved.
void MoveRuns(uint32_t* const* cols, int k, const std::vector<Run>& runs, size_t first, size_t last) {
  for (size_t i = last; i-- > first;)
    if (runs[i].shift > 0)
      for (int c = 0; c < k; ++c) MoveWords(cols[c], runs[i]);
  for (size_t i = first; i < last; ++i)
    if (runs[i].shift < 0)
      for (int c = 0; c < k; ++c) MoveWords(cols[c], runs[i]);
}

// Runs [first, last) moved in the `k` columns: when they are long (64 entries or more on
// average: few insertions, as with Zipf ids), one column at a time; else a run's columns
// together. (In one process on the same batches at 2^20 entries: the column at a time took
// 0.5-0.6x the moves' time for runs of ~170 entries and 1.2-1.3x for runs of ~17.)
void MoveSomeRuns(uint32_t* const* cols, int k, const std::vector<Run>& runs, size_t first, size_t last) {
  int64_t moved = 0;
  for (size_t i = first; i < last; ++i) moved += runs[i].end - runs[i].begin;
  if (moved >= 64 * static_cast<int64_t>(last - first)) {
    for (int c = 0; c < k; ++c) MoveRuns(cols + c, 1, runs, first, last);
  } else {
    MoveRuns(cols, k, runs, first, last);
  }
}

#ifdef HYBRIDREC_SELFTEST
int g_selftest_order = 0;  // `MoveAllRuns`' halves: 0 on two threads, 1 left first, 2 right first
bool g_selftest_skip_fixup = false;  // the meeting window left as the halves left it
#endif

// Every run moved in the `k` columns, on up to two threads, each moving every column of
// the runs on one side of the run nearest half the entries moved: left runs L, right runs
// R (so the threads' work is even, and each thread's entries are its own cache's). Their
// destinations are disjoint and keep the order, but the sides can touch each other's
// sources: L's last entries, moving right, can land on R's first sources ([B, L's last
// destination], B: R's first entry), and R's first entries, moving left, on L's last
// sources ([R's first destination, E), E: the end of L's last run). At most one of the two
// windows is non-empty, no longer than its run's shift. Its values are saved first; after
// both sides moved, each saved entry is written again to its destination (whatever its
// side read there, racing the other side, is overwritten: a benign race, which
// ThreadSanitizer would report; a randomized harness of the split against one thread's moves,
// both halves in either order, found no misplaced entry in 600,000 cases). When one side
// would hold over 3/4 of the entries (a few long runs), the columns are dealt to the threads
// instead. (Before, the columns were dealt
// to the threads whenever no split left both windows empty, which is most often so; with
// Zipf ids at 2^20 entries inside a `hybrid.Model` step on an Intel Xeon, the halves took
// 0.85-0.9x the moves' time of five columns dealt three and two, and the winners' writes
// after them 0.65x, their entries still in the thread's cache.)
void MoveAllRuns(uint32_t* const* cols, int k, const std::vector<Run>& runs, bool parallel) {
  const size_t nr = runs.size();
  if (!parallel || nr < 2 || omp_get_max_threads() < 2) {
    MoveSomeRuns(cols, k, runs, 0, nr);
    return;
  }
  int64_t total = 0;
  for (const Run& r : runs) total += r.end - r.begin;
  size_t split = 1;
  int64_t left = runs[0].end - runs[0].begin;  // entries of the runs left of `split`
  for (; split + 1 < nr && 2 * left < total; ++split) left += runs[split].end - runs[split].begin;
  if (4 * std::max(left, total - left) > 3 * total) {
    // a few long runs, one of them holding most entries: the columns dealt to the threads
#pragma omp parallel for num_threads(2) schedule(static, 1)
    for (int c = 0; c < k; ++c) MoveSomeRuns(cols + c, 1, runs, 0, nr);
    return;
  }
  const Run& a = runs[split - 1];
  const Run& b = runs[split];
  // the window: [from, to), whose entries are sources of R (`right`) or of L
  const bool right = a.end + a.shift > b.begin;
  const int64_t from = right ? b.begin : std::min(a.end, b.begin + b.shift);
  const int64_t to = right ? a.end + a.shift : a.end;
  const int64_t span = std::max<int64_t>(0, to - from);
  std::vector<uint32_t> saved(static_cast<size_t>(span) * k);
  for (int c = 0; c < k; ++c)
    if (span > 0) std::memcpy(saved.data() + c * span, cols[c] + from, sizeof(uint32_t) * span);
#ifdef HYBRIDREC_SELFTEST
  if (g_selftest_order != 0) {  // the race's two extremes: one half wholly before the other
    MoveSomeRuns(cols, k, runs, g_selftest_order == 1 ? 0 : split, g_selftest_order == 1 ? split : nr);
    MoveSomeRuns(cols, k, runs, g_selftest_order == 1 ? split : 0, g_selftest_order == 1 ? nr : split);
  } else
#endif
#pragma omp parallel sections num_threads(2)
  {
#pragma omp section
    MoveSomeRuns(cols, k, runs, 0, split);
#pragma omp section
    MoveSomeRuns(cols, k, runs, split, nr);
  }
#ifdef HYBRIDREC_SELFTEST
  if (g_selftest_skip_fixup) return;
#endif
  // each saved entry that is a source of the side the window belongs to, to its destination
  // (R's runs walked up from `split` as the window is walked up, L's down from `split - 1`
  // as it is walked down)
  const auto put = [&](int64_t p, const Run& r) {
    for (int c = 0; c < k; ++c) cols[c][p + r.shift] = saved[c * span + (p - from)];
  };
  if (right) {
    for (int64_t p = from, r = split; p < to; ++p) {
      while (r < static_cast<int64_t>(nr) && runs[r].end <= p) ++r;
      if (r < static_cast<int64_t>(nr) && p >= runs[r].begin) put(p, runs[r]);
    }
  } else {
    for (int64_t p = to - 1, r = split - 1; p >= from; --p) {
      while (r >= 0 && runs[r].begin > p) --r;
      if (r >= 0 && p < runs[r].end) put(p, runs[r]);
    }
  }
}

// Eviction policies (the `policy` attribute): `sparse_jax.managed._id_map._KERNEL_POLICIES`.
// "distance_lfu" (float scores) is not here: its CPU lowering is the XLA form.
enum Policy : int32_t { kLru = 0, kLfu = 1, kTtl = 2 };

// The policies' numbers, one definition for the sorted and the hashed form's evictions:
// a resident id's kept metadata once the window saw it `count` times, last at `last` (LFU: the
// count added, saturating; else the last access); a TTL entry's score (an empty entry 0, an
// expired one, `step - last > ttl`, its last access, a live one INT32_MAX); a new id's score.
inline int32_t SeenMeta(bool lfu, int32_t kept, int32_t count, int32_t last) {
  return !lfu ? last : kept > INT32_MAX - count ? INT32_MAX : kept + count;
}

inline int32_t TtlScore(bool empty, int32_t last, int32_t step, int32_t ttl) {
  return empty ? 0 : step - last > ttl ? last : INT32_MAX;
}

inline int32_t NewIdScore(int32_t policy, int32_t step, int32_t count, int32_t last) {
  return policy == kTtl ? step : policy == kLfu ? count : last;
}

// The new ids (`fresh`: window indices, ascending by id) best first, as indices into
// `fresh`: LFU count descending, LRU last access descending then count descending; ties keep
// the id order (the sort is stable).
std::vector<uint32_t> BestFirst(const std::vector<uint32_t>& fresh, const Coalesced& win, bool lfu, int32_t step) {
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
  return best;
}

// The eviction; with `slot_of`, also the slot each of the window's distinct ids (by their
// index in `Evict`'s coalesced window, `EvictWindow()`) maps to after it, as `MchRemap`
// would answer on the new state: a resident's slot unless it lost it, a winner's new slot,
// else the default slot. Returns how many entries it gave to new ids (each a distinct slot).
const Coalesced& EvictWindow() {
  static thread_local Coalesced scratch;  // (kept between calls: no reallocation)
  return scratch;
}

int64_t Evict(State& s, bool* evicted, int32_t policy, int32_t threshold, int32_t ttl,
              std::vector<int32_t>* slot_of) {
  const bool lfu = policy == kLfu;
  // the one metadata column the policy keeps (LFU the counts, LRU and TTL the last access):
  // updated, moved and written for winners; the other is left as it is
  int32_t* const meta = lfu ? s.counts : s.last;
  const int64_t z = s.z;
  const int32_t step = *s.step;
  const int64_t n = std::min<int64_t>(std::max<int32_t>(*s.used, 0), s.h);
  Coalesced& win = const_cast<Coalesced&>(EvictWindow());  // the calling thread's, also inside
                                                           // the parallel regions below
  Coalesce(s.whi, s.wlo, s.wstep, n, win);
  const int64_t u = static_cast<int64_t>(win.ids.size());  // ascending
  // residents' metadata; the admitted ids that are not resident, ascending, with the count
  // of residents below each
  // (the ids split over the threads in order; each gallops through its part)
  const Residents res{s.hi, s.lo};
  const int threads = std::max(1, std::min(omp_get_max_threads(), static_cast<int>(u >> 9)));
  // with `slot_of`: the entry of each resident id (-1: not resident), those below the
  // threshold too (they keep their entries and map to them)
  std::vector<int32_t> hit_at(slot_of ? u : 0, -1);
  // residents keep their slots (the losers' are overwritten below), read while the search
  // passes their entries
  if (slot_of) slot_of->assign(u, static_cast<int32_t>(z - 1));
  std::vector<std::vector<uint32_t>> fresh_of(threads);
  std::vector<std::vector<int64_t>> below_of(threads);
  // A resident's slot, count and last access are three cache misses at an unpredictable
  // place: each hit is prefetched when the scan finds it and handled `kLag` hits later, so
  // the misses of several hits are in flight at once (the scan's own reads run ahead in
  // order). Hits are distinct entries: handling them later changes nothing.
  constexpr int kLag = 16;
  const int32_t* const wcount = win.count.data();
  const int32_t* const wlast = win.last.data();
  const int64_t* const wids = win.ids.data();
  int32_t* const hit_out = slot_of ? hit_at.data() : nullptr;
  int32_t* const slot_out = slot_of ? slot_of->data() : nullptr;
#pragma omp parallel for num_threads(threads) schedule(static, 1)
  for (int id = 0; id < threads; ++id) {
    uint32_t ring_w[kLag];
    int64_t ring_pos[kLag];
    int64_t pending = 0;  // hits found so far; the last min(pending, kLag) not yet handled
    const auto handle = [&](uint32_t w, int64_t pos) {
      if (slot_out) {
        hit_out[w] = static_cast<int32_t>(pos);
        slot_out[w] = s.slots[pos];
      }
      if (wcount[w] < threshold) return;
      meta[pos] = SeenMeta(lfu, meta[pos], wcount[w], wlast[w]);
    };
    int64_t from = 0;
    for (int64_t i = u * id / threads; i < u * (id + 1) / threads; ++i) {
      const uint32_t w = static_cast<uint32_t>(i);
      const bool admitted = wcount[w] >= threshold;
      if (!admitted && !slot_of) continue;
      const int64_t k = wids[w];
      const int64_t pos = Scan(res, from, z - 1, k);
      from = pos;
      if (res.at(pos) == k) {
        if (slot_out) __builtin_prefetch(&s.slots[pos]);
        if (admitted) {
          __builtin_prefetch(&meta[pos], 1);
        }
        const int slot = static_cast<int>(pending % kLag);
        if (pending >= kLag) handle(ring_w[slot], ring_pos[slot]);
        ring_w[slot] = w;
        ring_pos[slot] = pos;
        ++pending;
      } else if (admitted) {
        fresh_of[id].push_back(w);
        below_of[id].push_back(pos);
      }
    }
    for (int64_t j = std::max<int64_t>(0, pending - kLag); j < pending; ++j)
      handle(ring_w[j % kLag], ring_pos[j % kLag]);
  }
  std::vector<uint32_t> fresh;  // window index of each new id, ascending by id
  std::vector<int64_t> fresh_below;
  for (int id = 0; id < threads; ++id) {
    fresh.insert(fresh.end(), fresh_of[id].begin(), fresh_of[id].end());
    fresh_below.insert(fresh_below.end(), below_of[id].begin(), below_of[id].end());
  }
  meta[z - 1] = lfu ? INT32_MAX : step;
  const int64_t f = static_cast<int64_t>(fresh.size());
  const std::vector<uint32_t> best = BestFirst(fresh, win, lfu, step);
  // the i-th best new id wins iff it beats the i-th weakest resident (a resident wins ties);
  // TTL: an expired (step - last > ttl) or empty entry scores its last access (empty: 0), a
  // live one INT32_MAX, a new id the step
  std::vector<int32_t> ttl_score;
  if (policy == kTtl) {
    ttl_score.resize(z);
    for (int64_t j = 0; j < z; ++j) {
      ttl_score[j] = TtlScore(res.at(j) == kEmpty, s.last[j], step, ttl);
    }
  }
  const int32_t* score = policy == kTtl ? ttl_score.data() : lfu ? s.counts : s.last;
  const int64_t m = std::min<int64_t>(f, z - 1);
  const std::vector<int64_t> weak = Weakest(score, z - 1, m);
  int64_t won = 0;
  while (won < m) {
    const uint32_t w = fresh[best[won]];
    if (!(NewIdScore(policy, step, win.count[w], win.last[w]) > score[weak[won]])) break;
    ++won;
  }
  std::memset(evicted, 0, sizeof(bool) * z);
  *s.used = 0;
  std::memset(s.wstep, 0, sizeof(int32_t) * s.h);
  *s.last_eviction = step;
  if (won == 0) return 0;
  // the best winner takes the best loser's (the won-th weakest) entry, and so on down
  std::vector<int32_t> won_slot(f, -1);
  std::vector<uint64_t> lost_bits((z + 63) / 64, 0);
  for (int64_t i = 0; i < won; ++i) {
    const int64_t loser = weak[won - 1 - i];
    if (i + 16 < won) __builtin_prefetch(&s.slots[weak[won - 17 - i]]);
    won_slot[best[i]] = s.slots[loser];
    evicted[s.slots[loser]] = true;
    lost_bits[loser >> 6] |= uint64_t(1) << (loser & 63);
  }
  if (slot_of) {
    for (int64_t w = 0; w < u; ++w) {
      const int32_t at = hit_at[w];
      if (at >= 0 && (lost_bits[at >> 6] >> (at & 63) & 1)) (*slot_of)[w] = static_cast<int32_t>(z - 1);
    }
    for (int64_t i = 0; i < won; ++i) (*slot_of)[fresh[best[i]]] = won_slot[best[i]];
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
  uint32_t* const cols[4] = {reinterpret_cast<uint32_t*>(s.hi), s.lo, reinterpret_cast<uint32_t*>(s.slots),
                             reinterpret_cast<uint32_t*>(meta)};
  MoveAllRuns(cols, 4, runs, z >= (1 << 15));
  // winner j (in id order) lands after the survivors below it and the winners before it
  // (the places are cache misses at unpredictable places: each winner's four are prefetched
  // `kAhead` winners before, at the place it would have if no entry below it but those
  // already passed had lost: at most a few entries off, mostly the same cache line)
  constexpr int64_t kAhead = 8;
  size_t li = 0;
  for (int64_t j = 0; j < won; ++j) {
    while (li < lost.size() && lost[li] < below[j]) ++li;
    if (j + kAhead < won) {
      const int64_t guess = j + kAhead + below[j + kAhead] - static_cast<int64_t>(li);
      for (uint32_t* col : cols) __builtin_prefetch(col + std::min(guess, z - 1), 1);
    }
    const int64_t at = j + below[j] - static_cast<int64_t>(li);
    const int64_t i = winner[j];
    const uint32_t w = fresh[i];
    const int64_t k = win.ids[w];
    s.hi[at] = static_cast<int32_t>(static_cast<uint64_t>(k) >> 32);
    s.lo[at] = static_cast<uint32_t>(static_cast<uint64_t>(k));
    s.slots[at] = won_slot[i];
    meta[at] = lfu ? win.count[w] : win.last[w];
  }
  return won;
}

template <ffi::DataType T>
auto* Take(ffi::Buffer<T> in, ffi::Result<ffi::Buffer<T>> out) {
  auto* dst = out->typed_data();
  if (dst != in.typed_data()) std::memcpy(dst, in.typed_data(), in.size_bytes());
  return dst;
}

// The slot of each of the `n` ids (the default slot `z - 1` when not resident): the ids
// sorted by a radix sort, then found by scanning the residents, the sorted run split over
// threads.
void Lookup(const Residents& res, const int32_t* slot, int64_t z, const int32_t* ih, const uint32_t* il,
            int64_t n, int32_t* o) {
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
        pos = Scan(res, from, z - 1, k);
        from = pos;
        answer = res.at(pos) == k ? slot[pos] : static_cast<int32_t>(z - 1);
        prev = k;
        have = true;
      }
      o[at[i]] = answer;
    }
  }
}

// A training call's first work: the step advanced, and the batch's valid ids appended to
// the window (`h` positions) at that step. Returns the new step.
int32_t Append(int32_t* whi, uint32_t* wlo, int32_t* wstep, int32_t* used, int32_t* step, int64_t h,
               const int32_t* ih, const uint32_t* il, const bool* ok, int64_t n) {
  const int32_t now = *step + 1;
  *step = now;
  int64_t at = *used;
  int32_t taken = 0;
  for (int64_t i = 0; i < n; ++i) {
    if (!ok[i]) continue;
    if (at >= 0 && at < h) {  // (a window that would overflow is refused at trace time)
      whi[at] = ih[i];
      wlo[at] = il[i];
      wstep[at] = now;
    }
    ++at;
    ++taken;
  }
  *used += taken;
  return now;
}

// After an eviction, the slot of each of the batch's `n` ids: a valid id's is its distinct
// window id's (`slot_at`, by `EvictWindow()`'s index; the batch's first valid id is at window
// position `first`), the padding's `find(id)` (often one id: asked once per run of it).
template <class Find>
void ReadOff(const int32_t* ih, const uint32_t* il, const bool* ok, int64_t n, int64_t first,
             const int32_t* slot_at, int32_t* out, Find find) {
  // (plain pointers: thread_local vectors read in the loop cost a call per access)
  const int32_t* const of = EvictWindow().of.data();
  const int64_t window = static_cast<int64_t>(EvictWindow().of.size());
  int64_t prev = 0;
  int32_t answer = 0;
  bool have = false;
  for (int64_t i = 0, w = first; i < n; ++i) {
    if (ok[i] && w >= 0 && w < window) {
      out[i] = slot_at[of[w++]];
      continue;
    }
    w += ok[i];
    const int64_t k = Key(ih[i], il[i]);
    if (!have || k != prev) {
      answer = find(k);
      prev = k;
      have = true;
    }
    out[i] = answer;
  }
}

// MchProfile's work; with `out` (one int32 per id), also the slot of each id on the new
// state (`MchRemap`'s answer): when the call evicts, read off the eviction (each valid id
// is in the window: its distinct id's slot), the padding's by a search; else a `Lookup`.
ffi::Error Profile(ffi::Buffer<ffi::S32> hi, ffi::Buffer<ffi::U32> lo, ffi::Buffer<ffi::S32> slots,
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
                          ffi::Result<ffi::Buffer<ffi::S32>> occupied, int32_t* out,
                   int32_t policy, int32_t interval, int32_t threshold, int32_t ttl) {
  State s{Take(hi, o_hi),         Take(lo, o_lo),       Take(slots, o_slots), Take(counts, o_counts),
          Take(last, o_last),     Take(whi, o_whi),     Take(wlo, o_wlo),     Take(wstep, o_wstep),
          Take(used, o_used),     Take(step, o_step),   Take(last_eviction, o_last_eviction),
          static_cast<int64_t>(hi.element_count()), static_cast<int64_t>(whi.element_count())};
  bool* ev = evicted->typed_data();
  const Residents res{s.hi, s.lo};
  // the entries an id holds before this call: where the first empty entry is (then after
  // it, and the slots given to new ids: the counters' update, without XLA searching the map
  // and summing the mask)
  int32_t* occ = occupied->typed_data();
  occ[0] = static_cast<int32_t>(Gallop(res, 0, s.z - 1, kEmpty));
  occ[1] = occ[0];
  occ[2] = 0;
  const int64_t n = ids_hi.element_count();
  const int32_t* ih = ids_hi.typed_data();
  const uint32_t* il = ids_lo.typed_data();
  const bool* ok = valid.typed_data();
  const int64_t first = *s.used;  // the window position of the batch's first valid id
  const int32_t now = Append(s.whi, s.wlo, s.wstep, s.used, s.step, s.h, ih, il, ok, n);
  if (now - *s.last_eviction == interval) {
    static thread_local std::vector<int32_t> slot_of;
    const int64_t admitted = Evict(s, ev, policy, threshold, ttl, out ? &slot_of : nullptr);
    occ[1] = static_cast<int32_t>(Gallop(res, 0, s.z - 1, kEmpty));
    occ[2] = static_cast<int32_t>(admitted);
    if (out)
      ReadOff(ih, il, ok, n, first, slot_of.data(), out, [&](int64_t k) {
        const int64_t pos = Gallop(res, 0, s.z - 1, k);
        return res.at(pos) == k ? s.slots[pos] : static_cast<int32_t>(s.z - 1);
      });
  } else {
    std::memset(ev, 0, sizeof(bool) * s.z);
    if (out) Lookup(res, s.slots, s.z, ih, il, n, out);
  }
  return ffi::Error::Success();
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
  return Profile(hi, lo, slots, counts, last, whi, wlo, wstep, used, step, last_eviction, ids_hi, ids_lo, valid,
                     o_hi, o_lo, o_slots, o_counts, o_last, o_whi, o_wlo, o_wstep, o_used, o_step,
                     o_last_eviction, evicted, occupied, nullptr, policy, interval, threshold, ttl);
}

ffi::Error MchProfileRemapImpl(ffi::Buffer<ffi::S32> hi, ffi::Buffer<ffi::U32> lo, ffi::Buffer<ffi::S32> slots,
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
                          ffi::Result<ffi::Buffer<ffi::S32>> occupied, ffi::Result<ffi::Buffer<ffi::S32>> out, int32_t policy,
                               int32_t interval, int32_t threshold, int32_t ttl) {
  return Profile(hi, lo, slots, counts, last, whi, wlo, wstep, used, step, last_eviction, ids_hi, ids_lo, valid,
                     o_hi, o_lo, o_slots, o_counts, o_last, o_whi, o_wlo, o_wstep, o_used, o_step,
                     o_last_eviction, evicted, occupied, out->typed_data(), policy, interval, threshold, ttl);
}

ffi::Error MchRemapImpl(ffi::Buffer<ffi::S32> hi, ffi::Buffer<ffi::U32> lo, ffi::Buffer<ffi::S32> slots,
                        ffi::Buffer<ffi::S32> ids_hi, ffi::Buffer<ffi::U32> ids_lo,
                        ffi::Result<ffi::Buffer<ffi::S32>> out) {
  Lookup(Residents{hi.typed_data(), lo.typed_data()}, slots.typed_data(), hi.element_count(),
         ids_hi.typed_data(), ids_lo.typed_data(), ids_hi.element_count(), out->typed_data());
  return ffi::Error::Success();
}

ffi::Error MaskPositionsImpl(ffi::Buffer<ffi::PRED> mask, ffi::Result<ffi::Buffer<ffi::S32>> out,
                             int32_t fill) {
  const bool* m = mask.typed_data();
  const int64_t n = mask.element_count(), size = out->element_count();
  int32_t* o = out->typed_data();
  int64_t k = 0, i = 0;
  // a mask of evicted slots is mostly false: 64 entries at a time (one AVX-512 test: a bit
  // per nonzero byte), or 8 without AVX-512, then one by one
#ifdef __AVX512BW__
  for (; i + 64 <= n && k < size; i += 64) {
    const __m512i v = _mm512_loadu_si512(m + i);
    for (uint64_t bits = _mm512_test_epi8_mask(v, v); bits != 0 && k < size; bits &= bits - 1)
      o[k++] = static_cast<int32_t>(i + __builtin_ctzll(bits));
  }
#endif
  for (; i + 8 <= n && k < size; i += 8) {
    uint64_t word;
    std::memcpy(&word, m + i, sizeof(word));
    for (int64_t j = 0; word != 0 && k < size; ++j, word >>= 8)
      if (word & 0xFF) o[k++] = static_cast<int32_t>(i + j);
  }
  for (; i < n && k < size; ++i)
    if (m[i]) o[k++] = static_cast<int32_t>(i);
  for (; k < size; ++k) o[k] = fill;
  return ffi::Error::Success();
}


// ---------------------------------------------------------------------------------------------
// The hashed form: the same map for training on CPU, kept without sorting.
//
// At each eviction the sorted form moves every entry between the first change and the last
// (the whole map when new ids land all over the id range, as they do) and scans the residents
// for the window's ids. The hashed form keeps each slot's id and policy metadata at the slot
// (`ids`: [Z] pairs of words; `meta`: [Z]; the default slot `Z - 1` holding the default entry's), an
// open-addressing table from id to slot (linear probing over 2^k buckets of four words: id hi,
// id lo, slot, unused (buckets 0 and 1: the seed, `SeedOf`); slot -1 marks a free bucket; at
// most half full), and the empty entries'
// slots in their sorted-form order (`free`, its first `free_count`). An eviction looks the
// window's ids up (a cache miss or two each, prefetched), selects the losers among the slots'
// scores (ties: the larger id loses first, as the later sorted entry does; empty entries come
// after every id, in their order), and writes only the losers' and winners' slots and buckets.
// Every decision is the sorted form's, on the same numbers: the same slots, evicted mask and
// counts, bit for bit, and `MchFromHash` gives back the sorted form's state exactly (the
// metadata column the policy does not keep is zero, as it always is: `adopt_metadata`).

// murmur3's 64-bit finalizer: ids are often small or sequential, and a bucket is the top bits.
inline uint64_t Mix(uint64_t k) {
  k ^= k >> 33;
  k *= 0xff51afd7ed558ccdULL;
  k ^= k >> 33;
  k *= 0xc4ceb9fe1a85ec53ULL;
  k ^= k >> 33;
  return k;
}

inline int32_t HiOf(int64_t k) { return static_cast<int32_t>(static_cast<uint64_t>(k) >> 32); }
inline uint32_t LoOf(int64_t k) { return static_cast<uint32_t>(static_cast<uint64_t>(k)); }

// The window's distinct ids with their counts and last access, as `Coalesce` gives them but
// in the order first seen, not sorted: each position's id found in a small open-addressing
// table of the distinct ids' indices (a power of two at least twice the window; -1: free),
// which with the distinct ids stays in the core's cache. (The sorted form needs the ids
// ascending for its scan; the hashed form only the new ids', sorted after.)
void CoalesceByHash(const int32_t* whi, const uint32_t* wlo, const int32_t* wstep, int64_t n,
                    uint64_t seed, Coalesced& out) {
  static thread_local std::vector<int32_t> index_buf;
  int bits = 4;
  while ((int64_t(1) << bits) < 2 * n) ++bits;
  const int shift = 64 - bits;
  const int64_t mask = (int64_t(1) << bits) - 1;
  index_buf.assign(size_t(1) << bits, -1);
  int32_t* const index = index_buf.data();
  out.ids.resize(n);
  out.count.resize(n);
  out.last.resize(n);
  out.of.resize(n);
  int64_t* const ids = out.ids.data();
  int32_t* const count = out.count.data();
  int32_t* const last = out.last.data();
  int32_t* const of = out.of.data();
  const auto home = [shift, seed](int64_t k) {
    return static_cast<int64_t>(Mix(static_cast<uint64_t>(k) ^ seed) >> shift);
  };
  constexpr int64_t kAhead = 16;
  int32_t u = 0;
  for (int64_t i = 0; i < n; ++i) {
    if (i + kAhead < n) __builtin_prefetch(index + home(Key(whi[i + kAhead], wlo[i + kAhead])));
    const int64_t k = Key(whi[i], wlo[i]);
    int64_t b = home(k);
    int32_t d;
    while ((d = index[b]) >= 0 && ids[d] != k) b = (b + 1) & mask;
    if (d < 0) {
      d = u++;
      index[b] = d;
      ids[d] = k;
      count[d] = 0;
      last[d] = wstep[i];
    }
    ++count[d];
    last[d] = std::max(last[d], wstep[i]);
    of[i] = d;
  }
  out.ids.resize(u);
  out.count.resize(u);
  out.last.resize(u);
}

// A map's hash seed: drawn when the map is hashed (`MchToHash`) and kept in the unused word
// of buckets 0 and 1, so ids chosen to collide under one map's seed do not under another's
// (an unseeded hash lets a stream of such ids turn every lookup into a walk of one long run).
// The buckets' layout decides nothing (every decision is by id and score): any seed gives the
// same slots.
inline uint64_t SeedOf(const int32_t* table) {
  return static_cast<uint64_t>(static_cast<uint32_t>(table[3])) |
         static_cast<uint64_t>(static_cast<uint32_t>(table[7])) << 32;
}

inline void PutFreshSeed(int32_t* table) {
  std::random_device device;
  table[3] = static_cast<int32_t>(device());
  table[7] = static_cast<int32_t>(device());
}

struct Hashed {
  int32_t* table;  // [buckets][4]
  int64_t mask;    // buckets - 1
  int shift;       // 64 - log2(buckets)
  int32_t* ids;    // by slot, (hi, lo) side by side: one line (kEmpty: an empty entry's, and
                   // the default slot's)
  int32_t* meta;  // by slot: the policy's column (LFU the count, LRU and TTL the last access)
  int32_t* free;  // the empty entries' slots, in their sorted-form order
  int32_t* free_count;
  int32_t* whi;
  uint32_t* wlo;
  int32_t* wstep;
  int32_t* used;
  int32_t* step;
  int32_t* last_eviction;
  int64_t z, h;
  inline int64_t id(int64_t slot) const { return Key(ids[2 * slot], static_cast<uint32_t>(ids[2 * slot + 1])); }
  uint64_t seed;   // mixed into every id before it is hashed (`SeedOf`)
  inline int32_t* bucket(int64_t k) const {
    return table + 4 * static_cast<int64_t>(Mix(static_cast<uint64_t>(k) ^ seed) >> shift);
  }
};

// log2 of the buckets for `z` entries: a power of two at least 2z.
inline int BucketBits(int64_t buckets) {
  int bits = 0;
  while ((int64_t(1) << bits) < buckets) ++bits;
  return bits;
}

// `t` reading the table of `buckets` buckets (a power of two) at `table`, with its seed.
inline void AttachTable(Hashed& t, int32_t* table, int64_t buckets) {
  t.table = table;
  t.mask = buckets - 1;
  t.shift = 64 - BucketBits(buckets);
  t.seed = SeedOf(table);
}

// The slot of id `k`, -1 when it is not resident.
inline int32_t FindSlot(const Hashed& t, int64_t k) {
  const int32_t khi = HiOf(k);
  const int32_t klo = static_cast<int32_t>(LoOf(k));
  const int32_t* const end = t.table + 4 * (t.mask + 1);
  for (const int32_t* e = t.bucket(k);;) {
    if (e[2] < 0) return -1;
    if (e[0] == khi && e[1] == klo) return e[2];
    e += 4;
    if (e == end) e = t.table;
  }
}

void Insert(const Hashed& t, int64_t k, int32_t slot) {
  const int32_t* const end = t.table + 4 * (t.mask + 1);
  int32_t* e = t.bucket(k);
  while (e[2] >= 0) {
    e += 4;
    if (e == end) e = t.table;
  }
  e[0] = HiOf(k);
  e[1] = static_cast<int32_t>(LoOf(k));
  e[2] = slot;
}

// Removes id `k` (resident): its bucket freed, and the buckets after it in its probe run
// shifted back where their own runs allow (no tombstones).
void Erase(const Hashed& t, int64_t k) {
  const int32_t khi = HiOf(k);
  const int32_t klo = static_cast<int32_t>(LoOf(k));
  int64_t i = (t.bucket(k) - t.table) / 4;
  while (t.table[4 * i + 2] >= 0 && !(t.table[4 * i] == khi && t.table[4 * i + 1] == klo))
    i = (i + 1) & t.mask;
  if (t.table[4 * i + 2] < 0) return;  // (not resident: nothing to remove)
  for (int64_t j = i;;) {
    j = (j + 1) & t.mask;
    int32_t* e = t.table + 4 * j;
    if (e[2] < 0) break;
    const int64_t home = (t.bucket(Key(e[0], static_cast<uint32_t>(e[1]))) - t.table) / 4;
    // the entry at j stays when its home lies cyclically in (i, j]
    const bool stays = i <= j ? (home > i && home <= j) : (home > i || home <= j);
    if (stays) continue;
    std::memcpy(t.table + 4 * i, e, 3 * sizeof(int32_t));  // (not the unused word: `SeedOf`)
    i = j;
  }
  t.table[4 * i + 2] = -1;
}

// `FindSlot` of keys [begin, end) (`key(i)`), each handed to `put(i, slot)`; the bucket of the
// key `kAhead` on prefetched (the lookups' misses overlap).
template <class K, class P>
void FindAll(const Hashed& t, int64_t begin, int64_t end, K key, P put) {
  constexpr int64_t kAhead = 40;
  for (int64_t i = begin; i < std::min(end, begin + kAhead); ++i) __builtin_prefetch(t.bucket(key(i)));
  for (int64_t i = begin; i < end; ++i) {
    if (i + kAhead < end) __builtin_prefetch(t.bucket(key(i + kAhead)));
    put(i, FindSlot(t, key(i)));
  }
}

// `FindAll` of keys [0, n), split over the threads (a part per thread when there are many).
template <class K, class P>
void FindAllSplit(const Hashed& t, int64_t n, K key, P put) {
  const int threads = std::max(1, std::min(omp_get_max_threads(), static_cast<int>(n >> 12)));
#pragma omp parallel for num_threads(threads) schedule(static, 1)
  for (int id = 0; id < threads; ++id) FindAll(t, n * id / threads, n * (id + 1) / threads, key, put);
}

// The slot of each of the `n` ids (`ih`, `il`) into `out`, `default_slot` when not resident.
void LookupHashed(const Hashed& t, const int32_t* ih, const uint32_t* il, int64_t n, int32_t default_slot,
                  int32_t* out) {
  FindAllSplit(
      t, n, [ih, il](int64_t i) { return Key(ih[i], il[i]); },
      [out, default_slot](int64_t i, int32_t slot) { out[i] = slot < 0 ? default_slot : slot; });
}

// The ids at the `c` slots `slots` (random places: each prefetched 16 slots ahead).
std::vector<int64_t> IdsAt(const Hashed& s, const int64_t* slots, int64_t c) {
  std::vector<int64_t> ids(c);
  for (int64_t i = 0; i < c; ++i) {
    if (i + 16 < c) __builtin_prefetch(s.ids + 2 * slots[i + 16]);
    ids[i] = s.id(slots[i]);
  }
  return ids;
}

// `slots` in the sorted form's order of loss: lowest `score` first, then the later entry
// first (the larger id; empty entries after every id, the later of them first: their order in
// `free`). Two stable radix sorts: by that order descending, then by score. `ids_out`, when
// given, receives each slot's id in the same order (read once here: the caller's too).
void InLossOrder(std::vector<int64_t>& slots, const int32_t* score, const Hashed& s,
                 std::vector<int64_t>* ids_out = nullptr) {
  const int64_t c = static_cast<int64_t>(slots.size());
  std::vector<int64_t> ids = IdsAt(s, slots.data(), c);
  if (c >= 2) {
    std::vector<uint64_t> key(c), tmp_key(c);
    std::vector<uint32_t> val(c), tmp_val(c);  // indices into `slots`
    // empty entries first (key 0), the later first (`free` read from its end); then ids
    // descending (key >= 1: no id is kEmpty)
    std::vector<std::pair<int64_t, uint32_t>> empties;  // (slot, index)
    for (int64_t i = 0; i < c; ++i)
      if (ids[i] == kEmpty) empties.push_back({slots[i], static_cast<uint32_t>(i)});
    int64_t at = 0;
    if (!empties.empty()) {
      std::sort(empties.begin(), empties.end());
      for (int32_t k = *s.free_count - 1; k >= 0 && at < static_cast<int64_t>(empties.size()); --k) {
        const auto it = std::lower_bound(empties.begin(), empties.end(), std::make_pair(int64_t(s.free[k]), 0u));
        if (it != empties.end() && it->first == s.free[k]) key[at] = 0, val[at++] = it->second;
      }
    }
    for (int64_t i = 0; i < c; ++i) {
      if (ids[i] == kEmpty) continue;
      key[at] = ~(static_cast<uint64_t>(ids[i]) ^ kSign);
      val[at++] = static_cast<uint32_t>(i);
    }
    RadixSort(key.data(), val.data(), tmp_key.data(), tmp_val.data(), c);
    for (int64_t i = 0; i < c; ++i) key[i] = static_cast<uint32_t>(score[slots[val[i]]]) ^ 0x80000000u;
    RadixSort(key.data(), val.data(), tmp_key.data(), tmp_val.data(), c);
    std::vector<int64_t> in_order(c), ids_in_order(c);
    for (int64_t i = 0; i < c; ++i) in_order[i] = slots[val[i]], ids_in_order[i] = ids[val[i]];
    slots.swap(in_order);
    ids.swap(ids_in_order);
  }
  if (ids_out) *ids_out = std::move(ids);
}

// The `need` latest of the slots [0, n) whose score is `bound`, latest first: the empty
// entries at it from the last one down (`free` read from its end), then the largest ids at it.
// The ids are kept in one pass that holds at most ~2 `need` candidates: when it holds more,
// it keeps the largest `need` (a selection) and from then on skips ids below the smallest of
// them (with many slots at the bound, as LFU's count 1 under uniform ids, most are skipped
// by one compare).
std::vector<int64_t> LatestAt(const int32_t* score, int64_t n, int32_t bound, int64_t need, const Hashed& s,
                              std::vector<int64_t>* ids_out) {
  std::vector<int64_t> out;
  out.reserve(need);
  for (int32_t k = *s.free_count - 1; k >= 0 && static_cast<int64_t>(out.size()) < need; --k)
    if (score[s.free[k]] == bound) out.push_back(s.free[k]);
  ids_out->assign(out.size(), kEmpty);
  const int64_t rest = need - static_cast<int64_t>(out.size());
  if (rest == 0) return out;
  struct Candidate {
    uint64_t key;  // the id in unsigned order (larger id, larger key)
    int64_t slot;
  };
  const auto larger = [](const Candidate& a, const Candidate& b) { return a.key > b.key; };
  std::vector<Candidate> kept;
  const size_t most = static_cast<size_t>(2 * rest + 1024);
  kept.reserve(most);
  uint64_t floor = 0;  // ids below it cannot be among the largest `rest`
  const auto consider = [&](int64_t j) {
    const int64_t id = s.id(j);
    if (id == kEmpty) return;
    const uint64_t key = static_cast<uint64_t>(id) ^ kSign;
    if (key < floor) return;
    kept.push_back({key, j});
    if (kept.size() < most) return;
    std::nth_element(kept.begin(), kept.begin() + (rest - 1), kept.end(), larger);
    kept.resize(rest);
    floor = kept[rest - 1].key;
  };
  int64_t j = 0;
#ifdef __AVX512F__
  const __m512i vbound = _mm512_set1_epi32(bound);
  for (; j + 16 <= n; j += 16)
    for (uint32_t eq = _mm512_cmpeq_epi32_mask(_mm512_loadu_si512(score + j), vbound); eq != 0; eq &= eq - 1)
      consider(j + __builtin_ctz(eq));
#endif
  for (; j < n; ++j)
    if (score[j] == bound) consider(j);
  const int64_t take = std::min<int64_t>(rest, static_cast<int64_t>(kept.size()));
  std::partial_sort(kept.begin(), kept.begin() + take, kept.end(), larger);
  for (int64_t i = 0; i < take; ++i) {
    out.push_back(kept[i].slot);
    ids_out->push_back(static_cast<int64_t>(kept[i].key ^ kSign));
  }
  return out;
}

// The slots that lose to new ids, in the sorted form's order of loss (`InLossOrder`): the
// i-th best new id (`mine(i)`: its score) wins iff it beats the i-th weakest slot, for the
// first `won` of the `m` candidates (`won` is set). The m lowest scores are found first, by
// scores alone: a bound guessed from a sample (`GuessBound`) or the exact m-th lowest score
// (`MthLowest`), the slots below it collected in one pass (`Below`). Only the `won` that lose
// are then ordered (ids read): those below the won-th lowest score, then the latest at it
// (from those collected, or `LatestAt` when it is the bound). With few winners (LFU under
// uniform ids: a handful a call) that is a handful of ids, not m.
template <class Mine>
std::vector<int64_t> LosersHashed(const int32_t* score, int64_t n, int64_t m, const Hashed& s, Mine mine,
                                  int64_t* won, std::vector<int64_t>* ids) {
  *won = 0;
  ids->clear();
  if (m <= 0) return {};
  int32_t bound;
  int64_t equal = 0;
  std::vector<int64_t> under;
  bool exact = false;
  if (GuessBound(score, n, m, &bound)) {
    under = Below(score, n, bound, 2 * m, &equal);
    exact = static_cast<int64_t>(under.size()) + equal >= m;  // the m weakest are within reach
  }
  if (!exact) {
    const int threads = std::max(1, std::min(omp_get_max_threads(), static_cast<int>(n >> 10)));
    const MthScore mth = MthLowest(score, n, m, threads);
    bound = static_cast<int32_t>(static_cast<int64_t>(mth.low) + mth.t);
    under = Below(score, n, bound, mth.below, &equal);
  }
  // the m lowest scores ascending: those collected (sorted by score alone), then the bound
  const int64_t c = static_cast<int64_t>(under.size());
  std::vector<uint64_t> key(c), tmp_key(c);
  std::vector<uint32_t> order(c), tmp_order(c);
  for (int64_t i = 0; i < c; ++i) {
    key[i] = static_cast<uint32_t>(score[under[i]]) ^ 0x80000000u;
    order[i] = static_cast<uint32_t>(i);
  }
  RadixSort(key.data(), order.data(), tmp_key.data(), tmp_order.data(), c);
  const auto lowest = [&](int64_t i) { return i < c ? score[under[order[i]]] : bound; };
  while (*won < m && mine(*won) > lowest(*won)) ++*won;
  if (*won == 0) return {};
  // the losers: every slot below the won-th lowest score `t`, then the latest at it
  const int32_t t = lowest(*won - 1);
  std::vector<int64_t> below, at;
  for (int64_t i = 0; i < c; ++i) {
    const int64_t slot = under[i];
    if (score[slot] < t) below.push_back(slot);
    else if (score[slot] == t) at.push_back(slot);
  }
  const int64_t need = *won - static_cast<int64_t>(below.size());
  std::vector<int64_t> at_ids;
  InLossOrder(below, score, s, ids);
  if (t == bound && static_cast<int64_t>(at.size()) < need) {
    at = LatestAt(score, n, bound, need, s, &at_ids);  // (those at the bound were not collected)
  } else {
    InLossOrder(at, score, s, &at_ids);
    at.resize(need);
    at_ids.resize(need);
  }
  below.insert(below.end(), at.begin(), at.end());
  ids->insert(ids->end(), at_ids.begin(), at_ids.end());
  return below;
}

// `Evict` on the hashed form: the same decisions (see there), the same returns; instead of
// the evicted mask, the slots given to new ids ascending, then `z` up to `limit` (`rows`:
// what the rows' reset reads, without a pass over a mask of every slot).
int64_t EvictHashed(const Hashed& s, int32_t* rows, int64_t limit, int32_t policy, int32_t threshold,
                    int32_t ttl, std::vector<int32_t>* slot_of) {
  const bool lfu = policy == kLfu;
  int32_t* const meta = s.meta;
  const int64_t z = s.z;
  const int32_t step = *s.step;
  const int64_t n = std::min<int64_t>(std::max<int32_t>(*s.used, 0), s.h);
  Coalesced& win = const_cast<Coalesced&>(EvictWindow());
  CoalesceByHash(s.whi, s.wlo, s.wstep, n, s.seed, win);
  const int64_t u = static_cast<int64_t>(win.ids.size());  // in the order first seen
  const int64_t* const wids = win.ids.data();
  const int32_t* const wcount = win.count.data();
  const int32_t* const wlast = win.last.data();
  // each distinct id's slot (-1: not resident), the lookups split over the threads
  static thread_local std::vector<int32_t> hit_buf;
  hit_buf.resize(u);
  int32_t* const hit = hit_buf.data();
  FindAllSplit(
      s, u, [wids](int64_t w) { return wids[w]; }, [hit](int64_t w, int32_t slot) { hit[w] = slot; });
  // residents' metadata (a resident below the threshold keeps its slot, unchanged); the
  // admitted ids that are not resident (then sorted ascending)
  if (slot_of) slot_of->assign(u, static_cast<int32_t>(z - 1));
  int32_t* const slot_out = slot_of ? slot_of->data() : nullptr;
  std::vector<uint32_t> fresh;
  constexpr int64_t kAhead = 16;
  for (int64_t w = 0; w < u; ++w) {
    if (w + kAhead < u && hit[w + kAhead] >= 0) __builtin_prefetch(meta + hit[w + kAhead], 1);
    const int32_t slot = hit[w];
    const bool admitted = wcount[w] >= threshold;
    if (slot < 0) {
      if (admitted) fresh.push_back(static_cast<uint32_t>(w));
      continue;
    }
    if (slot_out) slot_out[w] = slot;
    if (!admitted) continue;
    meta[slot] = SeenMeta(lfu, meta[slot], wcount[w], wlast[w]);
  }
  meta[z - 1] = lfu ? INT32_MAX : step;
  const int64_t f = static_cast<int64_t>(fresh.size());
  {
    std::vector<uint64_t> key(f), tmp_key(f);
    std::vector<uint32_t> tmp_val(f);
    for (int64_t i = 0; i < f; ++i) key[i] = static_cast<uint64_t>(wids[fresh[i]]) ^ kSign;
    SortKeys(key.data(), fresh.data(), tmp_key.data(), tmp_val.data(), f);  // (distinct ids)
  }
  const std::vector<uint32_t> best = BestFirst(fresh, win, lfu, step);
  std::vector<int32_t> ttl_score;
  if (policy == kTtl) {
    ttl_score.resize(z);
    for (int64_t j = 0; j < z; ++j) {
      ttl_score[j] = TtlScore(s.id(j) == kEmpty, meta[j], step, ttl);
    }
  }
  const int32_t* score = policy == kTtl ? ttl_score.data() : meta;
  const int64_t m = std::min<int64_t>(f, z - 1);
  int64_t won = 0;
  std::vector<int64_t> lost_ids;  // (each loser's id, read once by the selection)
  const std::vector<int64_t> weak = LosersHashed(
      score, z - 1, m, s,
      [&](int64_t i) {
        const uint32_t w = fresh[best[i]];
        return NewIdScore(policy, step, win.count[w], win.last[w]);
      },
      &won, &lost_ids);
  *s.used = 0;
  std::memset(s.wstep, 0, sizeof(int32_t) * s.h);
  *s.last_eviction = step;
  for (int64_t i = won; i < limit; ++i) rows[i] = static_cast<int32_t>(z);
  if (won == 0) return 0;
  // the best winner takes the best loser's (the won-th weakest) slot, and so on down; the
  // losers marked in a bitmap of the slots (cleared again below)
  static thread_local std::vector<uint64_t> lost_bits;
  lost_bits.resize((z + 63) / 64);
  uint64_t* const lost = lost_bits.data();
  const auto is_lost = [lost](int64_t slot) { return (lost[slot >> 6] >> (slot & 63)) & 1; };
  std::vector<int32_t> won_slot(f, -1);
  for (int64_t i = 0; i < won; ++i) {
    const int32_t loser = static_cast<int32_t>(weak[won - 1 - i]);
    won_slot[best[i]] = loser;
    lost[loser >> 6] |= uint64_t(1) << (loser & 63);
  }
  if (slot_out) {
    for (int64_t w = 0; w < u; ++w)
      if (hit[w] >= 0 && is_lost(hit[w])) slot_out[w] = static_cast<int32_t>(z - 1);
    for (int64_t i = 0; i < won; ++i) slot_out[fresh[best[i]]] = won_slot[best[i]];
  }
  // the losers leave: an id's bucket freed, an empty entry's place in `free` closed
  // (their buckets prefetched ahead)
  int64_t empties_lost = 0;
  for (int64_t i = 0; i < won; ++i) {
    if (i + kAhead < won && lost_ids[i + kAhead] != kEmpty) {
      // (its bucket's line, and the next: the backward shift walks on to the run's end)
      const int32_t* at = s.bucket(lost_ids[i + kAhead]);
      __builtin_prefetch(at, 1);
      __builtin_prefetch(at + 16, 1);
    }
    if (lost_ids[i] == kEmpty)
      ++empties_lost;
    else
      Erase(s, lost_ids[i]);
  }
  if (empties_lost > 0) {  // most often the latest ones: the later empty entries lose first
    int32_t e = *s.free_count;
    int64_t top = 0;
    while (top < e && is_lost(s.free[e - 1 - top])) ++top;
    int32_t kept = e - static_cast<int32_t>(top);
    if (top != empties_lost) {
      kept = 0;
      for (int32_t j = 0; j < e; ++j)
        if (!is_lost(s.free[j])) s.free[kept++] = s.free[j];
    }
    for (int32_t j = kept; j < e; ++j) s.free[j] = -1;
    *s.free_count = kept;
  }
  // the winners join: each at its slot, and in the table
  for (int64_t i = 0; i < won; ++i) {
    if (i + kAhead < won) __builtin_prefetch(s.bucket(win.ids[fresh[best[i + kAhead]]]));
    const uint32_t w = fresh[best[i]];
    const int32_t slot = won_slot[best[i]];
    const int64_t k = win.ids[w];
    s.ids[2 * slot] = HiOf(k);
    s.ids[2 * slot + 1] = static_cast<int32_t>(LoOf(k));
    meta[slot] = lfu ? win.count[w] : win.last[w];
    Insert(s, k, slot);
  }
  // the losers' slots ascending, read off the bitmap (which is cleared as it is read)
  int64_t r = 0;
  for (int64_t b = 0; b < static_cast<int64_t>(lost_bits.size()) && r < won; ++b)
    for (uint64_t bits = lost[b]; bits; bits &= bits - 1) rows[r++] = static_cast<int32_t>(b * 64 + __builtin_ctzll(bits));
  for (int64_t i = 0; i < won; ++i) lost[weak[i] >> 6] = 0;
  return won;
}

// A buffer's data as T*: the input's (the output when aliased to it, else a copy of it).
template <class T>
T* Took(const ffi::RemainingArgs& args, const ffi::RemainingRets& rets, size_t i) {
  ffi::AnyBuffer in = args.get<ffi::AnyBuffer>(i).value();
  void* dst = rets.get<ffi::AnyBuffer>(i).value()->untyped_data();
  if (dst != in.untyped_data()) std::memcpy(dst, in.untyped_data(), in.size_bytes());
  return static_cast<T*>(dst);
}

template <class T>
T* ArgData(const ffi::RemainingArgs& args, size_t i) {
  return static_cast<T*>(args.get<ffi::AnyBuffer>(i).value().untyped_data());
}

template <class T>
T* RetData(const ffi::RemainingRets& rets, size_t i) {
  return static_cast<T*>(rets.get<ffi::AnyBuffer>(i).value()->untyped_data());
}

constexpr size_t kHashedLeaves = 11;  // sparse_jax.managed._hashed.MCHHashState's fields

// The hashed state's 11 buffers (in MCHHashState's order), taken into the outputs.
Hashed TakeHashed(const ffi::RemainingArgs& args, const ffi::RemainingRets& rets) {
  Hashed s{};
  AttachTable(s, Took<int32_t>(args, rets, 0),
              static_cast<int64_t>(args.get<ffi::AnyBuffer>(0).value().element_count()) / 4);
  s.ids = Took<int32_t>(args, rets, 1);
  s.meta = Took<int32_t>(args, rets, 2);
  s.free = Took<int32_t>(args, rets, 3);
  s.free_count = Took<int32_t>(args, rets, 4);
  s.whi = Took<int32_t>(args, rets, 5);
  s.wlo = Took<uint32_t>(args, rets, 6);
  s.wstep = Took<int32_t>(args, rets, 7);
  s.used = Took<int32_t>(args, rets, 8);
  s.step = Took<int32_t>(args, rets, 9);
  s.last_eviction = Took<int32_t>(args, rets, 10);
  s.z = static_cast<int64_t>(args.get<ffi::AnyBuffer>(2).value().element_count());
  s.h = static_cast<int64_t>(args.get<ffi::AnyBuffer>(5).value().element_count());
  return s;
}

// MchProfileRemap on the hashed form: operands the hashed state's 11 buffers then the batch's
// hi, lo and valid (or its [n, 2] words, each id's hi then lo, and valid: as a prepared batch
// holds them, read here instead of split by XLA); results the new state's 11 (aliased), the
// slots given to new ids
// (ascending, then `zch_size`, `min(zch_size, history_capacity)` of them: the evicted mask's
// set entries), the counts (entries held before, after, slots given to new ids) and the
// batch's slots.
ffi::Error MchHashProfileRemapImpl(ffi::RemainingArgs args, ffi::RemainingRets rets, int32_t policy,
                                   int32_t interval, int32_t threshold, int32_t ttl) {
  const bool words = args.size() == kHashedLeaves + 2;
  if ((!words && args.size() != kHashedLeaves + 3) || rets.size() != kHashedLeaves + 3)
    return ffi::Error(ffi::ErrorCode::kInvalidArgument,
                      "MchHashProfileRemap: expected 13 or 14 operands and 14 results");
  const Hashed s = TakeHashed(args, rets);
  const int32_t* ih = ArgData<int32_t>(args, kHashedLeaves);
  const uint32_t* il = ArgData<uint32_t>(args, kHashedLeaves + 1);
  const bool* ok = ArgData<bool>(args, args.size() - 1);
  int64_t n = static_cast<int64_t>(args.get<ffi::AnyBuffer>(kHashedLeaves).value().element_count());
  if (words) {  // each id's (hi, lo) words side by side: split once
    static thread_local std::vector<int32_t> hi_buf;
    static thread_local std::vector<uint32_t> lo_buf;
    const int32_t* w = ArgData<int32_t>(args, kHashedLeaves);
    n /= 2;
    hi_buf.resize(n);
    lo_buf.resize(n);
    for (int64_t i = 0; i < n; ++i) hi_buf[i] = w[2 * i], lo_buf[i] = static_cast<uint32_t>(w[2 * i + 1]);
    ih = hi_buf.data();
    il = lo_buf.data();
  }
  int32_t* rows = RetData<int32_t>(rets, kHashedLeaves);
  const int64_t limit = static_cast<int64_t>(rets.get<ffi::AnyBuffer>(kHashedLeaves).value()->element_count());
  int32_t* occ = RetData<int32_t>(rets, kHashedLeaves + 1);
  int32_t* out = RetData<int32_t>(rets, kHashedLeaves + 2);
  const int32_t z1 = static_cast<int32_t>(s.z - 1);
  occ[0] = z1 - *s.free_count;  // the ids held: every entry but the empty ones and the default
  occ[1] = occ[0];
  occ[2] = 0;
  const int64_t first = *s.used;
  const int32_t now = Append(s.whi, s.wlo, s.wstep, s.used, s.step, s.h, ih, il, ok, n);
  const auto find = [&s, z1](int64_t k) {
    const int32_t slot = FindSlot(s, k);
    return slot < 0 ? z1 : slot;
  };
  if (now - *s.last_eviction == interval) {
    static thread_local std::vector<int32_t> slot_of;
    const int64_t admitted = EvictHashed(s, rows, limit, policy, threshold, ttl, &slot_of);
    occ[1] = z1 - *s.free_count;
    occ[2] = static_cast<int32_t>(admitted);
    ReadOff(ih, il, ok, n, first, slot_of.data(), out, find);
  } else {
    for (int64_t i = 0; i < limit; ++i) rows[i] = static_cast<int32_t>(s.z);
    LookupHashed(s, ih, il, n, z1, out);
  }
  return ffi::Error::Success();
}

// The eval lookup on the hashed form: the slot of each id (`default_slot` when not resident).
ffi::Error MchHashRemapImpl(ffi::Buffer<ffi::S32> table, ffi::Buffer<ffi::S32> ids_hi, ffi::Buffer<ffi::U32> ids_lo,
                            ffi::Result<ffi::Buffer<ffi::S32>> out, int32_t default_slot) {
  Hashed t{};
  AttachTable(t, const_cast<int32_t*>(table.typed_data()), static_cast<int64_t>(table.element_count()) / 4);
  LookupHashed(t, ids_hi.typed_data(), ids_lo.typed_data(), static_cast<int64_t>(ids_hi.element_count()),
               default_slot, out->typed_data());
  return ffi::Error::Success();
}

// The sorted form's 11 buffers -> the hashed form's 11 (`MchToHash`; the table's size is the
// result's). Refuses a map whose last entry is not the default slot's.
ffi::Error MchToHashImpl(ffi::RemainingArgs args, ffi::RemainingRets rets, int32_t policy) {
  if (args.size() != 11 || rets.size() != kHashedLeaves)
    return ffi::Error(ffi::ErrorCode::kInvalidArgument, "MchToHash: expected 11 operands and 11 results");
  const int32_t* hi = ArgData<int32_t>(args, 0);
  const uint32_t* lo = ArgData<uint32_t>(args, 1);
  const int32_t* slots = ArgData<int32_t>(args, 2);
  const int32_t* kept = ArgData<int32_t>(args, policy == kLfu ? 3 : 4);
  const int64_t z = static_cast<int64_t>(args.get<ffi::AnyBuffer>(0).value().element_count());
  if (slots[z - 1] != z - 1 || Key(hi[z - 1], lo[z - 1]) != kEmpty)
    return ffi::Error(ffi::ErrorCode::kInvalidArgument,
                      "MchToHash: the map's last entry is not the default slot's (zch_size - 1)");
  {  // the slots are written at: each in [0, z) and owned once
    std::vector<uint64_t> seen((z + 63) / 64, 0);
    for (int64_t j = 0; j < z; ++j) {
      const int32_t slot = slots[j];
      if (slot < 0 || slot >= z || (seen[slot >> 6] >> (slot & 63) & 1))
        return ffi::Error(ffi::ErrorCode::kInvalidArgument,
                          "MchToHash: the map's slots are not a permutation of 0..zch_size-1 "
                          "(entry " + std::to_string(j) + " holds slot " + std::to_string(slot) + ")");
      seen[slot >> 6] |= uint64_t(1) << (slot & 63);
    }
  }
  Hashed s{};
  int32_t* const table = RetData<int32_t>(rets, 0);
  const int64_t buckets = static_cast<int64_t>(rets.get<ffi::AnyBuffer>(0).value()->element_count()) / 4;
  std::memset(table, 0xFF, sizeof(int32_t) * 4 * buckets);  // every bucket free (slot -1)
  PutFreshSeed(table);
  AttachTable(s, table, buckets);
  s.ids = RetData<int32_t>(rets, 1);
  s.meta = RetData<int32_t>(rets, 2);
  s.free = RetData<int32_t>(rets, 3);
  int32_t e = 0;
  for (int64_t j = 0; j < z; ++j) {
    const int32_t slot = slots[j];
    s.ids[2 * slot] = hi[j];
    s.ids[2 * slot + 1] = static_cast<int32_t>(lo[j]);
    s.meta[slot] = kept[j];
    if (j == z - 1) break;
    const int64_t k = Key(hi[j], lo[j]);
    if (k == kEmpty)
      s.free[e++] = slot;
    else
      Insert(s, k, slot);
  }
  for (int64_t j = e; j < z; ++j) s.free[j] = -1;
  *RetData<int32_t>(rets, 4) = e;
  for (size_t i = 5; i < 11; ++i) {  // the window and the counters as they are
    ffi::AnyBuffer in = args.get<ffi::AnyBuffer>(i).value();
    std::memcpy(rets.get<ffi::AnyBuffer>(i).value()->untyped_data(), in.untyped_data(), in.size_bytes());
  }
  return ffi::Error::Success();
}

// The hashed form's 11 buffers -> the sorted form's 11: the ids ascending with their slots
// and metadata, then the empty entries in their order, then the default entry.
ffi::Error MchFromHashImpl(ffi::RemainingArgs args, ffi::RemainingRets rets, int32_t policy) {
  if (args.size() != kHashedLeaves || rets.size() != 11)
    return ffi::Error(ffi::ErrorCode::kInvalidArgument, "MchFromHash: expected 11 operands and 11 results");
  const int32_t* sid = ArgData<int32_t>(args, 1);
  const int32_t* meta = ArgData<int32_t>(args, 2);
  const int32_t* free = ArgData<int32_t>(args, 3);
  const int32_t e = *ArgData<int32_t>(args, 4);
  const int64_t z = static_cast<int64_t>(args.get<ffi::AnyBuffer>(2).value().element_count());
  int32_t* hi = RetData<int32_t>(rets, 0);
  uint32_t* lo = RetData<uint32_t>(rets, 1);
  int32_t* slots = RetData<int32_t>(rets, 2);
  int32_t* kept = RetData<int32_t>(rets, policy == kLfu ? 3 : 4);
  int32_t* other = RetData<int32_t>(rets, policy == kLfu ? 4 : 3);
  std::vector<uint64_t> key, tmp_key;
  std::vector<uint32_t> val, tmp_val;
  key.reserve(z);
  val.reserve(z);
  for (int64_t slot = 0; slot < z - 1; ++slot) {
    const int64_t k = Key(sid[2 * slot], static_cast<uint32_t>(sid[2 * slot + 1]));
    if (k == kEmpty) continue;
    key.push_back(static_cast<uint64_t>(k) ^ kSign);
    val.push_back(static_cast<uint32_t>(slot));
  }
  const int64_t r = static_cast<int64_t>(key.size());
  if (r + e != z - 1)
    return ffi::Error(ffi::ErrorCode::kInvalidArgument, "MchFromHash: the ids held and the empty entries do not add up");
  tmp_key.resize(r);
  tmp_val.resize(r);
  RadixSort(key.data(), val.data(), tmp_key.data(), tmp_val.data(), r);
  const auto put = [&](int64_t j, int32_t slot) {
    hi[j] = sid[2 * slot];
    lo[j] = static_cast<uint32_t>(sid[2 * slot + 1]);
    slots[j] = slot;
    kept[j] = meta[slot];
    other[j] = 0;
  };
  for (int64_t j = 0; j < r; ++j) put(j, static_cast<int32_t>(val[j]));
  for (int32_t k = 0; k < e; ++k) put(r + k, free[k]);
  put(z - 1, static_cast<int32_t>(z - 1));
  for (size_t i = 5; i < kHashedLeaves; ++i) {  // the window and the counters as they are
    ffi::AnyBuffer in = args.get<ffi::AnyBuffer>(i).value();
    std::memcpy(rets.get<ffi::AnyBuffer>(i).value()->untyped_data(), in.untyped_data(), in.size_bytes());
  }
  return ffi::Error::Success();
}

}  // namespace

#ifdef HYBRIDREC_SELFTEST
// A test build only (`tests/test_managed_moves.py` compiles this file with
// -DHYBRIDREC_SELFTEST): `cases` random evictions (maps of 2-`max_z` entries, up to half of
// them lost, as many winners joining at random places) moved by `MoveAllRuns` with its halves
// in `order` (0: two threads, 1: left first, 2: right first), checked entry by entry against
// where each survivor belongs. Returns the cases with a misplaced entry.
extern "C" int64_t HybridrecMovesSelftest(uint64_t seed, int64_t cases, int64_t max_z, int order,
                                          int skip_fixup) {
  g_selftest_order = order;
  g_selftest_skip_fixup = skip_fixup != 0;
  omp_set_num_threads(2);
  uint64_t state = seed;
  const auto next = [&state]() {  // splitmix64
    uint64_t z = (state += 0x9e3779b97f4a7c15ULL);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
  };
  int64_t bad = 0;
  for (int64_t c = 0; c < cases; ++c) {
    const int64_t z = 2 + static_cast<int64_t>(next() % static_cast<uint64_t>(max_z - 1));
    // lost: distinct positions below the default entry, bunched at one end a third of the time
    const int64_t want = static_cast<int64_t>(next() % static_cast<uint64_t>(z / 2 + 1));
    const int bunch = static_cast<int>(next() % 3);
    std::vector<char> gone(z, 0);
    for (int64_t i = 0; i < want; ++i) {
      uint64_t r = next() % static_cast<uint64_t>(z - 1);
      if (bunch == 1) r = r * r / (z - 1);  // toward the start
      if (bunch == 2) r = z - 2 - (r * r / (z - 1));  // toward the end
      gone[r] = 1;
    }
    std::vector<int64_t> lost, below;
    for (int64_t i = 0; i < z; ++i)
      if (gone[i]) lost.push_back(i);
    for (size_t i = 0; i < lost.size(); ++i) below.push_back(static_cast<int64_t>(next() % static_cast<uint64_t>(z)));
    std::sort(below.begin(), below.end());
    const std::vector<Run> runs = Runs(lost, below, z);
    std::vector<uint32_t> a(z), b(z);
    for (int64_t i = 0; i < z; ++i) a[i] = static_cast<uint32_t>(i), b[i] = static_cast<uint32_t>(i) ^ 0xA5A5A5A5u;
    uint32_t* cols[2] = {a.data(), b.data()};
    MoveAllRuns(cols, 2, runs, true);
    // survivor i lands after the survivors before it and the winners at or below it
    size_t li = 0, wi = 0;
    bool wrong = false;
    for (int64_t i = 0; i < z && !wrong; ++i) {
      while (wi < below.size() && below[wi] <= i) ++wi;
      if (li < lost.size() && lost[li] == i) {
        ++li;
        continue;
      }
      const int64_t at = i - static_cast<int64_t>(li) + static_cast<int64_t>(wi);
      wrong = a[at] != static_cast<uint32_t>(i) || b[at] != (static_cast<uint32_t>(i) ^ 0xA5A5A5A5u);
    }
    bad += wrong;
  }
  g_selftest_order = 0;
  g_selftest_skip_fixup = false;
  return bad;
}
#endif

XLA_FFI_DEFINE_HANDLER_SYMBOL(HybridrecMaskPositions, MaskPositionsImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::PRED>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Attr<int32_t>("fill"));

// The profile calls' operands: the state's 11 buffers and the batch's hi, lo and valid;
// the new state's 11 buffers, the evicted mask and the counts (then, for the remap form,
// the batch's slots, and the attributes).
static auto ProfileBinding() {
  return ffi::Ffi::Bind()
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
      .Ret<ffi::Buffer<ffi::S32>>();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(HybridrecMchProfile, MchProfileImpl,
                              ProfileBinding()
                                  .Attr<int32_t>("policy")
                                  .Attr<int32_t>("interval")
                                  .Attr<int32_t>("threshold")
                                  .Attr<int32_t>("ttl"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(HybridrecMchProfileRemap, MchProfileRemapImpl,
                              ProfileBinding()
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

XLA_FFI_DEFINE_HANDLER_SYMBOL(HybridrecMchHashProfileRemap, MchHashProfileRemapImpl,
                              ffi::Ffi::Bind()
                                  .RemainingArgs()
                                  .RemainingRets()
                                  .Attr<int32_t>("policy")
                                  .Attr<int32_t>("interval")
                                  .Attr<int32_t>("threshold")
                                  .Attr<int32_t>("ttl"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(HybridrecMchHashRemap, MchHashRemapImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::U32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Attr<int32_t>("default_slot"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(HybridrecMchToHash, MchToHashImpl,
                              ffi::Ffi::Bind().RemainingArgs().RemainingRets().Attr<int32_t>("policy"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(HybridrecMchFromHash, MchFromHashImpl,
                              ffi::Ffi::Bind().RemainingArgs().RemainingRets().Attr<int32_t>("policy"));
