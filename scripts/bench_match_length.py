"""A/B: the n-gram match length followed back to 16 tokens (long) vs cut at the 4-gram (short).

Long is the current path: the proposer reports how far back the matched 4-gram keeps agreeing
(up to 16 tokens) and the planner keeps beliefs for matches of 4-7, 8-15 and 16+ tokens, whose
first drafts are accepted 73/87/93% of the time (scripts/measure_match_acceptance.py). Short is
the path before: lengths cut at 4, one bucket for every match of 4 or more, with the prior it had
then (first draft 80%, later 85%).

Both arms run the goodput policy in one engine over the same requests, interleaved with static:0
(off), static:1, static:2 and the clairvoyant ceiling (specplan/clairvoyant.py; it needs each
cell's outputs, so an unrecorded SD-off run comes first), in an order rotated each repeat. Per
cell it prints the median goodputs and the paired ratios.

With ``suffix`` as the fourth argument it runs the same A/B for the suffix proposer, whose
matches run to 24 tokens: short cuts its reported lengths at 4, so they share one bucket from 4
on as before (its prior has no per-length values). No clairvoyant arm there: suffix drafts also
depend on other requests' outputs.

A development benchmark: `.venv/bin/python scripts/bench_match_length.py 1,4,16,32 3` from the
repo root (batch sizes, repeats, optional comma-separated workloads, optional proposer), on a
quiet machine; it writes the per-run goodputs to match-length-<proposer>-<batch sizes>.json in
the current directory.
"""
import dataclasses
import statistics
import sys

from _ab import median_goodput, paired, run_grid
from specplan.bench import evaluate as ev
from specplan.adaptive import load_or_make_profile
from specplan.engine.decider import FixedDecider
from specplan.engine.model.loader import load_model
from specplan.engine.proposers.ngram import NgramProposer
from specplan.engine.proposers.suffix import SuffixProposer
from specplan.planner.acceptance import default_prior
from specplan.planner.from_profile import planner_from_profile

STATIC = ("static:0", "static:1", "static:2")
# The n-gram prior before match lengths were followed back: buckets 1-3, and 4 for every longer match.
SHORT_PRIOR = dataclasses.replace(default_prior("ngram"),
                                  by_match_length=((0.2, 0.65), (0.5, 0.75), (0.65, 0.75), (0.8, 0.85)))


def main(batch_sizes: list[int], repeats: int, workloads: list[str], proposer: str = "ngram") -> None:
    loaded = load_model(None)
    profile = load_or_make_profile(loaded, None)
    engine = ev._engine(loaded, proposer, max(batch_sizes), 8)
    if proposer == "ngram":
        make, make_short, short_priors = NgramProposer, lambda: NgramProposer(max_match_length=4), {"ngram": SHORT_PRIOR}
    elif proposer == "suffix":
        make, make_short, short_priors = SuffixProposer, lambda: lengths_cut_at_4(SuffixProposer()), None
    else:
        raise SystemExit(f"proposer must be ngram or suffix, not {proposer!r}")
    arms = {
        "long": (lambda: planner_from_profile(profile, "goodput", proposer=proposer, max_k=8), make),
        "short": (lambda: planner_from_profile(profile, "goodput", proposer=proposer, max_k=8, priors=short_priors),
                  make_short),
    }
    arms.update({name: (lambda k=int(name[7:]): FixedDecider(k), make) for name in STATIC})

    def arms_for(prompts: list[list[int]], batch: int) -> dict:
        if proposer != "ngram":
            return arms
        _, make_clairvoyant = ev.clairvoyant_for(engine, prompts, 64, batch)
        return dict(arms, clairvoyant=(make_clairvoyant, NgramProposer))

    run_grid(loaded, engine, workloads, batch_sizes, repeats, arms_for, summary,
             f"match-length-{proposer}-{','.join(map(str, batch_sizes))}.json")


def lengths_cut_at_4(proposer):
    """The proposer, reporting match lengths of at most 4 (one bucket from 4 on, as before)."""
    def propose(seqs, k, inner=proposer.propose):
        drafts = inner(seqs, k)
        if drafts.match_length is not None:
            drafts.match_length = [min(m, 4) for m in drafts.match_length]
        return drafts
    proposer.propose = propose
    return proposer


def summary(workload: str, batch: int, runs: dict[str, list[dict]]) -> str:
    med = median_goodput(runs)
    best = max(STATIC, key=lambda name: med[name])
    mean_k = {name: statistics.median(r["mean_k"] for r in runs[name]) for name in ("long", "short")}
    return (f"{workload} B={batch}: " + " ".join(f"{n} {g:.1f}" for n, g in med.items())
            + f" | long/short {paired(runs, 'long', 'short'):.3f}"
            + f" | vs off: long {paired(runs, 'long', 'static:0'):.3f} short {paired(runs, 'short', 'static:0'):.3f}"
            + f" | vs {best}: long {paired(runs, 'long', best):.3f} short {paired(runs, 'short', best):.3f}"
            + (f" | vs clairvoyant: long {paired(runs, 'long', 'clairvoyant'):.3f}"
               f" short {paired(runs, 'short', 'clairvoyant'):.3f}" if "clairvoyant" in runs else "")
            + f" | mean k long {mean_k['long']:.2f} short {mean_k['short']:.2f}")


if __name__ == "__main__":
    main([int(b) for b in sys.argv[1].split(",")], int(sys.argv[2]),
         sys.argv[3].split(",") if len(sys.argv) > 3 and sys.argv[3] else list(ev.WORKLOADS),
         sys.argv[4] if len(sys.argv) > 4 else "ngram")
