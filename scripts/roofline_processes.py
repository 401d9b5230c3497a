"""The Q4_1 engine's B = 1 decode step against its weight floor, read in several fresh processes.

Why processes: on the Zen 4 VM the read bandwidth a process measures is bimodal (35 or 61 GB/s,
huge pages granted either way; where its memory lands is the likely cause), and the step moves far
less than the bandwidth between the two. One process's reading of "step / floor" is then one draw
of two. Each process here runs ``specplan.bench.quant_bench.roofline_line`` (rounds of steps, each
weighed against the bandwidth measured beside it):

    python scripts/roofline_processes.py --processes 8 --out reports/quant-zen4-s37/roofline-processes.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

_CHILD = r"""
import json
from specplan.bench.quant_bench import roofline_line
from specplan.engine import load_model
from specplan.engine.model import cpu_kernels
r = roofline_line(load_model(quantize="gguf"), repeats=20)
r["build"] = cpu_kernels.build_config()[0]
print(json.dumps(r))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--processes", type=int, default=8)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    readings = []
    for i in range(args.processes):
        done = subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise RuntimeError(done.stderr[-2000:])
        r = json.loads(done.stdout.strip().splitlines()[-1])
        readings.append(r)
        print(f"process {i + 1}: step {r['step_ms']:.2f} ms, {r['bandwidth_gb_s']:.1f} GB/s, "
              f"{r['step_over_floor_4.5']:.2f}x the 4.5-bit floor, {r['step_over_floor_packed']:.2f}x the packed bytes'",
              flush=True)
    ratios = [r["step_over_floor_4.5"] for r in readings]
    summary = {"measured": f"{started} - {time.strftime('%H:%M UTC', time.gmtime())}", "build": readings[0]["build"],
               "median_step_over_floor_4.5": statistics.median(ratios),
               "median_step_over_floor_packed": statistics.median(r["step_over_floor_packed"] for r in readings),
               "median_step_ms": statistics.median(r["step_ms"] for r in readings), "readings": readings}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(summary, indent=1))
    print(f"median over {len(readings)} processes: {summary['median_step_over_floor_4.5']:.2f}x the 4.5-bit floor, "
          f"{summary['median_step_over_floor_packed']:.2f}x the packed bytes' (min {min(ratios):.2f}x); wrote {args.out}")


if __name__ == "__main__":
    main()
