"""Matrix products for the model's projections, with the fastest kernel each device has.

Decode and verify steps multiply a few rows (M = tokens in the step, 1..~64) by every weight of
the model, so they are bound by streaming the weights from memory once. On CPU in float32 the
engine's own kernel (engine/model/csrc/packed_linear.cpp) does that at close to full bandwidth and is
faster than MKL's SGEMM at every M measured (``specplan bench engine``); elsewhere (CUDA,
other dtypes, no compiler) plain ``F.linear``. Weights in GGUF's Q8_0 / Q4_0 / Q4_1 blocks
(engine/model/quant.py) run through engine/model/csrc/quant_linear.cpp (``QuantLinear``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import cpu_kernels
from .huge_pages import huge_page_zeros
from .quant import QuantWeight, cat_rows

PANEL = 32  # output columns per packed panel (NR in packed_linear.cpp)


class Linear:
    """y = x W^T (+ b), W in nn.Linear's [out, in] layout."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        self.weight = weight  # [out, in]
        self.bias = bias  # [out] or None
        self.out_features = weight.shape[0]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] -> [ceil(N / 32), K, 32]: panel p holds columns 32p..32p+31, k-major, zero padded."""
    n, k = weight.shape
    panels = -(-n // PANEL)
    padded = torch.zeros(panels * PANEL, k, dtype=weight.dtype, device=weight.device)
    padded[:n] = weight
    return padded.view(panels, PANEL, k).transpose(1, 2).contiguous()


class PackedLinear(Linear):
    """The same product through the engine's CPU kernel. Only the packed copy of the weight is
    kept (``weight`` is None): the dense one would double the model's memory for nothing."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        self.packed = pack_weight(weight)  # [P, K, 32]
        self.weight = None
        self.bias = None if bias is None else bias.contiguous()
        self.out_features = weight.shape[0]
        self._op = torch.ops.specplan_linear.packed_linear

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2 and x.is_contiguous():  # the model's [N, hidden] rows: no reshape round trip
            return self._op(x, self.packed, self.out_features, self.bias)
        lead = x.shape[:-1]
        y = self._op(x.reshape(-1, x.shape[-1]).contiguous(), self.packed, self.out_features, self.bias)
        return y.view(*lead, self.out_features)


class QuantLinear(PackedLinear):
    """y = x W^T (+ b) with W in Q8_0 / Q4_0 / Q4_1 blocks, through quant_linear.cpp. A
    PackedLinear with another ``packed`` (uint8 [P, KB, bytes per block]): the C++ layer loop
    (decoder_layers.cpp) and ``move_to_huge_pages`` take either."""

    def __init__(self, weight: QuantWeight, bias: torch.Tensor | None = None):
        self.fmt = weight.fmt
        self.packed = weight.pack()  # [P, KB, bytes per block] (engine/model/quant.py)
        self.weight = None
        self.bias = None if bias is None else bias.float().contiguous()
        self.out_features = weight.shape[0]
        self._op = torch.ops.specplan_linear.quant_linear


def move_to_huge_pages(linears: list[Linear]) -> None:
    """Put the packed weights of ``linears`` side by side in one buffer backed by 2 MB pages
    (engine/model/huge_pages.py), each weight starting on a cache line: fewer TLB misses while
    a step streams every weight, which pays most when few rows are multiplied
    (measured: reports/README.md#engine-measurements).
    """
    packed = [lin for lin in linears if isinstance(lin, PackedLinear)]
    if not packed:
        return
    sizes = [-(-lin.packed.numel() * lin.packed.element_size() // 64) * 64 for lin in packed]  # bytes, whole lines
    arena = huge_page_zeros((sum(sizes),), torch.uint8)
    start = 0
    for lin, size in zip(packed, sizes, strict=True):
        old = lin.packed
        lin.packed = arena[start:start + old.numel() * old.element_size()].view(old.dtype).view(old.shape)
        lin.packed.copy_(old)
        start += size


def packed_available(device: torch.device, dtype: torch.dtype) -> bool:
    return device.type == "cpu" and dtype == torch.float32 and cpu_kernels.load()


def make_linear(weight: torch.Tensor | QuantWeight, bias: torch.Tensor | None = None, packed: bool = False) -> Linear:
    """The engine's kernel for ``weight`` when ``packed`` (fp32: PackedLinear; Q8_0 / Q4_0 / Q4_1
    blocks: QuantLinear), else F.linear (a quantised weight dequantised)."""
    if isinstance(weight, QuantWeight):
        return QuantLinear(weight, bias) if packed else Linear(weight.dequantize(), bias)
    return PackedLinear(weight, bias) if packed else Linear(weight, bias)


def concat_weights(weights: list[torch.Tensor | QuantWeight]) -> torch.Tensor | QuantWeight:
    """Weights stacked along their output features (the fused QKV and gate + up projections)."""
    if any(isinstance(w, QuantWeight) for w in weights):
        return cat_rows([w if isinstance(w, QuantWeight) else QuantWeight.quantize(w, "q8_0") for w in weights])
    return torch.cat(weights)
