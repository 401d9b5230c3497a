"""A/B: acceptance calibration per match bucket (per-bucket) vs one factor for all (global) vs none.

The planner scales each draft's expected yield by accepted / expected over the drafts it chose
(planner/calibration.py). Per-bucket is the current path: one such factor per match-length bucket,
as the acceptance beliefs are. Global is the path before: one factor over every bucket, so what
long matches yield moves the price of short ones too (within one B=1 cell it swung 0.62-1.19).
None: each request's posterior as is.

All three run the goodput policy in one engine over the same requests, interleaved with static:0
(off), static:1, static:2 and the clairvoyant ceiling (specplan/clairvoyant.py; an unrecorded
SD-off run per cell gives its outputs), in an order rotated each repeat. Per cell it prints the
median goodputs and the paired ratios.

A development benchmark: `.venv/bin/python scripts/bench_calibration.py 1,4 5` from the repo root
(batch sizes, repeats, optional comma-separated workloads), on a quiet machine; it writes the
per-run goodputs to calibration-<batch sizes>.json in the current directory.
"""
import statistics
import sys

from _ab import median_goodput, paired, run_grid
from specplan import evaluate as ev
from specplan.adaptive import load_or_make_profile
from specplan.engine.decider import FixedDecider
from specplan.engine.loader import load_model
from specplan.engine.proposers.ngram import NgramProposer
from specplan.planner.controller import Planner
from specplan.planner.from_profile import planner_from_profile

STATIC = ("static:0", "static:1", "static:2")
PLANNERS = ("per-bucket", "global", "none")


class GlobalCalibration(Planner):
    """The planner with one calibration shared by every match bucket."""

    def calibration_for(self, bucket):
        return super().calibration_for(None)


def main(batch_sizes: list[int], repeats: int, workloads: list[str]) -> None:
    loaded = load_model(None)
    profile = load_or_make_profile(loaded, None)
    engine = ev._engine(loaded, "ngram", max(batch_sizes), draft_layers=8)

    def goodput(**options):
        return lambda: planner_from_profile(profile, "goodput", proposer="ngram", max_k=8, **options)

    def global_calibration():
        planner = planner_from_profile(profile, "goodput", proposer="ngram", max_k=8)
        planner.__class__ = GlobalCalibration
        return planner

    arms = {"per-bucket": (goodput(), NgramProposer), "global": (global_calibration, NgramProposer),
            "none": (goodput(calibration=None), NgramProposer)}
    arms.update({name: (lambda k=int(name[7:]): FixedDecider(k), NgramProposer) for name in STATIC})

    def arms_for(prompts: list[list[int]], batch: int) -> dict:
        _, make_clairvoyant = ev.clairvoyant_for(engine, prompts, 64, batch)
        return dict(arms, clairvoyant=(make_clairvoyant, NgramProposer))

    run_grid(loaded, engine, workloads, batch_sizes, repeats, arms_for, summary,
             f"calibration-{','.join(map(str, batch_sizes))}.json")


def summary(workload: str, batch: int, runs: dict[str, list[dict]]) -> str:
    med = median_goodput(runs)
    best = max(STATIC, key=lambda name: med[name])
    mean_k = {name: statistics.median(r["mean_k"] for r in runs[name]) for name in PLANNERS}
    return (f"{workload} B={batch}: " + " ".join(f"{n} {g:.1f}" for n, g in med.items())
            + f" | per-bucket/global {paired(runs, 'per-bucket', 'global'):.3f}"
            + f" | per-bucket/none {paired(runs, 'per-bucket', 'none'):.3f}"
            + " | vs static:0: " + " ".join(f"{n} {paired(runs, n, 'static:0'):.3f}" for n in PLANNERS)
            + f" | vs {best}: " + " ".join(f"{n} {paired(runs, n, best):.3f}" for n in PLANNERS)
            + " | vs clairvoyant: " + " ".join(f"{n} {paired(runs, n, 'clairvoyant'):.3f}" for n in PLANNERS)
            + " | mean k " + " ".join(f"{n} {mean_k[n]:.2f}" for n in PLANNERS))


if __name__ == "__main__":
    main([int(b) for b in sys.argv[1].split(",")], int(sys.argv[2]),
         sys.argv[3].split(",") if len(sys.argv) > 3 and sys.argv[3] else list(ev.WORKLOADS))
