"""The small per-layer ops of a decoder step, behind one interface with two implementations.

``TorchLayerOps`` is the reference: op for op as Hugging Face's Llama (RMSNorm in fp32, RoPE in
rotate-half layout), on any device and dtype. ``CpuKernelOps`` runs the same math as fused C++
kernels (engine/model/csrc/fused_ops.cpp) on CPU in float32, where a decode step is otherwise a few
thousand tiny torch ops. ``layer_ops_for`` picks one per model.

The residual stream ``h`` is updated in place by ``add_rms_norm_`` (h += delta), as vLLM's fused
add + RMSNorm does: the caller owns ``h`` (a fresh embedding lookup).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import cpu_kernels
from .attention import write_kv


class TorchLayerOps:
    @staticmethod
    def add_rms_norm_(h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """h [N, E] += delta [N, E] (if given); returns weight * h / rms(h), computed in fp32."""
        if delta is not None:
            h += delta
        x = h.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
        return weight * x.to(h.dtype)

    @staticmethod
    def rope_write_kv(qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                      k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                      num_heads: int, num_kv_heads: int) -> torch.Tensor:
        """qkv [N, (H + 2 KVH) D] -> rotated q [N, H, D]; rotated k and v go to their cache slots.
        cos/sin: [max_pos, D] tables; caches [num_blocks, block_size, KVH, D]."""
        n, d = qkv.shape[0], cos.shape[-1]
        q, k, v = qkv.split([num_heads * d, num_kv_heads * d, num_kv_heads * d], dim=-1)
        c, s = cos[positions][:, None, :], sin[positions][:, None, :]  # [N, 1, D]
        q = _rotate(q.view(n, num_heads, d), c, s)  # [N, H, D]
        k = _rotate(k.view(n, num_kv_heads, d), c, s)  # [N, KVH, D]
        write_kv(k, v.reshape(n, num_kv_heads, d), k_cache, v_cache, slot_mapping)
        return q

    @staticmethod
    def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
        """gate_up [N, 2 I] -> silu(gate) * up [N, I]."""
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [N, heads, D] * cos + rotate_half(x) * sin, rotate_half(x) = [-x[..., D/2:], x[..., :D/2]]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class CpuKernelOps:
    """The same signatures through the fused C++ kernels (CPU, float32; inputs contiguous)."""

    @staticmethod
    def add_rms_norm_(h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return torch.ops.specplan_ops.add_rms_norm_(h, delta, weight, eps)

    @staticmethod
    def rope_write_kv(qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                      k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                      num_heads: int, num_kv_heads: int) -> torch.Tensor:
        return torch.ops.specplan_ops.rope_write_kv(qkv, positions, cos, sin, k_cache, v_cache, slot_mapping,
                                                    num_heads, num_kv_heads)

    @staticmethod
    def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
        return torch.ops.specplan_ops.silu_mul(gate_up)


LayerOps = type[TorchLayerOps] | type[CpuKernelOps]


def layer_ops_for(device: torch.device, dtype: torch.dtype) -> LayerOps:
    if device.type == "cpu" and dtype == torch.float32 and cpu_kernels.load():
        return CpuKernelOps
    return TorchLayerOps
