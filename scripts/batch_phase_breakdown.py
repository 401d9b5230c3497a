"""Where a closed-loop cell's time goes, by how many requests were running (issue #33, the B = 4
cells, and #36's Q4_1 ones with ``--quantize gguf --proposer ngram``): the evaluation's cell
(max(B, --requests) requests of one workload queued at once, at most B running, 64 tokens each),
run by static k and by the goodput policy in turn (the chain proposer unless told); for every step
the number of decoding requests, its seconds, emitted tokens and drafts, summed per batch size
(steps that also ran a prompt chunk apart), and the full-batch steps' tokens per second.

A policy can emit more tokens per second than a static k while the batch is full and still lose
the cell: if it drafts for some requests much more than for others (a request whose lookup copies
its prompt), those finish first and the rest run on in a smaller, less efficient batch, a drain a
server with a queue would refill.

    python scripts/batch_phase_breakdown.py --profile P.json --workload mtbench --batch 4 --static-k 0,1 --rounds 2
    python scripts/batch_phase_breakdown.py --profile P.json --quantize gguf --proposer ngram --batch 4 --requests 16 --static-k 0,1
"""

from __future__ import annotations

import argparse
import collections
import json
from pathlib import Path

from specplan.bench.evaluate import _engine, cell_prompts, run_cell
from specplan.engine import FixedDecider, load_model
from specplan.planner.controller import Planner
from specplan.planner.from_profile import planner_from_profile
from specplan.policies import make_policy
from specplan.profiler.profile import Profile

MAX_TOKENS = 64


class _Steps:
    """Mixed into a decider: every step's (decodes, seconds, emitted, drafts, carried a prefill chunk)."""

    def observe(self, record) -> None:
        self.steps.append((len(record.requests), record.total_s, sum(r.num_emitted for r in record.requests),
                           sum(r.num_proposed for r in record.requests), record.num_prefill_tokens > 0))
        super().observe(record)


class LoggedStatic(_Steps, FixedDecider):
    pass


class LoggedPlanner(_Steps, Planner):
    pass


def phases(steps: list[tuple[int, float, int, int, bool]]) -> dict[str, dict[str, float]]:
    """Sums per number of decoding requests: "4" for decode-only steps of 4, "4+prefill" for steps
    of 4 decodes that also ran a prompt chunk."""
    out: dict[str, dict[str, float]] = collections.defaultdict(lambda: {"steps": 0, "seconds": 0.0, "emitted": 0,
                                                                       "drafts": 0})
    for n, seconds, emitted, drafts, prefill in sorted(steps, key=lambda s: (s[0], s[4])):
        cell = out[f"{n}+prefill" if prefill else str(n)]
        cell["steps"] += 1
        cell["seconds"] += seconds
        cell["emitted"] += emitted
        cell["drafts"] += drafts
    return dict(out)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--profile", required=True)
    ap.add_argument("--workload", default="mtbench")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--static-k", default="1", help="static k's run beside the policy, comma-separated (e.g. 0,1)")
    ap.add_argument("--policy", default="goodput")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--proposer", default="chain")
    ap.add_argument("--quantize", default=None, help="as specplan evaluate's --quantize (e.g. gguf: the Q4_1 engine)")
    ap.add_argument("--out", type=Path, default=None, help="a JSON of every round's phases")
    ap.add_argument("--requests", type=int, default=4, help="requests a cell at least (evaluate's --min-requests)")
    args = ap.parse_args()
    profile = Profile.load(args.profile)
    loaded = load_model(None, quantize=args.quantize)
    engine = _engine(loaded, args.proposer, args.batch, 8)
    prompts = cell_prompts(loaded.tokenizer, args.workload, args.batch, min_requests=args.requests)
    run_cell(engine, prompts, FixedDecider(1), MAX_TOKENS, concurrency=args.batch)  # warm-up
    results = []
    for r in range(args.rounds):
        for name in [f"static:{k}" for k in args.static_k.split(",")] + [args.policy]:
            if name.startswith("static:"):
                decider = LoggedStatic(int(name.removeprefix("static:")))
            else:
                decider = planner_from_profile(profile, make_policy(name), proposer=args.proposer, max_k=8)
                decider.__class__ = LoggedPlanner
            decider.steps = []
            x = run_cell(engine, prompts, decider, MAX_TOKENS, concurrency=args.batch)
            by_batch = phases(decider.steps)
            full = by_batch.get(str(args.batch), {"seconds": 0.0, "emitted": 0})
            print(f"round {r} {name}: {x['goodput']:.1f} tok/s over the cell; full-batch steps "
                  f"{full['emitted'] / max(full['seconds'], 1e-9):.0f} tok/s; by running requests "
                  + ", ".join(f"{b}: {c['steps']} steps {c['seconds']:.2f} s {c['emitted']} tokens" for b, c in by_batch.items()),
                  flush=True)
            results.append({"round": r, "decider": name, "goodput": x["goodput"], "phases": by_batch})
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
