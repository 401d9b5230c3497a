"""The confidence stop, paired in one process (issue #33): the chain proposer (the shipped head),
fp32 target, the evaluation's prompts (max(B, 4) requests a cell, 64 tokens), SD off and static k
beside the goodput policy under several stop rules, arms interleaved and rotated each round.

* ``new``: the planner as it is: every request given a head draft may draft up to its cap, a draft
  pays for its query token; a pass after the first runs only while the drafts still running pay
  for it (engine/decider.py ``DraftStop.pass_gain``).
* ``old``: one price per draft, a query token plus a head pass (what the stop used before
  ``marginal_draft_prices``): a first draft was dropped unless it paid for the pass that had
  already drawn it.
* ``cut``: the stop only shortens the policy's chosen k (no drafting past it).
* ``none``: no stop: each request drafts exactly the chosen k.

    python scripts/stop_price_ab.py --profile P.json --batch 1 --rounds 4 --workloads mtbench,gsm8k \
        --arms new,old --out DIR
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from specplan.bench.evaluate import _engine, cell_prompts, run_cell
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


class CutOnly(Planner):
    """The stop may shorten the chosen k, never draft past it."""

    def _confident_drafts(self, state, ks):
        _, stop = super()._confident_drafts(state, ks)
        return ks, stop


class NoStop(Planner):
    """No confidence stop: the chosen k as they are."""

    def _confident_drafts(self, state, ks):
        return ks, None


VARIANTS = {"new": Planner, "old": OneDraftPrice, "cut": CutOnly, "none": NoStop}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--profile", required=True)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--workloads", default="mtbench,gsm8k")
    ap.add_argument("--arms", default="new,old", help=f"stop rules, of {', '.join(VARIANTS)}")
    ap.add_argument("--static-ks", default="0,1,2")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    profile = Profile.load(args.profile)
    loaded = load_model(None)
    engine = _engine(loaded, "chain", args.batch, 8)

    def planner(kind: type[Planner]) -> Planner:
        p = planner_from_profile(profile, make_policy("goodput"), proposer="chain", max_k=8)
        p.__class__ = kind  # the same planner, only the stop's rule differs
        return p

    variants = args.arms.split(",")
    arms = {("off" if k == 0 else f"static:{k}"): (lambda k=k: FixedDecider(k))
            for k in (int(x) for x in args.static_ks.split(","))}
    arms.update({v: (lambda v=v: planner(VARIANTS[v])) for v in variants})
    names = list(arms)
    results = {}
    for w in args.workloads.split(","):
        prompts = cell_prompts(loaded.tokenizer, w, args.batch)
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

        first = variants[0]
        summary = {"vs_off": {m: paired(m, "off") for m in names},
                   f"vs_{first}": {v: paired(v, first) for v in variants[1:]},
                   f"wins_over_{first}": {v: sum(x["goodput"] > y["goodput"] for x, y in zip(runs[v], runs[first]))
                                          for v in variants[1:]},
                   "k_zero_share": {v: statistics.median(x["k_zero_share"] for x in runs[v]) for v in variants},
                   "mean_k": {v: statistics.median(x["mean_k"] for x in runs[v]) for v in variants},
                   "acceptance": {m: statistics.median(x["acceptance"] for x in runs[m]) for m in names},
                   "goodput": {m: [x["goodput"] for x in runs[m]] for m in names}}
        print(f"{w} B={args.batch}: x off " + ", ".join(f"{m} {v:.3f}" for m, v in summary["vs_off"].items())
              + "; vs " + first + " " + ", ".join(f"{v} {r:.3f} ({summary[f'wins_over_{first}'][v]}/{args.rounds})"
                                                 for v, r in summary[f"vs_{first}"].items()), flush=True)
        results[w] = summary
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"stop-{'-'.join(variants)}-b{args.batch}.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
