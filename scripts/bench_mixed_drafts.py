"""What n one-token drafts add to a decode step of B requests, measured beside the profile's price.

The latency profile times steps where every request verifies the same number of tokens T, and
(since profile grids have ``lone_drafts``) a few where one request drafts 1 or 3 tokens; the
planner prices steps where a few requests draft and the rest do not. This times exactly those: B
requests decoding at context ~256, n of them with k = 1 (n = 0 is plain decoding), the values of n
shuffled within each round so the VM's slow and fast minutes hit them alike. Per n it prints the
median forward + verify time over plain decoding and what the cached profile's latency model
predicts for the same step. Measured here at B=16 (20 rounds, every n): with the product kernel
that ran each row block over the whole K, the first draft added 2.7 ms where the profile said
0.73 (17 rows: three row blocks instead of two of 8), then about 0.55 ms per draft; at B=8, odd
draft counts (unequal blocks) cost 2.1-2.3 ms and even ones 1.1-1.3. With every block on each
4 KB chunk in turn (c22423e): B=16 +0.97 ms for the first draft (profile 0.70), +9.0 for 16
(profile 11.3); B=8 +0.4-0.9 for 1-3 drafts, +2.1 for 8. On the Zen 4 VM (2026-11-30, Q4_1, 30
rounds, context 256): the first draft +0.35 ms at B=4 (6.6 ms step), +1.45 at B=8 (11.7 ms), +1.56
at B=16 (21.1 ms), +1.35 at B=32 (38.4 ms), each further one +0.7-0.9 (reports/profile-zen4-q4_1-s34).

A development benchmark: `.venv/bin/python scripts/bench_mixed_drafts.py [B] [rounds] [all]
[--quantize gguf] [--profile P.json]` from the repo root, on a quiet machine (the profile given, else
the cached one, or a quick one measured); `all` times every n from 0 to B + 1 instead of 0, 1, 2,
4, B/2 and B."""
import argparse
import random
import statistics

import torch

from specplan.adaptive import load_or_make_profile
from specplan.engine import load_model
from specplan.profiler.latency_model import StepShape
from specplan.profiler.profile import Profile
from specplan.profiler.step_timer import StepTimer, timing_engine

CONTEXT = 256
STEPS_PER_CELL = 3  # timed after one untimed step of the same shape


def main(batch_size: int, rounds: int, every_count: bool = False, quantize: str | None = None,
         profile: str | None = None) -> None:
    loaded = load_model(None, quantize=quantize)
    latency = (Profile.load(profile) if profile else load_or_make_profile(loaded, None)).model()
    engine = timing_engine(loaded, max_batch=batch_size, max_tokens_per_seq=2, context=CONTEXT)
    timer = StepTimer(engine)  # its proposer drafts random tokens: rejected, so a step adds one token
    decider = timer.decider

    def refill() -> None:  # B fresh requests at CONTEXT tokens, before they run out of room
        decider.drafting = None
        timer.fill(batch_size, CONTEXT)  # plain steps while the prompts prefill
        decider.k = 1

    refill()
    room = engine.max_model_len - CONTEXT - 64  # steps a fill lasts, with some margin
    steps = 0
    counts = list(range(batch_size + 2)) if every_count else sorted({0, 1, 2, 4, batch_size // 2, batch_size})
    seconds: dict[int, list[float]] = {n: [] for n in counts}
    contexts: dict[int, list[int]] = {n: [] for n in counts}
    rng = random.Random(0)
    order = list(counts)
    for _ in range(rounds):
        rng.shuffle(order)
        if steps + len(order) * (1 + STEPS_PER_CELL) > room:
            refill()
            steps = 0
        for n in order:
            decider.drafting = n
            for i in range(1 + STEPS_PER_CELL):
                engine.step()
                steps += 1
                if len(engine.scheduler.running) != batch_size:
                    raise RuntimeError("a request finished or was preempted mid-round")
                if i:
                    rec = decider.records[-1]
                    seconds[n].append(rec.forward_s + rec.verify_s)
                    contexts[n].append(rec.context_tokens)
    plain = statistics.median(seconds[0])
    context = int(statistics.median(contexts[0]))
    predicted_plain = latency.predict(StepShape(batch_size, batch_size, context))
    print(f"B={batch_size}, context {CONTEXT}: plain step {1e3 * plain:.2f} ms measured, "
          f"{1e3 * predicted_plain:.2f} ms predicted ({rounds} rounds x {STEPS_PER_CELL} steps)")
    print("drafts  measured +ms  profile +ms")
    for n in counts[1:]:
        measured = statistics.median(seconds[n]) - plain
        predicted = latency.predict(StepShape(batch_size, batch_size + n, context)) - predicted_plain
        print(f"{n:6d}  {1e3 * measured:11.2f}  {1e3 * predicted:11.2f}")


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("batch", nargs="?", type=int, default=16)
    ap.add_argument("rounds", nargs="?", type=int, default=40)
    ap.add_argument("every", nargs="?", choices=["all"], default=None)
    ap.add_argument("--quantize", default=None, help="as specplan evaluate's --quantize (gguf: the Q4_1 engine)")
    ap.add_argument("--profile", default=None)
    args = ap.parse_args()
    with torch.inference_mode():
        main(args.batch, args.rounds, args.every == "all", args.quantize, args.profile)
