"""Quantised projections (engine/model/quant.py, engine/model/csrc/quant_linear.cpp): the block
formats against gguf-py's (llama.cpp's reference in numpy), the packed layout, and the C++ kernel
against its torch reference for every format, row count and an odd N."""

from __future__ import annotations

import os
import shutil

import pytest
import torch
import torch.nn.functional as F

from specplan.engine.model.linear import make_linear, packed_available
from specplan.engine.model.linear import QuantLinear
from specplan.engine.model.quant import (BITS_PER_WEIGHT, FORMATS, QuantWeight, cat_rows,
                                         reference_linear)

GGML_TYPES = {"q8_0": "Q8_0", "q4_0": "Q4_0", "q4_1": "Q4_1"}


@pytest.fixture(scope="module")
def kernels():
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        pytest.skip("no C++ compiler on PATH: quantised weights run dequantised through F.linear")
    assert packed_available(torch.device("cpu"), torch.float32), "a compiler is available but the kernels failed to build"


def _weight(n: int, k: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, k, generator=g) * 0.1  # [N, K]


@pytest.mark.parametrize("fmt", FORMATS)
def test_quantize_matches_gguf_py_bit_for_bit(fmt):
    from gguf import GGMLQuantizationType, quants

    w = _weight(13, 96, 1)
    qtype = GGMLQuantizationType[GGML_TYPES[fmt]]
    raw = quants.quantize(w.numpy(), qtype)  # [13, 3 * block bytes] uint8, llama.cpp's reference
    ours = QuantWeight.quantize(w, fmt)
    theirs = QuantWeight.from_gguf_blocks(fmt, raw)
    assert torch.equal(ours.d, theirs.d) and torch.equal(ours.q, theirs.q)
    assert (ours.m is None) == (fmt != "q4_1") and (ours.m is None or torch.equal(ours.m, theirs.m))
    assert torch.equal(theirs.dequantize(), torch.from_numpy(quants.dequantize(raw, qtype)))
    # The error is what the format allows: half a step of the scale (a whole one at Q4_0's
    # clamped end, +max's opposite), plus the scale's fp16 rounding (q is computed with the fp32
    # scale) times |q| <= 128.
    step = ours.d.float().abs().repeat_interleave(32, dim=1)  # [N, K]
    steps = (1.0 if fmt == "q4_0" else 0.5) + 128 * 2**-11
    assert torch.all((ours.dequantize() - w).abs() <= steps * step + 1e-4)
    assert BITS_PER_WEIGHT[fmt] == {"q8_0": 8.5, "q4_0": 4.5, "q4_1": 5.0}[fmt]


def test_pack_layout_worked_example():
    # quant_linear.cpp's example: Q4_1, column 2, k = 13 of block 0 -> byte 137 of the block, high nibble.
    q = torch.zeros(19, 2, 32, dtype=torch.int8)
    q[2, 0, 13] = 9
    q[18, 1, 0] = 5  # column 18 = panel 1's column 2; block 1, k 0: group 0, low nibble of byte 64 + 8
    d = torch.arange(1, 39, dtype=torch.float16).view(19, 2)
    packed = QuantWeight("q4_1", d, q, m=-d).pack()
    assert packed.shape == (2, 2, 320)  # 19 columns -> 2 panels of 16 (13 padded), 2 blocks
    quants = packed[..., 64:]  # [P, KB, 256]
    assert quants[0, 0, 137 - 64] == 9 << 4 and quants[1, 1, 8] == 5
    assert quants.count_nonzero() == 2
    assert torch.equal(packed[0, 1, :32].view(torch.float16), d[:16, 1])  # block 1's d, columns 0..15
    assert torch.equal(packed[1, 0, 32:38].view(torch.float16), -d[16:, 0])  # m of columns 16..18
    assert torch.all(packed[1, :, 6:32] == 0) and torch.all(packed[1, :, 38:64] == 0)  # padded columns


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("m", [1, 3, 8, 32, 100])
@pytest.mark.parametrize("n,k", [(37, 64), (8, 32), (203, 576)])
def test_kernel_matches_reference(kernels, fmt, m, n, k):
    w = QuantWeight.quantize(_weight(n, k, n + k), fmt)
    g = torch.Generator().manual_seed(m)
    x = torch.randn(m, k, generator=g)
    x[0, :32] = 0  # an all-zero block: scale 0, no division by it
    bias = torch.randn(n, generator=g)
    got = QuantLinear(w, bias)(x)
    want = reference_linear(x, w, bias)
    assert got.shape == (m, n)
    torch.testing.assert_close(got, want, atol=1e-5 * want.abs().max().item(), rtol=1e-5)


@pytest.mark.parametrize("fmt", FORMATS)
def test_rows_do_not_depend_on_the_batch(kernels, fmt):
    # Greedy speculation needs a verify step's rows to equal the decode step's bit for bit.
    w = QuantWeight.quantize(_weight(77, 256, 3), fmt)
    x = torch.randn(70, 256)
    lin = QuantLinear(w)
    full = lin(x)
    for lo, hi in [(0, 1), (5, 6), (3, 12), (40, 70)]:
        assert torch.equal(lin(x[lo:hi]), full[lo:hi])


@pytest.mark.parametrize("fmt,min_cosine", [("q8_0", 0.9999), ("q4_1", 0.995), ("q4_0", 0.99)])
def test_close_to_the_float_product(kernels, fmt, min_cosine):
    w = _weight(64, 576, 5)
    x = torch.randn(4, 576)
    got = QuantLinear(QuantWeight.quantize(w, fmt))(x)
    cos = F.cosine_similarity(got.flatten(), F.linear(x, w).flatten(), dim=0)
    assert cos > min_cosine


def test_threads_split_a_large_product(kernels):
    w = QuantWeight.quantize(_weight(4096 + 13, 256, 7), "q4_1")
    x = torch.randn(5, 256)
    want = reference_linear(x, w)
    torch.testing.assert_close(QuantLinear(w)(x), want, atol=1e-5 * want.abs().max().item(), rtol=1e-5)


def test_3d_input_and_shape_errors(kernels):
    w = QuantWeight.quantize(_weight(40, 64, 9), "q8_0")
    lin = QuantLinear(w)
    x = torch.randn(2, 3, 64)
    assert torch.equal(lin(x), lin(x.reshape(6, 64)).view(2, 3, 40))
    with pytest.raises(RuntimeError, match="columns"):
        lin(torch.randn(2, 96))
    with pytest.raises(ValueError, match="multiple of 32"):
        QuantWeight.quantize(torch.randn(4, 40), "q8_0")


def test_without_kernels_the_weight_is_dequantised():
    w = QuantWeight.quantize(_weight(16, 64, 11), "q4_0")
    lin = make_linear(w, packed=False)
    x = torch.randn(2, 64)
    torch.testing.assert_close(lin(x), F.linear(x, w.dequantize()))


def test_cat_rows_keeps_a_shared_format_and_widens_mixed_ones():
    a, b = (QuantWeight.quantize(_weight(8, 64, s), "q4_1") for s in (1, 2))
    both = cat_rows([a, b])
    assert both.fmt == "q4_1" and torch.equal(both.dequantize(), torch.cat([a.dequantize(), b.dequantize()]))
    c = QuantWeight.quantize(_weight(8, 64, 3), "q8_0")
    mixed = cat_rows([a, c])
    assert mixed.fmt == "q8_0" and mixed.shape == (16, 64)
    torch.testing.assert_close(mixed.dequantize(), torch.cat([a.dequantize(), c.dequantize()]), atol=2e-3, rtol=0)


def test_gguf_rows_permute_like_the_float_tensor():
    # The loader undoes llama.cpp's q/k row order on the blocks; rows() must commute with dequantize().
    w = QuantWeight.quantize(_weight(12, 64, 4), "q4_1")
    perm = torch.randperm(12)
    assert torch.equal(w.rows(perm).dequantize(), w.dequantize()[perm])
