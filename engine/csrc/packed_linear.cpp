// y = x W^T (+ b) on CPU in float32, over a weight packed once into column panels.
//
// Built with paged_attention.cpp into one extension by engine/cpu_kernels.py; registers
// torch.ops.specplan_linear.packed_linear. engine/linear.py packs the weights and calls it.
//
// Why: a decode or verify step multiplies M = 1..~64 rows by every weight of the model, so the
// step is bound by streaming the weights once from memory. MKL's SGEMM (packed or not) reaches a
// fraction of the bandwidth at these row counts (DESIGN.md §7); this kernel streams each weight
// byte exactly once per M-block and keeps the FMA units busy from M ≈ 8 on.
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
// broadcast of x[m, k] per row m; the accumulators of MR rows stay in registers for the whole K.
//
// Work split: panels are divided between the threads of torch's intra-op pool; within a panel
// the M rows go through in balanced blocks of at most MR rows, re-reading the panel from L1/L2
// (not from memory) for every block after the first.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Optional.h>
#include <torch/library.h>

#include "kernels.h"

#include <algorithm>
#include <cstdint>

namespace {

constexpr int64_t NR = 32;  // output columns per panel: two 16-float vectors
// One 64-byte vector: one AVX-512 register, two AVX2 registers or four SSE/NEON registers.
typedef float V __attribute__((vector_size(64), aligned(4)));
// Rows per register block: MR * 2 accumulators + 2 weight vectors must fit the register file
// (32 zmm with AVX-512; 16 ymm otherwise, where each V takes two).
#if defined(__AVX512F__)
constexpr int MR = 8;
#else
constexpr int MR = 3;
#endif
// Below this many weight floats a product runs on the calling thread (waking a thread costs more).
constexpr int64_t kMinParallelFloats = 1 << 16;
// How a pass over a panel fetches the weights ahead of its math (Prefetch), by row count M:
// - M < kStreamPrefetchMinRows: nothing; the loop is a plain stream the hardware prefetcher runs
//   best alone.
// - up to MR rows (a single row block, one pass per panel): the lines kStreamPrefetchBytes ahead
//   of the ones being read, into L1 (prefetcht0). With 4-8 rows the multiply is long enough that
//   the hardware prefetcher alone falls behind. Measured here (Zen 5, one step's products of
//   SmolLM2-135M, 30 layers + lm_head, 2 threads, against what ran before: the next-panel
//   prefetch below from 7 rows, nothing under 7; A/B in one process): M = 8 0.88 in a fast
//   spell, 0.95 in a slow one; M = 5 0.86; M = 4 0.97; M = 1-2 0.95-1.01 (no clear gain), so
//   it starts at 4. At M = 8, 4 KB ahead read 0.93, 16 KB 0.88-0.97, 16 KB with the T1 hint (an
//   L2 fetch) 1.00.
// - several row blocks (the later ones re-read the panel from L2), from kPanelPrefetchMinRows
//   rows: the next panel, spread over the first two blocks' k steps. On the machine before
//   (Zen 4, where it also ran single blocks of 7-8 rows): M = 8 28.4 -> 22.5 ms, M = 9 30.2 ->
//   22.8, M = 16 39.2 -> 35.1, M = 32 53.2 -> 50.2. Here the stream prefetch above read 1.03-1.08x
//   slower than it at M = 9-16.
constexpr int64_t kStreamPrefetchMinRows = 4;
constexpr int64_t kStreamPrefetchBytes = 8192;
constexpr int64_t kPanelPrefetchMinRows = 7;

// What to fetch during a pass: `lines_per_k` cache lines per k step from `base` (the next panel),
// or, with `ahead` > 0, two lines (one k step's weights) `ahead` bytes past those being read.
struct Prefetch {
  const char* base = nullptr;
  int lines_per_k = 0;
  int64_t ahead = 0;
};

// Rows x[0..R) times one panel -> y[0..R, 0..ncols).
template <int R>
inline void panel_block(const float* __restrict x, int64_t K, const float* __restrict panel,
                        float* __restrict y, int64_t ldy, int64_t ncols, const float* __restrict bias,
                        Prefetch next) {
  V acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = V{};
  for (int64_t k = 0; k < K; ++k) {
    for (int i = 0; i < next.lines_per_k; ++i) __builtin_prefetch(next.base + (k * next.lines_per_k + i) * 64, 0, 2);
    if (next.ahead > 0) {  // past the panel's end this reads into the next one (or nowhere: prefetches never fault)
      const char* line = reinterpret_cast<const char*>(panel + k * NR) + next.ahead;
      __builtin_prefetch(line, 0, 3);
      __builtin_prefetch(line + 64, 0, 3);
    }
    const V w0 = *reinterpret_cast<const V*>(panel + k * NR);
    const V w1 = *reinterpret_cast<const V*>(panel + k * NR + 16);
    for (int r = 0; r < R; ++r) {
      const float xr = x[r * K + k];
      acc[r][0] += xr * w0;
      acc[r][1] += xr * w1;
    }
  }
  for (int r = 0; r < R; ++r) {
    float out[NR];
    *reinterpret_cast<V*>(out) = acc[r][0];
    *reinterpret_cast<V*>(out + 16) = acc[r][1];
    float* row = y + r * ldy;
    if (bias != nullptr) {
      for (int64_t j = 0; j < ncols; ++j) row[j] = out[j] + bias[j];
    } else {
      std::copy(out, out + ncols, row);
    }
  }
}

// panel_block with the row count R chosen at run time (1 <= rows <= R).
template <int R>
inline void panel_rows(const float* x, int64_t K, const float* panel, float* y, int64_t ldy, int64_t ncols,
                       const float* bias, int64_t rows, Prefetch next) {
  if constexpr (R > 1) {
    if (rows < R) return panel_rows<R - 1>(x, K, panel, y, ldy, ncols, bias, rows, next);
  }
  panel_block<R>(x, K, panel, y, ldy, ncols, bias, next);
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
  const float* xp = x.data_ptr<float>();
  const float* pp = packed.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t blocks = (M + MR - 1) / MR;

  auto panels = [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t n0 = p * NR, ncols = std::min<int64_t>(NR, N - n0);
      // A single block streams ahead of itself; with several, the next panel (K * NR floats =
      // 2K cache lines) is prefetched over this panel's first two blocks, one line per k in each.
      const char* next = reinterpret_cast<const char*>(pp + (p + 1) * K * NR);
      const bool prefetch = M >= kPanelPrefetchMinRows && p + 1 < p1;
      // Balanced row blocks: M = 9 with MR = 8 runs as 5 + 4, not 8 + 1.
      for (int64_t block = 0, m0 = 0; block < blocks; ++block) {
        const int64_t left = blocks - block;
        const int64_t rows = (M - m0 + left - 1) / left;
        Prefetch pf;
        if (blocks == 1 && M >= kStreamPrefetchMinRows) pf.ahead = kStreamPrefetchBytes;
        else if (prefetch && block < 2) pf = {next + block * K * 64, 1};
        panel_rows<MR>(xp + m0 * K, K, pp + p * K * NR, yp + m0 * N + n0, N, ncols, b ? b + n0 : nullptr, rows, pf);
        m0 += rows;
      }
    }
  };
  const int64_t threads = at::get_num_threads();
  if (threads <= 1 || P * K * NR < kMinParallelFloats) {
    panels(0, P);
  } else {
    at::parallel_for(0, P, (P + threads - 1) / threads, panels);
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
