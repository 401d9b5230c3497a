"""The planner's choices at B = 1, priced without noise: every arm replays the same recorded greedy
outputs, and every step costs what the latency profile says it costs.

Greedy speculation is lossless, so a request's output is the same whatever k each step asks for,
and whether a draft is accepted depends only on the output: the n-gram lookup over the prompt and
the first p output tokens finds the same drafts every time, and the first j of them are accepted
exactly when they equal output tokens p .. p + j - 1. So one SD-off run per prompt (the engine's
greedy output, recorded once: ``--trace``, written if missing, read if present) is enough to run
any decider over that request step by step: it sees what the engine's planner would see (the
lookup's drafts and match length, the step's shape), asks for k, is told how many were accepted,
and each step is charged the profile's forward + verify time for its shape plus a fixed
``--overhead-ms``. The planner's own time is not charged unless asked (``--charge-decider F``: each
step also pays the decider's calls, timed here, times F; in the engine the forward pass between
two steps evicts the planner's code and data, and the same calls cost ~2.3x what they cost hot),
nor is the machine's noise: without it, a difference between two arms here is a difference between
their choices.

Arms: static k for each of ``--static-ks``, the goodput planner cold, and the goodput planner
starting from beliefs saved by a planner that served ``--train-prompts`` other prompts of the same
workload (prompts the evaluation does not use), as `specplan bench coldstart` runs them.

    python scripts/choice_replay.py --quantize gguf --profile reports/profile-xeon-q4_1/profile.json \\
        --trace /tmp/replay-q4_1.json --prompts 8 [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from pathlib import Path
from typing import Callable

from specplan.engine.decider import RequestRecord, RequestView, StepOutline, StepRecord, StepView
from specplan.engine.proposers.ngram import NgramIndex
from specplan.planner.beliefs import capture, restore
from specplan.planner.from_profile import planner_from_profile
from specplan.policies import make_policy
from specplan.profiler.latency_model import StepShape
from specplan.profiler.profile import Profile

WORKLOADS = ("humaneval", "gsm8k", "mtbench", "xsum")
MAX_K = 8  # the engine's cap on drafts per request (evaluate's)
MAX_NATURAL_K = 8  # the n-gram proposer's natural length cap


def record_outputs(quantize: str | None, workloads: list[str], prompts: int, train_prompts: int,
                   max_tokens: int) -> dict:
    """{workload: {"test": [[prompt, output], ...], "train": [...]}}: SD-off greedy outputs of the
    evaluation's first prompts (test) and of prompts it does not use (train)."""
    import torch

    from specplan.bench.coldstart import B1_KV_CACHE_MIB, _prompts
    from specplan.bench.evaluate import _engine, held_out_prompts, run_cell
    from specplan.engine import FixedDecider, load_model

    loaded = load_model(None, quantize=quantize)
    engine = _engine(loaded, "ngram", 1, MAX_K, kv_cache_mib=B1_KV_CACHE_MIB)
    out = {}
    with torch.inference_mode():
        for w in workloads:
            sets = {"test": _prompts(loaded, w, prompts), "train": held_out_prompts(loaded.tokenizer, w, train_prompts)}
            out[w] = {name: [[p, run_cell(engine, [p], FixedDecider(0), max_tokens, concurrency=1)["outputs"][0]]
                             for p in ps] for name, ps in sets.items()}
            print(f"recorded {w}: {len(sets['test'])} test and {len(sets['train'])} train prompts", flush=True)
    return out


def serve(decider, prompt: list[int], output: list[int], latency, overhead_s: float, seq_id: int,
          charge: float = 0.0) -> tuple[int, float]:
    """Run one request through ``decider`` on its recorded output: (tokens emitted, seconds).

    Step by step: the prefill emits output[0]; then with p tokens out, the lookup over prompt +
    output[:p] offers drafts d (capped at what is left of the request), the decider picks k <=
    len(d), and the step emits a + 1 tokens, a the length of the longest prefix of d[:k] equal to
    output[p:p + k]. Worked example: output [7, 8, 9, 5], p = 1, d = [8, 9, 4], k = 3: a = 2
    (8 and 9 agree, 4 is not 5), the step emits 8, 9 and the target's 5, and p becomes 4.
    ``charge``: each step also costs the decider's own calls in it, timed, times this."""
    toks = list(prompt)
    index = NgramIndex(toks, 1, 4, 16)
    request_id = f"r{seq_id}"
    clock = time.perf_counter
    screen = getattr(decider, "may_speculate", None)
    observe = getattr(decider, "observe", None)

    def timed(call, *args):  # (the answer, the decider's seconds)
        t0 = clock()
        answer = call(*args)
        return answer, clock() - t0

    # The prefill step: the prompt's forward pass samples the first output token.
    seconds = latency.predict(StepShape(1, len(prompt), len(prompt)))
    spent = 0.0
    if observe is not None:
        spent = timed(observe, StepRecord((), 1, len(prompt), len(prompt), len(prompt), 0.0, seconds, 0.0,
                                          seconds + overhead_s))[1]
    seconds += overhead_s + charge * spent
    toks.append(output[0])
    p = 1
    while p < len(output):
        context = len(toks)
        cap = max(0, min(MAX_K, len(output) - p - 1))
        drafts, available, match_length, k, spent = [], 0, 0, 0, 0.0
        if cap and screen is not None:
            go, spent = timed(screen, StepOutline(1, context, 0, 0, context, cap, None))
        else:
            go = cap > 0
        if go:
            drafts, available, match_length = index.lookup(cap)
            cap = min(cap, len(drafts))
            view = StepView((RequestView(seq_id, request_id, context, p, cap, True, cap, match_length or None),),
                            0, 0, context, "ngram", None)
            ks, s = timed(decider.decide, view)
            k, spent = max(0, min(cap, int(ks[0]))), spent + s
        accepted = 0
        while accepted < k and drafts[accepted] == output[p + accepted]:
            accepted += 1
        emitted = accepted + 1
        step_s = latency.predict(StepShape(1, 1 + k, context + k))
        if observe is not None:
            natural = min(available, MAX_NATURAL_K) if k else None
            rr = RequestRecord(seq_id, request_id, k, k, accepted, emitted, natural, (match_length or None) if k else None)
            spent += timed(observe, StepRecord((rr,), 1, 1 + k, 0, context + k, 0.0, step_s, 0.0, step_s + overhead_s))[1]
        seconds += step_s + overhead_s + charge * spent
        toks.extend(output[p:p + emitted])
        p += emitted
    return len(output), seconds


class Static:
    """k drafts whenever the lookup offers them (the engine's FixedDecider)."""

    def __init__(self, k: int):
        self.k = k

    def decide(self, view: StepView) -> list[int]:
        return [self.k] * len(view.requests)


def run_arm(make: Callable[[], object], requests: list[list], latency, overhead_s: float, charge: float = 0.0
            ) -> list[float]:
    """Tokens per second of each request, each served by a fresh decider (one per process)."""
    out = []
    for i, (prompt, output) in enumerate(requests):
        tokens, seconds = serve(make(), prompt, output, latency, overhead_s, i, charge)
        out.append(tokens / seconds)
    return out


def geo(xs) -> float:
    xs = list(xs)
    return math.exp(statistics.fmean(math.log(x) for x in xs))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--profile", required=True)
    ap.add_argument("--quantize", default=None, help="as specplan evaluate's --quantize (gguf: the Q4_1 engine)")
    ap.add_argument("--trace", type=Path, required=True, help="the recorded outputs (JSON): written if missing")
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--prompts", type=int, default=8, help="test prompts per workload (the evaluation's first)")
    ap.add_argument("--train-prompts", type=int, default=8, help="prompts the saved beliefs are learned on")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--static-ks", default="1,2,3,4")
    ap.add_argument("--overhead-ms", type=float, default=0.3, help="per-step time outside forward + verify")
    ap.add_argument("--charge-decider", type=float, default=0.0,
                    help="charge each step its decider's own calls, timed, times this (0: not at all)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    workloads = [w for w in args.workloads.split(",") if w]
    if args.trace.exists():
        recorded = json.loads(args.trace.read_text())
    else:
        recorded = record_outputs(args.quantize, workloads, args.prompts, args.train_prompts, args.max_tokens)
        args.trace.write_text(json.dumps(recorded))
    profile = Profile.load(args.profile)
    latency = profile.model()
    overhead_s = args.overhead_ms / 1e3

    def planner():
        return planner_from_profile(profile, make_policy("goodput"), proposer="ngram", max_k=MAX_K)

    report = {}
    for w in workloads:
        test, train = recorded[w]["test"], recorded[w]["train"]
        teacher = planner()  # one process serving the other prompts, one after another
        for i, (prompt, output) in enumerate(train):
            serve(teacher, prompt, output, latency, overhead_s, 1000 + i)
        saved = capture(teacher, latency="replay")

        def warm():
            p = planner()
            restore(p, saved, latency="replay")
            return p

        arms = {f"static:{k}": (lambda k=int(k): Static(k)) for k in ["0"] + args.static_ks.split(",")}
        arms |= {"adaptive": planner, "adaptive+beliefs": warm}
        tok_s = {arm: run_arm(make, test, latency, overhead_s, args.charge_decider) for arm, make in arms.items()}
        statics = [a for a in arms if a.startswith("static:")]
        # Per request: each arm over the best static k of that request, and over the best single
        # static k of the workload (the geo-mean over its requests).
        best_single = max(statics, key=lambda a: geo(tok_s[a]))
        cell = {"tok_s": tok_s, "best_single_static": best_single,
                "over_best_single": {a: geo(x / y for x, y in zip(tok_s[a], tok_s[best_single])) for a in arms},
                "over_best_per_request": {a: geo(x / max(tok_s[s][i] for s in statics) for i, x in enumerate(tok_s[a]))
                                          for a in arms},
                "per_request_over_best_single": {a: [x / y for x, y in zip(tok_s[a], tok_s[best_single])]
                                                 for a in ("adaptive", "adaptive+beliefs")}}
        report[w] = cell
        print(f"{w}: best single static {best_single}; x it: "
              + ", ".join(f"{a} {v:.3f}" for a, v in cell["over_best_single"].items())
              + "; x each request's best static: "
              + ", ".join(f"{a} {cell['over_best_per_request'][a]:.3f}" for a in ("adaptive", "adaptive+beliefs")),
              flush=True)
        for a in ("adaptive", "adaptive+beliefs"):
            print(f"   {a} per request x {best_single}: "
                  + " ".join(f"{x:.3f}" for x in cell["per_request_over_best_single"][a]), flush=True)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "workloads": report}, indent=1))


if __name__ == "__main__":
    main()
