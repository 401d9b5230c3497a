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

With ``--noise-runs N`` every arm is replayed N times on a noisy machine (``StepNoise``: a level
that wanders with the priced clock, ``--level`` log sigma per ``--level-every-s``, and
``--jitter`` per step; run r is seed r, the same for every arm), and each arm's run-to-run spread
is reported: the standard deviation of log tok/s over the runs (and in the JSON also the bench's
(max - min) / median), raw and over SD off's in the same run. Static k spreads with the noise alone; a planner
whose choices follow its step-time readings spreads further by what its choices add.
``--draft-price P`` replays a machine whose drafts cost P x what the profile says (what the
planner's learned draft price is for); ``--significance S`` gives the replayed planners that
shrinkage of their learned draft price (planner/drift.py ``DraftSlopeConfig.significance``; 0:
the raw fit, as before 2026-11-29), ``--dearer-significance S`` where the fit prices drafts above
the profile (``DraftSlopeConfig.dearer_significance``). ``--rest-level`` and ``--rest-jitter`` put
noise on the time outside forward + verify too (what the planner's overhead and drafting-cost
learner reads: planner/timing.py), a level per request and a jitter per step; ``--no-learn-timing``
turns that learner off.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from pathlib import Path

from specplan.bench.choice_replay import ADAPTIVE, MAX_K, WARM, StepNoise, geo, replay_workload
from specplan.bench.coldstart import paired_spread, spread
from specplan.planner.drift import DraftSlopeConfig
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


def log_sd(xs: list[float]) -> float:
    """The standard deviation of log(x): a spread that does not widen with the number of runs."""
    return statistics.stdev(math.log(x) for x in xs)


def planner_options(args) -> dict:
    """PlannerConfig fields the replayed planners get: the learners' shrinkage, if asked for."""
    options: dict = {}
    slope = {k: v for k, v in (("significance", args.significance), ("dearer_significance", args.dearer_significance))
             if v is not None}
    if slope:
        options["draft_slope"] = DraftSlopeConfig(**slope)
    if not args.learn_timing:
        options["learn_timing"] = False
    return options


def noisy_spreads(profile: Profile, workload: str, sets: dict, args) -> dict:
    """Every arm replayed on ``args.noise_runs`` noisy machines: per arm its geo-mean tok/s over
    the test prompts in each run, their spread raw and over SD off's, and the planners' median
    ratio to the best single static k (picked on the median over runs)."""
    runs: dict[str, list[float]] = {}
    for seed in range(args.noise_runs):
        noise = StepNoise(jitter=args.jitter, level=args.level, level_every_s=args.level_every_s, seed=seed,
                          rest_level=args.rest_level, rest_jitter=args.rest_jitter)
        cell = replay_workload(profile, sets["test"], sets["train"],
                               static_ks=tuple(int(k) for k in args.static_ks.split(",") if k),
                               overhead_s=args.overhead_ms / 1e3, charge=args.charge_decider, noise=noise,
                               draft_price=args.draft_price, planner_options=planner_options(args))
        for arm, xs in cell["tok_s"].items():
            runs.setdefault(arm, []).append(geo(xs))
    statics = [a for a in runs if a.startswith("static:")]
    best = max(statics, key=lambda a: statistics.median(runs[a]))
    off = runs["static:0"]
    out = {"best_single_static": best, "tok_s": runs,
           "spread": {a: spread(xs) for a, xs in runs.items()},
           "paired_spread": {a: paired_spread(runs, a) for a in runs if a != "static:0"},
           "log_sd": {a: log_sd(xs) for a, xs in runs.items()},
           "paired_log_sd": {a: log_sd([x / o for x, o in zip(xs, off)]) for a, xs in runs.items() if a != "static:0"},
           "over_best_single": {a: statistics.median(x / b for x, b in zip(runs[a], runs[best])) for a in (ADAPTIVE, WARM)}}
    print(f"{workload}: best static {best}; log sd " + ", ".join(f"{a} {v:.2%}" for a, v in out["log_sd"].items())
          + "; paired " + ", ".join(f"{a} {v:.2%}" for a, v in out["paired_log_sd"].items())
          + "; x best static " + ", ".join(f"{a} {v:.3f}" for a, v in out["over_best_single"].items()), flush=True)
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
    ap.add_argument("--draft-price", type=float, default=1.0,
                    help="the replayed machine charges drafts this times the profile's increment (the planner must learn it)")
    ap.add_argument("--significance", type=float, default=None,
                    help="the planners' DraftSlopeConfig.significance (default: the shipped one; 0: the raw fit)")
    ap.add_argument("--dearer-significance", type=float, default=None,
                    help="the planners' DraftSlopeConfig.dearer_significance (default: the shipped one)")
    ap.add_argument("--noise-runs", type=int, default=0, help="replay every arm this many times on a noisy machine")
    ap.add_argument("--jitter", type=float, default=0.03, help="log sigma of each step's own noise")
    ap.add_argument("--level", type=float, default=0.02, help="log sigma of the level's move every --level-every-s")
    ap.add_argument("--level-every-s", type=float, default=0.5)
    ap.add_argument("--rest-level", type=float, default=0.0,
                    help="log sigma of each request's level of the time outside forward + verify")
    ap.add_argument("--rest-jitter", type=float, default=0.0, help="log sigma of that time's per-step noise")
    ap.add_argument("--learn-timing", action=argparse.BooleanOptionalAction, default=True,
                    help="the planners' overhead and drafting-cost learner (PlannerConfig.learn_timing)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    workloads = [w for w in args.workloads.split(",") if w]
    if args.trace.exists():
        recorded = json.loads(args.trace.read_text())
    else:
        recorded = record_outputs(args.quantize, workloads, args.prompts, args.train_prompts, args.max_tokens)
        args.trace.write_text(json.dumps(recorded))
    profile = Profile.load(args.profile)
    if args.noise_runs:
        report = {w: noisy_spreads(profile, w, recorded[w], args) for w in workloads}
        if args.out is not None:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "workloads": report},
                                           indent=1))
        return
    report = {}
    for w in workloads:
        cell = replay_workload(profile, recorded[w]["test"], recorded[w]["train"],
                               static_ks=tuple(int(k) for k in args.static_ks.split(",") if k),
                               overhead_s=args.overhead_ms / 1e3, charge=args.charge_decider,
                               draft_price=args.draft_price, planner_options=planner_options(args))
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
