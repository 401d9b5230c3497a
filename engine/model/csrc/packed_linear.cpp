// y = x W^T (+ b) on CPU in float32, over a weight packed once into column panels.
//
// Built with paged_attention.cpp into one extension by engine/model/cpu_kernels.py; registers
// torch.ops.specplan_linear.packed_linear. engine/model/linear.py packs the weights and calls it.
//
// Why: a decode or verify step multiplies M = 1..~64 rows by every weight of the model, so the
// step is bound by streaming the weights once from memory. MKL's SGEMM (packed or not) reaches a
// fraction of the bandwidth at these row counts (DESIGN.md §7); this kernel streams each weight
// byte from memory once per 64 rows and keeps the FMA units busy from M ≈ 8 on.
//
// Layouts:
//   x       [M, K]          float32, contiguous
//   packed  [P, K, NR]      float32, P = ceil(N / NR): panel p holds output columns p*NR .. p*NR+NR-1,
//                           stored k-major, so one panel is one contiguous stream of K*NR floats;
//                           columns past N are zero padding
//   bias    [N] or none
//   y       [M, N]
//
// Worked example (NR = 4 for brevity; the kernel uses NR = 32): W [N=6, K=2] =
//   [[a0 a1] [b0 b1] [c0 c1] [d0 d1] [e0 e1] [f0 f1]]  packs to P = 2 panels
//   panel 0 = [a0 b0 c0 d0 | a1 b1 c1 d1],  panel 1 = [e0 f0 0 0 | e1 f1 0 0].
// y[m, 0..3] = sum_k x[m, k] * panel0[k, 0..3]: per k, one vector load of the weights and one
// broadcast of x[m, k] per row m; the accumulators of up to MR rows stay in registers for a pass.
//
// Work split: panels are divided between the threads of torch's intra-op pool. Within a panel
// the rows go in balanced groups of at most kGroupRows, each group in balanced blocks of at most
// MR rows. With one block, the pass runs over the whole K. With several (and at most
// kChunkMaxRows rows in all), K goes in chunks of kChunkK steps and every block takes its turn on
// a chunk before the next chunk: the chunk (kChunkK * NR floats = 4 KB) is fetched from memory
// once, by the first block, and the others re-read it from L1. The accumulators of a group wait in
// acc [rows, NR] between chunks (exact: the sum over k runs in the same order as in one pass).
//
// Worked example, MR = 12, M = 30 rows (3 blocks: 10 + 10 + 10), K = 576 (18 chunks of 32):
//   chunk 0: rows 0-9, then 10-19, then 20-29 over k = 0..31   (weights from memory, then L1, L1)
//   chunk 1: the same three blocks over k = 32..63            ...
//   then acc [30, 32] (+ bias) -> y[0..30, n0..n0+32).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Optional.h>
#include <torch/library.h>

#include "kernels.h"
#include "team.h"
#include "vec_math.h"

#include <algorithm>
#include <cstdint>

namespace {

constexpr int64_t NR = 32;  // output columns per panel
// One register-width vector (vec_math.h): 16 floats with AVX-512, 8 with AVX2.
constexpr int kLanes = specplan::kRegLanes;
typedef specplan::RegF V;
constexpr int NV = NR / kLanes;  // vectors per panel row: 2 (AVX-512) or 4 (AVX2)
// Rows per register block: MR * NV accumulators + the broadcast of x must fit the register file
// (32 zmm with AVX-512; 16 ymm with AVX2, where the weights come straight from L1 as the FMA's
// memory operand). With AVX-512, 12 rows (24 + 2 registers) rather than 8: a verify step of 9-12
// rows then runs as one pass over the weights instead of two blocks taking turns on each chunk;
// faster for 9-12 rows, no slower elsewhere (outputs unchanged: each row's sum runs over k in the
// same order) (measured: reports/README.md#engine-measurements).
#if defined(__AVX512F__)
constexpr int MR = 12;
#else
constexpr int MR = 3;
#endif
// Below this many weight floats a product runs on the calling thread (waking a thread costs more).
constexpr int64_t kMinParallelFloats = 1 << 16;
// Rows per group (the accumulators of a group live in a [kGroupRows, NR] buffer: 8 KB).
constexpr int64_t kGroupRows = 64;
// k steps per chunk when a group has several blocks: 4 KB of one panel, well inside L1 (32-48 KB);
// up to kChunkMaxRows rows. Past that (prompt chunks, compute-bound) a block makes one pass over
// the whole K, re-reading the panel from L2, which was faster there than chunks
// (measured: reports/README.md#engine-measurements).
constexpr int64_t kChunkK = 32;
constexpr int64_t kChunkMaxRows = 128;
// From this many rows on, every pass prefetches the weights kStreamPrefetchBytes ahead of the
// ones it reads, into L1 (prefetcht0, two lines per k step): with 4 or more rows the multiply is
// long enough that the hardware prefetcher alone falls behind; with 1-3 it runs the plain stream
// best alone. Several blocks are chunked as above with every block prefetching, which beat one
// pass per block over the whole K up to the compute-bound sizes; chunks of 32 k steps at 8 KB
// ahead beat longer chunks, other distances and prefetching in the first block only
// (measured: reports/README.md#engine-measurements).
constexpr int64_t kStreamPrefetchMinRows = 4;
constexpr int64_t kStreamPrefetchBytes = 8192;

// acc [R, NR] (+)= x[0..R, k0..k1) times the panel's k steps k0..k1; starts from zero when `init`.
// With prefetch_ahead > 0 each k step also fetches the two lines that many bytes past its own
// (past the panel's end that is the next panel, or nowhere: prefetches never fault).
template <int R>
inline void panel_block(const float* __restrict x, int64_t K, int64_t k0, int64_t k1, const float* __restrict panel,
                        float* __restrict acc_out, bool init, int64_t prefetch_ahead) {
  V acc[R][NV];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < NV; ++v) acc[r][v] = init ? V{} : *reinterpret_cast<const V*>(acc_out + r * NR + v * kLanes);
  for (int64_t k = k0; k < k1; ++k) {
    if (prefetch_ahead > 0) {
      const char* line = reinterpret_cast<const char*>(panel + k * NR) + prefetch_ahead;
      __builtin_prefetch(line, 0, 3);
      __builtin_prefetch(line + 64, 0, 3);
    }
    const float* w = panel + k * NR;
    for (int r = 0; r < R; ++r) {
      const float xr = x[r * K + k];
      for (int v = 0; v < NV; ++v) acc[r][v] += xr * *reinterpret_cast<const V*>(w + v * kLanes);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < NV; ++v) *reinterpret_cast<V*>(acc_out + r * NR + v * kLanes) = acc[r][v];
}

// panel_block with the row count R chosen at run time (1 <= rows <= R).
template <int R>
inline void panel_rows(const float* x, int64_t K, int64_t k0, int64_t k1, const float* panel, float* acc_out, bool init,
                       int64_t rows, int64_t prefetch_ahead) {
  if constexpr (R > 1) {
    if (rows < R) return panel_rows<R - 1>(x, K, k0, k1, panel, acc_out, init, rows, prefetch_ahead);
  }
  panel_block<R>(x, K, k0, k1, panel, acc_out, init, prefetch_ahead);
}

}  // namespace

namespace specplan {

at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& packed, int64_t N, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kFloat, "x must be [M, K] contiguous float32");
  TORCH_CHECK(packed.dim() == 3 && packed.is_contiguous() && packed.size(2) == NR && packed.scalar_type() == at::kFloat,
              "packed must be [P, K, 32] contiguous float32");
  const int64_t M = x.size(0), K = x.size(1), P = packed.size(0);
  TORCH_CHECK(packed.size(1) == K, "x has ", K, " columns but the packed weight has ", packed.size(1));
  TORCH_CHECK(N > (P - 1) * NR && N <= P * NR, "N=", N, " does not match ", P, " panels");
  const float* b = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->is_contiguous() && bias->numel() == N && bias->scalar_type() == at::kFloat, "bias must be [N] float32");
    b = bias->data_ptr<float>();
  }
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0) return y;
  if (K == 0) {  // an empty sum: the passes below would never start their accumulators
    y.zero_();
    return b != nullptr ? y.add_(*bias) : y;
  }
  const float* xp = x.data_ptr<float>();
  const float* pp = packed.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t prefetch_ahead = M >= kStreamPrefetchMinRows ? kStreamPrefetchBytes : 0;
  const int64_t groups = (M + kGroupRows - 1) / kGroupRows;

  auto panels = [&](int64_t p0, int64_t p1) {
    alignas(64) float acc[kGroupRows * NR];  // [group rows, NR]
    for (int64_t p = p0; p < p1; ++p) {
      const float* panel = pp + p * K * NR;
      const int64_t n0 = p * NR, ncols = std::min<int64_t>(NR, N - n0);
      for (int64_t g = 0, g0 = 0, group = 0; g < groups; ++g, g0 += group) {
        group = (M - g0 + groups - g - 1) / (groups - g);  // balanced: 65 rows run as 33 + 32
        const int64_t blocks = (group + MR - 1) / MR;
        const int64_t chunk = blocks == 1 || M > kChunkMaxRows ? K : kChunkK;
        for (int64_t k0 = 0; k0 < K; k0 += chunk) {
          const int64_t k1 = std::min(K, k0 + chunk);
          // Balanced row blocks: 13 rows with MR = 12 run as 7 + 6, not 12 + 1.
          for (int64_t block = 0, m0 = 0; block < blocks; ++block) {
            const int64_t left = blocks - block;
            const int64_t rows = (group - m0 + left - 1) / left;
            panel_rows<MR>(xp + (g0 + m0) * K, K, k0, k1, panel, acc + m0 * NR, k0 == 0, rows, prefetch_ahead);
            m0 += rows;
          }
        }
        for (int64_t m = 0; m < group; ++m) {
          const float* out = acc + m * NR;
          float* row = yp + (g0 + m) * N + n0;
          if (b != nullptr) {
            for (int64_t j = 0; j < ncols; ++j) row[j] = out[j] + b[n0 + j];
          } else {
            std::copy(out, out + ncols, row);
          }
        }
      }
    }
  };
  const int64_t threads = specplan::num_threads();
  if (threads <= 1 || P * K * NR < kMinParallelFloats) {
    panels(0, P);
  } else {
    specplan::parallel_for(0, P, (P + threads - 1) / threads, panels);
  }
  return y;
}

}  // namespace specplan

TORCH_LIBRARY(specplan_linear, m) {
  m.def("packed_linear(Tensor x, Tensor packed, int N, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(specplan_linear, CPU, m) {
  m.impl("packed_linear", &specplan::packed_linear);
}
