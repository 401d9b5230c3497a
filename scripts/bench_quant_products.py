"""A decode step's quantized products alone, against the machine's bandwidth: the default model's
30 layers of products as the engine fuses them (qkv, o, gate_up, down; random weights of their
shapes; the LM head left out) in a block format, each called once at M rows, weights streamed
from memory (the set is far larger than the caches), torch's threads as the engine runs them.

    python scripts/bench_quant_products.py [--fmt q4_1|q4_0|q8_0] [--rows 1,8,32] [--reps 40]

Prints per M the median pass (ms), the bytes it streamed per second, and the median of each
pass's time over a plain read of as many bytes timed just before it (torch's sum over a buffer of
the same size, also far larger than the caches): a ratio that holds where milliseconds do not (a
shared VM's bandwidth moves by 2x between minutes). To compare two kernel builds, run it from
both checkouts one after the other, a few times each.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from specplan.engine.model import cpu_kernels
from specplan.engine.model.quant import QuantWeight

# SmolLM2-135M: hidden 576, 9 query and 3 KV heads of 64, MLP 1536; [N, K] per product of one
# layer, as engine/model/transformer.py fuses them: qkv, o, gate_up, down.
LAYER_SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))
NUM_LAYERS = 30


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--fmt", default="q4_1", choices=("q4_1", "q4_0", "q8_0"))
    ap.add_argument("--rows", default="1,8,32", help="M values, comma-separated")
    ap.add_argument("--reps", type=int, default=40)
    args = ap.parse_args()
    if not cpu_kernels.load():
        raise SystemExit("the C++ CPU kernels are not available here (no compiler, or SPECPLAN_CPU_KERNELS=0)")
    torch.manual_seed(0)
    op = torch.ops.specplan_linear.quant_linear
    weights = [(QuantWeight.quantize(torch.randn(n, k), args.fmt).pack(), n, k)
               for _ in range(NUM_LAYERS) for n, k in LAYER_SHAPES]
    nbytes = sum(p.numel() * p.element_size() for p, _, _ in weights)
    plain = torch.ones(nbytes // 4)  # [nbytes / 4] fp32: the plain read's buffer
    print(f"kernels {cpu_kernels.build_config()[0]}, {torch.get_num_threads()} threads, {args.fmt}: "
          f"{nbytes / 1e6:.1f} MB a pass")
    for m in (int(r) for r in args.rows.split(",")):
        xs = {k: torch.randn(m, k) for k in {k for _, k in LAYER_SHAPES}}
        for p, n, k in weights:  # warm-up pass
            op(xs[k], p, n, None)
        times, ratios = [], []
        for _ in range(args.reps):
            t0 = time.perf_counter()
            plain.sum()
            t1 = time.perf_counter()
            for p, n, k in weights:
                op(xs[k], p, n, None)
            t2 = time.perf_counter()
            times.append(t2 - t1)
            ratios.append((t2 - t1) / (t1 - t0))
        median, ratio = statistics.median(times), statistics.median(ratios)
        print(f"M={m:3d}: median {median * 1e3:6.2f} ms, {nbytes / median / 1e9:5.1f} GB/s;  "
              f"{ratio:.2f}x a plain read of as many bytes (median of per-pass ratios)")


if __name__ == "__main__":
    main()
