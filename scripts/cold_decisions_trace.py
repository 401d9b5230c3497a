"""Where a cold request's run-to-run spread comes from: the planner's choices, or the machine.

`specplan bench coldstart` runs one B = 1 request per process and reports each arm's spread over
runs. This script runs one of its cells the same way (a fresh process per run, the evaluation's
prompt, the model loaded and warmed untimed, 128 tokens, n-gram, greedy), alternating the adaptive
planner with a static k, and records every step: the k the planner chose, the drafts the lookup
found, and the step's measured time. Greedy tokens are the same in every run, so two runs of the
planner differ only where a measured step time moved a choice; the summary says at how many steps
each run's choices differ from the first run's, what that did to the step count, and the spread of
tokens/s for both arms.

    python scripts/cold_decisions_trace.py --profile reports/choice-replay/profile-fp32.json \\
        --workload xsum --prompt 0 --runs 6 --out /work/logs/coldtrace
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import time
from pathlib import Path


def child(arm: str, workload: str, prompt_index: int, profile_path: str, out: Path) -> None:
    """One run in this process: the request under ``arm`` (adaptive or static:K), every step logged."""
    from specplan.bench.coldstart import B1_KV_CACHE_MIB, WARMUP_PROMPT, ChildJob, _decider, _prompts
    from specplan.bench.evaluate import _engine, run_cell
    from specplan.engine import FixedDecider, load_model
    from specplan.profiler.profile import Profile

    profile = Profile.load(profile_path)
    loaded = load_model(None)
    engine = _engine(loaded, "ngram", 1, 8, kv_cache_mib=B1_KV_CACHE_MIB)
    run_cell(engine, [loaded.tokenizer.encode(WARMUP_PROMPT)], FixedDecider(0), 8, concurrency=1)  # untimed
    prompt = _prompts(loaded, workload, prompt_index + 1)[prompt_index]
    decisions: list[dict] = []  # per decide: drafts found, k chosen, the planner's price and drift then
    steps: list[dict] = []  # per observed step: forward + verify seconds, drafts, accepted
    # The bench's own decider for the arm (specplan/bench/coldstart.py), so the trace runs what it runs.
    decider = _decider(ChildJob(arm, [prompt], 128, profile_path), loaded, profile)
    decide, observe = decider.decide, decider.observe

    def logged_decide(view):
        t0 = time.perf_counter()
        ks = decide(view)
        entry = {"found": [r.available_drafts for r in view.requests], "k": list(ks), "decide_s": time.perf_counter() - t0}
        if arm == "adaptive":
            price = decider.draft_slope.price(len(view.requests))
            entry |= {"slope": price.slope, "jump": price.jump, "drift": decider.drift.factor,
                      "overhead_s": decider.overhead_s}
        decisions.append(entry)
        return ks

    def logged_observe(record):
        t0 = time.perf_counter()
        observe(record)
        steps.append({"step_s": record.forward_s + record.verify_s, "observe_s": time.perf_counter() - t0,
                      "drafts": sum(r.num_proposed for r in record.requests),
                      "accepted": sum(r.num_accepted for r in record.requests)})

    decider.decide, decider.observe = logged_decide, logged_observe
    r = run_cell(engine, [prompt], decider, 128, concurrency=1)
    out.write_text(json.dumps({"arm": arm, "tokens": r["output_tokens"], "seconds": r["seconds"],
                               "decisions": decisions, "steps": steps}))


def summarize(runs: dict[str, list[dict]]) -> dict:
    """Per arm: tokens/s per run and their sd (log units, %); for the planner, per run the steps
    whose choice differs from the first run's, the drafts, accepted drafts and steps."""
    out = {}
    for arm, ds in runs.items():
        rates = [d["tokens"] / d["seconds"] for d in ds]
        logs = [math.log(x) for x in rates]
        row = {"tok_s": [round(x, 2) for x in rates],
               "sd_pct": round(100 * statistics.stdev(logs), 2) if len(logs) > 1 else 0.0,
               "steps": [len(d["steps"]) for d in ds]}
        if arm == "adaptive":
            first = [e["k"] for e in ds[0]["decisions"]]
            row["choices_differing_from_run_0"] = [sum(a != b for a, b in zip([e["k"] for e in d["decisions"]], first))
                                                   for d in ds]
            row["decisions"] = [len(d["decisions"]) for d in ds]
            row["drafts"] = [sum(s["drafts"] for s in d["steps"]) for d in ds]
            row["accepted"] = [sum(s["accepted"] for s in d["steps"]) for d in ds]
            row["planner_ms_per_step"] = [round(1e3 * (sum(e["decide_s"] for e in d["decisions"])
                                                       + sum(s["observe_s"] for s in d["steps"])) / len(d["steps"]), 3)
                                          for d in ds]
        out[arm] = row
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--profile", required=True)
    ap.add_argument("--workload", default="xsum")
    ap.add_argument("--prompt", type=int, default=0, help="which of the evaluation's prompts (0: its first)")
    ap.add_argument("--runs", type=int, default=6)
    ap.add_argument("--static-k", type=int, default=4, help="the static arm beside the planner")
    ap.add_argument("--out", type=Path, required=True, help="a folder: one JSON per run, and summary-*.json")
    ap.add_argument("--child", nargs=2, metavar=("ARM", "FILE"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.child[0], args.workload, args.prompt, args.profile, Path(args.child[1]))
        return
    args.out.mkdir(parents=True, exist_ok=True)
    arms = ["adaptive", f"static:{args.static_k}"]
    runs: dict[str, list[dict]] = {a: [] for a in arms}
    for run in range(args.runs):
        for arm in (arms if run % 2 == 0 else arms[::-1]):  # alternate which arm goes first
            path = args.out / f"{args.workload}-{args.prompt}-{arm.replace(':', '')}-{run}.json"
            subprocess.run([sys.executable, __file__, "--profile", args.profile, "--workload", args.workload,
                            "--prompt", str(args.prompt), "--out", str(args.out), "--child", arm, str(path)], check=True)
            runs[arm].append(json.loads(path.read_text()))
            print(f"run {run} {arm}: {runs[arm][-1]['tokens'] / runs[arm][-1]['seconds']:.1f} tok/s", flush=True)
    summary = summarize(runs)
    (args.out / f"summary-{args.workload}-{args.prompt}.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
