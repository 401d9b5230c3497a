"""The packed CPU matmul kernel (engine/csrc/packed_linear.cpp) against F.linear."""

from __future__ import annotations

import os
import shutil

import pytest
import torch
import torch.nn.functional as F

from specplan.engine.model.huge_pages import HUGE_PAGE
from specplan.engine.model.linear import (Linear, PackedLinear, make_linear, move_to_huge_pages, pack_weight,
                                   packed_available)


@pytest.fixture(scope="module", autouse=True)
def kernels():
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        pytest.skip("no C++ compiler on PATH: the engine uses F.linear")
    assert packed_available(torch.device("cpu"), torch.float32), "a compiler is available but the kernels failed to build"


def test_pack_layout_worked_example():
    # The worked example of packed_linear.cpp with 32-column panels: N=40 -> 2 panels, the second padded.
    w = torch.arange(40 * 3, dtype=torch.float32).view(40, 3)
    p = pack_weight(w)
    assert p.shape == (2, 3, 32)
    assert torch.equal(p[0, :, 5], w[5]) and torch.equal(p[1, :, 7], w[39])
    assert torch.all(p[1, :, 8:] == 0)


@pytest.mark.parametrize("m", [1, 2, 3, 7, 8, 9, 16, 17, 33, 130])
@pytest.mark.parametrize("n,k", [(32, 16), (40, 24), (576, 64), (97, 5)])
def test_matches_f_linear(m, n, k):
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    w = torch.randn(n, k, generator=g)
    x = torch.randn(m, k, generator=g)
    expected = F.linear(x.double(), w.double()).float()
    assert torch.allclose(PackedLinear(w)(x), expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("m", [9, 13, 17, 70, 130])  # 1, 2, 2, 6 and 12 row blocks with AVX-512 (MR = 12)
@pytest.mark.parametrize("n,k", [(97, 100), (576, 576)])
def test_rows_agree_bit_for_bit_with_one_row_at_a_time(m, n, k):
    # Several row blocks go through K in chunks (groups of rows, accumulators parked between
    # chunks); one row makes a single pass. The sum over k runs in the same order either way.
    g = torch.Generator().manual_seed(m + n + k)
    linear = PackedLinear(torch.randn(n, k, generator=g))
    x = torch.randn(m, k, generator=g)
    assert torch.equal(linear(x), torch.cat([linear(x[i:i + 1]) for i in range(m)]))


def test_empty_inner_dimension_gives_the_bias():
    w, b = torch.randn(40, 0), torch.randn(40)
    for m in (3, 12):
        x = torch.randn(m, 0)
        assert torch.equal(PackedLinear(w, b)(x), F.linear(x, w, b))
        assert torch.equal(PackedLinear(w)(x), torch.zeros(m, 40))


def test_bias_and_leading_dims():
    g = torch.Generator().manual_seed(1)
    w, b = torch.randn(50, 20, generator=g), torch.randn(50, generator=g)
    x = torch.randn(2, 3, 20, generator=g)  # any leading shape, like F.linear
    out = PackedLinear(w, b)(x)
    assert out.shape == (2, 3, 50)
    assert torch.allclose(out, F.linear(x, w, b), atol=1e-5)


def test_move_to_huge_pages_keeps_every_product():
    g = torch.Generator().manual_seed(7)
    shapes = [(40, 24, True), (576, 64, False), (97, 5, True)]  # (N, K, bias)
    linears = [PackedLinear(torch.randn(n, k, generator=g), torch.randn(n, generator=g) if b else None)
               for n, k, b in shapes]
    x = [torch.randn(5, k, generator=g) for _, k, _ in shapes]
    before = [lin(xi) for lin, xi in zip(linears, x)]
    unpacked = Linear(torch.randn(8, 24, generator=g))  # not packed: left alone
    move_to_huge_pages(linears + [unpacked])
    # One buffer, the first weight on a 2 MB boundary, every weight on its own cache lines.
    base = linears[0].packed.untyped_storage().data_ptr()
    assert linears[0].packed.data_ptr() % HUGE_PAGE == 0
    ends = []
    for lin in linears:
        assert lin.packed.untyped_storage().data_ptr() == base and lin.packed.data_ptr() % 64 == 0
        ends.append((lin.packed.data_ptr(), lin.packed.data_ptr() + lin.packed.numel() * 4))
    assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(ends, ends[1:]))
    for lin, xi, y in zip(linears, x, before):
        assert torch.equal(lin(xi), y)
    assert unpacked.weight.shape == (8, 24)


def test_non_contiguous_input_and_empty_batch():
    w = torch.randn(64, 48)
    x = torch.randn(48, 10).t()  # [10, 48], not contiguous
    assert torch.allclose(PackedLinear(w)(x), F.linear(x, w), atol=1e-5)
    assert PackedLinear(w)(torch.empty(0, 48)).shape == (0, 64)


def test_large_product_uses_threads_and_stays_exact():
    # Big enough to be split between threads: every panel must be written exactly once.
    w = torch.randn(4096 + 17, 256)
    x = torch.randn(5, 256)
    assert torch.allclose(PackedLinear(w)(x), F.linear(x, w), atol=1e-3, rtol=1e-4)


def test_shape_mismatch_is_a_clear_error():
    with pytest.raises(RuntimeError, match="columns"):
        PackedLinear(torch.randn(32, 16))(torch.randn(2, 15))


def test_make_linear_falls_back_to_torch():
    w = torch.randn(8, 4, dtype=torch.float64)
    lin = make_linear(w, packed=False)
    assert type(lin) is Linear
    # x W^T with x all ones is each row's sum; torch's float64 product may add in another order than
    # sum() (it does on an AVX-512 Xeon), so the last bits may differ.
    torch.testing.assert_close(lin(torch.ones(1, 4, dtype=torch.float64)), w.sum(1)[None], rtol=1e-12, atol=1e-12)


def test_weight_prefetch_hint_follows_the_cpu_vendor(monkeypatch):
    """Non-temporal weight prefetches on AMD (measured faster there), T0 elsewhere (NTA measured
    2.5x slower on an Intel Xeon); the hint is in the build's name, so each is cached apart, and
    SPECPLAN_WEIGHT_PREFETCH overrides it."""
    from specplan.engine.model import cpu_kernels

    monkeypatch.delenv("SPECPLAN_WEIGHT_PREFETCH", raising=False)
    monkeypatch.delenv("SPECPLAN_CPU_ISA", raising=False)
    flags = "fpu avx2 fma f16c avx512f avx512vl avx512bw avx512_vnni"
    for vendor, hint, name in (("AuthenticAMD", "_MM_HINT_NTA", "specplan_cpu_kernels_nta_avx512vnni"),
                               ("GenuineIntel", "_MM_HINT_T0", "specplan_cpu_kernels_avx512vnni")):
        monkeypatch.setattr(cpu_kernels, "_cpuinfo", lambda field, v=vendor: v if field == "vendor_id" else flags)
        built, cflags = cpu_kernels.build_config()
        assert built == name and f"-DSPECPLAN_WEIGHT_HINT={hint}" in cflags
    monkeypatch.setenv("SPECPLAN_WEIGHT_PREFETCH", "nta")
    assert cpu_kernels.build_config()[0] == "specplan_cpu_kernels_nta_avx512vnni"
    monkeypatch.setenv("SPECPLAN_WEIGHT_PREFETCH", "t2")  # into L2, and 8 KB ahead: a build of its own
    monkeypatch.setenv("SPECPLAN_WEIGHT_PREFETCH_BYTES", "8192")
    built, cflags = cpu_kernels.build_config()
    assert built == "specplan_cpu_kernels_pf8192_t2_avx512vnni"
    assert {"-DSPECPLAN_WEIGHT_HINT=_MM_HINT_T2", "-DSPECPLAN_PREFETCH_BYTES=8192"} <= set(cflags)
    monkeypatch.setenv("SPECPLAN_WEIGHT_PREFETCH_BYTES", "100")
    with pytest.raises(ValueError, match="whole number of 64-byte lines"):
        cpu_kernels.build_config()
    monkeypatch.delenv("SPECPLAN_WEIGHT_PREFETCH_BYTES")
    monkeypatch.setenv("SPECPLAN_WEIGHT_PREFETCH", "l2")
    with pytest.raises(ValueError, match="SPECPLAN_WEIGHT_PREFETCH must be one of t0, nta, t1, t2"):
        cpu_kernels.build_config()


_FALLBACK_CHECK = """
import torch, torch.nn.functional as F
from specplan.engine.model import cpu_kernels
from specplan.engine.model.layer_ops import CpuKernelOps, TorchLayerOps
from specplan.engine.model.linear import PackedLinear
assert cpu_kernels.build_config()[0].endswith("{isa}") and cpu_kernels.load()
w, x = torch.randn(97, 40), torch.randn(11, 40)
assert torch.allclose(PackedLinear(w)(x), F.linear(x, w), atol=1e-4)
g = torch.randn(3, 2 * 37) * 8
assert torch.allclose(CpuKernelOps.silu_mul(g), TorchLayerOps.silu_mul(g), atol=1e-5)
from specplan.engine.model.linear import QuantLinear
from specplan.engine.model.quant import QuantWeight, reference_linear
for fmt in ("q8_0", "q4_0", "q4_1"):
    qw, xq = QuantWeight.quantize(torch.randn(37, 64), fmt), torch.randn(11, 64)
    want = reference_linear(xq, qw)
    assert torch.allclose(QuantLinear(qw)(xq), want, atol=1e-5 * want.abs().max().item(), rtol=1e-5), fmt
# a float16 KV cache: written by rope_write_kv (F16C, or c10::Half without it), read by attention
# (widened as loaded), against the same math in torch; one request verifying 3 tokens at 40 keys
H, KVH, D, T, L = 4, 2, 64, 3, 40
qkv = torch.randn(L, (H + 2 * KVH) * D)
ang = torch.rand(64, D // 2) * 6
cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)
table = torch.tensor([[2, 0, 1]], dtype=torch.int32)  # position j lives in block table[j // 16], slot j % 16
pos = torch.arange(L)
slots = table[0].long()[pos // 16] * 16 + pos % 16
caches = [torch.zeros(3, 16, KVH, D, dtype=dt) for dt in (torch.float16, torch.float16, torch.float32, torch.float32)]
q = CpuKernelOps.rope_write_kv(qkv, pos, cos, sin, caches[0], caches[1], slots, H, KVH)
TorchLayerOps.rope_write_kv(qkv, pos, cos, sin, caches[2], caches[3], slots, H, KVH)
assert torch.equal(caches[1].float(), caches[3].half().float())  # values: the same rounding
assert torch.allclose(caches[0].float(), caches[2], atol=2e-3, rtol=2e-3)
k16, v16 = caches[0], caches[1]
flat = lambda c: c.reshape(-1, KVH, D)  # row 16 b + o: block b, offset o
args = (torch.tensor([0, T], dtype=torch.int32), torch.tensor([L], dtype=torch.int32), table, pos[L - T:])
out = torch.ops.specplan_attn.paged_attention_cpu(q[L - T:].contiguous(), k16, v16, *args, D ** -0.5, 0, None)
wide = torch.ops.specplan_attn.paged_attention_cpu(q[L - T:].contiguous(), k16.float(), v16.float(), *args, D ** -0.5, 0, None)
assert torch.equal(out, wide)
k, v = flat(k16.float())[slots], flat(v16.float())[slots]  # [L, KVH, D] in position order
for i in range(T):
    p = L - T + i
    for h in range(H):
        w = torch.softmax(k[:p + 1, h // 2] @ q[p, h] * D ** -0.5, 0)
        assert torch.allclose(out[i, h], w @ v[:p + 1, h // 2], atol=1e-5)
print("ok")
"""


@pytest.mark.slow
@pytest.mark.parametrize("isa", ["generic", "avx2", "avx512"])  # avx2, avx512: the fallbacks of an AVX-512 VNNI CPU (native here if not)
def test_narrower_isa_builds_agree(isa, tmp_path):
    """The kernels built for a CPU without AVX-512/AVX2 (forced with SPECPLAN_CPU_ISA) compute the
    same products; built in a subprocess, since one process can load only one build of the ops."""
    import subprocess
    import sys

    env = dict(os.environ, SPECPLAN_CPU_ISA=isa, SPECPLAN_CACHE=str(tmp_path))
    out = subprocess.run([sys.executable, "-c", _FALLBACK_CHECK.format(isa=isa)], env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-2000:]


def test_kernel_not_slower_than_torch_at_verify_rows():
    """The packed kernel exists to beat F.linear at decode/verify row counts; a build that falls far
    behind it (as the AVX2 build once did, 23x at M = 8, from a vector wider than the registers)
    should fail here rather than in a benchmark. Loose bound (3x), fastest of many calls each, so a
    busy CI machine does not trip it; on a quiet machine the kernel reads 0.6-0.9x torch."""
    import time

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        w = torch.randn(1536, 576)  # SmolLM2-135M's gate/up shape, [N, K]
        x = torch.randn(8, 576)  # [M, K]: a verify step's rows
        kernel, reference = PackedLinear(w), lambda t: F.linear(t, w)

        def fastest_ms(fn) -> float:
            fn(x)
            best = float("inf")
            for _ in range(30):
                t0 = time.perf_counter()
                fn(x)
                best = min(best, time.perf_counter() - t0)
            return best * 1e3

        kernel_ms, torch_ms = fastest_ms(kernel), fastest_ms(reference)
    finally:
        torch.set_num_threads(threads)
    assert kernel_ms <= 3 * torch_ms, f"packed kernel {kernel_ms:.3f} ms vs F.linear {torch_ms:.3f} ms at M=8"
