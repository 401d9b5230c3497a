"""Matrix products for the model's projections, with the fastest kernel each device has.

Decode steps multiply a few rows (M = tokens in the step, 1..~64) by large weights, so they are
memory-bound: what matters is streaming the weight once at full bandwidth. On x86 CPUs, MKL's
packed GEMM (the weight reordered once into MKL's blocked layout; what torch.compile emits for
frozen linears on CPU) does that best for small M (DESIGN.md §7); elsewhere plain ``F.linear``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class Linear:
    """y = x W^T (+ b), W in nn.Linear's [out, in] layout."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        self.weight = weight  # [out, in]
        self.bias = bias  # [out] or None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class MklPackedLinear(Linear):
    """The same product through MKL's packed SGEMM (fp32, CPU).

    ``_mkl_linear``'s last argument must equal the input's row count, or MKL silently takes a
    slow path. The dense weight is kept: the op needs it (and it is the tied embedding's storage).
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, pack_batch_size: int = 1):
        super().__init__(weight, bias)
        self.packed = torch.ops.mkl._mkl_reorder_linear_weight(weight, pack_batch_size)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkl._mkl_linear(x, self.packed, self.weight, self.bias, x.shape[0])


def mkl_packing_available(device: torch.device, dtype: torch.dtype) -> bool:
    return (device.type == "cpu" and dtype == torch.float32 and torch.backends.mkl.is_available()
            and hasattr(torch.ops.mkl, "_mkl_reorder_linear_weight"))


def make_linear(weight: torch.Tensor, bias: torch.Tensor | None = None, packed: bool = False) -> Linear:
    return MklPackedLinear(weight.contiguous(), bias) if packed else Linear(weight, bias)
