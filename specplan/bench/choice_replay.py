"""Deciders replayed at B = 1 on recorded greedy outputs, every step priced by a latency model.

Greedy speculation is lossless, so a request's output is the same whatever k each step asks for,
and whether an n-gram draft is accepted depends only on that output: the lookup over the prompt
and the first p output tokens finds the same drafts every time, and the first j of them are
accepted exactly when they equal output tokens p .. p + j - 1. One SD-off run per prompt is then
enough to run any decider over that request step by step (``serve``): it sees what the engine's
planner would see (the lookup's drafts and match length, the step's shape), asks for k, is told
how many were accepted, and each step costs the model's forward + verify time for its shape plus
a fixed overhead. Every decider faces the same outputs and the same prices, so a difference
between two of them is a difference between their choices, without the machine's noise.

The machine's noise can be put back on purpose (``StepNoise``): each step's price times a level
that wanders with the (priced) clock and a jitter of its own, the same for every decider of a
run. Static k then spreads only with the noise, and a planner that follows its step-time
readings spreads further by as much as its choices move with them.

scripts/choice_replay.py records the outputs and reports; tests/test_choice_replay.py holds the
planner's choices on the recorded ones to a floor.
"""

from __future__ import annotations

import math
import random
import statistics
import time
from dataclasses import dataclass
from typing import Callable

from specplan.engine.decider import FixedDecider, RequestRecord, RequestView, StepOutline, StepRecord, StepView
from specplan.engine.proposers.ngram import NgramIndex
from specplan.planner.beliefs import capture, restore
from specplan.planner.from_profile import planner_from_profile
from specplan.policies import make_policy
from specplan.profiler.latency_model import LatencyModel, StepShape
from specplan.profiler.profile import Profile

MAX_K = 8  # the engine's cap on drafts per request (evaluate's)
MAX_NATURAL_K = 8  # the n-gram proposer's natural length cap
ADAPTIVE, WARM = "adaptive", "adaptive+beliefs"


@dataclass(frozen=True)
class StepNoise:
    """The machine's noise on each replayed step, as log-normal factors on its price: a level
    that takes a step of ``level`` (log sigma) every ``level_every_s`` of priced time (a slow
    minute on a shared VM), times an independent ``jitter`` (log sigma) per step. ``seed`` names
    the run: every decider of a run sees the same level at the same elapsed time and the same
    jitter at the same step index (common random numbers), so ratios within a run hold the
    noise's share that no choice causes.

    ``rest_level`` and ``rest_jitter`` (log sigmas) do the same for the time outside forward +
    verify: a level drawn once per request (the process's Python runs faster or slower than
    its forward pass does: traced per cold request, its median moved by ~7% between runs) times
    a jitter per step (~0.25 in the same traces: the step's bookkeeping, the decider's calls,
    allocation). 0 and 0: that time is a constant, as before they were modeled."""

    jitter: float = 0.03
    level: float = 0.02
    level_every_s: float = 0.5
    seed: int = 0
    rest_level: float = 0.0
    rest_jitter: float = 0.0

    def machine(self, request: int) -> "NoisyMachine":
        """The noise one request meets (request ``request`` of the run)."""
        return NoisyMachine(self, 1_000_003 * self.seed + request)


class NoisyMachine:
    """One request's noise: ``factor(seconds)`` for its next step (``StepNoise``)."""

    def __init__(self, noise: StepNoise, seed: int):
        self.noise = noise
        self._level_rng = random.Random(2 * seed)  # the level's path in priced time
        self._jitter_rng = random.Random(2 * seed + 1)  # the steps' own draws, by index
        self._elapsed_s = 0.0
        self._next_move_s = noise.level_every_s
        self._log_level = 0.0
        # The time outside forward + verify: a stream of its own, so the other draws stay as they were.
        self._rest_rng = random.Random(-2 * seed - 1)
        self._rest_log_level = self._rest_rng.gauss(0.0, noise.rest_level) if noise.rest_level else 0.0

    def rest_factor(self) -> float:
        """What the next step's time outside forward + verify takes, over the modeled overhead."""
        jitter = self.noise.rest_jitter
        return math.exp(self._rest_log_level + (self._rest_rng.gauss(0.0, jitter) if jitter else 0.0))

    def factor(self, seconds: float) -> float:
        """What a step priced at ``seconds`` takes on this machine, over its price."""
        noise = self.noise
        while self._elapsed_s >= self._next_move_s:
            self._log_level += self._level_rng.gauss(0.0, noise.level)
            self._next_move_s += noise.level_every_s
        f = math.exp(self._log_level + self._jitter_rng.gauss(0.0, noise.jitter))
        self._elapsed_s += seconds * f
        return f


@dataclass(frozen=True)
class ReplayPricing:
    """What a replayed step costs: the latency model's forward + verify seconds for its shape,
    plus ``overhead_s``; ``charge``: plus the decider's own calls in it, timed, times this (in the
    engine they cost ~2.3x what they cost here, hot); ``noise``: times the machine's noise;
    ``draft_price``: a machine whose drafts cost this times what the model says they add to a
    step (a profile that misprices them, as vLLM's few-drafts steps were measured at up to 2x:
    what the planner's learned draft price is for)."""

    latency: LatencyModel
    overhead_s: float = 3e-4
    charge: float = 0.0
    noise: StepNoise | None = None
    draft_price: float = 1.0

    def step_seconds(self, context: int, k: int) -> float:
        """A B = 1 decode step over ``context`` tokens carrying ``k`` drafts, before noise."""
        with_drafts = self.latency.predict(StepShape(1, 1 + k, context + k))
        if k == 0 or self.draft_price == 1.0:
            return with_drafts
        base = self.latency.predict(StepShape(1, 1, context))
        return base + self.draft_price * (with_drafts - base)


def serve(decider, prompt: list[int], output: list[int], pricing: ReplayPricing, seq_id: int,
          machine: NoisyMachine | None = None) -> tuple[int, float]:
    """Run one request through ``decider`` on its recorded output: (tokens emitted, seconds).

    Step by step: the prefill emits output[0]; then with p tokens out, the lookup over prompt +
    output[:p] offers drafts d (capped at what is left of the request), the decider picks k <=
    len(d), and the step emits a + 1 tokens, a the length of the longest prefix of d[:k] equal to
    output[p:p + k]. Worked example: output [7, 8, 9, 5], p = 1, d = [8, 9, 4], k = 3: a = 2
    (8 and 9 agree, 4 is not 5), the step emits 8, 9 and the target's 5, and p becomes 4.
    ``machine``: the noise this request meets (None: every step takes its price)."""
    latency, overhead_s, charge = pricing.latency, pricing.overhead_s, pricing.charge
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
    rest_s = overhead_s
    if machine is not None:
        seconds *= machine.factor(seconds)
        rest_s *= machine.rest_factor()
    spent = 0.0
    if observe is not None:
        spent = timed(observe, StepRecord((), 1, len(prompt), len(prompt), len(prompt), 0.0, seconds, 0.0,
                                          seconds + rest_s))[1]
    seconds += rest_s + charge * spent
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
        step_s = pricing.step_seconds(context, k)
        rest_s = overhead_s
        if machine is not None:
            step_s *= machine.factor(step_s)
            rest_s *= machine.rest_factor()
        if observe is not None:
            natural = min(available, MAX_NATURAL_K) if k else None
            rr = RequestRecord(seq_id, request_id, k, k, accepted, emitted, natural, (match_length or None) if k else None)
            spent += timed(observe, StepRecord((rr,), 1, 1 + k, 0, context + k, 0.0, step_s, 0.0, step_s + rest_s))[1]
        seconds += step_s + rest_s + charge * spent
        toks.extend(output[p:p + emitted])
        p += emitted
    return len(output), seconds


def run_arm(make: Callable[[], object], requests: list[list], pricing: ReplayPricing) -> list[float]:
    """Tokens per second of each request, each served by a fresh decider (one per process)."""
    out = []
    for i, (prompt, output) in enumerate(requests):
        machine = pricing.noise.machine(i) if pricing.noise is not None else None
        tokens, seconds = serve(make(), prompt, output, pricing, i, machine)
        out.append(tokens / seconds)
    return out


def geo(xs) -> float:
    xs = list(xs)
    return math.exp(statistics.fmean(math.log(x) for x in xs))


def replay_workload(profile: Profile, test: list[list], train: list[list], *, static_ks=(1, 2, 3, 4),
                    overhead_s: float = 3e-4, charge: float = 0.0, noise: StepNoise | None = None,
                    draft_price: float = 1.0, planner_options: dict | None = None) -> dict:
    """One workload's arms on its recorded requests ([prompt, output] pairs): SD off and each
    static k, the goodput planner cold (a fresh one per request, as one request per process), and
    the goodput planner from beliefs saved by one that served the ``train`` requests first.
    Returns tok/s per request per arm, the best single static k (best geo-mean), each arm's
    geo-mean over it, and the two planners' per-request ratios to it."""
    pricing = ReplayPricing(profile.model(), overhead_s, charge, noise, draft_price)

    def planner():
        return planner_from_profile(profile, make_policy("goodput"), proposer="ngram", max_k=MAX_K,
                                    **(planner_options or {}))

    teacher = planner()  # one process serving the other prompts, one after another
    for i, (prompt, output) in enumerate(train):
        serve(teacher, prompt, output, pricing, 1000 + i, noise.machine(1000 + i) if noise is not None else None)
    saved = capture(teacher, latency="replay")

    def warm():
        p = planner()
        restore(p, saved, latency="replay")
        return p

    arms: dict[str, Callable[[], object]] = {f"static:{k}": (lambda k=k: FixedDecider(k)) for k in (0, *static_ks)}
    arms |= {ADAPTIVE: planner, WARM: warm}
    tok_s = {arm: run_arm(make, test, pricing) for arm, make in arms.items()}
    statics = [a for a in arms if a.startswith("static:")]
    best = max(statics, key=lambda a: geo(tok_s[a]))
    return {"tok_s": tok_s, "best_single_static": best,
            "over_best_single": {a: geo(x / y for x, y in zip(tok_s[a], tok_s[best])) for a in arms},
            "over_best_per_request": {a: geo(x / max(tok_s[s][i] for s in statics) for i, x in enumerate(tok_s[a]))
                                      for a in arms},
            "per_request_over_best_single": {a: [x / y for x, y in zip(tok_s[a], tok_s[best])] for a in (ADAPTIVE, WARM)}}
