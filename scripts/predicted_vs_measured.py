"""What the planner's model predicts for the steps it chooses, against what they measure.

For every full-batch step of a closed-loop cell (the evaluation's: max(B, 4) requests of one
workload, 64 tokens), the tokens the step was expected to emit (each request's calibrated
estimate at the k it got) and its seconds (``StepCostModel.seconds``), beside the tokens it
emitted and the seconds it took. Two arms in turn: the goodput policy's own choices, and the same
planner forced to a static k (it learns as usual; only its answer is replaced). If the policy's
choices are predicted better than the static k's but measure worse, its model is off where it
chooses (reports/eagle/README.md, "Where the B = 4 cells go").

    python scripts/predicted_vs_measured.py --profile reports/evaluation-chain-xeon/profile.json \
        --proposer chain --batch 4 --workloads gsm8k,mtbench --static-k 2 --rounds 2
"""

from __future__ import annotations

import argparse
import statistics

from specplan.bench.evaluate import _engine, add_cell_arguments, cell_prompts, run_cell
from specplan.engine import FixedDecider, load_model
from specplan.planner.controller import Planner
from specplan.planner.from_profile import planner_from_profile
from specplan.policies import make_policy
from specplan.profiler.profile import Profile

MAX_TOKENS = 64
SKIP = 5  # the first full-batch steps, while the planner is still cold


class LoggingPlanner(Planner):
    """The planner, its answer optionally replaced by a static k (``force``), logging each
    full-batch step as (predicted seconds, predicted tokens, measured seconds, measured tokens)."""

    force: int | None = None
    batch: int = 4

    def decide(self, view):
        ks = super().decide(view)
        state = self.last_state
        self.pending = None
        if state is None:  # a paused planner (planner/pause.py): nothing was predicted
            return ks
        if self.force is not None:  # each request's cap; a lookup's drafts as found
            ks = [min(self.force, r.max_k, rv.available_drafts if rv.available_drafts is not None else r.max_k)
                  for r, rv in zip(state.requests, view.requests)]
        self.pending = None
        if len(view.requests) == self.batch and state.pricing.latency is not None:
            cost = state.cost_model()
            self.pending = (cost.seconds(ks), sum(r.acceptance.expected_emitted(k) for r, k in zip(state.requests, ks)))
        return ks

    def observe(self, record):
        if getattr(self, "pending", None) is not None and len(record.requests) == self.batch:
            self.log.append(self.pending + (record.total_s, sum(r.num_emitted for r in record.requests)))
        self.pending = None
        super().observe(record)


def main() -> None:
    ap = argparse.ArgumentParser()
    add_cell_arguments(ap, rounds=2)
    ap.add_argument("--static-k", type=int, default=2)
    args = ap.parse_args()
    profile = Profile.load(args.profile)
    loaded = load_model(None, quantize=args.quantize)
    engine = _engine(loaded, args.proposer, args.batch, 8)
    for workload in args.workloads.split(","):
        prompts = cell_prompts(loaded.tokenizer, workload, args.batch, min_requests=args.requests)
        run_cell(engine, prompts, FixedDecider(1), MAX_TOKENS, concurrency=args.batch)  # warm-up
        for r in range(args.rounds):
            for force in (args.static_k, None):
                planner = planner_from_profile(profile, make_policy("goodput"), proposer=args.proposer, max_k=8)
                planner.__class__ = LoggingPlanner
                planner.force, planner.batch, planner.log = force, args.batch, []
                cell = run_cell(engine, prompts, planner, MAX_TOKENS, concurrency=args.batch)
                steps = planner.log[SKIP:]
                if not steps:
                    continue
                mean = [statistics.mean(s[i] for s in steps) for i in range(4)]
                name = f"static:{force}" if force is not None else "goodput"
                print(f"{workload} B={args.batch} round {r} {name}: {cell['goodput']:.1f} tok/s over the cell; "
                      f"{len(steps)} full-batch steps after the first {SKIP}: predicted {mean[1]:.2f} tokens in "
                      f"{1e3 * mean[0]:.1f} ms ({mean[1] / mean[0]:.0f}/s), measured {mean[3]:.2f} in "
                      f"{1e3 * mean[2]:.1f} ms ({mean[3] / mean[2]:.0f}/s)", flush=True)


if __name__ == "__main__":
    main()
