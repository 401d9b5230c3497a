// y = x W^T (+ b) on CPU with W stored in GGUF's block formats Q8_0, Q4_0 or Q4_1, x in float32.
//
// Built with the other kernels by engine/model/cpu_kernels.py; registers
// torch.ops.specplan_linear.quant_linear. engine/model/quant.py repacks the weights (from a GGUF
// file as stored, or quantised at load), holds the torch reference of the product, and the tests
// compare the two.
//
// Why: a decode or verify step streams every weight once; at 4-5 bits per weight instead of 32
// the bytes shrink 6x and the unpacking work becomes the cost to beat. So the product runs in
// integers, as llama.cpp does: each row of x is quantised per block of 32 to int8 (Q8_0-style,
// scale dx = max|x| / 127, round half to even) and each block's dot product is 32 int8 x int8 (or
// 4-bit) multiplies summed exactly in int32; only the per-block scales are float. One 512-bit
// `vpdpbusd` does 64 multiplies where one float FMA does 16, and no weight is ever widened to
// float, so a 4-bit weight costs a few instructions per 16 columns x 4 k, shared by every row.
//
// Formats (weights of a block of 32 along K, per output column n):
//   Q8_0  w = d * q,        q int8,  d fp16                   (8.5 bits per weight)
//   Q4_0  w = d * (q - 8),  q 0..15, d fp16                   (4.5 bits per weight)
//   Q4_1  w = d * q + m,    q 0..15, d and m fp16              (5 bits per weight)
// so with x's block quantised as x = dx * qx and sx = dx * sum(qx):
//   Q8_0  dot = d * dx * sum(q qx)
//   Q4_0  dot = d * (dx * sum(q qx) - 8 sx)                    (q unsigned, the -8 folded in)
//   Q4_1  dot = d * dx * sum(q qx) + m * sx
//
// Packed layout (engine/model/quant.py's pack): packed [P, KB, BPB] uint8, P = ceil(N / 16)
// panels of 16 output columns, KB = K / 32 blocks, BPB bytes per (panel, block):
//   scales   16 x fp16 d (32 bytes), then for Q4_1 16 x fp16 m (32 bytes)
//   quants   8 groups of 4 k: group g holds k = 4g..4g+3 of the 16 columns, column c's four
//            values at bytes 4c..4c+3 (the int32 lane c of a 512-bit register)
//            Q8_0: group g is 64 bytes at 64g (512 bytes)
//            Q4_x: 4 x 64 bytes; byte 4c + j of row i holds group 2i in its low nibble and group
//                  2i + 1 in its high nibble (256 bytes)
//   BPB = 544 (Q8_0), 288 (Q4_0), 320 (Q4_1): the format follows from the shape alone.
// Worked example: Q4_1, column c = 2, k = 13 of block 0: group g = 3 (k 12..15), j = 1;
//   row i = 1 (g = 2i + 1: high nibble), byte 64 + 64 * 1 + 4 * 2 + 1 = 137 of the block.
//
// Per panel, per block, per row r (a broadcast of x's 4 int8 of group g to all 16 lanes):
//   acc_int[lane c] += sum_j q[c, 4g + j] * qx[r, 4g + j]          (8 groups; no horizontal sums)
//   acc[r] (16 floats) += d[16] * (float(acc_int) * dx[r]) (+ m[16] * sx[r])
// The int8 products: with AVX512-VNNI one `vpdpbusd` (unsigned x signed bytes, summed in int32)
// per row and group does 16 columns x 4 k; Q8_0's signed q goes in as q + 128 with 128 sum(qx)
// taken off. Without it (AVX2, 8 columns a register: the panel in two halves) `vpmaddubsw` needs
// one unsigned operand: 4-bit q is unsigned; Q8_0 uses |q| and x with q's sign (pairs <= 2 * 128
// * 127 < 2^15), then `vpmaddwd` into int32. The same integers either way.
//
// Every row's result is the same sequence of float operations whatever M is and wherever the row
// sits in a block (the int sums are exact; the float sum runs over the blocks in order): a verify
// step's rows equal the decode step's bit for bit, which greedy speculation relies on.
//
// Work split as packed_linear.cpp: panels divided between torch's intra-op threads; within a
// panel, rows in groups of at most kGroupRows, each group in blocks of at most MR rows; with
// several blocks, K goes in chunks of kChunkBlocks that every block takes in turn (the chunk comes
// from memory once, the other blocks re-read it from L1).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include "kernels.h"
#include "team.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
#include <immintrin.h>
#define SPECPLAN_QUANT_AVX2 1
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define SPECPLAN_QUANT_VNNI512 1  // a panel's 16 columns in one 512-bit register
#endif
#endif

namespace {

constexpr int64_t QK = 32;  // weights per block along K
constexpr int64_t NC = 16;  // output columns per panel: one 512-bit register of int32 / float lanes

enum class Fmt { Q8_0, Q4_0, Q4_1 };

template <Fmt F>
struct Layout {
  static constexpr int64_t scale_bytes = (F == Fmt::Q4_1 ? 2 : 1) * 2 * NC;  // fp16 d (and m) per column
  static constexpr int64_t group_bytes = 4 * NC;  // a group of 4 k of the panel's columns (Q4: two groups)
  static constexpr int64_t quant_bytes = (F == Fmt::Q8_0 ? 8 : 4) * group_bytes;
  static constexpr int64_t bytes = scale_bytes + quant_bytes;  // BPB
};

// Rows per register block: MR float accumulators + MR int accumulators + ~6 weight / constant
// registers must fit the register file (16 ymm with AVX2; 32 with AVX-512's EVEX encoding).
#if defined(__AVX512VL__)
constexpr int MR = 8;
#else
constexpr int MR = 4;
#endif
constexpr int64_t kGroupRows = 64;           // the accumulators of a group: [64, 16] floats, 4 KB
constexpr int64_t kChunkBlocks = 8;          // blocks per chunk when several row blocks take turns (<= 4.4 KB)
constexpr int64_t kMinParallelBytes = 1 << 15;  // smaller products stay on the calling thread
constexpr int64_t kRowsPerQuantTask = 16;
// How far ahead of the block in work each block's bytes are asked for: a thread's panels lie one
// after another, so this runs ahead into its next panels. The hardware prefetcher alone left a
// decode step's products at ~half the bandwidth a plain read reaches on 2 threads (Intel Xeon,
// AVX-512: 30 layers' Q4_1 projections at M = 1 in 7.1-9.0 ms, with it 5.1-6.9; 4 KB read best
// of 1, 2 and 4 KB). The hint is chosen per CPU at build time (engine/model/cpu_kernels.py
// ``weight_prefetch``): NTA on AMD Zen, where the streamed weights then stay out of L2 and L3 and
// leave the KV cache there (B = 1 ~1.03x the tokens/s on a Zen 4 EPYC, reports/weight-prefetch-zen4-s37);
// T0 elsewhere: on an Intel Xeon NTA made the B = 1 closed cells 2.5x slower (97 vs 250 tok/s SD
// off, 2026-11-29).
#ifndef SPECPLAN_PREFETCH_BYTES
#define SPECPLAN_PREFETCH_BYTES 4096
#endif
constexpr int64_t kPrefetchBytes = SPECPLAN_PREFETCH_BYTES;
#ifndef SPECPLAN_WEIGHT_HINT
#define SPECPLAN_WEIGHT_HINT _MM_HINT_T0
#endif

// x quantised per block of 32: q [M, K] int8, d [M, KB] scales, qsum [M, KB] = sum(q), s [M, KB]
// = d * sum(q) (times -8 for Q4_0, whose "min" is -8 d: then the kernel adds d * s).
struct QuantX {
  std::vector<int8_t> q;
  std::vector<float> d;
  std::vector<int32_t> qsum;
  std::vector<float> s;
  int64_t K = 0, KB = 0;
};

inline float half_to_float(uint16_t bits) { return static_cast<float>(c10::Half(bits, c10::Half::from_bits())); }

// The float half of a block's product, one definition for every path (scalar, 256- and 512-bit
// lanes), so each output goes through the same operations in the same order whatever the build:
//   Q4_0        acc += d * (isf * dx + s)
//   Q8_0, Q4_1  acc += d * (isf * dx)   (Q4_1: then acc += m * s)
// isf: the block's exact integer sum as float; dx, s: the row's block scale and scaled sum (QuantX).
inline float vfmadd(float a, float b, float c) { return std::fma(a, b, c); }
inline float vmul(float a, float b) { return a * b; }
#if defined(SPECPLAN_QUANT_AVX2)
inline __m256 vfmadd(__m256 a, __m256 b, __m256 c) { return _mm256_fmadd_ps(a, b, c); }
inline __m256 vmul(__m256 a, __m256 b) { return _mm256_mul_ps(a, b); }
#endif
#if defined(SPECPLAN_QUANT_VNNI512)
inline __m512 vfmadd(__m512 a, __m512 b, __m512 c) { return _mm512_fmadd_ps(a, b, c); }
inline __m512 vmul(__m512 a, __m512 b) { return _mm512_mul_ps(a, b); }
#endif

template <Fmt F, class V>
inline V add_block(V acc, V d, V m, V isf, V dx, V s) {
  if constexpr (F == Fmt::Q4_0) return vfmadd(d, vfmadd(isf, dx, s), acc);
  acc = vfmadd(d, vmul(isf, dx), acc);
  if constexpr (F == Fmt::Q4_1) acc = vfmadd(m, s, acc);
  (void)m;
  (void)s;
  return acc;
}

// One block of 32 floats -> 32 int8 (q = round_half_even(x / d), d = max|x| / 127); returns sum(q).
inline int32_t quantize_block(const float* x, int8_t* q, float* d_out) {
#if defined(SPECPLAN_QUANT_AVX2)
  const __m256 sign_bit = _mm256_set1_ps(-0.0f);
  __m256 v[4];
  __m256 mx = _mm256_setzero_ps();
  for (int i = 0; i < 4; ++i) {
    v[i] = _mm256_loadu_ps(x + 8 * i);
    mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign_bit, v[i]));
  }
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
  const float amax = _mm_cvtss_f32(m4);
  const float d = amax / 127.0f;
  const float id = d != 0.0f ? 1.0f / d : 0.0f;
  const __m256 idv = _mm256_set1_ps(id);
  __m256i qi[4];
  for (int i = 0; i < 4; ++i) {
    qi[i] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v[i], idv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
  const __m256i total = _mm256_add_epi32(_mm256_add_epi32(qi[0], qi[1]), _mm256_add_epi32(qi[2], qi[3]));
  // packs work within 128-bit lanes: the permute puts the 8 int32 groups back in order.
  const __m256i p01 = _mm256_packs_epi32(qi[0], qi[1]);
  const __m256i p23 = _mm256_packs_epi32(qi[2], qi[3]);
  const __m256i p = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(p01, p23), _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), p);
  __m128i t4 = _mm_add_epi32(_mm256_castsi256_si128(total), _mm256_extracti128_si256(total, 1));
  t4 = _mm_add_epi32(t4, _mm_shuffle_epi32(t4, 0x4E));
  t4 = _mm_add_epi32(t4, _mm_shuffle_epi32(t4, 0xB1));
  *d_out = d;
  return _mm_cvtsi128_si32(t4);
#else
  float amax = 0.0f;
  for (int j = 0; j < QK; ++j) amax = std::max(amax, std::fabs(x[j]));
  const float d = amax / 127.0f;
  const float id = d != 0.0f ? 1.0f / d : 0.0f;
  int32_t sum = 0;
  for (int j = 0; j < QK; ++j) {
    const int32_t v = static_cast<int32_t>(std::nearbyint(x[j] * id));
    q[j] = static_cast<int8_t>(v);
    sum += v;
  }
  *d_out = d;
  return sum;
#endif
}

// Grows v to at least n elements and never shrinks it: a buffer reused across calls is zeroed
// only where it grows (resize value-initialises), not every call.
template <typename T>
inline void grow(std::vector<T>& v, int64_t n) {
  if (static_cast<int64_t>(v.size()) < n) v.resize(n);
}

// Fills this thread's QuantX and returns it: a decode step quantises the input of ~120 products,
// and four fresh vectors each (allocated, zeroed, freed) were a visible share of a B = 1 step's
// time outside the products (perf). Valid until this thread's next call; the product that asked
// reads it from every thread before returning.
template <Fmt F>
const QuantX& quantize_x(const float* x, int64_t M, int64_t K) {
  thread_local QuantX buffer;
  QuantX& xq = buffer;  // a local name: lambdas capture it, where they would not capture a thread_local
  xq.K = K;
  xq.KB = K / QK;
  grow(xq.q, M * K);
  grow(xq.d, M * xq.KB);
  grow(xq.qsum, M * xq.KB);
  grow(xq.s, M * xq.KB);
  auto rows = [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      for (int64_t b = 0; b < xq.KB; ++b) {
        float d;
        const int32_t sum = quantize_block(x + m * K + b * QK, xq.q.data() + m * K + b * QK, &d);
        xq.d[m * xq.KB + b] = d;
        xq.qsum[m * xq.KB + b] = sum;
        xq.s[m * xq.KB + b] = F == Fmt::Q4_0 ? -8.0f * (d * static_cast<float>(sum)) : d * static_cast<float>(sum);
      }
    }
  };
  if (M >= 2 * kRowsPerQuantTask && specplan::num_threads() > 1) {
    specplan::parallel_for(0, M, kRowsPerQuantTask, rows);
  } else {
    rows(0, M);
  }
  return xq;
}

#if defined(SPECPLAN_QUANT_VNNI512)

inline __m512i broadcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}

// acc [R, 16] (+)= the products of rows m0 .. m0+R of x with the panel's blocks b0..b1: one
// 512-bit register holds a row's 16 columns, so each broadcast of x's 4 int8 feeds 16 columns and
// each vpdpbusd does 64 multiplies. 8-column panels in 256-bit registers took 1.6-2x the time
// (TSC cycles per row per 8 columns x 32 k, the inner loop alone, L2-hot on one core of an Intel
// Xeon, where a 512-bit vpdpbusd issues as often as a 256-bit one: 19.4 against 11.4 at one row,
// 9.5 against 5.2 at 8, 9.5 against 4.7 at 32).
template <Fmt F, int R>
inline void panel_block(const QuantX& xq, int64_t m0, const uint8_t* __restrict panel, int64_t b0, int64_t b1,
                        float* __restrict acc_out, bool init) {
  using L = Layout<F>;
  const int64_t K = xq.K, KB = xq.KB;
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = init ? _mm512_setzero_ps() : _mm512_loadu_ps(acc_out + r * NC);
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  // A row's 8 vpdpbusd of a block in C independent chains (summed at the block's end; int sums
  // are exact, so the result is the same bit for bit): one chain costs 8 x ~5 cycles of latency a
  // block, which few rows leave nothing to hide behind; C = 2 up to 4 rows, 1 above (measured).
  constexpr int C = R <= 4 ? 2 : 1;
  for (int64_t b = b0; b < b1; ++b) {
    const uint8_t* blk = panel + b * L::bytes;
    const uint8_t* quants = blk + L::scale_bytes;
    const int8_t* xb = xq.q.data() + m0 * K + b * QK;  // row r's block at xb + r * K
    for (int64_t line = 0; line < L::bytes; line += 64) {  // a prefetch never faults, past the end too
      _mm_prefetch(reinterpret_cast<const char*>(blk + kPrefetchBytes + line), SPECPLAN_WEIGHT_HINT);
    }
    __m512i part[C][R];
    for (int c = 0; c < C; ++c)
      for (int r = 0; r < R; ++r) part[c][r] = _mm512_setzero_si512();
    if constexpr (F == Fmt::Q8_0) {
      // vpdpbusd multiplies unsigned by signed bytes: q + 128 (the sign bit flipped) is unsigned,
      // and the block's sum(q qx) = sum((q + 128) qx) - 128 sum(qx), all exact in int32.
      for (int g = 0; g < 8; ++g) {
        const __m512i w = _mm512_xor_si512(_mm512_loadu_si512(quants + L::group_bytes * g), flip);
        for (int r = 0; r < R; ++r) part[g % C][r] = _mm512_dpbusd_epi32(part[g % C][r], w, broadcast4(xb + r * K + 4 * g));
      }
    } else {
      for (int i = 0; i < 4; ++i) {
        const __m512i v = _mm512_loadu_si512(quants + L::group_bytes * i);
        const __m512i lo = _mm512_and_si512(v, nibble);                         // group 2i
        const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble);  // group 2i + 1
        for (int r = 0; r < R; ++r) {
          part[(2 * i) % C][r] = _mm512_dpbusd_epi32(part[(2 * i) % C][r], lo, broadcast4(xb + r * K + 8 * i));
          part[(2 * i + 1) % C][r] = _mm512_dpbusd_epi32(part[(2 * i + 1) % C][r], hi, broadcast4(xb + r * K + 8 * i + 4));
        }
      }
    }
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk)));  // [16] column scales
    __m512 mins = _mm512_setzero_ps();
    if constexpr (F == Fmt::Q4_1) mins = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 2 * NC)));
    for (int r = 0; r < R; ++r) {
      const int64_t at = (m0 + r) * KB + b;
      __m512i isum = part[0][r];
      for (int c = 1; c < C; ++c) isum = _mm512_add_epi32(isum, part[c][r]);
      if constexpr (F == Fmt::Q8_0) isum = _mm512_sub_epi32(isum, _mm512_set1_epi32(128 * xq.qsum[at]));
      acc[r] = add_block<F>(acc[r], d, mins, _mm512_cvtepi32_ps(isum), _mm512_set1_ps(xq.d[at]),
                            _mm512_set1_ps(xq.s[at]));
    }
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(acc_out + r * NC, acc[r]);
}

#elif defined(SPECPLAN_QUANT_AVX2)

inline __m256i broadcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}

// The same product in 256-bit registers, one half of the panel (columns 8h .. 8h+7) at a time:
// acc [R, 16] columns 8h .. 8h+7 (+)= rows m0 .. m0+R of x times the half's blocks b0..b1.
template <Fmt F, int R>
inline void half_panel_block(const QuantX& xq, int64_t m0, const uint8_t* __restrict panel, int64_t b0, int64_t b1,
                             float* __restrict acc_out, bool init, int h) {
  using L = Layout<F>;
  const int64_t K = xq.K, KB = xq.KB;
  constexpr int64_t H = NC / 2;  // columns of a half
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = init ? _mm256_setzero_ps() : _mm256_loadu_ps(acc_out + r * NC + H * h);
  const __m256i nibble = _mm256_set1_epi8(0x0F);
  const __m256i ones16 = _mm256_set1_epi16(1);
  for (int64_t b = b0; b < b1; ++b) {
    const uint8_t* blk = panel + b * L::bytes;
    const uint8_t* quants = blk + L::scale_bytes + 4 * H * h;  // the half's 32 bytes of each 64-byte group row
    const int8_t* xb = xq.q.data() + m0 * K + b * QK;
    if (h == 0) {
      for (int64_t line = 0; line < L::bytes; line += 64) {
        _mm_prefetch(reinterpret_cast<const char*>(blk + kPrefetchBytes + line), SPECPLAN_WEIGHT_HINT);
      }
    }
    __m256i isum[R];
    for (int r = 0; r < R; ++r) isum[r] = _mm256_setzero_si256();
    if constexpr (F == Fmt::Q8_0) {
      for (int g = 0; g < 8; ++g) {
        const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(quants + L::group_bytes * g));
        const __m256i aw = _mm256_abs_epi8(w);  // -128 stays 0x80, i.e. 128 unsigned
        for (int r = 0; r < R; ++r) {
          const __m256i sx = _mm256_sign_epi8(broadcast4(xb + r * K + 4 * g), w);  // qx with w's sign
          isum[r] = _mm256_add_epi32(isum[r], _mm256_madd_epi16(_mm256_maddubs_epi16(aw, sx), ones16));
        }
      }
    } else {
      // vpmaddubsw needs one unsigned operand: 4-bit q is; pairs <= 2 * 15 * 127, and eight
      // groups summed in int16 <= 30480 < 2^15: one vpmaddwd per block.
      for (int i = 0; i < 4; ++i) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(quants + L::group_bytes * i));
        const __m256i lo = _mm256_and_si256(v, nibble);
        const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), nibble);
        for (int r = 0; r < R; ++r) {
          const __m256i x0 = broadcast4(xb + r * K + 8 * i);
          const __m256i x1 = broadcast4(xb + r * K + 8 * i + 4);
          isum[r] = _mm256_add_epi16(isum[r], _mm256_add_epi16(_mm256_maddubs_epi16(lo, x0), _mm256_maddubs_epi16(hi, x1)));
        }
      }
      for (int r = 0; r < R; ++r) isum[r] = _mm256_madd_epi16(isum[r], ones16);  // int16 pairs -> int32 per column
    }
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 2 * H * h)));
    __m256 mins = _mm256_setzero_ps();
    if constexpr (F == Fmt::Q4_1) mins = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 2 * NC + 2 * H * h)));
    for (int r = 0; r < R; ++r) {
      const int64_t at = (m0 + r) * KB + b;
      acc[r] = add_block<F>(acc[r], d, mins, _mm256_cvtepi32_ps(isum[r]), _mm256_set1_ps(xq.d[at]),
                            _mm256_set1_ps(xq.s[at]));
    }
  }
  for (int r = 0; r < R; ++r) _mm256_storeu_ps(acc_out + r * NC + H * h, acc[r]);
}

template <Fmt F, int R>
inline void panel_block(const QuantX& xq, int64_t m0, const uint8_t* panel, int64_t b0, int64_t b1, float* acc_out,
                        bool init) {
  half_panel_block<F, R>(xq, m0, panel, b0, b1, acc_out, init, 0);
  half_panel_block<F, R>(xq, m0, panel, b0, b1, acc_out, init, 1);  // its blocks come back from L1
}

#else  // no AVX2: the same arithmetic one column at a time (same integers; float order per row fixed)

template <Fmt F, int R>
inline void panel_block(const QuantX& xq, int64_t m0, const uint8_t* __restrict panel, int64_t b0, int64_t b1,
                        float* __restrict acc_out, bool init) {
  using L = Layout<F>;
  const int64_t K = xq.K, KB = xq.KB;
  for (int r = 0; r < R; ++r) {
    for (int64_t c = 0; c < NC; ++c) {
      float acc = init ? 0.0f : acc_out[r * NC + c];
      for (int64_t b = b0; b < b1; ++b) {
        const uint8_t* blk = panel + b * L::bytes;
        const uint8_t* quants = blk + L::scale_bytes;
        const int8_t* xr = xq.q.data() + (m0 + r) * K + b * QK;
        int32_t isum = 0;
        for (int g = 0; g < 8; ++g) {
          for (int j = 0; j < 4; ++j) {
            int32_t w;
            if constexpr (F == Fmt::Q8_0) {
              w = static_cast<int8_t>(quants[L::group_bytes * g + 4 * c + j]);
            } else {
              const uint8_t byte = quants[L::group_bytes * (g / 2) + 4 * c + j];
              w = g % 2 == 0 ? (byte & 0x0F) : (byte >> 4);
            }
            isum += w * xr[4 * g + j];
          }
        }
        uint16_t dbits, mbits = 0;
        std::memcpy(&dbits, blk + 2 * c, 2);
        if constexpr (F == Fmt::Q4_1) std::memcpy(&mbits, blk + 2 * NC + 2 * c, 2);
        const int64_t at = (m0 + r) * KB + b;
        acc = add_block<F>(acc, half_to_float(dbits), half_to_float(mbits), static_cast<float>(isum), xq.d[at],
                           xq.s[at]);
      }
      acc_out[r * NC + c] = acc;
    }
  }
}

#endif

// panel_block with the row count chosen at run time (1 <= rows <= R).
template <Fmt F, int R>
inline void panel_rows(const QuantX& xq, int64_t m0, const uint8_t* panel, int64_t b0, int64_t b1, float* acc_out,
                       bool init, int64_t rows) {
  if constexpr (R > 1) {
    if (rows < R) return panel_rows<F, R - 1>(xq, m0, panel, b0, b1, acc_out, init, rows);
  }
  panel_block<F, R>(xq, m0, panel, b0, b1, acc_out, init);
}

template <Fmt F>
void quant_product(const float* x, int64_t M, int64_t K, const uint8_t* packed, int64_t P, int64_t N, const float* bias,
                   float* y) {
  using L = Layout<F>;
  const int64_t KB = K / QK;
  const QuantX& xq = quantize_x<F>(x, M, K);
  const int64_t groups = (M + kGroupRows - 1) / kGroupRows;
  auto panels = [&](int64_t p0, int64_t p1) {
    alignas(64) float acc[kGroupRows * NC];  // [group rows, 16]
    for (int64_t p = p0; p < p1; ++p) {
      const uint8_t* panel = packed + p * KB * L::bytes;
      const int64_t n0 = p * NC, ncols = std::min<int64_t>(NC, N - n0);
      for (int64_t g = 0, g0 = 0, group = 0; g < groups; ++g, g0 += group) {
        group = (M - g0 + groups - g - 1) / (groups - g);  // balanced: 65 rows run as 33 + 32
        const int64_t blocks = (group + MR - 1) / MR;
        const int64_t chunk = blocks == 1 ? KB : kChunkBlocks;
        for (int64_t b0 = 0; b0 < KB; b0 += chunk) {
          const int64_t b1 = std::min(KB, b0 + chunk);
          for (int64_t block = 0, m0 = 0; block < blocks; ++block) {  // balanced: 9 rows with MR = 8 run as 5 + 4
            const int64_t left = blocks - block;
            const int64_t rows = (group - m0 + left - 1) / left;
            panel_rows<F, MR>(xq, g0 + m0, panel, b0, b1, acc + m0 * NC, b0 == 0, rows);
            m0 += rows;
          }
        }
        for (int64_t m = 0; m < group; ++m) {
          const float* out = acc + m * NC;
          float* row = y + (g0 + m) * N + n0;
          if (bias != nullptr) {
            for (int64_t j = 0; j < ncols; ++j) row[j] = out[j] + bias[n0 + j];
          } else {
            std::copy(out, out + ncols, row);
          }
        }
      }
    }
  };
  const int64_t threads = specplan::num_threads();
  if (threads <= 1 || P * KB * L::bytes < kMinParallelBytes) {
    panels(0, P);
  } else {
    specplan::parallel_for(0, P, (P + threads - 1) / threads, panels);
  }
}

}  // namespace

namespace specplan {

int64_t quant_linear_in_features(const at::Tensor& packed) { return packed.size(1) * QK; }

at::Tensor quant_linear(const at::Tensor& x, const at::Tensor& packed, int64_t N, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kFloat, "x must be [M, K] contiguous float32");
  TORCH_CHECK(packed.dim() == 3 && packed.is_contiguous() && packed.scalar_type() == at::kByte,
              "packed must be [P, K / 32, bytes per block] contiguous uint8");
  const int64_t M = x.size(0), K = x.size(1), P = packed.size(0), BPB = packed.size(2);
  TORCH_CHECK(packed.size(1) * QK == K, "x has ", K, " columns but the packed weight has ", packed.size(1) * QK);
  TORCH_CHECK(N > (P - 1) * NC && N <= P * NC, "N=", N, " does not match ", P, " panels");
  const float* b = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->is_contiguous() && bias->numel() == N && bias->scalar_type() == at::kFloat, "bias must be [N] float32");
    b = bias->data_ptr<float>();
  }
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0) return y;
  if (K == 0) {
    y.zero_();
    return b != nullptr ? y.add_(*bias) : y;
  }
  const float* xp = x.data_ptr<float>();
  const uint8_t* pp = packed.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  if (BPB == Layout<Fmt::Q8_0>::bytes) {
    quant_product<Fmt::Q8_0>(xp, M, K, pp, P, N, b, yp);
  } else if (BPB == Layout<Fmt::Q4_0>::bytes) {
    quant_product<Fmt::Q4_0>(xp, M, K, pp, P, N, b, yp);
  } else if (BPB == Layout<Fmt::Q4_1>::bytes) {
    quant_product<Fmt::Q4_1>(xp, M, K, pp, P, N, b, yp);
  } else {
    TORCH_CHECK(false, "packed block of ", BPB, " bytes is none of Q8_0 (", Layout<Fmt::Q8_0>::bytes, "), Q4_0 (",
                Layout<Fmt::Q4_0>::bytes, "), Q4_1 (", Layout<Fmt::Q4_1>::bytes, ")");
  }
  return y;
}

at::Tensor any_linear(const at::Tensor& x, const at::Tensor& packed, int64_t N, const std::optional<at::Tensor>& bias) {
  return packed.scalar_type() == at::kByte ? quant_linear(x, packed, N, bias) : packed_linear(x, packed, N, bias);
}

int64_t any_linear_in_features(const at::Tensor& packed) {
  return packed.scalar_type() == at::kByte ? quant_linear_in_features(packed) : packed.size(1);
}

}  // namespace specplan

TORCH_LIBRARY_FRAGMENT(specplan_linear, m) {
  m.def("quant_linear(Tensor x, Tensor packed, int N, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(specplan_linear, CPU, m) {
  m.impl("quant_linear", &specplan::quant_linear);
}
