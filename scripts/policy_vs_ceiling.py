"""Where the goodput policy leaves tokens the clairvoyant ceiling takes, by n-gram match length.

For each workload, the evaluation's requests (the first max(B, 4) of its 32, seed 0) run greedy
with SD off; the outputs are replayed through a fresh n-gram proposer (specplan/bench/clairvoyant.py
``replay``), which gives, per request and output length, how many drafts the target would accept:
what the ceiling asks for. Then the goodput policy runs the same requests, and every request-step
it decided is set against that. Per match-length bucket (planner/acceptance.py ``match_bucket``;
0 = no match), it prints:

    steps     request-steps the policy decided
    k         drafts it asked for, mean
    possible  drafts the target would have accepted (up to 8), mean: the ceiling's k
    taken     min(k, possible), mean: accepted drafts the policy got
    wasted    max(0, k - possible), mean: drafts verified and rejected
    short     share of steps with k < possible

The ceiling's edge over the policy is (possible - taken) more tokens a step and (wasted) fewer
query rows. A diagnostic, not a benchmark (timing does not matter):
`.venv/bin/python scripts/policy_vs_ceiling.py [B] [workloads]` from the repo root (default: B=1,
all four workloads; about a minute each).
"""
import sys
from collections import defaultdict

import torch

from specplan.adaptive import load_or_make_profile
from specplan.bench import evaluate as ev
from specplan.bench.workloads import load_workload
from specplan.engine import StepRecord, StepView, load_model
from specplan.planner.acceptance import match_bucket
from specplan.planner.from_profile import planner_from_profile
from specplan.policies import make_policy

MAX_TOKENS, MAX_K = 64, 8  # the evaluation's output length and k cap


class RecordingDecider:
    """Passes decide() and observe() through; keeps (request id, output length, match length, k)."""

    def __init__(self, inner):
        self.inner = inner
        self.decisions: list[tuple[str, int, int | None, int]] = []

    def decide(self, view: StepView) -> list[int]:
        ks = self.inner.decide(view)
        self.decisions += [(rv.request_id, rv.num_output_tokens, rv.match_length, k) for rv, k in zip(view.requests, ks)]
        return ks

    def observe(self, record: StepRecord) -> None:
        self.inner.observe(record)


def main(batch: int, workloads: list[str]) -> None:
    loaded = load_model(None)
    profile = load_or_make_profile(loaded, None)
    engine = ev._engine(loaded, "ngram", max(batch, 4), draft_layers=8)  # the evaluation's (unused by n-gram)
    print("workload  bucket  steps     k  possible  taken  wasted  short")
    for workload in workloads:
        prompts = [p.render(loaded.tokenizer) for p in load_workload(workload, 32, 0)][:max(batch, 4)]
        _, table = ev.replayed_reference(engine, prompts, MAX_TOKENS, concurrency=batch)
        decider = RecordingDecider(planner_from_profile(profile, make_policy("goodput"), proposer="ngram", max_k=MAX_K))
        ev.run_cell(engine, prompts, decider, MAX_TOKENS, concurrency=batch)
        # bucket -> [steps, k, possible, taken, wasted, short]
        sums: dict[int, list[int]] = defaultdict(lambda: [0] * 6)
        for request_id, position, match_length, k in decider.decisions:
            possible = table[ev._request_index(request_id)][position].accepted
            for bucket in (match_bucket(match_length) or 0, -1):  # -1: all buckets
                row = sums[bucket]
                for j, value in enumerate((1, k, possible, min(k, possible), max(0, k - possible), k < possible)):
                    row[j] += value
        for bucket in sorted(sums, key=lambda b: (b < 0, b)):
            steps, *rest = sums[bucket]
            k, possible, taken, wasted, short = (x / steps for x in rest)
            name = "all" if bucket < 0 else str(bucket)
            print(f"{workload:9s} {name:>6s} {steps:6d} {k:5.2f} {possible:9.2f} {taken:6.2f} {wasted:7.2f} {short:6.2f}",
                  flush=True)


if __name__ == "__main__":
    args = sys.argv[1:]
    with torch.inference_mode():
        main(int(args[0]) if args else 1, args[1].split(",") if len(args) > 1 else list(ev.WORKLOADS))
