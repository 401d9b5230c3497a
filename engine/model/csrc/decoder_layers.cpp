// The decoder layers of one step in one call: the same kernels as engine/model/transformer.py's per-op loop
// (packed products, fused norms, RoPE + KV write, paged attention, SiLU), in the same order, so
// the output is bit-identical; only the Python between them is gone.
//
// Why: a decode step makes about ten kernel calls per layer from Python, each paying interpreter
// and dispatcher time before the kernel starts, beside attribute lookups and argument checks: a
// visible share of a small model's B=1 step. Called from C++ they cost nothing measurable
// (measured: reports/README.md#engine-measurements). And their threads fork once per call, not once
// per kernel (team.h).
//
//   decoder_layers(h [N, E], x [N, E], weights[6 L], biases[2 L], kv_caches[2 L], ...) -> [N, E]
//
// h is the residual stream (updated in place) and x the first layer's normed input. Per layer l:
//   weights[6l .. 6l+5] = qkv, o, gate_up, down (packed [P, K, 32] float32, engine/model/linear.py,
//                         or quantised [P, K / 32, bytes per block] uint8, engine/model/quant.py),
//                         post_norm [E], next_norm [E] (layer l+1's input norm; the final norm
//                         after the last layer)
//   biases[2l], biases[2l+1] = the qkv and o biases, or None
//   kv_caches[2l], kv_caches[2l+1] = the layer's k and v cache [num_blocks, block_size, KVH, D]
// The rest describe the step as engine/model/attention_cpu.py's paged_attention_cpu takes it. Returns
// the final-normed hidden states.

#include <ATen/core/Tensor.h>
#include <ATen/core/List.h>
#include <torch/library.h>

#include <cstdint>
#include <cstdlib>
#include <string>
#include <optional>

#include "kernels.h"
#include "team.h"

namespace specplan {

at::Tensor decoder_layers(at::Tensor h, at::Tensor x, at::TensorList weights,
                          const c10::List<std::optional<at::Tensor>>& biases, at::TensorList kv_caches,
                          const at::Tensor& positions, const at::Tensor& slot_mapping, const at::Tensor& cos,
                          const at::Tensor& sin, const at::Tensor& query_start_loc, const at::Tensor& seq_lens,
                          const at::Tensor& block_tables, const std::optional<at::Tensor>& tree_bits,
                          int64_t num_heads, double scale, int64_t sliding_window, double eps) {
  const int64_t L = static_cast<int64_t>(kv_caches.size()) / 2;
  TORCH_CHECK(L > 0 && static_cast<int64_t>(kv_caches.size()) == 2 * L, "kv_caches must hold a k and a v per layer");
  TORCH_CHECK(static_cast<int64_t>(weights.size()) == 6 * L, "weights must hold 6 tensors per layer, got ",
              weights.size(), " for ", L, " layers");
  TORCH_CHECK(static_cast<int64_t>(biases.size()) == 2 * L, "biases must hold 2 entries per layer");
  TORCH_CHECK(h.dim() == 2 && x.sizes() == h.sizes(), "h and x must both be [N, hidden]");
  const int64_t N = h.size(0), E = h.size(1), D = cos.size(1), KVH = kv_caches[0].size(2);
  auto layers = [&] {
    for (int64_t l = 0; l < L; ++l) {
      const at::Tensor* w = weights.data() + 6 * l;
      const at::Tensor& k_cache = kv_caches[2 * l];
      const at::Tensor& v_cache = kv_caches[2 * l + 1];
      const int64_t intermediate = any_linear_in_features(w[3]);  // down's input width
      const at::Tensor qkv = any_linear(x, w[0], (num_heads + 2 * KVH) * D, biases.get(2 * l));  // [N, (H + 2 KVH) D]
      const at::Tensor q = rope_write_kv(qkv, positions, cos, sin, k_cache, v_cache, slot_mapping, num_heads, KVH);
      const at::Tensor attn = paged_attention_cpu(q, k_cache, v_cache, query_start_loc, seq_lens, block_tables,
                                                  positions, scale, sliding_window, tree_bits);  // [N, H, D]
      const at::Tensor o = any_linear(attn.view({N, num_heads * D}), w[1], E, biases.get(2 * l + 1));  // [N, E]
      x = add_rms_norm_(h, o, w[4], eps);
      const at::Tensor act = silu_mul(any_linear(x, w[2], 2 * intermediate, std::nullopt));  // [N, I]
      x = add_rms_norm_(h, any_linear(act, w[3], E, std::nullopt), w[5], eps);
    }
  };
  // One fork for all the layers' threaded kernels (team.h): B = 1 Q4_1 steps 1.029x faster, B = 4
  // 1.012x, B = 16-32 ~1.004x, null control 1.000x (scripts/decoder_team_ab.py, reports/decoder-team-zen4-s39).
  // SPECPLAN_DECODER_TEAM=0 (read every call) forks per kernel as before: what the A/B compares.
  const char* team = std::getenv("SPECPLAN_DECODER_TEAM");
  if (team == nullptr || std::string(team) != "0") {
    with_team(layers);
  } else {
    layers();
  }
  return x;
}

}  // namespace specplan

TORCH_LIBRARY_FRAGMENT(specplan_ops, m) {
  m.def("decoder_layers(Tensor(a!) h, Tensor x, Tensor[] weights, Tensor?[] biases, Tensor(b!)[] kv_caches, "
        "Tensor positions, Tensor slot_mapping, Tensor cos, Tensor sin, Tensor query_start_loc, Tensor seq_lens, "
        "Tensor block_tables, Tensor? tree_bits, int num_heads, float scale, int sliding_window, float eps) -> Tensor");
}

TORCH_LIBRARY_IMPL(specplan_ops, CPU, m) {
  m.impl("decoder_layers", &specplan::decoder_layers);
}
