"""The chain's lookup threshold, paired in one process (issue #33): one engine per
``chain_min_match`` (n-gram drafts only for matches of at least that many tokens, the shipped head
elsewhere), static k and the goodput policy on each, SD off beside them, arms interleaved and
rotated each round; the evaluation's prompts, fp32 target, greedy, 64 tokens. Every arm must
produce the same tokens (checked).

    python scripts/chain_min_match_ab.py --profile P.json --batch 4 --rounds 3 --min-match 1,2 \
        --workloads gsm8k,mtbench --out DIR
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from specplan.bench.evaluate import rotated_rounds, run_cell
from specplan.bench.workloads import load_workload
from specplan.engine import FixedDecider, LLMEngine, load_model
from specplan.engine.config import CacheConfig, EngineConfig, SchedulerConfig, SpecConfig
from specplan.planner.from_profile import planner_from_profile
from specplan.policies import make_policy
from specplan.profiler.profile import Profile

MAX_TOKENS = 64


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--profile", required=True)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--min-match", default="1,2")
    ap.add_argument("--static-ks", default="0,1,2")
    ap.add_argument("--workloads", default="gsm8k,mtbench")
    ap.add_argument("--requests", type=int, default=None, help="default max(B, 4), as the evaluation's cell")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    profile = Profile.load(args.profile)
    loaded = load_model(None)
    thresholds = [int(x) for x in args.min_match.split(",")]
    static_ks = [int(x) for x in args.static_ks.split(",")]

    def engine(min_match: int) -> LLMEngine:
        return LLMEngine(EngineConfig(
            cache=CacheConfig(block_size=16, kv_cache_bytes=768 * 1024**2),
            scheduler=SchedulerConfig(max_num_seqs=args.batch, max_num_batched_tokens=1024, max_model_len=2048),
            spec=SpecConfig(proposer="chain", k=0, max_k=8, chain_min_match=min_match)), loaded)

    engines = {m: engine(m) for m in thresholds}
    arms = {}  # name -> (threshold, decider maker)
    for m in thresholds:
        for k in static_ks:
            if k or m == thresholds[0]:  # SD off is the same on every engine: run it once
                arms[f"m{m} static:{k}"] = (m, lambda k=k: FixedDecider(k))
        arms[f"m{m} goodput"] = (m, lambda: planner_from_profile(profile, make_policy("goodput"), proposer="chain",
                                                                 max_k=8))
    off = f"m{thresholds[0]} static:0"
    n = args.requests or max(args.batch, 4)
    results = {}
    for w in args.workloads.split(","):
        prompts = [p.render(loaded.tokenizer) for p in load_workload(w, n, 0)][:n]
        for e in engines.values():
            run_cell(e, prompts, FixedDecider(1), MAX_TOKENS, concurrency=args.batch)  # warm-up
        names = list(arms)
        reference = []

        def run(name: str) -> dict:
            m, make = arms[name]
            x = run_cell(engines[m], prompts, make(), MAX_TOKENS, concurrency=args.batch)
            outputs = x.pop("outputs")
            reference[:] = reference or [outputs]
            if outputs != reference[0]:
                raise SystemExit(f"{name}: tokens differ from the other arms'")
            return x

        runs = rotated_rounds(names, args.rounds, run)
        vs_off = {m: statistics.median(a["goodput"] / b["goodput"] for a, b in zip(runs[m], runs[off])) for m in names}
        acceptance = {m: statistics.median(x["acceptance"] for x in runs[m]) for m in names}
        print(f"{w} B={args.batch} x off: " + ", ".join(f"{m} {v:.3f}" for m, v in vs_off.items()), flush=True)
        print(f"{w} B={args.batch} accepted/draft: " + ", ".join(f"{m} {v:.2f}" for m, v in acceptance.items()),
              flush=True)
        results[w] = {"vs_off": vs_off, "acceptance": acceptance,
                      "goodput": {m: [x["goodput"] for x in runs[m]] for m in names}}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"chain-min-match-b{args.batch}.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
