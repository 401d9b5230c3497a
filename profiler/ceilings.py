"""The machine's roofline ceilings, measured on the device the engine runs on.

Peak matmul FLOP/s (for the model's dtype, and for quantized weights the engine's kernels for
their block formats) and memory bandwidth, each the median of repeats;
their ratio is the ridge point, the arithmetic intensity (FLOP per byte) where a step stops
being limited by memory and starts being limited by compute.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Callable

import torch


@dataclass(frozen=True)
class Ceilings:
    peak_flops: float  # FLOP/s, dense matmul in the model's dtype (or its weights' block formats)
    bandwidth: float  # bytes/s, streaming read of a buffer far larger than the caches
    device: str
    dtype: str
    threads: int

    @property
    def ridge(self) -> float:
        """FLOP per byte where the roofline bends."""
        return self.peak_flops / self.bandwidth


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _median_seconds(fn, repeats: int, device: torch.device, warmup: bool = True) -> float:
    if warmup:
        fn()
        _sync(device)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure_peak_flops(device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                       n: int = 1536, repeats: int = 7, engine_kernels: bool = True,
                       weight_formats: tuple[str, ...] = ()) -> float:
    """Matmul FLOP/s: the fastest of torch's square n x n product and the engine's own projection
    kernels at 256 rows, each the median of repeats (``peak_candidates``). On CPU the engine's
    fp32 kernel beats MKL, and its kernels for quantized blocks (``weight_formats``: the model's
    Q8_0 / Q4_0 / Q4_1, engine/model/quant.py) beat both where the CPU multiplies int8 (VNNI):
    a ceiling below what the engine reaches would put the floor above steps it runs (a Q4_1
    profile on the Zen 4 VM timed B = 4 steps of 6 tokens at 0.57x an fp32-only floor).
    ``engine_kernels=False``: torch's alone (another engine's ceilings; the engine's kernels are
    then neither built nor loaded)."""
    device = torch.device(device)
    return max(flops / _median_seconds(fn, repeats, device)
               for _, flops, fn in peak_candidates(device, dtype, n, engine_kernels, weight_formats))


def peak_candidates(device: torch.device, dtype: torch.dtype, n: int = 1536, engine_kernels: bool = True,
                    weight_formats: tuple[str, ...] = ()) -> list[tuple[str, float, Callable[[], object]]]:
    """[(label, FLOPs of one call, the call)]: the products the peak is the fastest of."""
    from specplan.engine.model.linear import make_linear, packed_available
    from specplan.engine.model.quant import QuantWeight

    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    candidates = [("torch mm", 2.0 * n**3, lambda: torch.mm(a, b))]
    if not (engine_kernels and packed_available(device, dtype)):
        return candidates
    rows, k = 256, 1024
    x = torch.randn(rows, k, device=device, dtype=dtype)  # [rows, k]
    weight = torch.randn(n, k, device=device, dtype=dtype)  # [n, k]
    for fmt in ("float32", *sorted(set(weight_formats))):
        linear = make_linear(weight if fmt == "float32" else QuantWeight.quantize(weight, fmt), packed=True)
        candidates.append((f"engine {fmt}", 2.0 * rows * n * k, lambda linear=linear: linear(x)))
    return candidates


class BandwidthProbe:
    """Read bandwidth on demand: one pass over a buffer much larger than any cache, by the faster
    of a sum and, where the engine has its own projection kernel, that kernel streaming a weight
    of the same size for one row (what a decode step does to its weights; on CPU it can out-read
    torch's reduction, and a floor it beats would be no floor).

    Kept alive between readings so that a benchmark can read the bandwidth between the steps it
    times: on a shared VM it moves by 2x within minutes, and a floor from another minute than the
    step is no floor for it."""

    def __init__(self, device: torch.device | str = "cpu", megabytes: int = 512, engine_kernels: bool = True):
        from specplan.engine.model.huge_pages import huge_page_zeros
        from specplan.engine.model.linear import make_linear, move_to_huge_pages, packed_available

        self.device = torch.device(device)
        numel = megabytes * 1024**2 // 4
        # On the same 2 MB pages as the engine's weights and KV cache (they read faster there).
        self.buffer = (huge_page_zeros((numel,), torch.float32) if self.device.type == "cpu"
                       else torch.zeros(numel, device=self.device)).fill_(1.0)
        self.linear = self.row = None
        if engine_kernels and packed_available(self.device, torch.float32):
            k = 4096
            self.linear = make_linear(torch.empty(numel // k, k, device=self.device).normal_(), packed=True)
            move_to_huge_pages([self.linear])
            self.row = torch.randn(1, k, device=self.device)
        self.read()  # first touch and warm-up

    def read(self) -> float:
        """Bytes/s of one pass, the faster of the two ways."""
        nbytes = self.buffer.numel() * 4
        best = nbytes / _median_seconds(self.buffer.sum, 1, self.device, warmup=False)
        if self.linear is not None:
            best = max(best, nbytes / _median_seconds(lambda: self.linear(self.row), 1, self.device, warmup=False))
        return best


def measure_bandwidth(device: torch.device | str = "cpu", megabytes: int = 512, repeats: int = 7,
                      probe: BandwidthProbe | None = None) -> float:
    """Read bandwidth (a BandwidthProbe's, made here unless given), the median of repeats."""
    probe = probe or BandwidthProbe(device, megabytes)
    return statistics.median(probe.read() for _ in range(repeats))


def measure_ceilings(device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                     repeats: int = 7, probe: BandwidthProbe | None = None, engine_kernels: bool = True,
                     weight_formats: tuple[str, ...] = ()) -> Ceilings:
    """The ceilings of this device; ``engine_kernels=False``: as torch alone reaches them (another
    engine's profile: vLLM runs its own kernels, and building the engine's would cost a compile);
    ``weight_formats``: the quantized block formats the model's weights are in (LoadedModel
    ``weight_formats``), whose kernels count toward the peak."""
    device = torch.device(device)
    probe = probe or BandwidthProbe(device, engine_kernels=engine_kernels)
    return Ceilings(
        peak_flops=measure_peak_flops(device, dtype, repeats=repeats, engine_kernels=engine_kernels,
                                      weight_formats=weight_formats),
        bandwidth=measure_bandwidth(device, repeats=repeats, probe=probe),
        device=str(device), dtype=str(dtype).removeprefix("torch."), threads=torch.get_num_threads(),
    )
