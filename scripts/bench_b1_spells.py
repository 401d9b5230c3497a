"""The two B=1 engine-speed targets of `specplan bench engine`, round by round beside the bandwidth.

This VM's read bandwidth moves between ~35 and ~75 GB/s within minutes. A B=1, T=1 step is bound by
it; a B=1, T=8 step much less (its 8-row products are close to compute-bound), so both of the
report's B=1 ratios depend on the minute they were measured in. Each round here reads the
bandwidth probe, then times B=1 steps at T=1 and at T=8 back to back in one engine (median of 5
each, whole engine steps as the report times them), and prints

    T=1 step / roofline floor (the step's bytes at the bandwidth just read)     target <= 1.2
    T=8 step / T=1 step                                                         target <= 1.4

A development benchmark: `.venv/bin/python scripts/bench_b1_spells.py [rounds]` from the repo root,
on a quiet machine."""
import statistics
import sys

import torch

from specplan.engine import load_model
from specplan.profiler.ceilings import BandwidthProbe
from specplan.profiler.cost_model import decode_step_cost
from specplan.profiler.step_timer import StepTimer, timing_engine

CONTEXT = 256


def main(rounds: int) -> None:
    loaded = load_model(None)
    probe = BandwidthProbe()
    timer = StepTimer(timing_engine(loaded, max_batch=1, max_tokens_per_seq=9, context=CONTEXT))
    timer.fill(1, CONTEXT)
    for t in (1, 8):
        timer.time_steps(t, repeats=1, warmup=1)
    print("round  GB/s  floor ms  T=1 ms  T=8 ms  T=1/floor  T=8/T=1")
    vs_floor, widths = [], []
    for r in range(rounds):
        bandwidth = probe.read()
        t1 = statistics.median(timer.time_steps(1, repeats=5, warmup=0).total_seconds)
        t8 = statistics.median(timer.time_steps(8, repeats=5, warmup=0).total_seconds)
        floor = decode_step_cost(loaded.config, 1, 1, CONTEXT).bytes / bandwidth
        vs_floor.append(t1 / floor)
        widths.append(t8 / t1)
        print(f"{r:5d}  {bandwidth / 1e9:4.1f}  {1e3 * floor:8.1f}  {1e3 * t1:6.2f}  {1e3 * t8:6.2f}"
              f"  {t1 / floor:9.3f}  {t8 / t1:7.3f}", flush=True)
    print(f"median  T=1/floor {statistics.median(vs_floor):.3f}  T=8/T=1 {statistics.median(widths):.3f}")


if __name__ == "__main__":
    with torch.inference_mode():
        main(int(sys.argv[1]) if len(sys.argv) > 1 else 8)
