"""The decoder step's threads kept as one team (engine/model/csrc/team.h) against forking them per
kernel, measured step by step: the two arms alternate on successive decode steps of the same
requests (SPECPLAN_DECODER_TEAM=1 / 0, read by decoder_layers at every call), so each pair of
adjacent steps meets the same minute of the machine; a step's ratio is fork / team (> 1: the team
is faster). The null control runs the team on both sides of the pair. Greedy, SD off, one
engine per batch size, requests of 256 prompt tokens decoding 300 tokens.

    python scripts/decoder_team_ab.py --batch-sizes 1,4,16,32 --rounds 4 --out reports/DIR/team-ab.json
    python scripts/decoder_team_ab.py --quantize none --batch-sizes 1 --out DIR/team-ab-fp32.json

Why step by step: on the 2-core VMs the same build's tokens/s moves by 10-25% between runs a
minute apart, which buries a few percent; adjacent steps share that minute.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

from specplan.engine import SamplingParams, load_model
from specplan.engine.model import cpu_kernels
from specplan.profiler.machine import machine_info
from specplan.profiler.step_timer import timing_engine

TOGGLE = "SPECPLAN_DECODER_TEAM"
PROMPT_TOKENS, OUTPUT_TOKENS = 256, 300


def paired_ratios(engine, batch: int, rounds: int, null: bool) -> list[float]:
    """fork / team time of adjacent decode steps (team first), over ``rounds`` closed batches."""
    ratios = []
    for r in range(rounds):
        for i in range(batch):
            prompt = list(range(100 + i, 100 + i + PROMPT_TOKENS))
            engine.add_request(f"{r}-{i}", prompt, SamplingParams(max_tokens=OUTPUT_TOKENS, temperature=0.0,
                                                                  ignore_eos=True))
        engine.step()  # the prompts
        team_s = None
        n = 0
        while engine.has_unfinished:
            team = n % 2 == 0
            os.environ[TOGGLE] = "1" if (team or null) else "0"
            t0 = time.perf_counter()
            engine.step()
            seconds = time.perf_counter() - t0
            if team:
                team_s = seconds
            elif team_s is not None:
                ratios.append(seconds / team_s)
            n += 1
        for i in range(batch):
            engine.pop_finished(f"{r}-{i}")
    os.environ[TOGGLE] = "1"
    return ratios


def summary(ratios: list[float]) -> dict:
    xs = sorted(ratios)
    return {"pairs": len(xs), "median": statistics.median(xs), "q25": xs[len(xs) // 4], "q75": xs[3 * len(xs) // 4],
            "share_team_faster": sum(x > 1 for x in xs) / len(xs)}


def plot(path: Path) -> Path:
    """The JSON's medians and quartiles per batch size, beside the null control's, as a PNG next to it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = json.loads(path.read_text())
    batches = list(data["cells"])
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for offset, arm in ((-0.18, "team vs fork"), (0.18, "null control")):
        cells = [data["cells"][b][arm] for b in batches]
        med = [c["median"] for c in cells]
        err = [[m - c["q25"] for m, c in zip(med, cells)], [c["q75"] - m for m, c in zip(med, cells)]]
        ax.bar([i + offset for i in range(len(batches))], med, width=0.36, yerr=err, capsize=3, label=arm)
    ax.axhline(1.0, color="black", lw=0.8)
    ax.set_xticks(range(len(batches)), [f"B={b}" for b in batches])
    ax.set_ylim(0.9, 1.1)
    ax.set_ylabel("fork / team step time (median, IQR)")
    ax.set_title(f"decoder team, {data['weights']} weights, adjacent steps paired")
    ax.legend()
    fig.tight_layout()
    out = path.with_suffix(".png")
    fig.savefig(out, dpi=120)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quantize", default="gguf", help="load_model's scheme (gguf: the embedded Q4_1 GGUF; none: fp32)")
    ap.add_argument("--batch-sizes", default="1,4,16,32")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--out", type=Path, required=True, help="JSON file (and a PNG beside it)")
    ap.add_argument("--replot", action="store_true", help="only draw the PNG of an existing --out")
    args = ap.parse_args()
    if args.replot:
        print(f"wrote {plot(args.out)}")
        return
    if not cpu_kernels.load():
        raise SystemExit("the C++ CPU kernels are not available here: there is no decoder team to measure")
    loaded = load_model(None, quantize=args.quantize)
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    cells = {}
    for batch in (int(b) for b in args.batch_sizes.split(",")):
        engine = timing_engine(loaded, max_batch=batch, max_tokens_per_seq=1, context=PROMPT_TOKENS + OUTPUT_TOKENS)
        cell = {}
        for arm, null in (("team vs fork", False), ("null control", True)):
            cell[arm] = summary(paired_ratios(engine, batch, args.rounds, null))
        cells[str(batch)] = cell
        print(f"B={batch}: fork / team {cell['team vs fork']['median']:.4f} (IQR {cell['team vs fork']['q25']:.3f}-"
              f"{cell['team vs fork']['q75']:.3f}, team faster in {cell['team vs fork']['share_team_faster']:.0%} of "
              f"{cell['team vs fork']['pairs']} pairs); null control {cell['null control']['median']:.4f} "
              f"({cell['null control']['share_team_faster']:.0%})", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"measured": f"{started} - {time.strftime('%H:%M UTC', time.gmtime())}",
                                    "machine": machine_info(), "kernels": cpu_kernels.build_id(),
                                    "weights": args.quantize, "cells": cells}, indent=1))
    print(f"wrote {args.out} and {plot(args.out)}")


if __name__ == "__main__":
    main()
