"""A/B: the suffix proposer asked before the planner decides (ahead) vs after (the old path).

Ahead, the engine proposes each request's tree for its cap first, so the goodput planner sees how
many drafts exist and the match length that found them (one acceptance belief per match-length
bucket), then keeps the first k nodes. After is the path before that change: the planner decides
k from one belief per request, then the proposer is asked for k (the script hides the match
length in that arm, as the proposer did not report one then).

Both arms run in one engine over the same requests, interleaved with static:0 (off), static:2
and static:3, in an order rotated each repeat. Per cell it prints the median goodputs and the
paired ratios (medians over repeats of ratios within a repeat).

A development benchmark: `.venv/bin/python scripts/bench_suffix_lookahead.py 1,32 3` from the repo
root (batch sizes, repeats, optional comma-separated workloads), on a quiet machine; it writes the
per-run goodputs to suffix-lookahead-<batch sizes>.json in the current directory.
"""
import statistics
import sys

from _ab import median_goodput, paired, run_grid
from specplan.bench import evaluate as ev
from specplan.adaptive import load_or_make_profile
from specplan.engine.decider import FixedDecider
from specplan.engine.model.loader import load_model
from specplan.engine.proposers.suffix import SuffixProposer
from specplan.planner.from_profile import planner_from_profile

STATIC = ("static:0", "static:2", "static:3")


def main(batch_sizes: list[int], repeats: int, workloads: list[str]) -> None:
    loaded = load_model(None)
    profile = load_or_make_profile(loaded, None)
    engine = ev._engine(loaded, "suffix", max(batch_sizes), 8)

    def goodput() -> object:
        return planner_from_profile(profile, "goodput", proposer="suffix", max_k=8)

    arms = {"ahead": (goodput, SuffixProposer), "after": (goodput, proposer_asked_after)}
    arms.update({name: (lambda k=int(name[7:]): FixedDecider(k), SuffixProposer) for name in STATIC})
    run_grid(loaded, engine, workloads, batch_sizes, repeats, lambda prompts, b: arms, summary,
             f"suffix-lookahead-{','.join(map(str, batch_sizes))}.json")


def proposer_asked_after() -> SuffixProposer:
    """The old path: asked after deciding, no match length reported."""
    proposer = SuffixProposer()
    proposer.proposes_prefixes = False

    def old_propose(seqs, k, propose=proposer.propose):
        drafts = propose(seqs, k)
        drafts.match_length = None
        return drafts
    proposer.propose = old_propose
    return proposer


def summary(workload: str, batch: int, runs: dict[str, list[dict]]) -> str:
    med = median_goodput(runs)
    best = max(STATIC[1:], key=lambda name: med[name])
    mean_k = {name: statistics.median(r["mean_k"] for r in runs[name]) for name in ("ahead", "after")}
    return (f"{workload} B={batch}: " + " ".join(f"{n} {g:.1f}" for n, g in med.items())
            + f" | ahead/after {paired(runs, 'ahead', 'after'):.3f}"
            + f" | vs off: ahead {paired(runs, 'ahead', 'static:0'):.3f} after {paired(runs, 'after', 'static:0'):.3f}"
            + f" | vs {best}: ahead {paired(runs, 'ahead', best):.3f} after {paired(runs, 'after', best):.3f}"
            + f" | mean k ahead {mean_k['ahead']:.2f} after {mean_k['after']:.2f}")


if __name__ == "__main__":
    main([int(b) for b in sys.argv[1].split(",")], int(sys.argv[2]),
         sys.argv[3].split(",") if len(sys.argv) > 3 else list(ev.WORKLOADS))
