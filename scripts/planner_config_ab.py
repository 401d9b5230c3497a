"""The goodput planner as it ships against variants of its configuration, paired in one process on
the evaluation's closed-loop cells (max(B, --requests) requests of one workload, 64 tokens, greedy), with
SD off and static k beside them. Arms alternate, their order rotated per round; every arm's
tokens must equal SD off's.

Variants (``--variants``, comma-separated):
  no-pause   ``PlannerConfig(pause=None)``: plan every step (planner/pause.py)
  no-settle  ``DraftSlopeConfig(settle_steps=0)``: learn draft prices from the decode steps right
             after a prefill too (planner/drift.py)
  no-explore the goodput policy with ``explore_budget=0``: no probe where its choice is off
             (policies/goodput.py)
  pause-b4   ``PauseConfig(min_decodes=4)``: steps of 4 decodes or more may pause (planner/pause.py)
  no-measured-pause  ``PauseConfig(min_measured_decodes=0)``: steps of 2-7 decodes never pause (the
             planner before the measured rule, planner/pause.py)
  fp32-ceiling  the profile's peak FLOP/s replaced by the engine's fp32 kernels' (measured at the
             start): a quantized engine's ridge as profiles measured it before its int8 kernels
             counted (profiler/ceilings.py); the ridge scales the policy's exploration
  warm       the shipped planner started from beliefs (planner/beliefs.py) a planner saved after one
             cell of other prompts of the same workload at the same batch size: what a process
             that `serve` or `generate` ran before starts from, against the cold planner
  other-profile  the shipped planner with the profile given by ``--other-profile`` (two profiles
             of one engine, e.g. one measured by an older profiler, paired on the same cells)
  dearer-2   ``DraftSlopeConfig(dearer_significance=2.0)``: believe a dearer draft price only two
             standard errors off the profile's, as a cheaper one (planner/drift.py)
  pinned-price  the draft price held at the profile's (slope and jump priors of 1e6 and 1e8 units)
  again      the shipped planner a second time: the null control of the comparison

    python scripts/planner_config_ab.py --quantize gguf --profile reports/profile-xeon-q4_1/profile.json \\
        --proposer ngram --batch 4 --variants no-settle --static-ks 1,2 --rounds 5 --out reports/planner-ab/q4_1-b4.json
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import tempfile
from pathlib import Path

from specplan.bench.evaluate import _engine, add_cell_arguments, cell_prompts, rotated_rounds, run_cell
from specplan.bench.workloads import load_workload
from specplan.engine import FixedDecider, load_model
from specplan.planner.beliefs import BeliefStore, latency_id
from specplan.planner import DraftSlopeConfig
from specplan.planner.pause import PauseConfig
from specplan.planner.from_profile import planner_from_profile
from specplan.policies import make_policy
from specplan.policies.goodput import GoodputPolicy
from specplan.profiler.profile import Profile

MAX_TOKENS = 64
# PlannerConfig fields that differ from the shipped planner, and "policy": a maker of the rule
# (each planner gets its own, as Planner asks).
VARIANTS = {
    "no-pause": {"pause": None},
    "no-settle": {"draft_slope": DraftSlopeConfig(settle_steps=0)},
    "no-explore": {"policy": lambda: GoodputPolicy(explore_budget=0.0)},
    "pause-b4": {"pause": PauseConfig(min_decodes=4)},
    "no-measured-pause": {"pause": PauseConfig(min_measured_decodes=0)},
    "fp32-ceiling": {"profile": "fp32-ceiling"},
    "warm": {"warm": True},
    "other-profile": {"profile": "other"},
    "dearer-2": {"draft_slope": DraftSlopeConfig(dearer_significance=2.0)},
    "pinned-price": {"draft_slope": DraftSlopeConfig(prior_units=1e6, jump_prior_units=1e8)},
    "again": {},
}
SHIPPED = "goodput"


def decider_for(arm: str, profiles: dict[str, Profile], proposer: str, beliefs: BeliefStore | None = None):
    """``profiles``: "shipped", and the profiles variants name by key; ``beliefs``: what the
    ``warm`` variant starts from."""
    if arm.startswith("static:"):
        return FixedDecider(int(arm.split(":")[1]))
    options = dict(VARIANTS.get(arm, {}))
    policy = options.pop("policy", lambda: make_policy("goodput"))()
    profile = profiles[options.pop("profile", "shipped")]
    warm = options.pop("warm", False)
    planner = planner_from_profile(profile, policy, proposer=proposer, max_k=8, **options)
    if warm:
        beliefs.load_into(planner)
    return planner


def learned_beliefs(engine, profile: Profile, proposer: str, tokenizer, workload: str, held_out: list[list[int]],
                    batch: int, path: Path) -> BeliefStore:
    """A store holding what a planner learned over one cell of this workload's other prompts (seed
    1, none of the cell's own), as ``serve`` or ``generate`` would have saved it."""
    prompts = [p for p in (q.render(tokenizer) for q in load_workload(workload, 2 * len(held_out), 1))
               if p not in held_out][:len(held_out)]
    planner = decider_for(SHIPPED, {"shipped": profile}, proposer)
    run_cell(engine, prompts, planner, MAX_TOKENS, concurrency=batch)
    store = BeliefStore(path, latency=latency_id(profile.latency_model))
    store.save(planner)
    return store


def with_fp32_ceiling(profile: Profile) -> Profile:
    """The profile with the fp32 kernels' peak FLOP/s (measured now) in place of its own."""
    from specplan.profiler.ceilings import measure_peak_flops

    peak = measure_peak_flops()
    ceilings = profile.ceilings.model_copy(update={"peak_flops": peak, "ridge": peak / profile.ceilings.bandwidth})
    return profile.model_copy(update={"ceilings": ceilings})


def geo(xs) -> float:
    xs = list(xs)
    return math.exp(statistics.fmean(math.log(x) for x in xs))


def main() -> None:
    ap = argparse.ArgumentParser()
    add_cell_arguments(ap, proposer="ngram", workloads="gsm8k,humaneval,mtbench,xsum", rounds=5)
    ap.add_argument("--variants", default="no-settle")
    ap.add_argument("--static-ks", default="1,2")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--other-profile", default=None, help="the profile of the other-profile variant")
    args = ap.parse_args()
    variants = [v for v in args.variants.split(",") if v]
    if ("other-profile" in variants) != (args.other_profile is not None):
        raise SystemExit("the other-profile variant and --other-profile go together")
    unknown = set(variants) - set(VARIANTS)
    if unknown:
        raise SystemExit(f"unknown variant(s) {sorted(unknown)}; choose from {', '.join(VARIANTS)}")
    profile = Profile.load(args.profile)
    profiles = {"shipped": profile}
    if args.other_profile is not None:
        profiles["other"] = Profile.load(args.other_profile)
    if "fp32-ceiling" in variants:
        profiles["fp32-ceiling"] = with_fp32_ceiling(profile)
        print(f"ridge {profile.ceilings.ridge:.1f} FLOP/byte; with the fp32 ceiling {profiles['fp32-ceiling'].ceilings.ridge:.1f}")
    loaded = load_model(None, quantize=args.quantize)
    engine = _engine(loaded, args.proposer, args.batch, 8)
    statics = ["static:0"] + [f"static:{k}" for k in args.static_ks.split(",") if k]
    arms = statics + [SHIPPED] + variants
    report = {}
    for workload in args.workloads.split(","):
        prompts = cell_prompts(loaded.tokenizer, workload, args.batch, min_requests=args.requests)
        run_cell(engine, prompts, FixedDecider(1), MAX_TOKENS, concurrency=args.batch)  # warm-up
        beliefs = None
        if "warm" in variants:
            with tempfile.TemporaryDirectory() as tmp:
                beliefs = learned_beliefs(engine, profile, args.proposer, loaded.tokenizer, workload, prompts,
                                          args.batch, Path(tmp) / "beliefs.json")
                beliefs.document()  # read now, before the directory goes
        def run(arm: str) -> dict:
            decider = decider_for(arm, profiles, args.proposer, beliefs)
            out = run_cell(engine, prompts, decider, MAX_TOKENS, concurrency=args.batch)
            pause = getattr(decider, "pause", None)
            out["paused_share"] = pause.paused_steps / max(1, decider.steps) if pause is not None else 0.0
            return out

        runs = rotated_rounds(arms, args.rounds, run)
        off = runs["static:0"]
        same = all(x["outputs"] == off[0]["outputs"] for arm in arms for x in runs[arm])

        def paired(arm: str, base: str) -> float:
            return statistics.median(a["goodput"] / b["goodput"] for a, b in zip(runs[arm], runs[base]))

        best = max(statics, key=lambda a: statistics.median(x["goodput"] for x in runs[a]))
        line = {"tok_s": {arm: statistics.median(x["goodput"] for x in runs[arm]) for arm in arms},
                "best_static": best,
                "over_off": {arm: paired(arm, "static:0") for arm in [SHIPPED] + variants},
                "over_best_static": {arm: paired(arm, best) for arm in [SHIPPED] + variants},
                "shipped_over_variant": {v: paired(SHIPPED, v) for v in variants},
                "shipped_over_variant_rounds": {v: [a["goodput"] / b["goodput"] for a, b in zip(runs[SHIPPED], runs[v])]
                                                for v in variants},
                "decider_ms_per_step": {arm: statistics.median(x["decider_ms_per_step"] for x in runs[arm])
                                        for arm in [SHIPPED] + variants},
                # steps the planner's pause answered (planner/pause.py), of the steps it was asked about
                "paused_share": {arm: statistics.median(x["paused_share"] for x in runs[arm]) for arm in [SHIPPED] + variants},
                "outputs_identical": same}
        report[workload] = line
        print(f"{workload} B={args.batch}: x off " + ", ".join(f"{a} {v:.3f}" for a, v in line["over_off"].items())
              + f"; x best static ({best}) " + ", ".join(f"{a} {v:.3f}" for a, v in line["over_best_static"].items())
              + "; shipped / " + ", ".join(f"{v} {line['shipped_over_variant'][v]:.3f} (rounds "
                                          + ", ".join(f"{x:.3f}" for x in line["shipped_over_variant_rounds"][v]) + ")"
                                          for v in variants)
              + "; paused " + ", ".join(f"{a} {v:.0%}" for a, v in line["paused_share"].items())
              + f"; outputs identical: {same}", flush=True)
    summary = {"over_off": {arm: geo(v["over_off"][arm] for v in report.values()) for arm in [SHIPPED] + variants},
               "over_best_static": {arm: geo(v["over_best_static"][arm] for v in report.values())
                                    for arm in [SHIPPED] + variants},
               "shipped_over_variant": {var: geo(v["shipped_over_variant"][var] for v in report.values())
                                        for var in variants}}
    print("geo-mean over cells: " + json.dumps(summary), flush=True)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"batch": args.batch, "requests": args.requests, "proposer": args.proposer,
                                        "quantize": args.quantize,
                                        "profile": args.profile, "rounds": args.rounds, "variants": variants,
                                        "geo_mean": summary, "workloads": report}, indent=1))


if __name__ == "__main__":
    main()
