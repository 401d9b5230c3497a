"""Offline: how much any policy that picks k from the n-gram match length can earn, next to the
best single k and the clairvoyant ceiling, under a linear row cost. No timing, so the machine
need not be quiet.

Held-out prompts (as scripts/measure_match_acceptance.py: 24 per workload the evaluation does not
use) run greedy with SD off and are replayed through the n-gram proposer. A request-step with k
drafts then emits 1 + min(k, drafts, accepted) tokens and costs 1 + c * min(k, drafts) (c: one
row's cost as a share of a request's part of a step). c = 0.045 is a B=1 step here (a draft costs
3.5-6% of one: the engine grid, and static k=8 vs k=4 in reports/evaluation-r5); 0.16 only shows
the trend as rows get dearer. The linear model is for B=1 and small B: compute-bound steps (B=16
and up) do not cost linearly per row (reports/evaluation-clairvoyant reads the ceiling level with
off there). Per workload and c it prints tokens per unit cost for: the best single k, the best k per
match-length bucket (planner/acceptance.py ``match_bucket``), both chosen in hindsight, the best k
per bucket split again by how sure the target was of the last committed token (its top
probability above 0.9 or not: known before the step, from the step before), and the clairvoyant
(k = accepted), with ratios to the best single k. The per-bucket value bounds
what one k per bucket can buy, which is how the planner prices drafts (its per-request evidence
on top can move a request within its bucket); the clairvoyant's needs each step's outcome.

`.venv/bin/python scripts/bucket_hindsight.py` from the repo root (about two minutes).
"""
from collections import defaultdict

import torch
from transformers import AutoModelForCausalLM

from specplan.bench import evaluate as ev
from specplan.engine import load_model
from specplan.planner.acceptance import match_bucket

PROMPTS, MAX_TOKENS, MAX_K = 24, 64, 8
ROW_COSTS = (0.045, 0.16)


def rate(steps, k_of) -> float:
    """Tokens per unit cost when a request-step (bucket, drafts, accepted) gets k_of(bucket) drafts."""
    tokens = cost = 0.0
    for bucket, drafts, accepted, c in steps:
        k = min(k_of(bucket), drafts)
        tokens += 1 + min(k, accepted)
        cost += 1 + c * k
    return tokens / cost


def best_per_bucket(steps) -> float:
    """max over k per bucket of total tokens / total cost (Dinkelbach: a ratio of sums)."""
    by_bucket = defaultdict(list)
    for s in steps:
        by_bucket[s[0]].append(s)
    value = 1.0
    for _ in range(30):
        ks = {b: max(range(MAX_K + 1), key=lambda k: sum(1 + min(k, d, a) - value * (1 + c * min(k, d))
                                                         for _, d, a, c in group))
              for b, group in by_bucket.items()}
        value = rate(steps, ks.__getitem__)
    return value


def last_token_confidence(model, prompt: list[int], output: list[int]) -> list[float]:
    """Per output length p: the target's probability of the last committed token's argmax when
    it produced that token (position len(prompt) + p - 2 of prompt + output)."""
    with torch.inference_mode():
        probs = torch.softmax(model(torch.tensor([prompt + output])).logits[0].float(), -1)  # [L, V]
    top = probs.max(-1).values  # [L]
    return [top[len(prompt) + p - 2].item() for p in range(len(output))]


def main() -> None:
    loaded = load_model(None)
    engine = ev._engine(loaded, "ngram", PROMPTS, draft_layers=8)
    hf = AutoModelForCausalLM.from_pretrained(loaded.path, dtype=torch.float32).eval()
    print("workload      c  best k  per bucket  +confidence  clairvoyant  bucket/k  +confidence/k  clairvoyant/k")
    for w in ev.WORKLOADS:
        held_out = ev.held_out_prompts(loaded.tokenizer, w, PROMPTS)
        reference, table = ev.replayed_reference(engine, held_out, MAX_TOKENS, concurrency=PROMPTS)
        replayed = [r for steps in table for r in steps]
        sure = [top > 0.9 for prompt, output in zip(held_out, reference)
                for top in last_token_confidence(hf, list(prompt), list(output))]
        for c in ROW_COSTS:
            steps = [(match_bucket(r.match_length), r.num_drafts, r.accepted, c) for r in replayed]
            static = max(rate(steps, lambda b, k=k: k) for k in range(MAX_K + 1))
            bucketed = best_per_bucket(steps)
            by_confidence = best_per_bucket([((b, s), d, a, c) for (b, d, a, c), s in zip(steps, sure, strict=True)])
            # the clairvoyant's "bucket" is the step's accepted length, and it asks for exactly that
            clairvoyant = rate([(r.accepted, r.num_drafts, r.accepted, c) for r in replayed], lambda b: b)
            print(f"{w:10s} {c:5.3f}  {static:6.3f}  {bucketed:10.3f}  {by_confidence:11.3f}  {clairvoyant:11.3f}"
                  f"  {bucketed / static:8.3f}  {by_confidence / static:13.3f}  {clairvoyant / static:13.3f}", flush=True)


if __name__ == "__main__":
    main()
