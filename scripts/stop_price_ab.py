"""The confidence stop's prices, paired in one process (issue #33): the chain proposer (the
shipped head), fp32 target, the evaluation's prompts, SD off and static k = 1, 2 beside the
goodput policy under two stop rules, arms interleaved and rotated each round.

* ``old``: one price per draft, a query token plus a head pass (what the stop used before
  ``marginal_draft_prices``): a first draft was dropped unless it paid for the pass that had
  already drawn it.
* ``new``: the planner as it is: a draft pays for its query token; a pass after the first runs
  only while the drafts still running pay for it (engine/decider.py ``DraftStop.pass_gain``).

    python scripts/stop_price_ab.py --profile P.json --batch 1 --rounds 4 --workloads mtbench,gsm8k --out DIR
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from specplan.bench.evaluate import _engine, run_cell
from specplan.bench.workloads import load_workload
from specplan.engine import FixedDecider, load_model
from specplan.planner.controller import Planner
from specplan.planner.from_profile import planner_from_profile
from specplan.policies import make_policy
from specplan.profiler.profile import Profile

MAX_TOKENS = 64


class OneDraftPrice(Planner):
    """The planner with the stop's earlier rule: every draft priced at a query token plus a pass."""

    def _confident_drafts(self, state, ks):
        deeper, stop = super()._confident_drafts(state, ks)
        return deeper, self.confidence.stop(stop.min_gain + stop.pass_gain, 0.0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--profile", required=True)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--workloads", default="mtbench,gsm8k")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    profile = Profile.load(args.profile)
    loaded = load_model(None)
    engine = _engine(loaded, "chain", args.batch, 8)

    def planner(kind: type[Planner]) -> Planner:
        p = planner_from_profile(profile, make_policy("goodput"), proposer="chain", max_k=8)
        p.__class__ = kind  # the same planner, only the stop's rule differs
        return p

    arms = {"off": lambda: FixedDecider(0), "static:1": lambda: FixedDecider(1), "static:2": lambda: FixedDecider(2),
            "old": lambda: planner(OneDraftPrice), "new": lambda: planner(Planner)}
    names = list(arms)
    results = {}
    for w in args.workloads.split(","):
        n = max(args.batch, 4)  # the evaluation's cell: max(B, 4) requests of the workload
        prompts = [p.render(loaded.tokenizer) for p in load_workload(w, n, 0)][:n]
        run_cell(engine, prompts, FixedDecider(1), MAX_TOKENS, concurrency=args.batch)  # warm-up
        runs: dict[str, list[dict]] = {name: [] for name in names}
        reference = None
        for r in range(args.rounds):
            for name in names[r % len(names):] + names[:r % len(names)]:
                x = run_cell(engine, prompts, arms[name](), MAX_TOKENS, concurrency=args.batch)
                outputs = x.pop("outputs")
                reference = reference or outputs
                if outputs != reference:
                    raise SystemExit(f"{name}: tokens differ from the other arms'")
                runs[name].append(x)
            print(f"{w} B={args.batch} round {r}: " + " ".join(f"{m} {runs[m][-1]['goodput']:.1f}" for m in names),
                  flush=True)

        def paired(a: str, b: str) -> float:
            return statistics.median(x["goodput"] / y["goodput"] for x, y in zip(runs[a], runs[b]))

        summary = {"vs_off": {m: paired(m, "off") for m in names}, "new_vs_old": paired("new", "old"),
                   "new_wins_rounds": sum(x["goodput"] > y["goodput"] for x, y in zip(runs["new"], runs["old"])),
                   "k_zero_share": {m: statistics.median(x["k_zero_share"] for x in runs[m]) for m in ("old", "new")},
                   "mean_k": {m: statistics.median(x["mean_k"] for x in runs[m]) for m in ("old", "new")},
                   "goodput": {m: [x["goodput"] for x in runs[m]] for m in names}}
        print(f"{w} B={args.batch}: new/old {summary['new_vs_old']:.3f} (new ahead in {summary['new_wins_rounds']} of "
              f"{args.rounds} rounds); x off " + ", ".join(f"{m} {v:.3f}" for m, v in summary["vs_off"].items()), flush=True)
        results[w] = summary
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"stop-prices-b{args.batch}.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
