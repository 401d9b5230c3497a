"""Weight-only quantised projections in GGUF's block formats Q8_0, Q4_0 and Q4_1.

A weight [N, K] is cut along K into blocks of 32; each (row, block) keeps small integers and an
fp16 scale (and, for Q4_1, an fp16 min):

    Q8_0  w = d * q         q int8           8.5 bits per weight
    Q4_0  w = d * (q - 8)   q 0..15          4.5 bits per weight
    Q4_1  w = d * q + m     q 0..15          5 bits per weight

``QuantWeight`` holds them unpacked (one integer per weight, in memory only while loading): read
from a GGUF file as stored (``from_gguf_blocks``) or quantised from a float weight at load
(``quantize``, llama.cpp's reference rounding). ``pack`` lays them out for the C++ kernel
(engine/model/csrc/quant_linear.cpp), which engine/model/linear.py's QuantLinear calls;
``reference_linear`` is the same product in torch, op for op in float64, for the tests: x is
quantised per block of 32 to int8 as the kernel does (``quantize_rows``), each block's dot product
is an exact integer sum, and only the scales are float.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


BLOCK = 32  # weights per block along K
PANEL_COLUMNS = 16  # output columns per packed panel (NC in quant_linear.cpp)
FORMATS = ("q8_0", "q4_0", "q4_1")
# GGUF bytes per block: fp16 d (+ fp16 m), then the quants (Q4: two per byte).
GGUF_BLOCK_BYTES = {"q8_0": 2 + 32, "q4_0": 2 + 16, "q4_1": 4 + 16}
# Packed bytes per (panel of 16 columns, block): 16 d (+ 16 m) fp16, then 16 x 32 quants.
PACKED_BLOCK_BYTES = {"q8_0": 32 + 512, "q4_0": 32 + 256, "q4_1": 64 + 256}
BITS_PER_WEIGHT = {fmt: 8 * nbytes / BLOCK for fmt, nbytes in GGUF_BLOCK_BYTES.items()}  # 8.5, 4.5, 5.0
# ``--quantize`` names: the projections' format and the LM head's (kept at 8 bits, as llama.cpp's
# Q4 files keep their output and token embedding wider).
SCHEMES = {"int8": ("q8_0", "q8_0"), "q4": ("q4_1", "q8_0")}


@dataclass(frozen=True, eq=False)
class QuantWeight:
    """A weight [N, K] in blocks of 32 along K, unpacked."""

    fmt: str  # "q8_0" | "q4_0" | "q4_1"
    d: torch.Tensor  # [N, KB] float16 scales
    q: torch.Tensor  # [N, KB, 32] int8 (q8_0: -128..127; q4_*: 0..15)
    m: torch.Tensor | None = None  # [N, KB] float16 mins (q4_1 only)

    @property
    def shape(self) -> tuple[int, int]:
        return self.q.shape[0], self.q.shape[1] * BLOCK

    def dequantize(self) -> torch.Tensor:
        """[N, K] float32."""
        d = self.d.float()[..., None]  # [N, KB, 1]
        q = self.q.float()  # [N, KB, 32]
        if self.fmt == "q8_0":
            w = d * q
        elif self.fmt == "q4_0":
            w = d * (q - 8)
        else:
            w = d * q + self.m.float()[..., None]
        return w.reshape(self.shape)

    def rows(self, index: torch.Tensor) -> QuantWeight:
        """The rows ``index`` (a permutation or a selection) of the weight."""
        m = None if self.m is None else self.m[index]
        return QuantWeight(self.fmt, self.d[index], self.q[index], m)

    # --- from a GGUF file, as stored ---------------------------------------------------------

    @staticmethod
    def from_gguf_blocks(fmt: str, raw: np.ndarray | torch.Tensor) -> QuantWeight:
        """raw [N, KB * block bytes] uint8, one GGUF row per output feature (``GGUFFile.raw`` of a
        quantised 2-D tensor, engine/model/gguf_file.py)."""
        nbytes = GGUF_BLOCK_BYTES[fmt]
        raw = torch.from_numpy(np.array(raw, dtype=np.uint8))  # a copy: the file is mapped read-only
        n = raw.shape[0]
        blocks = raw.view(n, -1, nbytes)  # [N, KB, bytes]
        d = blocks[..., 0:2].contiguous().view(torch.float16)[..., 0]  # [N, KB]
        if fmt == "q8_0":
            return QuantWeight(fmt, d, blocks[..., 2:].contiguous().view(torch.int8))
        m = blocks[..., 2:4].contiguous().view(torch.float16)[..., 0] if fmt == "q4_1" else None
        qs = blocks[..., nbytes - 16:]  # [N, KB, 16]: element j in the low nibble, j + 16 in the high
        q = torch.cat([qs & 0x0F, qs >> 4], dim=-1).to(torch.int8)  # [N, KB, 32]
        return QuantWeight(fmt, d, q, m)

    # --- quantised at load from a float weight -----------------------------------------------

    @staticmethod
    def quantize(weight: torch.Tensor, fmt: str) -> QuantWeight:
        """weight [N, K] (K a multiple of 32) -> blocks, rounding as llama.cpp's reference
        quantisers (quantize_row_q8_0_ref, _q4_0_ref, _q4_1_ref) do."""
        if fmt not in FORMATS:
            raise ValueError(f"unknown quantisation format {fmt!r}; one of {', '.join(FORMATS)}")
        n, k = weight.shape
        if k % BLOCK:
            raise ValueError(f"cannot quantise a weight with {k} input features: not a multiple of {BLOCK}")
        x = weight.detach().float().reshape(n, k // BLOCK, BLOCK)  # [N, KB, 32]
        if fmt == "q8_0":
            d = x.abs().amax(-1) / 127  # [N, KB]
            inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
            q = _round_away(x * inv[..., None]).clamp(-128, 127)
            return QuantWeight(fmt, d.half(), q.to(torch.int8))
        if fmt == "q4_0":
            # The value of largest magnitude, with its sign, maps to -8 (so +max gets 7 steps, -max 8).
            at = x.abs().argmax(-1, keepdim=True)
            d = x.gather(-1, at)[..., 0] / -8
            inv = torch.where(d != 0, 1 / d, torch.zeros_like(d))
            q = torch.trunc(x * inv[..., None] + 8.5).clamp(0, 15)
            return QuantWeight(fmt, d.half(), q.to(torch.int8))
        lo, hi = x.amin(-1), x.amax(-1)  # [N, KB]
        d = (hi - lo) / 15
        inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
        q = torch.trunc((x - lo[..., None]) * inv[..., None] + 0.5).clamp(0, 15)
        return QuantWeight(fmt, d.half(), q.to(torch.int8), lo.half())

    # --- the kernel's layout -----------------------------------------------------------------

    def pack(self) -> torch.Tensor:
        """-> [P, KB, bytes per block] uint8, quant_linear.cpp's layout: panel p holds columns
        16p..16p+15 (zero past N); per block their fp16 d (and m), then 8 groups of 4 k with column
        c's four values at bytes 4c..4c+3 (Q4: groups 2i and 2i+1 share 64 bytes, low and high
        nibble)."""
        n, kb = self.q.shape[0], self.q.shape[1]
        panels = -(-n // PANEL_COLUMNS)
        pad = panels * PANEL_COLUMNS - n

        def by_panel(t: torch.Tensor) -> torch.Tensor:  # [N, KB, ...] -> [P, KB, 16, ...], zero padded
            t = torch.cat([t, t.new_zeros((pad, *t.shape[1:]))]) if pad else t
            return t.view(panels, PANEL_COLUMNS, kb, *t.shape[2:]).transpose(1, 2)

        group = 4 * PANEL_COLUMNS  # bytes of one group of 4 k over the panel's columns
        scales = [by_panel(self.d).contiguous().view(torch.uint8)]  # [P, KB, 32]
        if self.fmt == "q4_1":
            scales.append(by_panel(self.m).contiguous().view(torch.uint8))
        q = by_panel(self.q.view(n, kb, 8, 4))  # [P, KB, 16 columns, 8 groups, 4]
        q = q.transpose(2, 3).reshape(panels, kb, 8, group)  # [P, KB, group, column * 4 + j]
        if self.fmt == "q8_0":
            quants = q.contiguous().view(torch.uint8).view(panels, kb, 8 * group)
        else:
            q = q.to(torch.uint8).view(panels, kb, 4, 2, group)  # groups (2i, 2i + 1)
            quants = (q[:, :, :, 0] | (q[:, :, :, 1] << 4)).reshape(panels, kb, 4 * group)
        return torch.cat([*scales, quants], dim=-1).contiguous()


def _round_away(x: torch.Tensor) -> torch.Tensor:
    """C's roundf: halves away from zero (torch.round rounds them to even)."""
    return torch.sign(x) * torch.floor(x.abs() + 0.5)


def cat_rows(weights: list[QuantWeight]) -> QuantWeight:
    """Stack weights along N (fused QKV, gate + up). Mixed formats are requantised to Q8_0 (the
    widest), which a GGUF mixing widths inside one fused projection needs."""
    if len({w.fmt for w in weights}) > 1:
        weights = [QuantWeight.quantize(w.dequantize(), "q8_0") for w in weights]
    m = None if weights[0].m is None else torch.cat([w.m for w in weights])
    return QuantWeight(weights[0].fmt, torch.cat([w.d for w in weights]), torch.cat([w.q for w in weights]), m)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] float32 -> (q [M, KB, 32] int8-valued float64, dx [M, KB] float32): x = dx * q
    per block, dx = max|x| / 127, q rounded half to even -- the kernel's own arithmetic in float32."""
    m, k = x.shape
    xb = x.float().reshape(m, k // BLOCK, BLOCK)  # [M, KB, 32]
    dx = xb.abs().amax(-1) / 127  # [M, KB]
    inv = torch.where(dx != 0, 1 / dx, torch.zeros_like(dx))
    return torch.round(xb * inv[..., None]).double(), dx


def reference_linear(x: torch.Tensor, weight: QuantWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] float32 -> y [M, N] float32: quant_linear.cpp's product, in float64 from its
    exact integer block sums."""
    qx, dx = quantize_rows(x)  # [M, KB, 32], [M, KB]
    dx = dx.double()
    isum = torch.einsum("mbk,nbk->mnb", qx, weight.q.double())  # [M, N, KB], exact integers
    d = weight.d.double()[None]  # [1, N, KB]
    if weight.fmt == "q8_0":
        y = (d * isum * dx[:, None]).sum(-1)
    else:
        sx = dx * qx.sum(-1)  # [M, KB]: dx * sum(q)
        if weight.fmt == "q4_0":
            y = (d * (isum * dx[:, None] - 8 * sx[:, None])).sum(-1)
        else:
            y = (d * isum * dx[:, None] + weight.m.double()[None] * sx[:, None]).sum(-1)
    y = y.float()
    return y if bias is None else y + bias
