"""Why a closed batch of equal-length requests flatters SD off: where each arm's cell spends its time.

With every request ``--max-tokens`` long, SD off runs a closed cell of R requests at concurrency B
in lockstep: B requests start together, their prompts prefill in one step, they finish together,
and the next B start. Speculation moves requests apart (each emits 1 to k + 1 tokens a step), so
prompts prefill one at a time beside the others' decodes, and the cell ends in a drain of steps
with fewer than B requests, each costing most of a full step for fewer tokens. Serving traffic
has requests of different lengths, and SD off drains there too.

For each arm (SD off, static k, the goodput planner) and each length mode (every request equal;
``--length-spread S``: each drawn once from max_tokens +- S, the same in every arm, as
``specplan evaluate --length-spread``), this runs the cell and splits its steps by how many
requests decoded and whether a prompt ran, and prints each arm's tokens/s against SD off's in the
same round (arms rotated each round; tokens identical in every arm; ``control:off`` is SD off run
again, the null control):

    python scripts/lockstep_drain.py --quantize gguf --profile reports/profile-zen4-q4_1-s34/profile.json \\
        --batch 4 --workloads gsm8k,mtbench --requests 16 --rounds 4 [--length-spread 32] [--out FILE.json]
    python scripts/lockstep_drain.py ... --mixed --batch 16 --requests 64 --max-tokens 128 --length-spread 64
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
from pathlib import Path

from specplan.bench.coldstart import mixed_prompts
from specplan.bench.evaluate import _engine, add_cell_arguments, cell_prompts, output_lengths, rotated_rounds, run_cell
from specplan.engine import FixedDecider, load_model
from specplan.planner.from_profile import planner_from_profile
from specplan.policies import make_policy
from specplan.profiler.profile import Profile


def run(engine, prompts: list[list[int]], lengths: list[int], decider, batch: int) -> dict:
    """One cell (``run_cell``): tokens/s, and seconds / steps / tokens by step kind: all ``batch``
    requests decoding ("full"), fewer ("drain"), or a prompt ran ("prompt")."""
    parts: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0, 0])  # kind -> [steps, s, tokens]

    def count(record) -> None:
        kind = "prompt" if record.num_prefill_tokens else ("full" if len(record.requests) == batch else "drain")
        part = parts[kind]
        part[0] += 1
        part[1] += record.total_s
        part[2] += sum(r.num_emitted for r in record.requests)

    out = run_cell(engine, prompts, decider, lengths, concurrency=batch, on_step=count)
    return {"tokens_per_s": out["goodput"], "wall_s": out["seconds"], "parts": dict(parts), "outputs": out["outputs"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_cell_arguments(ap, proposer="ngram", workloads="gsm8k,mtbench", rounds=4)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--length-spread", type=int, default=32, help="the spread mode's +- (0: only equal lengths)")
    ap.add_argument("--static-ks", default="1")
    ap.add_argument("--mixed", action="store_true",
                    help="one cell of every workload's prompts interleaved (specplan bench coldstart's mixed batch, "
                         "--requests of them at concurrency --batch) instead of one cell per workload")
    ap.add_argument("--out", default=None, help="write every round's numbers here (JSON) and a plot beside it (.png)")
    ap.add_argument("--replot", default=None, help="only redraw the plot of an --out JSON")
    args = ap.parse_args()
    if args.replot:
        plot(json.loads(Path(args.replot).read_text()), Path(args.replot).with_suffix(".png"))
        return
    profile = Profile.load(args.profile)
    loaded = load_model(None, quantize=args.quantize)
    engine = _engine(loaded, args.proposer, max(args.batch, 32), 8)
    static = [int(k) for k in args.static_ks.split(",") if k]
    arms = ["off", *(f"static:{k}" for k in static), "goodput", "control:off"]  # control: SD off again (the null control)
    modes = {"equal": 0, **({f"spread {args.length_spread}": args.length_spread} if args.length_spread else {})}
    results = {}
    for workload in ["mixed"] if args.mixed else args.workloads.split(","):
        prompts = (mixed_prompts(loaded, args.requests) if args.mixed
                   else cell_prompts(loaded.tokenizer, workload, args.batch, args.requests))
        for mode, spread in modes.items():
            lengths = output_lengths(args.max_tokens, spread, len(prompts))

            def one(arm: str) -> dict:
                decider = (FixedDecider(0) if arm.endswith("off") else FixedDecider(int(arm.split(":")[1])) if arm.startswith("static:")
                           else planner_from_profile(profile, make_policy("goodput"), proposer=args.proposer, max_k=8))
                return run(engine, prompts, lengths, decider, args.batch)

            runs = rotated_rounds(arms, args.rounds, one)
            reference = runs["off"][0]["outputs"]
            assert all(r["outputs"] == reference for rs in runs.values() for r in rs), "outputs differ between arms"
            print(f"{workload} B={args.batch}, {len(prompts)} requests, lengths {mode} "
                  f"({min(lengths)}-{max(lengths)} tokens): median over {args.rounds} rounds")
            cell = {}
            for arm, rs in runs.items():
                ratio = statistics.median(r["tokens_per_s"] / o["tokens_per_s"] for r, o in zip(rs, runs["off"]))
                shares = {key: statistics.median(r["parts"].get(key, [0, 0.0, 0])[1] / r["wall_s"] for r in rs)
                          for key in ("full", "drain", "prompt")}
                steps = {key: statistics.median(r["parts"].get(key, [0, 0.0, 0])[0] for r in rs)
                         for key in ("full", "drain", "prompt")}
                print(f"  {arm:10s} {ratio:.3f}x off | wall share: all {args.batch} decoding "
                      f"{shares['full']:.0%} ({steps['full']:.0f} steps), fewer (drain) {shares['drain']:.0%} "
                      f"({steps['drain']:.0f}), a prompt ran {shares['prompt']:.0%} ({steps['prompt']:.0f})")
                cell[arm] = {"vs_off": ratio, "wall_share": shares, "steps": steps,
                             "tokens_per_s": [r["tokens_per_s"] for r in rs]}
            results[f"{workload} {mode}"] = cell
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))
        plot(results, Path(args.out).with_suffix(".png"))


def plot(results: dict, path: Path) -> None:
    """One panel per workload: each arm's tokens/s against SD off's, equal lengths beside spread."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = sorted({key.split(" ", 1)[0] for key in results})
    fig, axes = plt.subplots(1, len(workloads), figsize=(4.5 * len(workloads), 3.6), sharey=True, squeeze=False)
    for ax, workload in zip(axes[0], workloads):
        modes = [key for key in results if key.split(" ", 1)[0] == workload]
        arms = [a for a in results[modes[0]] if a != "off"]
        width = 0.8 / len(modes)
        for m, key in enumerate(modes):
            values = [results[key][a]["vs_off"] for a in arms]
            ax.bar([i + m * width for i in range(len(arms))], values, width, label=key.split(" ", 1)[1])
        ax.axhline(1.0, color="black", lw=0.8)
        ax.axhline(0.98, color="grey", lw=0.8, ls="--")
        ax.set_xticks([i + width * (len(modes) - 1) / 2 for i in range(len(arms))], arms)
        ax.set_ylim(0.8, 1.1)
        ax.set_title(workload)
    axes[0][0].set_ylabel("tokens/s x SD off (median of rounds)")
    axes[0][-1].legend(title="output lengths")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
