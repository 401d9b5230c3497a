"""The analytic step cost matches counts done by hand on a tiny config."""

from __future__ import annotations

import pytest

from specplan.engine import ModelConfig
from specplan.profiler.cost_model import decode_step_cost, layer_costs, step_cost, step_costs, weight_bytes

TINY = ModelConfig(architecture="llama", vocab_size=10, hidden_size=8, intermediate_size=16, num_layers=2,
                   num_heads=2, num_kv_heads=1, head_dim=4, rms_norm_eps=1e-6, max_position_embeddings=64,
                   tie_word_embeddings=True, qkv_bias=False, rope_inv_freq=(1.0, 0.1))


def test_layer_costs_by_hand():
    # Two sequences: 1 query token over 3 keys, 2 query tokens over 5 keys (N = 3 tokens).
    c = layer_costs(TINY, [1, 2], [3, 5], itemsize=1)
    # qkv: [3, 8] x [8, 8 + 2*4 = 16]
    assert (c["qkv_proj"].flops, c["qkv_proj"].weight_bytes, c["qkv_proj"].activation_bytes) == (768, 128, 72)
    # attention: 4 * heads(2) * head_dim(4) * (1*3 + 2*5) = 416; K,V read 2*4*(3+5) = 64, written 2*4*3 = 24
    assert (c["attention"].flops, c["attention"].kv_bytes) == (416, 88)
    assert (c["o_proj"].flops, c["o_proj"].weight_bytes) == (384, 64)
    assert (c["gate_up_proj"].flops, c["gate_up_proj"].weight_bytes) == (1536, 256)
    assert (c["down_proj"].flops, c["down_proj"].weight_bytes) == (768, 128)
    assert (c["norms"].flops, c["norms"].weight_bytes) == (192, 16)


def test_step_cost_by_hand():
    total = step_cost(TINY, [1, 2], [3, 5], itemsize=1)
    layer_flops = 768 + 416 + 384 + 1536 + 768 + 192
    lm_head = 2 * 2 * 8 * 10 + 4 * 2 * 8  # 2 logits rows, plus the final norm
    assert total.flops == 2 * layer_flops + lm_head
    # weights: 2 layers x 592, LM head 80 + final norm 8, and the 3 embedding rows read (3 x 8)
    assert total.weight_bytes == 2 * 592 + 80 + 8 + 24
    assert weight_bytes(TINY, itemsize=1) == 2 * 592 + 80 + 8
    assert set(step_costs(TINY, [1], [1])) >= {"qkv_proj", "attention", "lm_head", "embedding"}


def test_intensity_grows_with_tokens_per_step():
    one = decode_step_cost(TINY, 1, 1, 32)
    nine = decode_step_cost(TINY, 1, 9, 32)
    wide = decode_step_cost(TINY, 32, 9, 32)
    assert one.intensity < nine.intensity < wide.intensity
    assert one.bound(ridge=8.6) == "memory"
    assert one.roofline_seconds(1e9, 1e9) == pytest.approx(one.bytes / 1e9)


def test_weight_itemsize_prices_only_the_products_and_the_head():
    """Quantized products and LM head (weight_itemsize) beside float norms and activations (itemsize)."""
    c = layer_costs(TINY, [1, 2], [3, 5], itemsize=4, weight_itemsize=0.5)
    assert c["qkv_proj"].weight_bytes == 8 * 16 * 0.5 and c["qkv_proj"].activation_bytes == 72 * 4
    assert c["norms"].weight_bytes == 16 * 4  # norms stay float
    float_only = weight_bytes(TINY, itemsize=4)
    products = 2 * (8 * 16 + 8 * 8 + 3 * 8 * 16) + 10 * 8  # per layer x 2 layers, + the tied head
    assert weight_bytes(TINY, itemsize=4, weight_itemsize=0.5) == pytest.approx(float_only - products * 3.5)
    assert decode_step_cost(TINY, 1, 1, 4, weight_itemsize=0.5).weight_bytes < decode_step_cost(TINY, 1, 1, 4).weight_bytes


def test_a_float16_cache_halves_the_kv_bytes_only():
    full = decode_step_cost(TINY, 4, 3, 64)
    half = decode_step_cost(TINY, 4, 3, 64, kv_itemsize=2)
    assert half.kv_bytes == full.kv_bytes / 2 > 0
    assert (half.weight_bytes, half.activation_bytes, half.flops) == (full.weight_bytes, full.activation_bytes, full.flops)
