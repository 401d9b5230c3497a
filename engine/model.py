"""Our Llama-family decoder (Llama, SmolLM2, Mistral-style, Qwen2) over a flattened TokenBatch.

Weights are plain tensors in fused layouts (QKV in one matrix, gate and up in one) so that each
layer runs five matrix products; the math follows Hugging Face's modeling code op for op in
fp32 (RMSNorm in fp32, RoPE in rotate-half layout, tied embeddings).
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .attention import AttentionPlan, paged_attention, write_kv
from .attention_cpu import load_kernel, paged_attention_cpu
from .attention_cpu import supports as cpu_kernel_supports
from .batch import TokenBatch
from .config import ModelConfig
from .linear import Linear, make_linear, mkl_packing_available


@dataclass
class DecoderLayer:
    input_norm: torch.Tensor  # [hidden]
    qkv: Linear  # hidden -> (H + 2 * KVH) * D
    o: Linear  # H * D -> hidden
    post_norm: torch.Tensor  # [hidden]
    gate_up: Linear  # hidden -> 2 * intermediate
    down: Linear  # intermediate -> hidden


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [N, heads, D], cos/sin [N, 1, D] (rotate-half layout, as Hugging Face Llama)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class Model:
    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor], device: torch.device | str,
                 dtype: torch.dtype, packed_linears: bool | None = None):
        """``packed_linears``: MKL-packed weights (default: wherever available, i.e. CPU fp32)."""
        self.config = config
        self.device = torch.device(device)
        self.dtype = dtype
        c = config
        if packed_linears is None:
            packed_linears = mkl_packing_available(self.device, dtype)

        def linear(weight: torch.Tensor, bias: torch.Tensor | None = None) -> Linear:
            return make_linear(weight, bias, packed_linears)

        def w(name: str) -> torch.Tensor:
            if name not in weights:
                raise ValueError(f"checkpoint is missing weight {name!r}")
            return weights[name].to(device=self.device, dtype=dtype)

        def maybe(name: str) -> torch.Tensor | None:
            return w(name) if name in weights else None

        self.embed = w("model.embed_tokens.weight")  # [V, hidden]
        self.final_norm = w("model.norm.weight")  # [hidden]
        lm_head = self.embed if c.tie_word_embeddings or "lm_head.weight" not in weights else w("lm_head.weight")
        self.lm_head = linear(lm_head)  # [V, hidden]
        self.layers: list[DecoderLayer] = []
        for i in range(c.num_layers):
            p = f"model.layers.{i}."
            qkv_w = torch.cat([w(p + f"self_attn.{n}_proj.weight") for n in "qkv"])
            qkv_b = None
            if c.qkv_bias:
                qkv_b = torch.cat([w(p + f"self_attn.{n}_proj.bias") for n in "qkv"])
            self.layers.append(DecoderLayer(
                input_norm=w(p + "input_layernorm.weight"),
                qkv=linear(qkv_w, qkv_b),
                o=linear(w(p + "self_attn.o_proj.weight"), maybe(p + "self_attn.o_proj.bias")),
                post_norm=w(p + "post_attention_layernorm.weight"),
                gate_up=linear(torch.cat([w(p + "mlp.gate_proj.weight"), w(p + "mlp.up_proj.weight")])),
                down=linear(w(p + "mlp.down_proj.weight")),
            ))
        # RoPE tables for every position the model can see: [max_pos, 1, D] (computed in fp32, as HF).
        inv_freq = torch.tensor(c.rope_inv_freq, dtype=torch.float32)
        pos = torch.arange(c.max_position_embeddings, dtype=torch.float32)
        freqs = torch.cat([pos[:, None] * inv_freq[None, :]] * 2, dim=-1)  # [max_pos, D]
        self.rope_cos = (freqs.cos() * c.rope_attention_scaling).to(self.device, dtype)[:, None, :]
        self.rope_sin = (freqs.sin() * c.rope_attention_scaling).to(self.device, dtype)[:, None, :]
        self.scale = c.head_dim ** -0.5
        self.q_size = c.num_heads * c.head_dim
        self.kv_size = c.num_kv_heads * c.head_dim
        if self.device.type == "cpu":
            load_kernel()  # compile the paged-attention kernel now, not inside the first request

    def truncated(self, num_layers: int) -> "Model":
        """The first ``num_layers`` layers with the same embedding, final norm and LM head (shared
        tensors, no copy): the layer-skip draft."""
        draft = copy.copy(self)
        draft.layers = self.layers[:num_layers]
        draft.config = dataclasses.replace(self.config, num_layers=num_layers,
                                           name=f"{self.config.name}[:{num_layers}]")
        return draft

    @torch.inference_mode()
    def forward(self, batch: TokenBatch, kv_cache: torch.Tensor, block_size: int) -> torch.Tensor:
        """Hidden states [N, hidden] after the final norm; writes this step's K/V into kv_cache.

        kv_cache: [num_layers, 2, num_blocks, block_size, KVH, D].
        """
        c = self.config
        # On CPU a C++ kernel reads K/V in place through the block tables; tree-masked batches and
        # other devices use the torch reference, which gathers each sequence's K/V.
        use_kernel = cpu_kernel_supports(batch, self.dtype, self.device)
        plan = None if use_kernel else AttentionPlan.build(batch, block_size, c.num_heads // c.num_kv_heads,
                                                           c.sliding_window)
        cos, sin = self.rope_cos[batch.positions], self.rope_sin[batch.positions]  # [N, 1, D]
        n = batch.num_tokens
        h = self.embed[batch.input_ids]  # [N, hidden]
        for i, layer in enumerate(self.layers):
            x = rms_norm(h, layer.input_norm, c.rms_norm_eps)
            qkv = layer.qkv(x)  # [N, (H + 2 KVH) * D]
            q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            q = apply_rope(q.view(n, c.num_heads, c.head_dim), cos, sin)  # [N, H, D]
            k = apply_rope(k.view(n, c.num_kv_heads, c.head_dim), cos, sin)  # [N, KVH, D]
            v = v.reshape(n, c.num_kv_heads, c.head_dim)  # [N, KVH, D]
            k_cache, v_cache = kv_cache[i, 0], kv_cache[i, 1]
            write_kv(k, v, k_cache, v_cache, batch.slot_mapping)
            if use_kernel:
                attn = paged_attention_cpu(q, k_cache, v_cache, batch, self.scale, c.sliding_window)  # [N, H, D]
            else:
                attn = paged_attention(q, k_cache, v_cache, plan, self.scale)  # [N, H, D]
            h = h + layer.o(attn.view(n, self.q_size))
            x = rms_norm(h, layer.post_norm, c.rms_norm_eps)
            gate, up = layer.gate_up(x).chunk(2, dim=-1)  # [N, I] each
            h = h + layer.down(F.silu(gate) * up)
        return rms_norm(h, self.final_norm, c.rms_norm_eps)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [R, hidden] -> logits [R, V] in fp32."""
        return self.lm_head(hidden).float()
