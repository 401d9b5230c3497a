"""The quantised kernels' weight prefetch, measured: builds with other hints (t0, nta, t1, t2) and
distances ahead (bytes) against the baseline build (engine/model/cpu_kernels.py ``weight_prefetch``),
SD off on the GGUF (Q4_1) engine, with a null control (the baseline against itself).

Each arm runs in its own process (one process loads one build of the kernels), built with
SPECPLAN_WEIGHT_PREFETCH=<hint> and SPECPLAN_WEIGHT_PREFETCH_BYTES=<bytes>; every round runs the
arms in a rotated order, and each arm times closed cells of GSM8K prompts at B = 1, 4, 16 and 32
(greedy, SD off). Ratios are paired within a round, so a slow minute of the shared VM moves both
sides. An arm is ``hint`` or ``hint:bytes``; the first is the baseline:

    python scripts/weight_prefetch_ab.py --arms t0,nta --rounds 8 --out reports/weight-prefetch-zen4-s37
    python scripts/weight_prefetch_ab.py --arms nta:4096,t2:8192 --batch-sizes 1,4 --rounds 8 --out DIR
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
CONTROL = "control"  # the null control's name: the baseline's build again

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


def run_arm(arm: str, cells: tuple) -> dict:
    """Time ``cells`` in a fresh process built as ``arm`` says ("hint" or "hint:bytes")."""
    hint, _, ahead = arm.partition(":")
    env = dict(os.environ, SPECPLAN_WEIGHT_PREFETCH=hint)
    env.pop("SPECPLAN_WEIGHT_PREFETCH_BYTES", None)
    if ahead:
        env["SPECPLAN_WEIGHT_PREFETCH_BYTES"] = ahead
    done = subprocess.run([sys.executable, "-c", _CHILD, json.dumps(cells)], env=env, capture_output=True,
                          text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"arm {arm} failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arms", default="t0,nta", help="hint[:bytes], comma-separated; the first is the baseline")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--batch-sizes", default="1,4,16,32", help="cells to run, of " + ",".join(str(c[0]) for c in CELLS))
    ap.add_argument("--out", type=Path, required=True, help="directory for ab.json and ab.png")
    args = ap.parse_args()
    wanted = {int(b) for b in args.batch_sizes.split(",")}
    cells = tuple(c for c in CELLS if c[0] in wanted)
    args.out.mkdir(parents=True, exist_ok=True)
    specs = args.arms.split(",")
    baseline = specs[0]
    builds = {arm: arm for arm in specs} | {CONTROL: baseline}  # arm -> the build it runs
    arms = list(builds)
    runs: dict[str, list[dict]] = {arm: [] for arm in arms}
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    for r in range(args.rounds):
        order = arms[r % len(arms):] + arms[:r % len(arms)]
        for arm in order:
            runs[arm].append(run_arm(builds[arm], cells))
            print(f"round {r + 1} {arm}: " + ", ".join(f"B={b} {runs[arm][-1][str(b)]['goodput']:.1f} tok/s"
                                                       for b, _, _ in cells), flush=True)
    summary = {}
    for batch, _, _ in cells:
        b = str(batch)
        row = {}
        for arm in arms[1:]:
            ratios = [x[b]["goodput"] / t[b]["goodput"] for t, x in zip(runs[baseline], runs[arm])]
            forward = [x[b]["forward_ms"] / t[b]["forward_ms"] for t, x in zip(runs[baseline], runs[arm])]
            row[arm] = {"paired_goodput_vs_baseline": statistics.median(ratios), "ratios": ratios,
                        "forward_vs_baseline": statistics.median(forward)}
        row["baseline_goodput"] = statistics.median(x[b]["goodput"] for x in runs[baseline])
        summary[b] = row
        print(f"B={batch}: " + "; ".join(f"{arm} {row[arm]['paired_goodput_vs_baseline']:.3f}x {baseline} (forward "
                                         f"{row[arm]['forward_vs_baseline']:.3f}x)" for arm in arms[1:]))
    measured = f"{started} - {time.strftime('%H:%M UTC', time.gmtime())}"
    (args.out / "ab.json").write_text(json.dumps({"measured": measured, "cells": cells, "baseline": baseline, "builds":
                                                  {arm: runs[arm][0]["build"] for arm in arms},
                                                  "summary": summary, "runs": runs}, indent=1))
    fig, ax = plt.subplots(figsize=(6, 3.5))
    xs = range(len(cells))
    width = 0.8 / (len(arms) - 1)
    for i, arm in enumerate(arms[1:]):
        ax.bar([x - 0.4 + width * (i + 0.5) for x in xs],
               [summary[str(b)][arm]["paired_goodput_vs_baseline"] for b, _, _ in cells], width=width, label=arm)
    ax.axhline(1.0, color="black", lw=0.8)
    ax.set_xticks(list(xs), [f"B={b}" for b, _, _ in cells])
    ax.set_ylabel(f"tok/s vs {baseline} (paired median)")
    ax.set_ylim(0.9, 1.15)
    ax.legend()
    ax.set_title(f"Q4_1 engine, SD off: weight prefetch against {baseline}")
    fig.tight_layout()
    fig.savefig(args.out / "ab.png", dpi=120)
    print(f"wrote {args.out / 'ab.json'} and ab.png")


if __name__ == "__main__":
    main()
