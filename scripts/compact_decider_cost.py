"""What a compact planner step would cost in the engine: a spike beside the shipped planner.

The shipped goodput planner costs 0.2-0.35 ms a step in the engine on the Q4_1 engine (2.5-5% of a
B = 1-4 step), almost all of it cache misses: its code and objects come back from memory after
every forward pass (reports/planner-ab). The design change named for it is a step that touches a
few kilobytes. This measures what such a step costs, in the same cells, before anyone builds it:
``CompactGoodput`` below is the goodput rule in its plainest form (one acceptance rate per
request from a Beta count, drafts given one at a time to the request whose next draft is likeliest
accepted while the step's tokens per second still rise, the step's time from the profile's model
in one call). Plain, it has none of the planner's safeguards (pooled priors by match length, the learned
draft price, exploration, the pause, calibration, SLA): its choices are not the product's, and its
goodput says little; its milliseconds a step are the point.

Each round runs SD off, the shipped planner, the compact rule, and the compact rule with two of
the planner's safeguards in the same flat form (``compact+learned``: pooled priors, a learned
draft price per batch-size bucket), their calls timed where they run
(``planner_cost_in_cell.Recording``), tokens identical in every arm:

    python scripts/compact_decider_cost.py --quantize gguf --profile reports/profile-zen4-q4_1-s34/profile.json \\
        --batch 4 --workloads gsm8k --rounds 6 [--mixed] [--max-tokens 64] [--lookups-only] [--out FILE.json]

``--lookups-only`` adds an arm that says yes to every screen and drafts nothing: what the engine's
speculative path (its lookups for every request) costs a step by itself.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from planner_cost_in_cell import CALLS, Recording

from specplan.bench.coldstart import mixed_prompts
from specplan.bench.evaluate import _engine, add_cell_arguments, cell_prompts, rotated_rounds, run_cell
from specplan.engine import FixedDecider, load_model
from specplan.planner.from_profile import planner_from_profile
from specplan.policies import make_policy
from specplan.profiler.latency_model import StepShape
from specplan.profiler.profile import Profile

PRIOR_ACCEPTED, PRIOR_REJECTED = 1.0, 1.0  # a draft accepted half the time until a request shows otherwise
PRIOR_WEIGHT = 4.0  # with ``learned``: a new request starts from the pooled rate, as 4 drafts' worth
LEVEL_WEIGHT = 0.1  # with ``learned``: the EMAs' weight of the newest step
MAX_K = 8


class CompactGoodput:
    """The goodput rule over flat per-request counts (see the module docstring). ``learned``: two
    of the planner's safeguards in the same flat form, (1) a new request's prior is the pooled
    acceptance of the requests seen so far (PRIOR_WEIGHT drafts' worth), and (2) the profile's price
    of drafts is scaled per batch-size bucket by what steps with drafts measured over the plain
    steps' level (an EMA of measured increment / predicted increment)."""

    def __init__(self, latency, learned: bool = False):
        self.latency = latency  # the profile's fitted model (HingeLatencyModel: ``predict_added``)
        self.learned = learned
        self.accepted: dict[int, float] = {}  # seq_id -> accepted drafts + prior
        self.rejected: dict[int, float] = {}  # seq_id -> verify steps that rejected a draft + prior
        self.pooled = [PRIOR_ACCEPTED, PRIOR_REJECTED]  # every request's counts, summed
        self.plain_level: dict[int, float] = {}  # B bucket -> EMA of measured / predicted, plain steps
        self.price: dict[int, float] = {}  # B bucket -> EMA of measured / predicted draft increment

    def _prior(self) -> tuple[float, float]:
        if not self.learned:
            return PRIOR_ACCEPTED, PRIOR_REJECTED
        a, r = self.pooled
        return PRIOR_WEIGHT * a / (a + r), PRIOR_WEIGHT * r / (a + r)

    def may_speculate(self, outline) -> bool:
        return True

    def decide(self, view) -> list[int]:
        reqs = view.requests
        n = len(reqs)
        ks = [0] * n
        caps, rates, total = [], [], 0
        accepted, rejected = self.accepted, self.rejected
        prior_a, prior_r = self._prior()
        for rv in reqs:
            cap = min(rv.available_drafts or 0, rv.max_k, MAX_K)
            caps.append(cap)
            total += cap
            a = accepted.get(rv.seq_id, prior_a)
            rates.append(a / (a + rejected.get(rv.seq_id, prior_r)))
        if not total:
            return ks
        base = StepShape(n + view.num_prefill_seqs, n + view.num_prefill_tokens, view.context_tokens)
        seconds = self.latency.predict_added(base, total)  # [total + 1]: the step with 0..total drafts
        if self.learned:
            scale = self.price.get(n.bit_length(), 1.0)
            seconds = [seconds[0] + scale * (t - seconds[0]) for t in seconds]
        # The j-th draft of a request is emitted with probability rate^j (geometric acceptance):
        # give the next draft to the request whose next one is likeliest, while tokens/s rise.
        tokens, used = float(n), 0
        best = tokens / seconds[0]
        gain = [r if c else 0.0 for r, c in zip(rates, caps)]
        while used < total:
            i = max(range(n), key=gain.__getitem__)
            g = gain[i]
            if g <= 0.0 or (tokens + g) / seconds[used + 1] <= best:
                break
            tokens, used = tokens + g, used + 1
            best = tokens / seconds[used]
            ks[i] += 1
            gain[i] = g * rates[i] if ks[i] < caps[i] else 0.0
        return ks

    def observe(self, record) -> None:
        accepted, rejected = self.accepted, self.rejected
        prior_a, prior_r = self._prior()
        drafts = 0
        for rr in record.requests:
            if rr.k <= 0 or rr.num_proposed <= 0:
                continue
            drafts += rr.num_proposed
            accepted[rr.seq_id] = accepted.get(rr.seq_id, prior_a) + rr.num_accepted
            self.pooled[0] += rr.num_accepted
            if rr.num_accepted < rr.num_proposed:
                rejected[rr.seq_id] = rejected.get(rr.seq_id, prior_r) + 1.0
                self.pooled[1] += 1.0
        if not self.learned or record.num_prefill_tokens or not record.requests:
            return
        n = len(record.requests)
        bucket = n.bit_length()
        measured = record.forward_s + record.verify_s
        base = StepShape(record.num_seqs, record.num_tokens - drafts, record.context_tokens - drafts)
        curve = self.latency.predict_added(base, drafts)  # [drafts + 1]
        level = self.plain_level.get(bucket)
        if not drafts:
            self.plain_level[bucket] = measured / curve[0] if level is None else (
                level + LEVEL_WEIGHT * (measured / curve[0] - level))
        elif level is not None and curve[-1] > curve[0]:
            ratio = (measured / level - curve[0]) / (curve[-1] - curve[0])  # measured increment / predicted
            ratio = min(4.0, max(0.25, ratio))
            price = self.price.get(bucket, 1.0)
            self.price[bucket] = price + LEVEL_WEIGHT * (ratio - price)


class LookupsOnly:
    """Says yes to every screen (so the engine runs its lookups for every request) and then gives
    no drafts: what a step costs the engine besides any decision."""

    def may_speculate(self, outline) -> bool:
        return True

    def decide(self, view) -> list[int]:
        return [0] * len(view.requests)

    def observe(self, record) -> None:
        pass


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_cell_arguments(ap, proposer="ngram", workloads="gsm8k", rounds=6)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--mixed", action="store_true", help="one cell: the cold-start bench's mixed batch of --batch requests")
    ap.add_argument("--out", type=Path, default=None, help="a JSON of every cell's readings")
    ap.add_argument("--lookups-only", action="store_true", help="also an arm that runs every lookup and drafts nothing")
    args = ap.parse_args()
    results = {}
    profile = Profile.load(args.profile)
    loaded = load_model(None, quantize=args.quantize)
    engine = _engine(loaded, args.proposer, max(args.batch, 32), 8)
    for workload in ["mixed"] if args.mixed else args.workloads.split(","):
        prompts = (mixed_prompts(loaded, args.batch) if args.mixed else
                   cell_prompts(loaded.tokenizer, workload, args.batch, min_requests=args.requests))
        run_cell(engine, prompts, FixedDecider(1), args.max_tokens, concurrency=args.batch)  # warm-up
        reference = None
        arms = ["planner", "compact", "compact+learned"] + (["lookups-only"] if args.lookups_only else [])
        spent = {arm: dict.fromkeys(CALLS, 0.0) for arm in arms}
        steps = dict.fromkeys(spent, 0)
        mean_k = {arm: [] for arm in spent}

        def run_arm(arm: str) -> float:
            nonlocal reference
            if arm == "off":
                decider = FixedDecider(0)
            elif arm == "lookups-only":
                decider = Recording(LookupsOnly())
            else:
                inner = (planner_from_profile(profile, make_policy("goodput"), proposer=args.proposer, max_k=MAX_K)
                         if arm == "planner" else CompactGoodput(profile.model(), learned=arm == "compact+learned"))
                decider = Recording(inner)
            x = run_cell(engine, prompts, decider, args.max_tokens, concurrency=args.batch)
            reference = reference or x["outputs"]
            if x["outputs"] != reference:
                raise RuntimeError(f"{arm} changed the output tokens ({workload})")
            if arm != "off":
                for name in CALLS:
                    spent[arm][name] += decider.seconds[name]
                steps[arm] += decider.steps
                mean_k[arm].append(x["mean_k"])
            return x["goodput"]

        goodput = rotated_rounds(["off"] + arms, args.rounds, run_arm)
        line = [f"{workload} B={args.batch}, {args.max_tokens} tokens, {args.rounds} rounds:"]
        results[workload] = {"goodput": goodput}
        for arm in spent:
            ratio = statistics.median(a / b for a, b in zip(goodput[arm], goodput["off"]))
            ms = {name: 1e3 * s / max(steps[arm], 1) for name, s in spent[arm].items()}
            results[workload][arm] = {"vs_off": ratio, "mean_k": statistics.median(mean_k[arm]), "ms_per_step": ms}
            line.append(f"  {arm}: {ratio:.3f}x off, mean k {statistics.median(mean_k[arm]):.2f}, ms a step "
                        + ", ".join(f"{name} {v:.3f}" for name, v in ms.items())
                        + f" (total {sum(ms.values()):.3f})")
        print("\n".join(line), flush=True)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"args": vars(args) | {"out": str(args.out)}, "cells": results}, indent=1))


if __name__ == "__main__":
    main()
