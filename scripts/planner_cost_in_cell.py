"""What the goodput planner's own time costs a closed-loop cell, apart from what its choices are
worth: each round runs SD off, static k, the planner (recording every screen answer and every k it
chose), and then the planner's choices replayed by a decider that only reads them back. Greedy
outputs are the same in every arm, so the engine makes the same calls in the same order and the
replay answers each one as the planner did, at no cost of its own:

  planner / replay  the cell's goodput lost to planning (screens, decisions, learning from steps)
  replay / off      what the planner's choices are worth with planning free

The planner's calls are also timed where they run (ms per step, in the engine, caches cold after
each forward pass). Arms other than the replay rotate their order each round; the replay always
runs right after the planner it replays.

    python scripts/planner_cost_in_cell.py --quantize gguf --profile reports/profile-xeon-q4_1/profile.json \\
        --proposer ngram --batch 4 --rounds 5 [--requests 16] [--max-tokens 64] [--out FILE.json]

With ``--mixed`` the one cell is ``specplan bench coldstart``'s mixed batch instead (every workload
in one batch of --batch requests), e.g. ``--mixed --batch 16 --max-tokens 128`` as that bench runs it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from specplan.bench.coldstart import mixed_prompts
from specplan.bench.evaluate import _engine, add_cell_arguments, cell_prompts, rotated_rounds, run_cell
from specplan.engine import FixedDecider, load_model
from specplan.planner.from_profile import planner_from_profile
from specplan.policies import make_policy
from specplan.profiler.profile import Profile

MAX_TOKENS = 64
CALLS = ("may_speculate", "decide", "observe")


class Recording:
    """The planner, its answers logged in call order and its calls timed."""

    def __init__(self, planner):
        self.planner = planner
        self.answers: list[tuple[str, object]] = []
        self.seconds = dict.fromkeys(CALLS, 0.0)
        self.steps = 0

    def _timed(self, name: str, arg):
        t0 = time.perf_counter()
        answer = getattr(self.planner, name)(arg)
        self.seconds[name] += time.perf_counter() - t0
        return answer

    def may_speculate(self, outline) -> bool:
        answer = self._timed("may_speculate", outline)
        self.answers.append(("may_speculate", answer))
        return answer

    def decide(self, view) -> list[int]:
        ks = self._timed("decide", view)
        self.answers.append(("decide", list(ks)))
        return ks

    def observe(self, record) -> None:
        self._timed("observe", record)
        self.steps += 1


class Replaying:
    """Answers the engine's calls with a Recording's answers, in order (and learns nothing)."""

    def __init__(self, answers: list[tuple[str, object]]):
        self._answers = iter(answers)

    def _next(self, name: str):
        asked, answer = next(self._answers)
        if asked != name:
            raise RuntimeError(f"the replay was asked {name} where the planner was asked {asked}")
        return answer

    def may_speculate(self, outline) -> bool:
        return self._next("may_speculate")

    def decide(self, view) -> list[int]:
        return self._next("decide")

    def observe(self, record) -> None:
        pass


def main() -> None:
    ap = argparse.ArgumentParser()
    add_cell_arguments(ap, proposer="ngram", workloads="gsm8k,humaneval,mtbench,xsum", rounds=5)
    ap.add_argument("--static-ks", default="1")
    ap.add_argument("--max-tokens", type=int, default=MAX_TOKENS)
    ap.add_argument("--mixed", action="store_true", help="one cell: the cold-start bench's mixed batch of --batch requests")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    profile = Profile.load(args.profile)
    loaded = load_model(None, quantize=args.quantize)
    engine = _engine(loaded, args.proposer, max(args.batch, 32), 8)
    rotating = ["static:0"] + [f"static:{k}" for k in args.static_ks.split(",") if k] + ["goodput"]
    results = {}
    for workload in ["mixed"] if args.mixed else args.workloads.split(","):
        prompts = (mixed_prompts(loaded, args.batch) if args.mixed else
                   cell_prompts(loaded.tokenizer, workload, args.batch, min_requests=args.requests))
        run_cell(engine, prompts, FixedDecider(1), args.max_tokens, concurrency=args.batch)  # warm-up
        spent = dict.fromkeys(CALLS, 0.0)
        steps = 0
        reference = None

        def run(name: str, decider) -> float:
            nonlocal reference
            x = run_cell(engine, prompts, decider, args.max_tokens, concurrency=args.batch)
            outputs = x.pop("outputs")
            reference = reference or outputs
            if outputs != reference:
                raise RuntimeError(f"{name} changed the output tokens ({workload})")
            return x["goodput"]

        replayed: list[float] = []

        def run_arm(arm: str) -> float:
            nonlocal steps
            if arm != "goodput":
                return run(arm, FixedDecider(int(arm.split(":")[1])))
            recording = Recording(planner_from_profile(profile, make_policy("goodput"), proposer=args.proposer,
                                                       max_k=8))
            tok_s = run(arm, recording)
            replayed.append(run("replay", Replaying(recording.answers)))  # right after the planner it replays
            for name in CALLS:
                spent[name] += recording.seconds[name]
            steps += recording.steps
            return tok_s

        goodput = rotated_rounds(rotating, args.rounds, run_arm) | {"replay": replayed}

        def paired(a: str, b: str) -> float:
            return statistics.median(x / y for x, y in zip(goodput[a], goodput[b]))

        cell = {"vs_off": {arm: paired(arm, "static:0") for arm in goodput},
                "planner_vs_replay": paired("goodput", "replay"),
                "planner_ms_per_step": {name: 1e3 * s / max(steps, 1) for name, s in spent.items()},
                "goodput": goodput}
        results[workload] = cell
        print(f"{workload} B={args.batch}: x off " + ", ".join(f"{a} {v:.3f}" for a, v in cell["vs_off"].items())
              + f"; planner / its choices replayed {cell['planner_vs_replay']:.3f}; planner ms/step "
              + ", ".join(f"{n} {v:.3f}" for n, v in cell["planner_ms_per_step"].items()), flush=True)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"args": vars(args) | {"out": str(args.out)}, "cells": results}, indent=1))


if __name__ == "__main__":
    main()
