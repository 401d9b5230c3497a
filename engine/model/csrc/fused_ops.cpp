// The small per-layer ops of a decoder step, fused: each replaces 5-12 torch ops (and as many
// temporaries) with one pass over the rows. float32, CPU. Built with the other kernels by
// engine/model/cpu_kernels.py; engine/model/layer_ops.py holds the torch reference of each, op for op as
// Hugging Face's Llama, and the tests compare the two.
//
//   add_rms_norm_(h [N, E], delta [N, E]?, weight [E], eps) -> [N, E]
//       h += delta (in place, the residual stream), then returns weight * h / rms(h).
//   rope_write_kv(qkv [N, (H + 2 KVH) D], positions [N], cos/sin [max_pos, D],
//                 k_cache/v_cache [num_blocks, block_size, KVH, D], slot_mapping [N], H, KVH) -> q [N, H, D]
//       rotates q and k (rotate-half layout) and writes k and v straight into their cache slots
//       (float32, or float16 rounded to nearest even as torch's .half()); returns the rotated q.
//       Replaces split + two apply_rope + two index_copy_.
//   silu_mul(gate_up [N, 2 I]) -> [N, I]:  silu(gate) * up.
//   argmax_rows(x [R, V]) -> [R] int64:  torch.argmax(x, -1) (greedy tokens from the logits).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/argmax.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/util/Half.h>
#include <c10/util/Optional.h>
#include <torch/library.h>

#include "kernels.h"
#include "team.h"

#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "vec_math.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

namespace {

using specplan::F8;
using specplan::exp_nonpositive;

constexpr int64_t kRowsPerTask = 8;         // rows per parallel task
constexpr int64_t kMinParallelFloats = 1 << 15;  // smaller ops stay on the calling thread

inline F8 load8(const float* p) {
  F8 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline void store8(float* p, F8 v) { std::memcpy(p, &v, sizeof(v)); }

// fn(row_begin, row_end) over N rows of `width` floats, threaded only when it pays.
template <typename Fn>
void for_rows(int64_t N, int64_t width, const Fn& fn) {
  if (N * width < kMinParallelFloats || specplan::num_threads() <= 1) {
    fn(0, N);
  } else {
    specplan::parallel_for(0, N, kRowsPerTask, fn);
  }
}

void check_float_rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat && t.dim() == 2 && t.is_contiguous(), name,
              " must be a contiguous float32 [N, width] CPU tensor");
}

// Sum of x[j]^2 in double: as accurate as torch's cascade sum, whatever the order. Eight
// independent double lanes: one serial chain over a row would wait on the adder's latency for
// every element (at 32 rows x 576 that chain, not memory, was the whole cost of the op).
inline double sum_squares(const float* x, int64_t n) {
  typedef float F4 __attribute__((vector_size(16)));
  typedef double D4 __attribute__((vector_size(32)));
  D4 a0 = {}, a1 = {};
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    F4 lo, hi;
    std::memcpy(&lo, x + j, sizeof(lo));
    std::memcpy(&hi, x + j + 4, sizeof(hi));
    const D4 d0 = __builtin_convertvector(lo, D4), d1 = __builtin_convertvector(hi, D4);
    a0 += d0 * d0;
    a1 += d1 * d1;
  }
  const D4 a = a0 + a1;
  double ss = (a[0] + a[1]) + (a[2] + a[3]);
  for (; j < n; ++j) ss += static_cast<double>(x[j]) * x[j];
  return ss;
}

// out[0:D] = x * cos + rotate_half(x) * sin, rotate_half(x) = [-x[D/2:], x[:D/2]].
inline void rotate(const float* __restrict x, const float* __restrict c, const float* __restrict s, int64_t D,
                   float* __restrict out) {
  const int64_t half = D / 2;
  for (int64_t j = 0; j < half; ++j) out[j] = x[j] * c[j] - x[j + half] * s[j];
  for (int64_t j = half; j < D; ++j) out[j] = x[j] * c[j] + x[j - half] * s[j];
}

// The cache's copy of D floats: as they are, or rounded to fp16 (to nearest even, as torch's
// .half(), so the torch reference writes the same bits).
inline void store_kv(const float* __restrict src, float* __restrict dst, int64_t D) {
  std::memcpy(dst, src, D * sizeof(float));
}
inline void store_kv(const float* __restrict src, at::Half* __restrict dst, int64_t D) {
  int64_t j = 0;
#if defined(__F16C__)
  for (; j + 8 <= D; j += 8)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + j),
                     _mm256_cvtps_ph(_mm256_loadu_ps(src + j), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#endif
  for (; j < D; ++j) dst[j] = static_cast<at::Half>(src[j]);
}

// silu(g) * u = g * sigmoid(g) * u, sigmoid from e = exp(-|g|) (never overflows):
// sigmoid(g) = 1 / (1 + e) for g >= 0, e / (1 + e) for g < 0. One register-width vector.
using specplan::kRegLanes;
using specplan::RegF;
using specplan::RegI;

inline RegF silu_times(RegF g, RegF u) {
  const RegF e = specplan::exp_nonpositive_v<RegF, RegI>(g < 0 ? g : -g);
  const RegF num = g < 0 ? e : RegF{} + 1.0f;
  return g * (num / (1.0f + e)) * u;
}

}  // namespace

namespace specplan {

at::Tensor add_rms_norm_(at::Tensor h, const std::optional<at::Tensor>& delta, const at::Tensor& weight, double eps) {
  check_float_rows(h, "h");
  const int64_t N = h.size(0), E = h.size(1);
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == E && weight.scalar_type() == at::kFloat,
              "weight must be [", E, "] float32");
  const float* d = nullptr;
  if (delta.has_value() && delta->defined()) {
    check_float_rows(*delta, "delta");
    TORCH_CHECK(delta->sizes() == h.sizes(), "delta must have h's shape");
    d = delta->data_ptr<float>();
  }
  at::Tensor out = at::empty_like(h);
  float* hp = h.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float* w = weight.data_ptr<float>();
  for_rows(N, E, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      float* x = hp + r * E;
      if (d != nullptr) {
        const float* dr = d + r * E;
        for (int64_t j = 0; j < E; ++j) x[j] += dr[j];
      }
      const double ss = sum_squares(x, E);
      const float inv = 1.0f / std::sqrt(static_cast<float>(ss / E) + static_cast<float>(eps));
      float* o = op + r * E;
      for (int64_t j = 0; j < E; ++j) o[j] = w[j] * (x[j] * inv);
    }
  });
  return out;
}

at::Tensor rope_write_kv(const at::Tensor& qkv, const at::Tensor& positions, const at::Tensor& cos,
                         const at::Tensor& sin, at::Tensor k_cache, at::Tensor v_cache, const at::Tensor& slot_mapping,
                         int64_t H, int64_t KVH) {
  check_float_rows(qkv, "qkv");
  check_float_rows(cos, "cos");
  check_float_rows(sin, "sin");
  const int64_t N = qkv.size(0), D = cos.size(1), max_pos = cos.size(0);
  TORCH_CHECK(D % 2 == 0 && qkv.size(1) == (H + 2 * KVH) * D, "qkv must be [N, (H + 2 KVH) * D]");
  TORCH_CHECK(sin.sizes() == cos.sizes(), "sin and cos tables must match");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes() && k_cache.size(2) == KVH &&
                  k_cache.size(3) == D && k_cache.stride(3) == 1 && v_cache.stride(3) == 1 &&
                  k_cache.scalar_type() == v_cache.scalar_type() &&
                  (k_cache.scalar_type() == at::kFloat || k_cache.scalar_type() == at::kHalf),
              "k_cache / v_cache must be float32 or float16 [num_blocks, block_size, KVH, D], head_dim contiguous");
  TORCH_CHECK(positions.scalar_type() == at::kLong && slot_mapping.scalar_type() == at::kLong &&
                  positions.is_contiguous() && slot_mapping.is_contiguous() && positions.numel() == N &&
                  slot_mapping.numel() == N,
              "positions and slot_mapping must be contiguous int64 [N]");
  const int64_t bs = k_cache.size(1), num_slots = k_cache.size(0) * bs;
  const int64_t* pos = positions.data_ptr<int64_t>();
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  for (int64_t i = 0; i < N; ++i) {
    TORCH_CHECK(pos[i] >= 0 && pos[i] < max_pos, "position ", pos[i], " outside the RoPE table (", max_pos, ")");
    TORCH_CHECK(slots[i] >= 0 && slots[i] < num_slots, "slot ", slots[i], " outside the KV cache (", num_slots, ")");
  }
  at::Tensor q = at::empty({N, H, D}, qkv.options());
  const float* in = qkv.data_ptr<float>();
  const float* ct = cos.data_ptr<float>();
  const float* st = sin.data_ptr<float>();
  float* qp = q.data_ptr<float>();
  const int64_t sk0 = k_cache.stride(0), sk1 = k_cache.stride(1), sk2 = k_cache.stride(2);
  const int64_t sv0 = v_cache.stride(0), sv1 = v_cache.stride(1), sv2 = v_cache.stride(2);
  const int64_t width = (H + 2 * KVH) * D;
  auto write = [&](auto* kp, auto* vp) {  // float* or at::Half*: the cache's element type
    constexpr bool narrow = !std::is_same_v<std::remove_pointer_t<decltype(kp)>, float>;
    for_rows(N, width, [&](int64_t r0, int64_t r1) {
      // A float cache takes the rotated key in place; a float16 one from a row rotated here first.
      std::vector<float> rotated(narrow ? D : 0);
      for (int64_t i = r0; i < r1; ++i) {
        const float* row = in + i * width;
        const float* c = ct + pos[i] * D;
        const float* s = st + pos[i] * D;
        const int64_t block = slots[i] / bs, offset = slots[i] % bs;
        for (int64_t h = 0; h < H; ++h) rotate(row + h * D, c, s, D, qp + (i * H + h) * D);
        for (int64_t kv = 0; kv < KVH; ++kv) {
          auto* key = kp + block * sk0 + offset * sk1 + kv * sk2;
          if constexpr (narrow) {
            rotate(row + (H + kv) * D, c, s, D, rotated.data());
            store_kv(rotated.data(), key, D);
          } else {
            rotate(row + (H + kv) * D, c, s, D, key);
          }
          store_kv(row + (H + KVH + kv) * D, vp + block * sv0 + offset * sv1 + kv * sv2, D);
        }
      }
    });
  };
  if (k_cache.scalar_type() == at::kHalf) {
    write(k_cache.data_ptr<at::Half>(), v_cache.data_ptr<at::Half>());
  } else {
    write(k_cache.data_ptr<float>(), v_cache.data_ptr<float>());
  }
  return q;
}

at::Tensor silu_mul(const at::Tensor& gate_up) {
  check_float_rows(gate_up, "gate_up");
  const int64_t N = gate_up.size(0), I = gate_up.size(1) / 2;
  TORCH_CHECK(gate_up.size(1) == 2 * I, "gate_up must have an even width");
  at::Tensor out = at::empty({N, I}, gate_up.options());
  const float* in = gate_up.data_ptr<float>();
  float* op = out.data_ptr<float>();
  for_rows(N, 2 * I, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* g = in + r * 2 * I;
      const float* u = g + I;
      float* o = op + r * I;
      int64_t j = 0;
      for (; j + kRegLanes <= I; j += kRegLanes) {
        RegF gv, uv;
        std::memcpy(&gv, g + j, sizeof(gv));
        std::memcpy(&uv, u + j, sizeof(uv));
        const RegF ov = silu_times(gv, uv);
        std::memcpy(o + j, &ov, sizeof(ov));
      }
      for (; j < I; ++j) o[j] = g[j] / (1.0f + std::exp(-g[j])) * u[j];
    }
  });
  return out;
}

// Row-wise argmax of x [R, V] (greedy decoding over the logits): the first index of the
// largest value, as torch.argmax. kRegLanes running maxima per row, each lane keeping its first
// maximum; a row holding NaN falls back to torch (which returns the NaN's index).
at::Tensor argmax_rows(const at::Tensor& x) {
  check_float_rows(x, "x");
  const int64_t R = x.size(0), V = x.size(1);
  TORCH_CHECK(V > 0, "argmax over an empty row");
  at::Tensor out = at::empty({R}, x.options().dtype(at::kLong));
  const float* xp = x.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  std::atomic<bool> saw_nan{false};  // set by any thread that meets a NaN row
  for_rows(R, V, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* row = xp + r * V;
      int64_t j = 0, best_j = 0;
      float best = row[0];
      if (V >= kRegLanes) {
        const RegI step = RegI{} + kRegLanes;
        RegI lane_j = specplan::lane_index();
        RegF vmax;
        std::memcpy(&vmax, row, sizeof(vmax));
        RegI imax = lane_j;
        RegF nan_check = vmax;
        for (j = kRegLanes; j + kRegLanes <= V; j += kRegLanes) {
          lane_j += step;
          RegF v;
          std::memcpy(&v, row + j, sizeof(v));
          const RegI gt = v > vmax;  // strictly greater: each lane keeps its first maximum
          vmax = gt ? v : vmax;
          imax = gt ? lane_j : imax;
          nan_check += v;  // NaN anywhere makes the sum NaN
        }
        bool nan = false;
        for (int l = 0; l < kRegLanes; ++l) nan |= nan_check[l] != nan_check[l];
        if (nan) {
          saw_nan.store(true, std::memory_order_relaxed);
          continue;
        }
        best = vmax[0];
        best_j = imax[0];
        for (int l = 1; l < kRegLanes; ++l)
          if (vmax[l] > best || (vmax[l] == best && imax[l] < best_j)) best = vmax[l], best_j = imax[l];
      }
      for (; j < V; ++j) {
        if (row[j] != row[j]) {  // NaN wins, as in torch
          best_j = j;
          break;
        }
        if (row[j] > best) best = row[j], best_j = j;
      }
      op[r] = best_j;
    }
  });
  if (saw_nan.load()) return x.argmax(-1);
  return out;
}

}  // namespace specplan

TORCH_LIBRARY(specplan_ops, m) {
  m.def("add_rms_norm_(Tensor(a!) h, Tensor? delta, Tensor weight, float eps) -> Tensor");
  m.def("rope_write_kv(Tensor qkv, Tensor positions, Tensor cos, Tensor sin, Tensor(a!) k_cache, "
        "Tensor(b!) v_cache, Tensor slot_mapping, int H, int KVH) -> Tensor");
  m.def("silu_mul(Tensor gate_up) -> Tensor");
  m.def("argmax_rows(Tensor x) -> Tensor");
}

TORCH_LIBRARY_IMPL(specplan_ops, CPU, m) {
  m.impl("add_rms_norm_", &specplan::add_rms_norm_);
  m.impl("rope_write_kv", &specplan::rope_write_kv);
  m.impl("silu_mul", &specplan::silu_mul);
  m.impl("argmax_rows", &specplan::argmax_rows);
}
