"""A/B: contested n-gram matches in a belief of their own (on) vs pooled with the rest (off).

On is the current path: the n-gram proposer says when a match is contested (the matched text was
followed by something else at every earlier occurrence but the one drafted from) and the planner
keeps one belief for those, whose first draft is accepted 14% of the time, against 28-93% for
uncontested matches by length (scripts/measure_match_acceptance.py). Off is the path before: the
flag is dropped, every match is priced by its length alone, with the priors of then (first draft
20/50/65/73/87/93% after 1, 2, 3, 4-7, 8-15, 16+ tokens).

A third arm, on-old, splits contested matches off but keeps the old priors for the rest. All three
run the goodput policy in one engine over the same requests, interleaved with static:0
(off), static:1, static:2 and the clairvoyant ceiling (specplan/clairvoyant.py; an unrecorded
SD-off run per cell gives its outputs), in an order rotated each repeat. Per cell it prints the
median goodputs and the paired ratios.

A development benchmark: `.venv/bin/python scripts/bench_contested.py 1,4 3` from the repo root
(batch sizes, repeats, optional comma-separated workloads), on a quiet machine; it writes the
per-run goodputs to contested-<batch sizes>.json in the current directory.
"""
import dataclasses
import statistics
import sys

from _ab import median_goodput, paired, run_grid
from specplan import evaluate as ev
from specplan.adaptive import load_or_make_profile
from specplan.engine.decider import FixedDecider
from specplan.engine.loader import load_model
from specplan.engine.proposers.ngram import NgramProposer
from specplan.planner.acceptance import default_prior
from specplan.planner.from_profile import planner_from_profile

STATIC = ("static:0", "static:1", "static:2")
# The n-gram prior before contested matches had a bucket (measured over all matches of each length).
BLIND_PRIOR = dataclasses.replace(default_prior("ngram"), contested=None, by_match_length=(
    (0.2, 0.65), (0.5, 0.75), (0.65, 0.75), (0.73, 0.82), (0.87, 0.9), (0.93, 0.94)))


def blind_proposer() -> NgramProposer:
    """An n-gram proposer that never reports a contested match."""
    proposer = NgramProposer()

    def propose(seqs, k, inner=proposer.propose):
        drafts = inner(seqs, k)
        drafts.contested = None
        return drafts
    proposer.propose = propose
    return proposer


def main(batch_sizes: list[int], repeats: int, workloads: list[str]) -> None:
    loaded = load_model(None)
    profile = load_or_make_profile(loaded, None)
    engine = ev._engine(loaded, "ngram", max(batch_sizes), draft_layers=8)
    arms = {
        "on": (lambda: planner_from_profile(profile, "goodput", proposer="ngram", max_k=8), NgramProposer),
        "off": (lambda: planner_from_profile(profile, "goodput", proposer="ngram", max_k=8,
                                             priors={"ngram": BLIND_PRIOR}), blind_proposer),
    }
    # On with the old priors for uncontested matches: whether the new priors or the split itself moves k.
    arms["on-old"] = (lambda: planner_from_profile(profile, "goodput", proposer="ngram", max_k=8,
                                                   priors={"ngram": dataclasses.replace(BLIND_PRIOR, contested=(0.14, 0.66))}),
                      NgramProposer)
    arms.update({name: (lambda k=int(name[7:]): FixedDecider(k), NgramProposer) for name in STATIC})

    def arms_for(prompts: list[list[int]], batch: int) -> dict:
        _, make_clairvoyant = ev.clairvoyant_for(engine, prompts, 64, batch)
        return dict(arms, clairvoyant=(make_clairvoyant, NgramProposer))

    run_grid(loaded, engine, workloads, batch_sizes, repeats, arms_for, summary,
             f"contested-{','.join(map(str, batch_sizes))}.json")


def summary(workload: str, batch: int, runs: dict[str, list[dict]]) -> str:
    med = median_goodput(runs)
    best = max(STATIC, key=lambda name: med[name])
    mean_k = {name: statistics.median(r["mean_k"] for r in runs[name]) for name in ("on", "off")}
    return (f"{workload} B={batch}: " + " ".join(f"{n} {g:.1f}" for n, g in med.items())
            + f" | on/off {paired(runs, 'on', 'off'):.3f}"
            + f" | vs static:0: on {paired(runs, 'on', 'static:0'):.3f} off {paired(runs, 'off', 'static:0'):.3f}"
            + f" | vs {best}: on {paired(runs, 'on', best):.3f} off {paired(runs, 'off', best):.3f}"
            + f" | vs clairvoyant: on {paired(runs, 'on', 'clairvoyant'):.3f} off {paired(runs, 'off', 'clairvoyant'):.3f}"
            + f" | on-old/off {paired(runs, 'on-old', 'off'):.3f}"
            + f" | mean k on {mean_k['on']:.2f} off {mean_k['off']:.2f}")


if __name__ == "__main__":
    main([int(b) for b in sys.argv[1].split(",")], int(sys.argv[2]),
         sys.argv[3].split(",") if len(sys.argv) > 3 and sys.argv[3] else list(ev.WORKLOADS))
