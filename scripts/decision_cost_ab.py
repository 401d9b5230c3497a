"""What the planner's own decision time costs a closed-loop cell: the goodput policy with its
small searches in plain Python (the default) against the same policy with every search in numpy
(``policies/goodput.py _FEW_DRAFTS`` set to -1). Asked the same question, both answer the same,
to the last bit (tests/test_planner.py); in the engine their questions drift apart, since the
planner learns prices from measured step times, which the decision's own time is part of. So
the arms differ by the decision's time and by what it does to the timing they learn from. The
tokens are identical (lossless). The arms run in one process, alternated and rotated, on the
evaluation's cells (max(B, 4) requests of one workload, 64 tokens), SD off beside them.

    python scripts/decision_cost_ab.py --profile reports/evaluation-chain-xeon/profile.json \
        --proposer chain --batch 4 --workloads gsm8k,mtbench --rounds 3 [--out ab.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import specplan.policies.goodput as goodput_module
from specplan.bench.evaluate import _engine, add_cell_arguments, cell_prompts, rotated_rounds, run_cell
from specplan.engine import FixedDecider, load_model
from specplan.planner.from_profile import planner_from_profile
from specplan.policies import make_policy
from specplan.profiler.profile import Profile

MAX_TOKENS = 64
ARMS = ("off", "python", "numpy")


def run_arm(arm: str, engine, prompts: list[str], profile: Profile, proposer: str, batch: int) -> dict:
    few = goodput_module._FEW_DRAFTS
    if arm == "off":
        decider = FixedDecider(0)
    else:
        decider = planner_from_profile(profile, make_policy("goodput"), proposer=proposer, max_k=8)
        if arm == "numpy":
            goodput_module._FEW_DRAFTS = -1
    try:
        result = run_cell(engine, prompts, decider, MAX_TOKENS, concurrency=batch)
    finally:
        goodput_module._FEW_DRAFTS = few
    return {"goodput": result["goodput"], "decider_ms_per_step": result["decider_ms_per_step"],
            "outputs": result["outputs"]}


def main() -> None:
    ap = argparse.ArgumentParser()
    add_cell_arguments(ap)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    profile = Profile.load(args.profile)
    loaded = load_model(None, quantize=args.quantize)
    engine = _engine(loaded, args.proposer, args.batch, 8)
    report = {}
    for workload in args.workloads.split(","):
        prompts = cell_prompts(loaded.tokenizer, workload, args.batch, min_requests=args.requests)
        run_cell(engine, prompts, FixedDecider(1), MAX_TOKENS, concurrency=args.batch)  # warm-up
        runs = rotated_rounds(list(ARMS), args.rounds,
                              lambda arm: run_arm(arm, engine, prompts, profile, args.proposer, args.batch))
        same = all(x["outputs"] == runs["off"][0]["outputs"] for arm in ARMS for x in runs[arm])
        ratio = [p["goodput"] / q["goodput"] for p, q in zip(runs["python"], runs["numpy"])]
        line = {
            "python_over_numpy": ratio, "median": statistics.median(ratio),
            "python_over_off": statistics.median(p["goodput"] / o["goodput"] for p, o in zip(runs["python"], runs["off"])),
            "numpy_over_off": statistics.median(p["goodput"] / o["goodput"] for p, o in zip(runs["numpy"], runs["off"])),
            "decider_ms_per_step": {arm: statistics.median(x["decider_ms_per_step"] for x in runs[arm]) for arm in ARMS},
            "outputs_identical": same,
        }
        report[workload] = line
        print(f"{workload} B={args.batch}: python / numpy {line['median']:.3f} "
              f"(rounds {', '.join(f'{x:.3f}' for x in ratio)}); x off {line['python_over_off']:.3f} / "
              f"{line['numpy_over_off']:.3f}; decider ms a step "
              + ", ".join(f"{a} {v:.2f}" for a, v in line["decider_ms_per_step"].items())
              + f"; outputs identical: {same}", flush=True)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"batch": args.batch, "proposer": args.proposer, "rounds": args.rounds,
                                        "workloads": report}, indent=1))


if __name__ == "__main__":
    main()
