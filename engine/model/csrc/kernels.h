// The entry points of the engine's CPU kernels, callable from C++ as well as through torch.ops:
// decoder_layers.cpp chains them into a whole decoder stack. Each is documented where defined.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>

namespace specplan {

// packed_linear.cpp: y [M, N] = x [M, K] W^T (+ bias), W packed by engine/model/linear.py.
at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& packed, int64_t N, const std::optional<at::Tensor>& bias);

// quant_linear.cpp: the same product with W in Q8_0 / Q4_0 / Q4_1 blocks, packed [P, K / 32, bytes
// per block] uint8 by engine/model/quant.py. any_linear runs whichever of the two a packed weight
// is for (uint8: quantised, float32: packed_linear); any_linear_in_features is its K.
at::Tensor quant_linear(const at::Tensor& x, const at::Tensor& packed, int64_t N, const std::optional<at::Tensor>& bias);
at::Tensor any_linear(const at::Tensor& x, const at::Tensor& packed, int64_t N, const std::optional<at::Tensor>& bias);
int64_t any_linear_in_features(const at::Tensor& packed);

// fused_ops.cpp
at::Tensor add_rms_norm_(at::Tensor h, const std::optional<at::Tensor>& delta, const at::Tensor& weight, double eps);
at::Tensor rope_write_kv(const at::Tensor& qkv, const at::Tensor& positions, const at::Tensor& cos,
                         const at::Tensor& sin, at::Tensor k_cache, at::Tensor v_cache, const at::Tensor& slot_mapping,
                         int64_t H, int64_t KVH);
at::Tensor silu_mul(const at::Tensor& gate_up);
at::Tensor argmax_rows(const at::Tensor& x);

// paged_attention.cpp
at::Tensor paged_attention_cpu(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                               const at::Tensor& query_start_loc, const at::Tensor& seq_lens,
                               const at::Tensor& block_tables, const at::Tensor& positions, double scale,
                               int64_t sliding_window, const std::optional<at::Tensor>& tree_bits);

}  // namespace specplan
