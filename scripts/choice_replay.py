"""The planner's choices at B = 1, priced without noise (specplan/bench/choice_replay.py says how).

Records each prompt's greedy output once with SD off on the engine (``--trace``: written if
missing, read if present), then replays every arm on those outputs: SD off and static k for each
of ``--static-ks``, the goodput planner cold, and the goodput planner starting from beliefs saved by
one that served ``--train-prompts`` other prompts of the workload (prompts the evaluation does not
use), as `specplan bench coldstart` runs them. Each step costs the profile's forward + verify time
plus ``--overhead-ms``; the planner's own time is not charged unless asked (``--charge-decider F``:
each step also pays the decider's calls, timed here, times F; in the engine the forward pass
between two steps evicts the planner's code and data, and the same calls cost ~2.3x what they
cost hot).

    python scripts/choice_replay.py --quantize gguf --profile reports/profile-xeon-q4_1-s23/profile.json \\
        --trace reports/choice-replay/outputs-q4_1.json --prompts 8 [--charge-decider 2.3] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from specplan.bench.choice_replay import ADAPTIVE, MAX_K, WARM, replay_workload
from specplan.profiler.profile import Profile

WORKLOADS = ("humaneval", "gsm8k", "mtbench", "xsum")


def record_outputs(quantize: str | None, workloads: list[str], prompts: int, train_prompts: int,
                   max_tokens: int) -> dict:
    """{workload: {"test": [[prompt, output], ...], "train": [...]}}: SD-off greedy outputs of the
    evaluation's first prompts (test) and of prompts it does not use (train)."""
    import torch

    from specplan.bench.coldstart import B1_KV_CACHE_MIB, _prompts
    from specplan.bench.evaluate import _engine, held_out_prompts, run_cell
    from specplan.engine import FixedDecider, load_model

    loaded = load_model(None, quantize=quantize)
    engine = _engine(loaded, "ngram", 1, MAX_K, kv_cache_mib=B1_KV_CACHE_MIB)
    out = {}
    with torch.inference_mode():
        for w in workloads:
            sets = {"test": _prompts(loaded, w, prompts), "train": held_out_prompts(loaded.tokenizer, w, train_prompts)}
            out[w] = {name: [[p, run_cell(engine, [p], FixedDecider(0), max_tokens, concurrency=1)["outputs"][0]]
                             for p in ps] for name, ps in sets.items()}
            print(f"recorded {w}: {len(sets['test'])} test and {len(sets['train'])} train prompts", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--profile", required=True)
    ap.add_argument("--quantize", default=None, help="as specplan evaluate's --quantize (gguf: the Q4_1 engine)")
    ap.add_argument("--trace", type=Path, required=True, help="the recorded outputs (JSON): written if missing")
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--prompts", type=int, default=8, help="test prompts per workload (the evaluation's first)")
    ap.add_argument("--train-prompts", type=int, default=8, help="prompts the saved beliefs are learned on")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--static-ks", default="1,2,3,4")
    ap.add_argument("--overhead-ms", type=float, default=0.3, help="per-step time outside forward + verify")
    ap.add_argument("--charge-decider", type=float, default=0.0,
                    help="charge each step its decider's own calls, timed, times this (0: not at all)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    workloads = [w for w in args.workloads.split(",") if w]
    if args.trace.exists():
        recorded = json.loads(args.trace.read_text())
    else:
        recorded = record_outputs(args.quantize, workloads, args.prompts, args.train_prompts, args.max_tokens)
        args.trace.write_text(json.dumps(recorded))
    profile = Profile.load(args.profile)
    report = {}
    for w in workloads:
        cell = replay_workload(profile, recorded[w]["test"], recorded[w]["train"],
                               static_ks=tuple(int(k) for k in args.static_ks.split(",") if k),
                               overhead_s=args.overhead_ms / 1e3, charge=args.charge_decider)
        report[w] = cell
        best_single = cell["best_single_static"]
        print(f"{w}: best single static {best_single}; x it: "
              + ", ".join(f"{a} {v:.3f}" for a, v in cell["over_best_single"].items())
              + "; x each request's best static: "
              + ", ".join(f"{a} {cell['over_best_per_request'][a]:.3f}" for a in (ADAPTIVE, WARM)),
              flush=True)
        for a in (ADAPTIVE, WARM):
            print(f"   {a} per request x {best_single}: "
                  + " ".join(f"{x:.3f}" for x in cell["per_request_over_best_single"][a]), flush=True)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "workloads": report}, indent=1))


if __name__ == "__main__":
    main()
