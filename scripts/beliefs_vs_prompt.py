"""Do a workload's saved beliefs fit the prompt they are used on? Per n-gram match bucket, the
acceptance of the cold-start bench's test prompt against the prompts its beliefs were saved from
(specplan/bench/coldstart.py: the evaluation's first prompt of the workload, and the 8 held-out
prompts of ``held_out_prompts``), and against a saved beliefs file.

Each prompt set runs greedy at B = 1 with a fixed k = 8 (every draft the lookup found is verified),
fp32, 128 tokens. Per bucket it prints (steps that drafted, first draft accepted, later draft
accepted given the ones before it). A measurement, not a benchmark: the machine need not be quiet.

    python scripts/beliefs_vs_prompt.py --workloads humaneval,xsum \\
        --beliefs reports/coldstart-xeon-s21/beliefs-humaneval.json
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict

from specplan.bench.coldstart import _prompts
from specplan.bench.evaluate import _engine, held_out_prompts, run_cell
from specplan.engine import FixedDecider, load_model
from specplan.planner.acceptance import match_bucket

MAX_TOKENS, TRAIN_PROMPTS = 128, 8


class Recorder(FixedDecider):
    """A fixed k that keeps (match bucket, drafts proposed, accepted) of every step that drafted."""

    def __init__(self, k: int):
        super().__init__(k)
        self.rows: list[tuple[int | None, int, int]] = []

    def observe(self, record) -> None:
        self.rows += [(match_bucket(r.match_length), r.num_proposed, r.num_accepted)
                      for r in record.requests if r.num_proposed]


def by_bucket(rows) -> dict:
    """bucket -> (steps, first accepted, later accepted): a later draft is judged only when every
    draft before it was accepted (one rejection ends a step's judging)."""
    grouped = defaultdict(list)
    for bucket, proposed, accepted in rows:
        grouped[bucket].append((proposed, accepted))
    out = {}
    for bucket, steps in sorted(grouped.items(), key=lambda x: x[0] or 0):
        first = sum(a > 0 for _, a in steps) / len(steps)
        judged = sum(min(a, p - 1) + (0 < a < p) for p, a in steps)  # positions >= 2 that were judged
        later = sum(max(0, a - 1) for _, a in steps)
        out[bucket] = (len(steps), round(first, 2), round(later / judged, 2) if judged else None)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workloads", default="humaneval,xsum")
    ap.add_argument("--beliefs", action="append", default=[], help="a saved beliefs JSON to print beside")
    args = ap.parse_args()
    loaded = load_model(None)
    engine = _engine(loaded, "ngram", 1, 8, kv_cache_mib=256)
    for workload in args.workloads.split(","):
        for name, prompts in (("test", _prompts(loaded, workload, 1)),
                              ("train", held_out_prompts(loaded.tokenizer, workload, TRAIN_PROMPTS))):
            recorder = Recorder(8)
            run_cell(engine, prompts, recorder, MAX_TOKENS, concurrency=1)
            print(f"{workload} {name}: bucket -> (steps, first accepted, later accepted) {by_bucket(recorder.rows)}")
    for path in args.beliefs:
        for key, pool in json.load(open(path))["acceptance"].items():
            c = pool["counts"]
            first = c["first_accepted"] / max(1e-9, c["first_accepted"] + c["first_rejected"])
            later = c["accepted"] / max(1e-9, c["accepted"] + c["rejected"])
            print(f"{path}: {key} first {first:.2f} later {later:.2f} "
                  f"({c['first_accepted'] + c['first_rejected']:.0f} discounted steps of evidence)")


if __name__ == "__main__":
    main()
