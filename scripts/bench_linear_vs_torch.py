"""The engine's packed fp32 linear (C++ kernels) against torch's, side by side, at decode and
verify row counts: [M, 576] x [576, 1536] (SmolLM2-135M's gate/up shape), one thread, the third
best of 20 calls each. On an AVX2-only VM (2026-11-25) the kernel read 1.36 / 10.9 / 43.4 ms at
M = 1 / 8 / 32 against torch's 0.13 / 0.44 / 1.10 ms while it used 64-byte vectors (two AVX2
registers, which GCC spilled through the stack); with register-width vectors (vec_math.h's RegF)
0.107 / 0.259 / 0.940 ms against 0.122 / 0.450 / 1.067 ms.

    python scripts/bench_linear_vs_torch.py [M ...]
"""

from __future__ import annotations

import sys
import time

import torch

from specplan.engine.model import cpu_kernels
from specplan.engine.model.linear import make_linear


def third_best_ms(fn, x: torch.Tensor, calls: int = 20) -> float:
    fn(x)
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn(x)
        times.append(time.perf_counter() - t0)
    return sorted(times)[2] * 1e3


def main() -> None:
    torch.set_num_threads(1)
    rows = [int(m) for m in sys.argv[1:]] or [1, 8, 32]
    if not cpu_kernels.load():
        sys.exit("the C++ CPU kernels are not available here (no compiler, or SPECPLAN_CPU_KERNELS=0)")
    print(f"kernels: {cpu_kernels.build_config()[0]}")
    weight = torch.randn(1536, 576)  # [N, K]
    kernel, reference = make_linear(weight, packed=True), make_linear(weight, packed=False)
    for m in rows:
        x = torch.randn(m, 576)  # [M, K]
        k_ms, t_ms = third_best_ms(kernel, x), third_best_ms(reference, x)
        print(f"M={m:>3}: kernel {k_ms:7.3f} ms, torch {t_ms:7.3f} ms, kernel/torch {k_ms / t_ms:5.1f}x")


if __name__ == "__main__":
    main()
