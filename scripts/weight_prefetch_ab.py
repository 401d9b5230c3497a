"""The quantised kernels' weight prefetch hint, measured: T0 against NTA (engine/model/cpu_kernels.py
``weight_prefetch``), SD off on the GGUF (Q4_1) engine, with a null control (T0 against itself).

Each arm runs in its own process (one process loads one build of the kernels), built with
SPECPLAN_WEIGHT_PREFETCH=t0 or nta; every round runs the arms in a rotated order, and each arm
times closed cells of GSM8K prompts at B = 1, 4, 16 and 32 (greedy, SD off). Ratios are paired
within a round, so a slow minute of the shared VM moves both sides:

    python scripts/weight_prefetch_ab.py --rounds 8 --out reports/weight-prefetch-zen4-s37
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

# (batch size, requests, output tokens) of each cell.
CELLS = ((1, 4, 128), (4, 16, 64), (16, 32, 64), (32, 32, 64))
ARMS = {"t0": "t0", "nta": "nta", "control:t0": "t0"}  # arm -> hint; the control is T0 again

_CHILD = r"""
import json, statistics, sys
from specplan.bench.evaluate import _engine, cell_prompts, run_cell
from specplan.engine import FixedDecider, load_model
from specplan.engine.model import cpu_kernels
loaded = load_model(quantize="gguf")
out = {"build": cpu_kernels.build_config()[0]}
for batch, requests, tokens in json.loads(sys.argv[1]):
    engine = _engine(loaded, "ngram", batch, 1)
    prompts = cell_prompts(loaded.tokenizer, "gsm8k", batch, requests)
    run_cell(engine, prompts[:2], FixedDecider(0), 16, concurrency=batch)  # warm-up
    records = []
    cell = run_cell(engine, prompts, FixedDecider(0), tokens, concurrency=batch, on_step=records.append)
    decode = [r.forward_s for r in records if r.num_prefill_tokens == 0]
    out[str(batch)] = {"goodput": cell["goodput"], "forward_ms": 1000 * statistics.median(decode)}
print(json.dumps(out))
"""


def run_arm(hint: str, cells: tuple) -> dict:
    env = dict(os.environ, SPECPLAN_WEIGHT_PREFETCH=hint)
    done = subprocess.run([sys.executable, "-c", _CHILD, json.dumps(cells)], env=env, capture_output=True,
                          text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"arm {hint} failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--batch-sizes", default="1,4,16,32", help="cells to run, of " + ",".join(str(c[0]) for c in CELLS))
    ap.add_argument("--out", type=Path, required=True, help="directory for ab.json and ab.png")
    args = ap.parse_args()
    wanted = {int(b) for b in args.batch_sizes.split(",")}
    cells = tuple(c for c in CELLS if c[0] in wanted)
    args.out.mkdir(parents=True, exist_ok=True)
    arms = list(ARMS)
    runs: dict[str, list[dict]] = {arm: [] for arm in arms}
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    for r in range(args.rounds):
        order = arms[r % len(arms):] + arms[:r % len(arms)]
        for arm in order:
            runs[arm].append(run_arm(ARMS[arm], cells))
            print(f"round {r + 1} {arm}: " + ", ".join(f"B={b} {runs[arm][-1][str(b)]['goodput']:.1f} tok/s"
                                                       for b, _, _ in cells), flush=True)
    summary = {}
    for batch, _, _ in cells:
        b = str(batch)
        row = {}
        for arm in ("nta", "control:t0"):
            ratios = [x[b]["goodput"] / t[b]["goodput"] for t, x in zip(runs["t0"], runs[arm])]
            forward = [x[b]["forward_ms"] / t[b]["forward_ms"] for t, x in zip(runs["t0"], runs[arm])]
            row[arm] = {"paired_goodput_vs_t0": statistics.median(ratios), "ratios": ratios,
                        "forward_vs_t0": statistics.median(forward)}
        row["t0_goodput"] = statistics.median(x[b]["goodput"] for x in runs["t0"])
        summary[b] = row
        print(f"B={batch}: nta {row['nta']['paired_goodput_vs_t0']:.3f}x t0 (forward "
              f"{row['nta']['forward_vs_t0']:.3f}x), null control {row['control:t0']['paired_goodput_vs_t0']:.3f}x")
    measured = f"{started} - {time.strftime('%H:%M UTC', time.gmtime())}"
    (args.out / "ab.json").write_text(json.dumps({"measured": measured, "cells": cells, "builds":
                                                  {arm: runs[arm][0]["build"] for arm in arms},
                                                  "summary": summary, "runs": runs}, indent=1))
    fig, ax = plt.subplots(figsize=(6, 3.5))
    xs = range(len(cells))
    for offset, arm in ((-0.18, "nta"), (0.18, "control:t0")):
        ax.bar([x + offset for x in xs], [summary[str(b)][arm]["paired_goodput_vs_t0"] for b, _, _ in cells],
               width=0.36, label=arm)
    ax.axhline(1.0, color="black", lw=0.8)
    ax.set_xticks(list(xs), [f"B={b}" for b, _, _ in cells])
    ax.set_ylabel("tok/s vs T0 (paired median)")
    ax.set_ylim(0.9, 1.15)
    ax.legend()
    ax.set_title("Q4_1 engine, SD off: weight prefetch NTA vs T0")
    fig.tight_layout()
    fig.savefig(args.out / "ab.png", dpi=120)
    print(f"wrote {args.out / 'ab.json'} and ab.png")


if __name__ == "__main__":
    main()
