"""Our Llama-family decoder (Llama, SmolLM2, Mistral-style, Qwen2) over a flattened TokenBatch.

Weights are plain tensors in fused layouts (QKV in one matrix, gate and up in one) so that each
layer runs five matrix products; the math follows Hugging Face's modeling code op for op in
fp32 (RMSNorm in fp32, RoPE in rotate-half layout, tied embeddings). On CPU in float32 the
layer loop runs as one C++ call (``_KernelStack``); ``Model.forward``'s Python loop is the same
sequence of kernels, and the path for every other device, dtype and batch.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass
from typing import Sequence

import torch

from .attention import AttentionPlan, paged_attention
from .attention_cpu import load_kernel, paged_attention_cpu
from .attention_cpu import supports as cpu_kernel_supports
from ..batch import TokenBatch
from ..config import ModelConfig
from .layer_ops import CpuKernelOps, layer_ops_for
from .linear import Linear, PackedLinear, concat_weights, make_linear, move_to_huge_pages, packed_available
from .quant import QuantWeight


@dataclass
class DecoderLayer:
    input_norm: torch.Tensor  # [hidden]
    qkv: Linear  # hidden -> (H + 2 * KVH) * D
    o: Linear  # H * D -> hidden
    post_norm: torch.Tensor  # [hidden]
    gate_up: Linear  # hidden -> 2 * intermediate
    down: Linear  # intermediate -> hidden


class Model:
    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor], device: torch.device | str,
                 dtype: torch.dtype, packed_linears: bool | None = None):
        """``packed_linears``: the engine's packed CPU kernel for the projections (default: wherever
        available, i.e. CPU float32 with the C++ kernels built)."""
        self.config = config
        self.device = torch.device(device)
        self.dtype = dtype
        c = config
        if packed_linears is None:
            packed_linears = packed_available(self.device, dtype)

        def linear(weight: torch.Tensor | QuantWeight, bias: torch.Tensor | None = None) -> Linear:
            return make_linear(weight, bias, packed_linears)

        def w(name: str) -> torch.Tensor | QuantWeight:
            if name not in weights:
                raise ValueError(f"checkpoint is missing weight {name!r}")
            t = weights[name]
            if isinstance(t, QuantWeight):  # blocks for the CPU kernel; dequantised where it does not run
                return t if packed_linears else t.dequantize().to(device=self.device, dtype=dtype)
            return t.to(device=self.device, dtype=dtype)

        def maybe(name: str) -> torch.Tensor | None:
            return w(name) if name in weights else None

        self.embed = w("model.embed_tokens.weight")  # [V, hidden]
        self.final_norm = w("model.norm.weight")  # [hidden]
        # A quantised head is the loader's (a tied model's embedding in blocks; lookups stay float).
        own_head = "lm_head.weight" in weights and (
            not c.tie_word_embeddings or isinstance(weights["lm_head.weight"], QuantWeight))
        lm_head = w("lm_head.weight") if own_head else self.embed
        self.lm_head = linear(lm_head)  # [V, hidden]
        self.layers: list[DecoderLayer] = []
        for i in range(c.num_layers):
            p = f"model.layers.{i}."
            qkv_w = concat_weights([w(p + f"self_attn.{n}_proj.weight") for n in "qkv"])
            qkv_b = None
            if c.qkv_bias:
                qkv_b = torch.cat([w(p + f"self_attn.{n}_proj.bias") for n in "qkv"])
            self.layers.append(DecoderLayer(
                input_norm=w(p + "input_layernorm.weight"),
                qkv=linear(qkv_w, qkv_b),
                o=linear(w(p + "self_attn.o_proj.weight"), maybe(p + "self_attn.o_proj.bias")),
                post_norm=w(p + "post_attention_layernorm.weight"),
                gate_up=linear(concat_weights([w(p + "mlp.gate_proj.weight"), w(p + "mlp.up_proj.weight")])),
                down=linear(w(p + "mlp.down_proj.weight")),
            ))
        move_to_huge_pages([self.lm_head] + [lin for layer in self.layers
                                             for lin in (layer.qkv, layer.o, layer.gate_up, layer.down)])
        # RoPE tables for every position the model can see: [max_pos, D] (computed in fp32, as HF).
        inv_freq = torch.tensor(c.rope_inv_freq, dtype=torch.float32)
        pos = torch.arange(c.max_position_embeddings, dtype=torch.float32)
        freqs = torch.cat([pos[:, None] * inv_freq[None, :]] * 2, dim=-1)  # [max_pos, D]
        self.rope_cos = (freqs.cos() * c.rope_attention_scaling).to(self.device, dtype).contiguous()
        self.rope_sin = (freqs.sin() * c.rope_attention_scaling).to(self.device, dtype).contiguous()
        self.ops = layer_ops_for(self.device, dtype)  # norms, RoPE + KV write, SiLU: fused on CPU
        self.scale = c.head_dim ** -0.5
        self.q_size = c.num_heads * c.head_dim
        if self.device.type == "cpu":
            load_kernel()  # compile the CPU kernels now, not inside the first request
        self.kernel_stack = _KernelStack.of(self)  # None where the layers run op by op

    def truncated(self, num_layers: int) -> "Model":
        """The first ``num_layers`` layers with the same embedding, final norm and LM head (shared
        tensors, no copy): the layer-skip draft."""
        draft = copy.copy(self)
        draft.layers = self.layers[:num_layers]
        draft.config = dataclasses.replace(self.config, num_layers=num_layers,
                                           name=f"{self.config.name}[:{num_layers}]")
        draft.kernel_stack = _KernelStack.of(draft)
        return draft

    @torch.inference_mode()
    def forward(self, batch: TokenBatch, layer_caches: Sequence[tuple[torch.Tensor, torch.Tensor]],
                block_size: int) -> torch.Tensor:
        """Hidden states [N, hidden] after the final norm; writes this step's K/V into the caches.

        layer_caches: per layer (k_cache, v_cache), each [num_blocks, block_size, KVH, D]
        (``layer_caches(allocate_kv_cache(...))``, made once per cache).
        """
        return self._forward(batch, layer_caches, block_size, ())[0]

    @torch.inference_mode()
    def forward_capturing(self, batch: TokenBatch, layer_caches: Sequence[tuple[torch.Tensor, torch.Tensor]],
                          block_size: int, layers: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        """``forward``, also keeping the residual stream that enters each of ``layers`` (ascending):
        (hidden [N, hidden], captured [N, len(layers) * hidden], layer by layer). That is the
        feature EAGLE-3 heads read (vLLM's ``aux_hidden_states``: layer i's input, i.e. Hugging
        Face's ``hidden_states[i]``); the same pass, just a copy of h at each of those layers.
        Index ``num_layers`` captures the residual stream leaving the last layer (before the final
        norm): what a draft head's trainer turns into the target's logits."""
        hidden, captured = self._forward(batch, layer_caches, block_size, layers)
        return hidden, torch.cat(captured, dim=-1)

    def _forward(self, batch: TokenBatch, layer_caches: Sequence[tuple[torch.Tensor, torch.Tensor]],
                 block_size: int, capture: tuple[int, ...]) -> tuple[torch.Tensor, list[torch.Tensor]]:
        if list(capture) != sorted(set(capture)) or not all(0 <= i <= len(self.layers) for i in capture):
            raise ValueError(f"capture layers must be ascending and in [0, {len(self.layers)}], got {capture}")
        c = self.config
        # On CPU a C++ kernel reads K/V in place through the block tables; tree-masked batches and
        # other devices use the torch reference, which gathers each sequence's K/V.
        kv_dtype = layer_caches[0][0].dtype if layer_caches else None
        use_kernel = cpu_kernel_supports(batch, self.dtype, self.device, kv_dtype, c.head_dim)
        plan = None if use_kernel else AttentionPlan.build(batch, block_size, c.num_heads // c.num_kv_heads,
                                                           c.sliding_window)
        ops, n, eps = self.ops, batch.num_tokens, c.rms_norm_eps
        # Each layer's input norm is fused with the residual add that ends the previous layer.
        norms = [layer.input_norm for layer in self.layers] + [self.final_norm]
        h = self.embed[batch.input_ids]  # [N, hidden], the residual stream (updated in place)
        x = ops.add_rms_norm_(h, None, norms[0], eps)  # [N, hidden]
        captured: list[torch.Tensor] = []  # per capture layer, h entering it [N, hidden]
        if use_kernel and self.kernel_stack is not None:  # the same kernels as the loop below, called from C++
            # Captures split the C++ call into runs of layers, e.g. capture (2, 15) on 30 layers:
            # layers [0, 2), copy h, [2, 15), copy h, [15, 30).
            done = 0
            for i in sorted({*capture, len(self.layers)}):
                if i > done:
                    x = self.kernel_stack(h, x, batch, layer_caches, done, i)
                    done = i
                if i in capture:
                    captured.append(h.clone())
            return x, captured
        for i, (layer, (k_cache, v_cache)) in enumerate(zip(self.layers, layer_caches, strict=True)):
            if i in capture:
                captured.append(h.clone())
            q = ops.rope_write_kv(layer.qkv(x), batch.positions, self.rope_cos, self.rope_sin, k_cache, v_cache,
                                  batch.slot_mapping, c.num_heads, c.num_kv_heads)  # [N, H, D]
            if use_kernel:
                attn = paged_attention_cpu(q, k_cache, v_cache, batch, self.scale, c.sliding_window)  # [N, H, D]
            else:
                attn = paged_attention(q, k_cache, v_cache, plan, self.scale)  # [N, H, D]
            x = ops.add_rms_norm_(h, layer.o(attn.view(n, self.q_size)), layer.post_norm, eps)
            x = ops.add_rms_norm_(h, layer.down(ops.silu_mul(layer.gate_up(x))), norms[i + 1], eps)
        if len(self.layers) in capture:
            captured.append(h.clone())
        return x, captured

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [R, hidden] -> logits [R, V] in fp32."""
        return self.lm_head(hidden).float()


@dataclass(frozen=True)
class _KernelStack:
    """The decoder layers as one C++ call (engine/model/csrc/decoder_layers.cpp): the kernels of
    ``Model.forward``'s loop in the same order, so the same bits, without its Python-level op
    calls (about ten per layer, each paying interpreter and dispatcher time). Only for models
    whose layer ops and projections all run the CPU kernels."""

    weights: list[torch.Tensor]  # per layer: qkv, o, gate_up, down (packed), post_norm, next_norm
    biases: list[torch.Tensor | None]  # per layer: qkv, o
    rope_cos: torch.Tensor  # [max_pos, D]
    rope_sin: torch.Tensor  # [max_pos, D]
    num_heads: int
    scale: float
    sliding_window: int  # 0: none
    eps: float

    @staticmethod
    def of(model: Model) -> _KernelStack | None:
        layers = model.layers
        if model.ops is not CpuKernelOps or not layers or not all(
                isinstance(lin, PackedLinear) for layer in layers for lin in (layer.qkv, layer.o, layer.gate_up, layer.down)):
            return None
        if any(lin.bias is not None for layer in layers for lin in (layer.gate_up, layer.down)):
            return None  # the C++ loop has no MLP biases (no Llama-family checkpoint has them)
        next_norms = [layer.input_norm for layer in layers[1:]] + [model.final_norm]
        weights = [t for layer, next_norm in zip(layers, next_norms, strict=True)
                   for t in (layer.qkv.packed, layer.o.packed, layer.gate_up.packed, layer.down.packed,
                             layer.post_norm, next_norm)]
        c = model.config
        return _KernelStack(weights, [b for layer in layers for b in (layer.qkv.bias, layer.o.bias)],
                            model.rope_cos, model.rope_sin, c.num_heads, model.scale, c.sliding_window or 0,
                            c.rms_norm_eps)

    def __call__(self, h: torch.Tensor, x: torch.Tensor, batch: TokenBatch,
                 layer_caches: Sequence[tuple[torch.Tensor, torch.Tensor]], first: int = 0,
                 end: int | None = None) -> torch.Tensor:
        """h [N, hidden] residual stream (updated in place), x [N, hidden] the normed input of layer
        ``first`` -> the input of layer ``end`` normed by its input norm (end = all layers: the
        final-normed hidden states [N, hidden])."""
        end = len(layer_caches) if end is None else end
        return torch.ops.specplan_ops.decoder_layers(
            h, x, self.weights[6 * first:6 * end], self.biases[2 * first:2 * end],
            [t for kv in layer_caches[first:end] for t in kv],
            batch.positions, batch.slot_mapping, self.rope_cos, self.rope_sin,
            batch.query_start_loc, batch.seq_lens, batch.block_tables, batch.tree_bits,
            self.num_heads, self.scale, self.sliding_window, self.eps)
