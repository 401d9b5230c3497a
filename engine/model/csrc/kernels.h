// The entry points of the engine's CPU kernels, callable from C++ as well as through torch.ops:
// decoder_layers.cpp chains them into a whole decoder stack. Each is documented where defined.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>

namespace specplan {

// packed_linear.cpp: y [M, N] = x [M, K] W^T (+ bias), W packed by engine/model/linear.py.
at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& packed, int64_t N, const std::optional<at::Tensor>& bias);

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
