"""The KV cache's element type, measured: float32 against float16 (engine/model_runner.py
``kv_cache_dtype``) on the GGUF (Q4_1) engine, SD off, with a null control (float32 again).

All three engines live in one process (the kernels are the same build; on the Zen 4 VM a
process's read bandwidth is 24, 35 or 61 GB/s by the process, reports/quant-zen4-s37, so arms in
separate processes would compare processes). Each round runs the arms in a rotated order over:

* steps: ``StepTimer`` decode steps (T = 1) at B and context (the profiler's measurement);
* cells: closed cells of a workload's prompts at concurrency B (``specplan evaluate``'s cells,
  greedy, SD off), goodput = output tokens / wall seconds, prefill included.

Ratios are paired within a round (float32 over float16 seconds; float16 over float32 tok/s):

    python scripts/kv_cache_ab.py --rounds 5 --out reports/kv-cache-zen4-s38
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import matplotlib
import torch

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from specplan.bench.evaluate import _engine, cell_prompts, run_cell  # noqa: E402
from specplan.engine import FixedDecider, load_model  # noqa: E402
from specplan.profiler.machine import describe, machine_info  # noqa: E402
from specplan.profiler.step_timer import StepTimer, timing_engine  # noqa: E402

ARMS = {"float32": torch.float32, "float16": torch.float16, "control:float32": torch.float32}
STEPS = ((1, 128), (1, 512), (1, 1024), (4, 512), (16, 512), (32, 128), (32, 512))  # (B, context)
CELLS = (("gsm8k", 1, 4, 128), ("xsum", 1, 4, 128), ("gsm8k", 32, 32, 64), ("xsum", 32, 32, 64))  # (workload, B, requests, tokens)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", type=Path, required=True, help="directory for ab.json, ab.png and README.md")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    loaded = load_model(quantize="gguf")
    timers = {arm: StepTimer(timing_engine(loaded, 32, 2, 1100, kv_dtype=d)) for arm, d in ARMS.items()}
    engines = {arm: _engine(loaded, "ngram", 32, 1, kv_dtype=d) for arm, d in ARMS.items()}
    prompts = {(w, b): cell_prompts(loaded.tokenizer, w, b, n) for w, b, n, _ in CELLS}
    for engine in engines.values():  # warm-up
        run_cell(engine, prompts[CELLS[0][:2]][:2], FixedDecider(0), 16, concurrency=2)
    arms = list(ARMS)
    steps = {arm: {f"B={b} ctx={c}": [] for b, c in STEPS} for arm in arms}
    cells = {arm: {f"{w} B={b}": [] for w, b, _, _ in CELLS} for arm in arms}
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    for r in range(args.rounds):
        order = arms[r % len(arms):] + arms[:r % len(arms)]
        for b, c in STEPS:
            for arm in order:
                timer = timers[arm]
                timer.fill(b, c)
                steps[arm][f"B={b} ctx={c}"].append(timer.time_steps(1, repeats=20 if b == 1 else 8).median)
                timer.clear()
        for w, b, n, tokens in CELLS:
            for arm in order:
                cell = run_cell(engines[arm], prompts[(w, b)], FixedDecider(0), tokens, concurrency=b)
                cells[arm][f"{w} B={b}"].append(cell["goodput"])
        print(f"round {r + 1}/{args.rounds} done", flush=True)

    def paired(table, key, arm, faster):  # faster: seconds (fp32 / arm) or tok/s (arm / fp32)
        pairs = zip(table["float32"][key], table[arm][key])
        return statistics.median((a / x) if faster == "seconds" else (x / a) for a, x in pairs)

    summary = {"steps": {k: {"float32_ms": 1e3 * statistics.median(steps["float32"][k]),
                             "float16_ms": 1e3 * statistics.median(steps["float16"][k]),
                             "speedup": paired(steps, k, "float16", "seconds"),
                             "null": paired(steps, k, "control:float32", "seconds")} for k in steps["float32"]},
               "cells": {k: {"float32_tok_s": statistics.median(cells["float32"][k]),
                             "float16_tok_s": statistics.median(cells["float16"][k]),
                             "speedup": paired(cells, k, "float16", "tok/s"),
                             "null": paired(cells, k, "control:float32", "tok/s")} for k in cells["float32"]}}
    measured = f"{started} - {time.strftime('%H:%M UTC', time.gmtime())}"
    (args.out / "ab.json").write_text(json.dumps({"measured": measured, "machine": machine_info(), "rounds": args.rounds,
                                                  "summary": summary, "steps": steps, "cells": cells}, indent=1))
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
    for ax, (part, rows) in zip(axes, summary.items()):
        keys = list(rows)
        xs = range(len(keys))
        ax.bar([x - 0.18 for x in xs], [rows[k]["speedup"] for k in keys], width=0.36, label="float16 cache")
        ax.bar([x + 0.18 for x in xs], [rows[k]["null"] for k in keys], width=0.36, label="null control (float32)")
        ax.axhline(1.0, color="black", lw=0.8)
        ax.set_xticks(list(xs), keys, rotation=30, ha="right", fontsize=8)
        ax.set_ylabel("x float32 cache (paired)")
        ax.set_title("decode steps" if part == "steps" else "closed cells, SD off")
        ax.set_ylim(0.8, max(1.3, max(rows[k]["speedup"] for k in keys) + 0.05))
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(args.out / "ab.png", dpi=120)
    lines = [f"# The KV cache in float16 against float32 (Q4_1 engine, SD off)", "",
             f"`python scripts/kv_cache_ab.py --rounds {args.rounds} --out {args.out}`, measured {measured}. "
             f"{describe(machine_info())}", "", "![kv cache](ab.png)", "",
             "| decode step | float32 ms | float16 ms | float16 speed-up (paired) | null control |", "|---|---:|---:|---:|---:|"]
    lines += [f"| {k} | {v['float32_ms']:.2f} | {v['float16_ms']:.2f} | {v['speedup']:.3f}x | {v['null']:.3f}x |"
              for k, v in summary["steps"].items()]
    lines += ["", "| closed cell | float32 tok/s | float16 tok/s | float16 speed-up (paired) | null control |",
              "|---|---:|---:|---:|---:|"]
    lines += [f"| {k} | {v['float32_tok_s']:.1f} | {v['float16_tok_s']:.1f} | {v['speedup']:.3f}x | {v['null']:.3f}x |"
              for k, v in summary["cells"].items()]
    (args.out / "README.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
