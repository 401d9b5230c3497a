// Paged attention on CPU, read straight from the block-paged KV cache.
//
// Built into one extension with the other kernels by engine/model/cpu_kernels.py; registers the
// op torch.ops.specplan_attn.paged_attention_cpu, which engine/model/attention_cpu.py calls.
// Semantics match engine/model/attention.py's paged_attention (causal, optional sliding window,
// GQA) for requests WITHOUT tree masks.
//
// Layouts:
//   q             [N, H, D]                          contiguous, float32 or float64
//   k/v cache     [num_blocks, block_size, KVH, D]   any strides, last dim contiguous; q's dtype,
//                                                    or float16 with float32 q (head_dim 64/128:
//                                                    half the bytes a decode step reads, widened
//                                                    to float as loaded; the math stays float)
//   query_start_loc [B+1] int32, seq_lens [B] int32, block_tables [B, max_blocks] int32,
//   positions     [N] int64
//   tree_bits     [N] int64 or None                  draft-tree rows: which tree nodes they see
// Request b owns query rows query_start_loc[b]:query_start_loc[b+1] and keys 0..seq_lens[b]-1;
// key j lives in block block_tables[b][j / block_size] at offset j % block_size. Row i attends
// to keys j <= positions[i] (and j > positions[i] - sliding_window when sliding_window > 0).
// Tree rows (tree_bits[i] != 0): the request's T query tokens are the nodes of a draft tree,
// node u in key slot c + u (c = seq_lens[b] - T), so position order is not visibility order. Row
// i sees every context key j < c and tree key c + u iff bit u of tree_bits[i] is set (its
// ancestors and itself; no sliding window, as in the torch reference). Worked example: a tree
// root -> {x, y}, x -> z, nodes [root, x, y, z] in slots c..c+3: tree_bits = [0b0001, 0b0011,
// 0b0101, 0b1011] (z sees root, x and itself, not its cousin y).
// Query head h reads KV head h / G (G = H / KVH): the G heads of one KV head are processed
// together against each key/value vector read in place; nothing is gathered or repeated. Rows
// with no visible key (invalid input) come out as zeros.
//
// Work split: by default one item per (request, chunk of <= kQueryChunk query tokens) covering all
// KV heads, so every cache block is streamed once, front to back, with the next block prefetched.
// Few requests (a single verify or prefill): one item per KV head, and query chunks are halved
// until each thread has a couple of items.
//
// Batch invariance: a row's result depends only on its own query, keys and values, never on the
// other rows of the batch or the thread count: every row runs one online softmax over its keys
// front to back, whoever computes it. Greedy speculation needs this bit for bit: a verify step's
// row must equal the decode step that would have produced it. Splitting a lone decode's keys into
// ranges merged after (flash-decoding) broke it: a decode at B = 1 summed its keys in pieces
// while the same row inside a verify step did not, and the last-bit difference flipped greedy
// tokens once int8 activation rounding (quant_linear.cpp) magnified it. The split bought nothing
// measurable up to 1024 keys (a B = 1 decode's attention over 30 layers, 2 threads: 1.26 -> 1.08-1.26
// ms at 256 keys, 5.3 -> 5.3-6.0 ms at 1024) and cost 20 -> 22-26 ms at 4096 keys
// (scripts/bench_attention_shapes.py, two runs after, one before). Getting that back without
// losing invariance needs ranges fixed by key index (say every 1024 keys) that every row of every
// batch uses, merged in the same order, not ranges chosen from the batch's item count.
// Threads of torch's intra-op pool (specplan::parallel_for, team.h: at::parallel_for, or the step's
// team inside decoder_layers; hence -fopenmp at build time) pull items, costliest first, from a shared counter. Per item and
// query row: online (streaming) softmax over the key blocks, accumulated in the input precision.
// float with head_dim 64 or 128 (the common sizes): attend_rows, L keys per pass in L-lane (one register)
// vectors with head_dim a compile-time constant and the G heads of a KV head sharing each load.
// Other float head sizes: explicit SIMD, 4 keys per pass for q.k, a vectorized exp. double: the
// same loops with libm exp.

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_like.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include "kernels.h"
#include "team.h"

#include "vec_math.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <type_traits>
#include <vector>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

namespace {

using specplan::exp_nonpositive;

constexpr int64_t kQueryChunk = 16;  // query tokens per work item (prefill chunks are split)
constexpr int64_t kPrefetchBlocks = 2;  // generic loops: KV blocks fetched ahead of the one being read
// Fast path: the (block, KV head) pair whose keys and values are fetched while this one is
// computed, this many pairs ahead, one row per key computed (RowPrefetch). Fetching a whole block
// at once before its math (as the generic loops do) filled the core's miss buffers and stalled the
// math behind the fetch, so fetch and math took turns. Row fetch was faster at every batch size
// and context tried, most with scattered blocks; one pair ahead did as well at B=32, three or
// four did worse (measured: reports/README.md#engine-measurements).
constexpr int64_t kPrefetchUnits = 2;
constexpr int64_t kItemsPerThread = 4;     // fewer (request, chunk) items per thread: split by KV head
constexpr int64_t kMinItemsPerThread = 2;  // still fewer: split the query rows finer

// Explicit SIMD through GCC/Clang vector extensions (no intrinsics): 32-byte vectors become one
// AVX register when built with -mavx2, or two SSE/NEON registers otherwise. Plain loops were
// left half-scalar by the auto-vectorizer (reductions cannot be reassociated without -ffast-math).
template <typename T>
struct Simd;
template <>
struct Simd<float> {
  typedef float V __attribute__((vector_size(32)));
  typedef float Half __attribute__((vector_size(16)));
};
template <>
struct Simd<double> {
  typedef double V __attribute__((vector_size(32)));
  typedef double Half __attribute__((vector_size(16)));
};
template <typename T>
using Vec = typename Simd<T>::V;
template <typename T>
constexpr int64_t kLanes = 32 / sizeof(T);

template <typename T>
inline Vec<T> loadv(const T* p) {
  Vec<T> v;
  std::memcpy(&v, p, sizeof(v));  // unaligned load
  return v;
}

template <typename T>
inline void storev(T* p, const Vec<T>& v) {
  std::memcpy(p, &v, sizeof(v));
}

template <typename T>
inline T hsum(const Vec<T>& v) {
  typename Simd<T>::Half lo, hi;
  std::memcpy(&lo, &v, sizeof(lo));
  std::memcpy(&hi, reinterpret_cast<const char*>(&v) + sizeof(lo), sizeof(hi));
  const typename Simd<T>::Half h = lo + hi;
  T s = h[0];
  for (int64_t j = 1; j < kLanes<T> / 2; ++j) s += h[j];
  return s;
}

template <typename T>
inline T dot(const T* __restrict a, const T* __restrict b, int64_t n) {
  constexpr int64_t L = kLanes<T>;
  Vec<T> s0 = {}, s1 = {};
  int64_t d = 0;
  for (; d + 2 * L <= n; d += 2 * L) {
    s0 += loadv(a + d) * loadv(b + d);
    s1 += loadv(a + d + L) * loadv(b + d + L);
  }
  if (d + L <= n) {
    s0 += loadv(a + d) * loadv(b + d);
    d += L;
  }
  T s = hsum<T>(s0 + s1);
  for (; d < n; ++d) s += a[d] * b[d];
  return s;
}

// out[t] = scale * dot(q, k + t * stride) for t < nt.
template <typename T>
inline void scores_row(const T* q, const T* k, int64_t stride, int64_t nt, int64_t n, T scale, T* out) {
  for (int64_t t = 0; t < nt; ++t) out[t] = dot(q, k + t * stride, n) * scale;
}

#if defined(__has_builtin)
#if __has_builtin(__builtin_shufflevector)
#define SPECPLAN_HAVE_SHUFFLEVECTOR 1
#endif
#endif

#ifdef SPECPLAN_HAVE_SHUFFLEVECTOR
// float: four keys per pass, so each chunk of q is loaded once for four keys and the four
// horizontal sums share their shuffles (a 4x4 transpose-add).
template <>
inline void scores_row<float>(const float* q, const float* k, int64_t stride, int64_t nt, int64_t n, float scale,
                              float* out) {
  typedef Simd<float>::V V;
  typedef Simd<float>::Half H;
  constexpr int64_t L = kLanes<float>;
  const int64_t nv = n / L * L;
  int64_t t = 0;
  for (; t + 4 <= nt; t += 4) {
    const float* k0 = k + t * stride;
    const float* k1 = k0 + stride;
    const float* k2 = k1 + stride;
    const float* k3 = k2 + stride;
    V a0 = {}, a1 = {}, a2 = {}, a3 = {};
    for (int64_t d = 0; d < nv; d += L) {
      const V qd = loadv(q + d);
      a0 += qd * loadv(k0 + d);
      a1 += qd * loadv(k1 + d);
      a2 += qd * loadv(k2 + d);
      a3 += qd * loadv(k3 + d);
    }
    const H b0 = __builtin_shufflevector(a0, a0, 0, 1, 2, 3) + __builtin_shufflevector(a0, a0, 4, 5, 6, 7);
    const H b1 = __builtin_shufflevector(a1, a1, 0, 1, 2, 3) + __builtin_shufflevector(a1, a1, 4, 5, 6, 7);
    const H b2 = __builtin_shufflevector(a2, a2, 0, 1, 2, 3) + __builtin_shufflevector(a2, a2, 4, 5, 6, 7);
    const H b3 = __builtin_shufflevector(a3, a3, 0, 1, 2, 3) + __builtin_shufflevector(a3, a3, 4, 5, 6, 7);
    const H c0 = __builtin_shufflevector(b0, b1, 0, 4, 1, 5) + __builtin_shufflevector(b0, b1, 2, 6, 3, 7);
    const H c1 = __builtin_shufflevector(b2, b3, 0, 4, 1, 5) + __builtin_shufflevector(b2, b3, 2, 6, 3, 7);
    H sums = __builtin_shufflevector(c0, c1, 0, 1, 4, 5) + __builtin_shufflevector(c0, c1, 2, 3, 6, 7);
    for (int64_t d = nv; d < n; ++d) {  // head_dim tail
      const H kd = {k0[d], k1[d], k2[d], k3[d]};
      sums += q[d] * kd;
    }
    sums *= scale;
    std::memcpy(out + t, &sums, sizeof(sums));
  }
  for (; t < nt; ++t) out[t] = dot(q, k + t * stride, n) * scale;
}
#endif

// acc[0:n] += sum_t p[t] * x[t * stride + 0:n]. Each chunk of acc stays in registers across all t
// (instead of a load and a store of acc per key).
template <typename T>
inline void weighted_sum(T* __restrict acc, const T* __restrict p, const T* __restrict x, int64_t stride,
                         int64_t nt, int64_t n) {
  constexpr int64_t L = kLanes<T>;
  int64_t d = 0;
  for (; d + 4 * L <= n; d += 4 * L) {
    Vec<T> r0 = loadv(acc + d), r1 = loadv(acc + d + L), r2 = loadv(acc + d + 2 * L), r3 = loadv(acc + d + 3 * L);
    for (int64_t t = 0; t < nt; ++t) {
      const Vec<T> pt = Vec<T>{} + p[t];
      const T* xt = x + t * stride + d;
      r0 += pt * loadv(xt);
      r1 += pt * loadv(xt + L);
      r2 += pt * loadv(xt + 2 * L);
      r3 += pt * loadv(xt + 3 * L);
    }
    storev(acc + d, r0);
    storev(acc + d + L, r1);
    storev(acc + d + 2 * L, r2);
    storev(acc + d + 3 * L, r3);
  }
  for (; d + L <= n; d += L) {
    Vec<T> r = loadv(acc + d);
    for (int64_t t = 0; t < nt; ++t) r += (Vec<T>{} + p[t]) * loadv(x + t * stride + d);
    storev(acc + d, r);
  }
  for (; d < n; ++d) {
    T r = acc[d];
    for (int64_t t = 0; t < nt; ++t) r += p[t] * x[t * stride + d];
    acc[d] = r;
  }
}

// row[t] = exp(row[t] - m) for t < n; returns the sum. Generic (double): libm, one at a time.
// row has room for n rounded up to whole vectors.
template <typename T>
inline T exp_and_sum(T* row, int64_t n, T m) {
  T sum = 0;
  for (int64_t t = 0; t < n; ++t) {
    row[t] = std::exp(row[t] - m);
    sum += row[t];
  }
  return sum;
}

template <>
inline float exp_and_sum<float>(float* row, int64_t n, float m) {
  constexpr int64_t L = kLanes<float>;
  for (int64_t t = n; t % L != 0; ++t) row[t] = -std::numeric_limits<float>::infinity();  // pad: exp = 0
  Simd<float>::V sum = {};
  for (int64_t t = 0; t < n; t += L) {
    const Simd<float>::V e = exp_nonpositive(loadv(row + t) - m);
    storev(row + t, e);
    sum += e;
  }
  return hsum<float>(sum);
}

// Software prefetch of `rows` rows of n elements, `stride` elements apart (one call per cache line).
template <typename T>
inline void prefetch_rows(const T* base, int64_t stride, int64_t rows, int64_t n) {
  const int64_t bytes = n * static_cast<int64_t>(sizeof(T));
  for (int64_t r = 0; r < rows; ++r) {
    const char* p = reinterpret_cast<const char*>(base + r * stride);
    for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(p + off, 0, 2);
  }
}

// The key and value rows of a later (block, KV head) to fetch while this one is computed: one
// row (D floats) of each per key of this one, so the loads stream in steadily beside the math.
// KV: the cache's element type (float, or at::Half: a row of D values is then half the lines).
template <typename KV>
struct RowPrefetch {
  static constexpr int kPerLine = 64 / sizeof(KV);  // elements per cache line
  const KV* k = nullptr;
  const KV* v = nullptr;
  int64_t ks = 0, vs = 0;
  int rows = 0;  // 0: nothing to fetch
  template <int D>
  void key_row(int t) const {
    for (int off = 0; off < D; off += kPerLine) __builtin_prefetch(k + t * ks + off, 0, 2);
  }
  template <int D>
  void value_row(int t) const {
    for (int off = 0; off < D; off += kPerLine) __builtin_prefetch(v + t * vs + off, 0, 2);
  }
};

#ifdef SPECPLAN_HAVE_SHUFFLEVECTOR
// ---- float fast path: L keys at a time in L-lane vectors, head_dim D known at compile time ----
// L = kRegLanes: one register per vector (16 lanes with AVX-512, 8 with AVX2). Per query row and
// chunk of n <= L keys: L dot products reduced together into one vector of scores, one vectorized
// exp, and the weighted sum of V with the row's accumulator held in registers.
constexpr int L = specplan::kRegLanes;
typedef specplan::RegF VL;
typedef specplan::RegI VIL;

inline VL loadL(const float* p) { return *reinterpret_cast<const VL*>(p); }

// L keys' or values' elements from the cache as floats: a float cache is read as is; an fp16
// cache (at::Half) is widened exactly (every fp16 value is a float), by one instruction where the
// CPU has F16C (every AVX2 CPU) or AVX-512.
inline VL load_kv(const float* p) { return loadL(p); }
inline VL load_kv(const at::Half* p) {
#if SPECPLAN_REG_LANES == 16
  return (VL)_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
#elif defined(__F16C__)
  return (VL)_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#else
  VL v;
  for (int i = 0; i < L; ++i) v[i] = static_cast<float>(p[i]);
  return v;
#endif
}

// out[t] = sum of the L lanes of p[t]. A transpose-add tree: each level halves the number of
// vectors and doubles the keys per vector (L - 1 shuffle pairs for L sums instead of L reductions).
// With 16 lanes: level 1 pairs keys (0,1): lanes 0-7 hold key 0's 8 partial sums, lanes 8-15 key
// 1's; level 2: 4 lanes for each of keys 0-3; level 3: 2 lanes for each of keys 0-7; level 4: key
// t in lane t. With 8 lanes the same from 4 partial sums per key, in three levels.
inline VL transpose_sum(const VL (&p)[L]) {
#if SPECPLAN_REG_LANES == 16
  VL x[8], z[4], u[2];
  for (int j = 0; j < 8; ++j)
    x[j] = __builtin_shufflevector(p[2 * j], p[2 * j + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
           __builtin_shufflevector(p[2 * j], p[2 * j + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  for (int j = 0; j < 4; ++j)
    z[j] = __builtin_shufflevector(x[2 * j], x[2 * j + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
           __builtin_shufflevector(x[2 * j], x[2 * j + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
  for (int j = 0; j < 2; ++j)
    u[j] = __builtin_shufflevector(z[2 * j], z[2 * j + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
           __builtin_shufflevector(z[2 * j], z[2 * j + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
  return __builtin_shufflevector(u[0], u[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
         __builtin_shufflevector(u[0], u[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
#else
  VL x[4], z[2];
  for (int j = 0; j < 4; ++j)
    x[j] = __builtin_shufflevector(p[2 * j], p[2 * j + 1], 0, 1, 2, 3, 8, 9, 10, 11) +
           __builtin_shufflevector(p[2 * j], p[2 * j + 1], 4, 5, 6, 7, 12, 13, 14, 15);
  for (int j = 0; j < 2; ++j)
    z[j] = __builtin_shufflevector(x[2 * j], x[2 * j + 1], 0, 1, 4, 5, 8, 9, 12, 13) +
           __builtin_shufflevector(x[2 * j], x[2 * j + 1], 2, 3, 6, 7, 10, 11, 14, 15);
  return __builtin_shufflevector(z[0], z[1], 0, 2, 4, 6, 8, 10, 12, 14) +
         __builtin_shufflevector(z[0], z[1], 1, 3, 5, 7, 9, 11, 13, 15);
#endif
}

// The largest and the sum of the L lanes: combine v with itself rotated by L/2, L/4, ... lanes
// until lane 0 and 1 hold the result of all (a rotation by `by` lanes: lane i takes lane i + by).
template <int by>
inline VL rotate_lanes(VL v) {
#if SPECPLAN_REG_LANES == 16
  return __builtin_shufflevector(v, v, by % 16, (1 + by) % 16, (2 + by) % 16, (3 + by) % 16, (4 + by) % 16,
                                 (5 + by) % 16, (6 + by) % 16, (7 + by) % 16, (8 + by) % 16, (9 + by) % 16,
                                 (10 + by) % 16, (11 + by) % 16, (12 + by) % 16, (13 + by) % 16, (14 + by) % 16,
                                 (15 + by) % 16);
#else
  return __builtin_shufflevector(v, v, by % 8, (1 + by) % 8, (2 + by) % 8, (3 + by) % 8, (4 + by) % 8, (5 + by) % 8,
                                 (6 + by) % 8, (7 + by) % 8);
#endif
}

inline float hmax_lanes(VL v) {
  VL w;
  if constexpr (L == 16) {
    w = rotate_lanes<8>(v);
    v = v > w ? v : w;
  }
  w = rotate_lanes<4>(v);
  v = v > w ? v : w;
  w = rotate_lanes<2>(v);
  v = v > w ? v : w;
  return v[0] > v[1] ? v[0] : v[1];
}

inline float hsum_lanes(VL v) {
  if constexpr (L == 16) v += rotate_lanes<8>(v);
  v += rotate_lanes<4>(v);
  v += rotate_lanes<2>(v);
  return v[0] + v[1];
}

// R query rows (the heads of one KV head that see the same keys; row r at q + r * D) against keys
// k[t * ks] and values v[t * vs] for t < n <= L, of which those with bit t of `lanes` set are
// visible (lanes == (1 << n) - 1 but for draft-tree rows; never 0): the online-softmax update of each row's running
// maximum m[r], denominator l[r] and accumulator acc[r * D : (r + 1) * D]. Each key and value
// vector is loaded once for all R rows (GQA: the heads sharing a KV head are read together), and
// each q.k sum runs in two independent chains.
template <int D, int R, typename KV>
inline void attend_rows(const float* __restrict q, const KV* __restrict k, int64_t ks,
                          const KV* __restrict v, int64_t vs, int n, uint32_t lanes, float scale,
                          float* __restrict m, float* __restrict l, float* __restrict acc, const RowPrefetch<KV>& pf) {
  constexpr int C = D / L;  // vectors per head
  VL scores[R];
  {
    VL qv[R][C];
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c) qv[r][c] = loadL(q + r * D + L * c) * scale;
    VL partial[R][L];
    for (int t = 0; t < L; ++t) {
      if (t < n) {
        const KV* kt = k + t * ks;
        if (t < pf.rows) pf.template key_row<D>(t);
        VL kv[C];
        for (int c = 0; c < C; ++c) kv[c] = load_kv(kt + L * c);
        for (int r = 0; r < R; ++r) {
          VL even = qv[r][0] * kv[0], odd = qv[r][1] * kv[1];
          for (int c = 2; c < C; c += 2) {
            even += qv[r][c] * kv[c];
            odd += qv[r][c + 1] * kv[c + 1];
          }
          partial[r][t] = even + odd;
        }
      } else {
        for (int r = 0; r < R; ++r) partial[r][t] = VL{};
      }
    }
    for (int r = 0; r < R; ++r) scores[r] = transpose_sum(partial[r]);  // lane t: q_r . k_t * scale
  }
  if (lanes != (1u << L) - 1u) {  // fewer than L keys, or a tree row's hidden keys: score -inf
    const VIL lane = specplan::lane_index();
    const VIL visible = ((VIL{} + static_cast<int32_t>(lanes)) >> lane) & 1;
    const VL neg_inf = VL{} - std::numeric_limits<float>::infinity();
    for (int r = 0; r < R; ++r) scores[r] = visible != 0 ? scores[r] : neg_inf;
  }
  alignas(64) float p[R][L];  // softmax numerators, read back one broadcast lane at a time
  float alpha[R];  // rescales what row r summed under its old maximum (1: no new maximum)
  for (int r = 0; r < R; ++r) {
    const float mx = hmax_lanes(scores[r]);
    alpha[r] = 1.0f;
    if (mx > m[r]) {
      if (m[r] != -std::numeric_limits<float>::infinity()) alpha[r] = std::exp(m[r] - mx);
      m[r] = mx;
    }
    const VL e = specplan::exp_nonpositive_v<VL, VIL>(scores[r] - m[r]);  // padded lanes: 0
    l[r] = l[r] * alpha[r] + hsum_lanes(e);
    *reinterpret_cast<VL*>(p[r]) = e;
  }
  VL a[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) a[r][c] = loadL(acc + r * D + L * c) * alpha[r];
  for (int t = 0; t < n; ++t) {
    const KV* vt = v + t * vs;
    if (t < pf.rows) pf.template value_row<D>(t);
    VL vv[C];
    for (int c = 0; c < C; ++c) vv[c] = load_kv(vt + L * c);
    for (int r = 0; r < R; ++r) {
      const VL pt = VL{} + p[r][t];
      for (int c = 0; c < C; ++c) a[r][c] += pt * vv[c];
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) *reinterpret_cast<VL*>(acc + r * D + L * c) = a[r][c];
}

// attend_rows for g rows, in groups whose accumulators (rows x D / L vectors) fill at most half
// the vector registers (32 with AVX-512: 4 rows at head_dim 64, 2 at 128; 16 with AVX2: 1 row).
template <int D, typename KV>
inline void attend_heads(const float* q, const KV* k, int64_t ks, const KV* v, int64_t vs, int n,
                           uint32_t lanes, float scale, float* m, float* l, float* acc, int64_t g, RowPrefetch<KV> pf) {
  constexpr int kRegisters = L == 16 ? 32 : 16;
  constexpr int64_t kMaxRows = std::max(1, kRegisters / 2 / (D / L));
  for (int64_t r = 0; r < g; r += kMaxRows) {
    const float* qr = q + r * D;
    float* ar = acc + r * D;
    switch (std::min(g - r, kMaxRows)) {
      case 1: attend_rows<D, 1, KV>(qr, k, ks, v, vs, n, lanes, scale, m + r, l + r, ar, pf); break;
      case 2: attend_rows<D, 2, KV>(qr, k, ks, v, vs, n, lanes, scale, m + r, l + r, ar, pf); break;
      case 3: attend_rows<D, 3, KV>(qr, k, ks, v, vs, n, lanes, scale, m + r, l + r, ar, pf); break;
      default: attend_rows<D, kMaxRows, KV>(qr, k, ks, v, vs, n, lanes, scale, m + r, l + r, ar, pf); break;
    }
    pf.rows = 0;
  }
}
#endif

#ifdef SPECPLAN_HAVE_SHUFFLEVECTOR
constexpr bool kFastPath = true;
#else
constexpr bool kFastPath = false;
#endif

struct WorkItem {
  int64_t req;
  int64_t kv_begin;  // KV heads [kv_begin, kv_end)
  int64_t kv_end;
  int64_t tok_begin;  // rows of q
  int64_t tok_end;
  int64_t cost;  // rows x keys, for largest-first scheduling
};

template <typename T>
struct Scratch {
  std::vector<T> m, l, acc, scores;
  std::vector<int64_t> lo, hi;
  std::vector<uint64_t> tree;  // per query token: its tree_bits (0 = causal row)
};

// Whether a tree row (bits != 0) sees key j: every context key (j < c), tree key c + u iff bit u.
inline bool key_visible(uint64_t bits, int64_t c, int64_t j) {
  return j < c || (j - c < 64 && ((bits >> (j - c)) & 1u));
}

// Visibility of keys j0 .. j0 + n - 1 (n <= 16) to a row: bit t for key j0 + t. Causal rows see
// every key of their span; a tree row (bits != 0) sees context keys (< c) and tree key c + u iff
// bit u of bits is set. Example: c = 20, bits = 0b101, keys 16..31: context lanes 0-3, tree
// lanes 4 (node 0) and 6 (node 2): 0b1010000 | 0b1111 = 0x5F.
inline uint32_t visible_lanes(uint64_t bits, int64_t c, int64_t j0, int64_t n) {
  const uint32_t all = (1u << n) - 1u;
  if (bits == 0 || j0 + n <= c) return all;
  const int64_t off = c - j0;  // lanes below off are context; lane off + u is node u
  const uint64_t tree = off >= 0 ? bits << off : (-off >= 64 ? 0 : bits >> -off);
  const uint64_t context = off > 0 ? (uint64_t{1} << off) - 1 : 0;
  return static_cast<uint32_t>((tree | context) & all);
}

// T: the queries' and outputs' type; KV: the cache's (T, or at::Half with float queries).
template <typename T, typename KV>
struct Args {
  const T* q;
  const KV* k;
  const KV* v;
  T* out;
  const int32_t* seq_lens;
  const int32_t* query_start_loc;
  const int32_t* block_tables;
  const int64_t* positions;
  const int64_t* tree_bits;  // nullptr: no tree rows in the batch
  int64_t H, D, G, block_size, table_stride;
  int64_t sk0, sk1, sk2, sv0, sv1, sv2;  // element strides: block, slot, kv head
  T scale;
  int64_t window;
};

// FastD > 0: float with head_dim FastD, through attend_heads; 0: the generic loops (a cache of
// the queries' own type only).
template <typename T, typename KV, int FastD>
void process(const Args<T, KV>& a, const WorkItem& it, Scratch<T>& s) {
  static_assert(FastD > 0 || std::is_same_v<T, KV>, "an fp16 cache is read by the fast path only");
  const int64_t G = a.G, D = a.D, bs = a.block_size;
  const int64_t ntok = it.tok_end - it.tok_begin;
  const int64_t heads = (it.kv_end - it.kv_begin) * G;  // query heads of this item, contiguous in q
  const int64_t head0 = it.kv_begin * G;
  const int64_t rows = ntok * heads;  // row r = i * heads + (h - head0)
  const int64_t seq_len = a.seq_lens[it.req];
  const int32_t* table = a.block_tables + it.req * a.table_stride;
  constexpr T kNegInf = -std::numeric_limits<T>::infinity();

  s.m.assign(rows, kNegInf);
  s.l.assign(rows, T(0));
  s.acc.assign(rows * D, T(0));
  const int64_t ss = (bs + kLanes<T> - 1) / kLanes<T> * kLanes<T>;  // scores row stride
  s.scores.resize(G * ss);
  s.lo.resize(ntok);
  s.hi.resize(ntok);
  s.tree.assign(ntok, 0);
  // A tree request's nodes follow its c cached tokens: c = seq_len - (its query tokens).
  const int64_t tree_c = seq_len - (a.query_start_loc[it.req + 1] - a.query_start_loc[it.req]);

  // Key range [lo, hi) of each query token; the union [jmin, jmax) bounds the blocks visited.
  int64_t jmin = std::numeric_limits<int64_t>::max(), jmax = 0;
  for (int64_t i = 0; i < ntok; ++i) {
    const int64_t p = a.positions[it.tok_begin + i];
    int64_t hi = std::min(p + 1, seq_len);
    int64_t lo = a.window > 0 ? std::max<int64_t>(0, p - a.window + 1) : 0;
    if (a.tree_bits != nullptr && a.tree_bits[it.tok_begin + i] != 0) {  // a draft-tree node
      s.tree[i] = static_cast<uint64_t>(a.tree_bits[it.tok_begin + i]);
      lo = 0;
      hi = seq_len;
    }
    if (hi <= lo) lo = hi = 0;  // nothing visible: the row comes out as zeros
    s.lo[i] = lo;
    s.hi[i] = hi;
    if (hi > lo) {
      jmin = std::min(jmin, lo);
      jmax = std::max(jmax, hi);
    }
  }

  T* sc = s.scores.data();
  // Blocks are scattered in memory, so the hardware prefetcher cannot run ahead across them: fetch
  // the keys and values ahead of the ones being read (kPrefetchUnits, kPrefetchBlocks).
  const int64_t first_blk = jmax > jmin ? jmin / bs : 0;
  const int64_t nkv = it.kv_end - it.kv_begin;
  auto prefetch_block = [&](int64_t blk, int64_t kv) {
    const int64_t j = blk * bs;
    if (FastD > 0 || j >= jmax) return;  // the fast path fetches row by row (RowPrefetch)
    const int64_t phys = table[blk], n = std::min(bs, jmax - j);
    prefetch_rows(a.k + phys * a.sk0 + kv * a.sk2, a.sk1, n, D);
    prefetch_rows(a.v + phys * a.sv0 + kv * a.sv2, a.sv1, n, D);
  };
  for (int64_t d = 1; d < kPrefetchBlocks; ++d)
    for (int64_t kv = it.kv_begin; kv < it.kv_end; ++kv) prefetch_block(first_blk + d, kv);
  for (int64_t blk = first_blk; blk * bs < jmax; ++blk) {
    const int64_t j0 = blk * bs;
    const int64_t j1 = std::min(j0 + bs, jmax);
    const int64_t phys = table[blk];
    for (int64_t kv = it.kv_begin; kv < it.kv_end; ++kv) {
      prefetch_block(blk + kPrefetchBlocks, kv);  // spread over the block's work, not all at once
      const KV* kb = a.k + phys * a.sk0 + kv * a.sk2;
      const KV* vb = a.v + phys * a.sv0 + kv * a.sv2;
      for (int64_t i = 0; i < ntok; ++i) {
        const int64_t ta = std::max(s.lo[i], j0), tb = std::min(s.hi[i], j1);
        if (ta >= tb) continue;
        const int64_t nt = tb - ta;
        const T* qi = a.q + ((it.tok_begin + i) * a.H + kv * G) * D;  // the G heads of kv, contiguous
        const int64_t r0 = i * heads + kv * G - head0;
        const KV* k0 = kb + (ta - j0) * a.sk1;
        const KV* v0 = vb + (ta - j0) * a.sv1;
        const uint64_t tree = s.tree[i];
#ifdef SPECPLAN_HAVE_SHUFFLEVECTOR
        if constexpr (FastD > 0) {
          // Fetch the pair kPrefetchUnits ahead in (block, KV head) order during row 0's math.
          const KV* pk = nullptr;
          const KV* pv = nullptr;
          int64_t prows = 0;
          if (i == 0) {
            const int64_t u = (blk - first_blk) * nkv + (kv - it.kv_begin) + kPrefetchUnits;
            const int64_t pblk = first_blk + u / nkv, pkv = it.kv_begin + u % nkv;
            if (pblk * bs < jmax) {
              pk = a.k + table[pblk] * a.sk0 + pkv * a.sk2;
              pv = a.v + table[pblk] * a.sv0 + pkv * a.sv2;
              prows = std::min(bs, jmax - pblk * bs);
            }
          }
          for (int64_t t = 0; t < nt; t += L) {
            const int64_t n = std::min<int64_t>(L, nt - t);
            const uint32_t lanes = visible_lanes(tree, tree_c, ta + t, n);
            if (lanes == 0) continue;  // a tree row's cousins only
            RowPrefetch<KV> pf;  // rows t.. of the pair ahead, beside keys t.. of this one
            if (prows > t) pf = {pk + t * a.sk1, pv + t * a.sv1, a.sk1, a.sv1, static_cast<int>(std::min<int64_t>(L, prows - t))};
            attend_heads<FastD>(qi, k0 + t * a.sk1, a.sk1, v0 + t * a.sv1, a.sv1, static_cast<int>(n), lanes,
                                  a.scale, s.m.data() + r0, s.l.data() + r0, s.acc.data() + r0 * D, G, pf);
          }
          continue;
        }
#endif
        if constexpr (std::is_same_v<T, KV>) {  // the generic loops
        if (tree != 0) {  // a span of a tree row's cousins only is skipped; hidden keys score -inf
          bool any = false;
          for (int64_t t = 0; t < nt && !any; ++t) any = key_visible(tree, tree_c, ta + t);
          if (!any) continue;
        }
        for (int64_t g = 0; g < G; ++g) {
          T* row = sc + g * ss;
          scores_row(qi + g * D, k0, a.sk1, nt, D, a.scale, row);
          if (tree != 0)
            for (int64_t t = 0; t < nt; ++t)
              if (!key_visible(tree, tree_c, ta + t)) row[t] = kNegInf;
        }
        for (int64_t g = 0; g < G; ++g) {
          const int64_t r = r0 + g;
          T* row = sc + g * ss;
          T mx = row[0];
          for (int64_t t = 1; t < nt; ++t) mx = std::max(mx, row[t]);
          const T m_old = s.m[r];
          if (mx > m_old) {
            if (m_old != kNegInf) {  // rescale what was accumulated under the old maximum
              const T alpha = std::exp(m_old - mx);
              s.l[r] *= alpha;
              T* acc = s.acc.data() + r * D;
              for (int64_t d = 0; d < D; ++d) acc[d] *= alpha;
            }
            s.m[r] = mx;
          }
          s.l[r] += exp_and_sum(row, nt, s.m[r]);
        }
        for (int64_t g = 0; g < G; ++g) weighted_sum(s.acc.data() + (r0 + g) * D, sc + g * ss, v0, a.sv1, nt, D);
        }
      }
    }
  }

  for (int64_t i = 0; i < ntok; ++i) {
    T* o = a.out + ((it.tok_begin + i) * a.H + head0) * D;
    for (int64_t h = 0; h < heads; ++h) {
      const int64_t r = i * heads + h;
      const T inv = s.l[r] > 0 ? T(1) / s.l[r] : T(0);
      const T* acc = s.acc.data() + r * D;
      for (int64_t d = 0; d < D; ++d) o[h * D + d] = acc[d] * inv;
    }
  }
}

template <typename T, typename KV, int FastD>
void run(const Args<T, KV>& a, const std::vector<WorkItem>& items) {
  const int64_t n = static_cast<int64_t>(items.size());
  std::atomic<int64_t> next{0};
  auto worker = [&]() {
    Scratch<T> s;
    for (int64_t w; (w = next.fetch_add(1, std::memory_order_relaxed)) < n;) process<T, KV, FastD>(a, items[w], s);
  };
  // Waking a second thread costs microseconds (more when the cores are busy), so only a tiny step
  // stays on the calling thread. Decode attention waits on memory, not arithmetic: from a few
  // hundred keys a second thread's loads pay, even at B=1
  // (measured: reports/README.md#engine-measurements).
  int64_t total_cost = 0;
  for (const WorkItem& it : items) total_cost += it.cost * (it.kv_end - it.kv_begin);
  constexpr int64_t kMinParallelCost = 1 << 8;  // query rows x keys x KV heads
  const int64_t threads = total_cost < kMinParallelCost ? 1 : std::min<int64_t>(specplan::num_threads(), n);
  if (threads <= 1) {
    worker();
  } else {
    // One task per thread; each pulls items until none are left (dynamic load balance).
    specplan::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) worker();
    });
  }
}

}  // namespace

namespace specplan {

at::Tensor paged_attention_cpu(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                               const at::Tensor& query_start_loc, const at::Tensor& seq_lens,
                               const at::Tensor& block_tables, const at::Tensor& positions, double scale,
                               int64_t sliding_window, const std::optional<at::Tensor>& tree_bits) {
  TORCH_CHECK(q.device().is_cpu() && k_cache.device().is_cpu() && v_cache.device().is_cpu(),
              "paged_attention_cpu: CPU tensors only");
  TORCH_CHECK(q.dim() == 3 && q.is_contiguous(), "q must be a contiguous [N, H, D] tensor");
  TORCH_CHECK(k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(),
              "k_cache / v_cache must both be [num_blocks, block_size, KVH, D]");
  const bool half_cache = k_cache.scalar_type() == at::kHalf;
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type() &&
                  (k_cache.scalar_type() == q.scalar_type() || (half_cache && q.scalar_type() == at::kFloat)),
              "k_cache and v_cache must share q's dtype, or be float16 with float32 q");
  TORCH_CHECK(k_cache.stride(3) == 1 && v_cache.stride(3) == 1, "cache head_dim must be contiguous");
  const int64_t N = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t num_blocks = k_cache.size(0), bs = k_cache.size(1), KVH = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == D, "cache head_dim ", k_cache.size(3), " != q head_dim ", D);
  TORCH_CHECK(KVH > 0 && H % KVH == 0, "num_heads ", H, " not a multiple of kv_heads ", KVH);
  TORCH_CHECK(bs > 0, "block_size must be positive");
  TORCH_CHECK(!half_cache || (kFastPath && (D == 64 || D == 128)),
              "a float16 KV cache needs head_dim 64 or 128 (got ", D, ") and a compiler with vector shuffles");

  auto check_meta = [](const at::Tensor& t, at::ScalarType dt, int64_t dim, const char* name) {
    TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == dt && t.dim() == dim && t.is_contiguous(), name,
                " must be a contiguous CPU ", c10::toString(dt), " tensor with ", dim, " dims");
  };
  check_meta(query_start_loc, at::kInt, 1, "query_start_loc");
  check_meta(seq_lens, at::kInt, 1, "seq_lens");
  check_meta(block_tables, at::kInt, 2, "block_tables");
  check_meta(positions, at::kLong, 1, "positions");
  const int64_t B = seq_lens.size(0);
  TORCH_CHECK(query_start_loc.size(0) == B + 1, "query_start_loc must have B+1 entries");
  TORCH_CHECK(block_tables.size(0) == B, "block_tables must have B rows");
  TORCH_CHECK(positions.size(0) == N, "positions must have N entries");
  const int64_t* tree = nullptr;
  if (tree_bits.has_value()) {
    check_meta(*tree_bits, at::kLong, 1, "tree_bits");
    TORCH_CHECK(tree_bits->size(0) == N, "tree_bits must have N entries");
    tree = tree_bits->data_ptr<int64_t>();
  }

  const int32_t* qsl = query_start_loc.data_ptr<int32_t>();
  const int32_t* sl = seq_lens.data_ptr<int32_t>();
  const int32_t* bt = block_tables.data_ptr<int32_t>();
  const int64_t* pos = positions.data_ptr<int64_t>();
  const int64_t max_blocks = block_tables.size(1);
  TORCH_CHECK(qsl[0] == 0 && qsl[B] == N, "query_start_loc must run from 0 to N = ", N);

  // Validate everything that is used as an address.
  for (int64_t b = 0; b < B; ++b) {
    const int64_t L = sl[b];
    TORCH_CHECK(qsl[b] <= qsl[b + 1], "query_start_loc must be non-decreasing");
    TORCH_CHECK(L >= 0 && L <= max_blocks * bs, "seq_lens[", b, "] = ", L, " exceeds its block table");
    for (int64_t j = 0; j < (L + bs - 1) / bs; ++j) {
      const int64_t id = bt[b * max_blocks + j];
      TORCH_CHECK(id >= 0 && id < num_blocks, "block_tables[", b, "][", j, "] = ", id, " out of range");
    }
  }

  // List the work. Default: one item per (request, chunk of <= kQueryChunk query tokens) covering
  // all KV heads, so each block is read front to back once. With too few of those to keep the
  // threads busy (few requests), one item per KV head, and if still too few, smaller query chunks
  // (each re-reads the request's K/V, from cache by then).
  const int64_t threads = std::max<int64_t>(specplan::num_threads(), 1);
  auto count_chunks = [&](int64_t chunk) {
    int64_t n = 0;
    for (int64_t b = 0; b < B; ++b) n += (qsl[b + 1] - qsl[b] + chunk - 1) / chunk;
    return n;
  };
  int64_t qchunk = kQueryChunk;
  int64_t chunks = count_chunks(qchunk);
  int64_t kv_per_item = KVH;
  if (chunks < kItemsPerThread * threads) {
    kv_per_item = 1;
    while (qchunk > 1 && chunks * KVH < kMinItemsPerThread * threads) {
      qchunk = (qchunk + 1) / 2;
      chunks = count_chunks(qchunk);
    }
  }
  std::vector<WorkItem> items;
  items.reserve(chunks * (KVH / kv_per_item));
  for (int64_t b = 0; b < B; ++b) {
    const int64_t qs = qsl[b], T = qsl[b + 1] - qsl[b];
    const int64_t pieces = (T + qchunk - 1) / qchunk;  // equal-sized pieces of the request's rows
    for (int64_t j = 0; j < pieces; ++j) {
      const int64_t t0 = qs + T * j / pieces, t1 = qs + T * (j + 1) / pieces;
      // Cost ~ rows x keys seen by the chunk's last token (causal prefill chunks differ a lot).
      int64_t keys = std::min<int64_t>(pos[t1 - 1] + 1, sl[b]);
      if (sliding_window > 0) keys = std::min(keys, sliding_window);
      const int64_t cost = (t1 - t0) * kv_per_item * std::max<int64_t>(keys, 1);
      for (int64_t kv = 0; kv < KVH; kv += kv_per_item)
        items.push_back({b, kv, kv + kv_per_item, t0, t1, cost});
    }
  }
  std::stable_sort(items.begin(), items.end(),
                   [](const WorkItem& x, const WorkItem& y) { return x.cost > y.cost; });

  at::Tensor out = at::empty_like(q);
  if (N == 0) return out;
  auto attend = [&](auto query_type, auto cache_type) {
    using T = decltype(query_type);
    using KV = decltype(cache_type);
    Args<T, KV> a;
    a.q = q.data_ptr<T>();
    a.k = k_cache.data_ptr<KV>();
    a.v = v_cache.data_ptr<KV>();
    a.out = out.data_ptr<T>();
    a.seq_lens = sl;
    a.query_start_loc = qsl;
    a.block_tables = bt;
    a.positions = pos;
    a.tree_bits = tree;
    a.H = H;
    a.D = D;
    a.G = H / KVH;
    a.block_size = bs;
    a.table_stride = max_blocks;
    a.sk0 = k_cache.stride(0);
    a.sk1 = k_cache.stride(1);
    a.sk2 = k_cache.stride(2);
    a.sv0 = v_cache.stride(0);
    a.sv1 = v_cache.stride(1);
    a.sv2 = v_cache.stride(2);
    a.scale = static_cast<T>(scale);
    a.window = sliding_window;
    // The common head sizes get the float fast path; everything else the generic loops (checked
    // above: an fp16 cache always has a fast path).
    constexpr bool fast = kFastPath && std::is_same_v<T, float>;
    if constexpr (std::is_same_v<T, KV>) {
      if (D == 64) {
        run<T, KV, fast ? 64 : 0>(a, items);
      } else if (D == 128) {
        run<T, KV, fast ? 128 : 0>(a, items);
      } else {
        run<T, KV, 0>(a, items);
      }
    } else if constexpr (fast) {
      if (D == 64) {
        run<T, KV, 64>(a, items);
      } else {
        run<T, KV, 128>(a, items);
      }
    }
  };
  if (half_cache) {
    attend(float{}, at::Half{});
  } else {
    AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "paged_attention_cpu", [&] { attend(scalar_t{}, scalar_t{}); });
  }
  return out;
}

}  // namespace specplan

TORCH_LIBRARY(specplan_attn, m) {
  m.def(
      "paged_attention_cpu(Tensor q, Tensor k_cache, Tensor v_cache, Tensor query_start_loc, "
      "Tensor seq_lens, Tensor block_tables, Tensor positions, float scale, int sliding_window, "
      "Tensor? tree_bits=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(specplan_attn, CPU, m) {
  m.impl("paged_attention_cpu", &specplan::paged_attention_cpu);
}
