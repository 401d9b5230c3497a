"""How often n-gram drafts are accepted, by the match length that found them: the planner's priors.

For each workload, 24 prompts the evaluation does not use (it draws 32 with seed 0) run greedy with
SD off; each request's output is then replayed through a fresh n-gram proposer at every output
length (specplan/bench/clairvoyant.py ``replay``): its drafts against what the target really emitted
next. Per match-length bucket (planner/acceptance.py ``match_bucket``), it prints the first
draft's acceptance and each later draft's, given the ones before it were accepted: the numbers
behind ``DEFAULT_PRIORS["ngram"].by_match_length``.

A measurement, not a benchmark: `.venv/bin/python scripts/measure_match_acceptance.py` from the
repo root (about a minute); timing does not matter, so the machine need not be quiet.
"""
from collections import defaultdict

from specplan.bench import evaluate as ev
from specplan.engine import load_model
from specplan.planner.acceptance import match_bucket

PROMPTS, MAX_TOKENS = 24, 64


def main() -> None:
    loaded = load_model(None)
    engine = ev._engine(loaded, "ngram", PROMPTS, draft_layers=8)  # the evaluation's (unused by n-gram)
    # (workload or "all", bucket) -> [first drafts judged, accepted, later drafts judged, accepted]
    counts: dict[tuple[str, int], list[int]] = defaultdict(lambda: [0, 0, 0, 0])
    for w in ev.WORKLOADS:
        held_out = ev.held_out_prompts(loaded.tokenizer, w, PROMPTS)
        _, replayed = ev.replayed_reference(engine, held_out, MAX_TOKENS, concurrency=PROMPTS)
        for steps in replayed:
            for r in steps:
                if r.num_drafts == 0:
                    continue
                for key in ((w, match_bucket(r.match_length)), ("all", match_bucket(r.match_length))):
                    c = counts[key]
                    c[0] += 1
                    c[1] += r.accepted > 0
                    if r.accepted > 0:  # drafts 2.. were judged up to the first rejection
                        c[2] += min(r.accepted + 1, r.num_drafts) - 1
                        c[3] += r.accepted - 1
    print("workload   bucket  first drafts  accepted  later drafts  accepted")
    for (w, bucket), (n1, a1, n2, a2) in sorted(counts.items()):
        print(f"{w:10s} {bucket:6d}  {n1:12d}  {a1 / n1:8.2f}  {n2:12d}  {a2 / max(n2, 1):8.2f}")


if __name__ == "__main__":
    main()
