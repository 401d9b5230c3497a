"""What the planner costs per engine step, by call: the screen (``may_speculate``), ``decide`` on a
step where no draft is possible, ``decide`` where the lookup found drafts, and ``observe``.

It records what the engine hands the planner over one cold request of each workload (the
evaluation's first prompt, 128 tokens, n-gram, greedy, goodput policy; with ``--batch B``, the
evaluation's closed-loop cell of each workload at concurrency B instead), then replays that trace
through fresh planners, so the planner's time is measured alone, without the forward pass
beside it, and the same trace can be replayed by another checkout (``--trace``: written if
missing, read if present; plain pickles of the engine's view and record dataclasses).

    python scripts/planner_step_cost.py --quantize gguf --trace /tmp/b1.pkl --repeats 5 [--flush-mib 64]
    python scripts/planner_step_cost.py --batch 4 --trace /tmp/b4.pkl --decisions /tmp/b4-answers.json [--cprofile]
    python scripts/planner_step_cost.py --trace /tmp/b1.pkl --flush-mib 64 --without step-time --without timing

Hot (the default), the planner's objects and code stay in the caches from one step to the next;
in the engine the forward pass between two steps streams ~100 MB of weights and evicts them, and
the same calls cost ~2.3x as much (``--flush-mib 64`` reads 64 MiB before each step to show it).
"""

from __future__ import annotations

import argparse
import json
import pickle
import statistics
import time
from pathlib import Path


from specplan.bench.caches import CacheSweep
from specplan.profiler.profile import Profile
from specplan.planner import Planner
from specplan.planner.acceptance import PooledAcceptance
from specplan.planner.from_profile import planner_from_profile
from specplan.policies import make_policy

WORKLOADS = ("gsm8k", "mtbench", "humaneval", "xsum")
KINDS = ("screen", "decide, no draft", "decide, drafts", "observe")


# Parts of the planner a replay can leave out (``--without``), to see what each costs: config
# fields set to what turns the part off, or (where no field does) the method that runs it replaced
# by one that does nothing. The answers then differ from the planner's: a cost breakdown, not a
# variant to ship.
WITHOUT_CONFIG = {"timing": {"learn_timing": False}, "calibration": {"calibration": None}, "pause": {"pause": None}}
WITHOUT_METHOD = {"step-time": (Planner, "_observe_step_time"),  # the drift factor and the drafts' price
                  "pool-refresh": (PooledAcceptance, "refresh")}  # the pooled priors publishing what they learned
WITHOUT = tuple(WITHOUT_CONFIG) + tuple(WITHOUT_METHOD)


def fresh_planner(profile: Profile, without: tuple[str, ...] = ()):
    options = {k: v for part in without for k, v in WITHOUT_CONFIG.get(part, {}).items()}
    return planner_from_profile(profile, make_policy("goodput"), proposer="ngram", max_k=8, **options)


def leave_out(without: tuple[str, ...]) -> None:
    """Replace the methods of the ``without`` parts that no config field turns off (this process only)."""
    for part in without:
        if part in WITHOUT_METHOD:
            owner, name = WITHOUT_METHOD[part]
            setattr(owner, name, lambda *args, **kwargs: None)


def record_trace(profile: Profile, quantize: str, max_tokens: int, batch: int = 1) -> list[tuple[str, object]]:
    """[(kind, argument)]: every call the engine made on the planner, one cell per workload (kind
    "new" between them: the replay starts a fresh planner there, as each cell had). ``batch``: 1,
    one cold request per workload; B > 1, the evaluation's closed-loop cell at concurrency B."""
    from specplan.bench.coldstart import B1_KV_CACHE_MIB, WARMUP_PROMPT, _prompts
    from specplan.bench.evaluate import _engine, cell_prompts, run_cell
    from specplan.engine import FixedDecider, load_model

    loaded = load_model(None, quantize=quantize)
    engine = _engine(loaded, "ngram", batch, 8, **({"kv_cache_mib": B1_KV_CACHE_MIB} if batch == 1 else {}))
    run_cell(engine, [loaded.tokenizer.encode(WARMUP_PROMPT)], FixedDecider(0), 8, concurrency=1)
    trace: list[tuple[str, object]] = []
    for workload in WORKLOADS:
        planner = fresh_planner(profile)
        for kind, name in (("screen", "may_speculate"), ("decide", "decide"), ("observe", "observe")):
            method = getattr(planner, name)
            setattr(planner, name, lambda x, method=method, kind=kind: (trace.append((kind, x)), method(x))[1])
        prompts = [_prompts(loaded, workload, 1)[0]] if batch == 1 else cell_prompts(loaded.tokenizer, workload, batch)
        run_cell(engine, prompts, planner, max_tokens, concurrency=batch)
        trace.append(("new", workload))
    return trace


def replay(profile: Profile, trace: list[tuple[str, object]], flush_mib: int = 0,
           decisions: list | None = None, without: tuple[str, ...] = ()) -> dict[str, float]:
    """Microseconds per call of each kind over one replay of the trace. ``flush_mib``: read that
    many MiB before each step's first call, as the forward pass streams the weights between two
    steps of the engine (its caches hold none of the planner's objects or code then).
    ``decisions``: a list to append every screen's and decision's answer to (two source trees
    that replay one trace must answer alike, whatever either costs)."""
    spent = dict.fromkeys(KINDS, 0.0)
    calls = dict.fromkeys(KINDS, 0)
    planner = fresh_planner(profile, without)
    caches = CacheSweep(flush_mib)
    for kind, arg in trace:
        if kind == "new":
            planner = fresh_planner(profile, without)
            continue
        if kind == "observe":  # the engine observes first after a forward
            caches.sweep()
        if kind == "decide":
            kind = "decide, drafts" if any(r.max_k for r in arg.requests) else "decide, no draft"
        call = planner.may_speculate if kind == "screen" else planner.observe if kind == "observe" else planner.decide
        t0 = time.perf_counter()
        answer = call(arg)
        spent[kind] += time.perf_counter() - t0
        if decisions is not None and kind != "observe":
            decisions.append(answer)
        calls[kind] += 1
    return {k: spent[k] / calls[k] * 1e6 if calls[k] else 0.0 for k in KINDS} | {"calls": calls}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--profile", help="latency profile JSON (default: the cached one for these weights)")
    parser.add_argument("--quantize", default="gguf", help="the engine's weights when recording (default gguf)")
    parser.add_argument("--trace", type=Path, help="trace file: replayed if it exists, else recorded there")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--batch", type=int, default=1,
                        help="when recording: 1, a cold request per workload; B > 1, the evaluation's cell at concurrency B")
    parser.add_argument("--decisions", type=Path,
                        help="a JSON of the replay's answers: written if missing, else compared (same trace, another tree)")
    parser.add_argument("--cprofile", action="store_true", help="print the replay's top functions by own time")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--flush-mib", type=int, default=0,
                        help="read this many MiB before each step (64: as after a forward pass; the in-engine cost)")
    parser.add_argument("--without", action="append", choices=WITHOUT, default=[],
                        help="replay with this part of the planner left out (repeatable): what it costs")
    args = parser.parse_args()
    without = tuple(args.without)
    leave_out(without)
    if args.profile:
        profile = Profile.load(args.profile)
    else:
        from specplan.adaptive import load_or_make_profile
        from specplan.engine import load_model

        profile = load_or_make_profile(load_model(None, quantize=args.quantize), None)
    if args.trace and args.trace.exists():
        trace = pickle.loads(args.trace.read_bytes())
    else:
        trace = record_trace(profile, args.quantize, args.max_tokens, args.batch)
        if args.trace:
            args.trace.write_bytes(pickle.dumps(trace))
    answers: list = []
    replay(profile, trace, decisions=answers, without=without)
    if args.decisions is not None:
        if args.decisions.exists():
            same = json.loads(args.decisions.read_text()) == json.loads(json.dumps(answers))
            print(f"answers equal to {args.decisions}: {same}")
        else:
            args.decisions.write_text(json.dumps(answers))
    if args.cprofile:
        import cProfile
        import pstats

        prof = cProfile.Profile()
        prof.enable()
        replay(profile, trace, args.flush_mib, without=without)
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)
    runs = [replay(profile, trace, args.flush_mib, without=without) for _ in range(args.repeats)]
    calls = runs[0]["calls"]
    steps = calls["observe"]
    print(f"{steps} steps replayed {args.repeats}x; median microseconds per call (calls per replay):")
    per_step = 0.0
    for kind in KINDS:
        us = statistics.median(r[kind] for r in runs)
        per_step += us * calls[kind] / max(steps, 1)
        print(f"  {kind:17s} {us:7.1f} us  ({calls[kind]})")
    print(f"  per step, all calls: {per_step:.1f} us")


if __name__ == "__main__":
    main()
