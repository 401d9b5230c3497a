"""`specplan evaluate`: every policy against every static k, offline, on the same requests.

Cells are (workload, B): max(B, min_requests) requests of one workload run closed-loop at
concurrency B (all queued at once, at most B running; greedy, fixed output length), repeated and
reduced to medians, and each decider — static k in {0, 1, 2, 3, 4, 6, 8} and the planner policies —
runs the very same requests on the same engine. Goodput is output tokens per second of wall time
(prefill included). Greedy speculation is lossless, so every decider must produce the same tokens;
the run checks it. The oracle is the best static k of each cell in hindsight.

Why the summary also pairs repeats: on a shared 2-core VM one decider's goodput moves 10-15% from
one run to the next. Two things follow. A ratio taken within one repeat (the deciders of a cell run
back to back) cancels the machine's slow spells, which a ratio of medians does not. And "the best
of seven static k", picked and scored on the same noisy runs, is biased upward (the winner's
curse): with seven deciders within noise of each other, the maximum of their medians beats each of
their true values. So the paired check picks the best static k on the other repeats (leave one
out) and scores it, and the policy, on the held-out one.

How far a cell can read from itself is measured, not guessed: a null control (``control:off``)
runs SD off a second time as its own decider, so its paired ratio to ``static:0`` is what a
policy that changed nothing would score in that cell.

And how far any per-request policy could get: the clairvoyant decider (specplan/bench/clairvoyant.py)
knows each step's accepted drafts in advance and asks for exactly those. It is the ceiling the
policies are read against, for every proposer (a run at max_k records the accepted lengths first;
with a draft model it is a reference rather than a bound: clairvoyant.py).
"""

from __future__ import annotations

import json
import math
import random
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import pandas as pd
from rich.progress import Progress

from specplan.bench.clairvoyant import AcceptanceRecorder, ClairvoyantDecider, Replayed, replay
from specplan.bench.workloads import load_workload
from specplan.engine import CacheConfig, EngineConfig, FixedDecider, LLMEngine, LoadedModel, Proposer, SamplingParams, SchedulerConfig, SpecConfig, StepRecord, make_proposer
from specplan.planner.acceptance import LOOKUP_PROPOSERS
from specplan.planner.controller import Planner
from specplan.planner.from_profile import planner_from_profile
from specplan.policies import make_policy
from specplan.profiler.profile import Profile

WORKLOADS = ("humaneval", "gsm8k", "mtbench", "xsum")
BATCH_SIZES = (1, 4, 16, 32)
STATIC_KS = (0, 1, 2, 3, 4, 6, 8)
POLICIES = ("batch_table", "heuristic", "roofline", "goodput")
NULL_CONTROL = "control:off"  # static:0 again: its reading vs static:0 is the cell's noise
CLAIRVOYANT = "clairvoyant"  # knows each step's accepted lengths (specplan/bench/clairvoyant.py): the ceiling
# The adaptive policy's targets: a geo-mean goodput over all cells at least 1.10x that of the single
# best static k; and in every cell at least 0.97x that cell's best static k and 0.98x SD off.
GEOMEAN_TARGET = 1.10
PER_CELL_VS_BEST_STATIC, PER_CELL_VS_OFF = 0.97, 0.98
EVALUATION_POOL = 32  # prompts drawn per workload (seed 0) by the evaluation at its largest cells


def _is_policy(decider: str) -> bool:
    return not decider.startswith(("static:", "control:")) and decider != CLAIRVOYANT


def _request_id(index: int) -> str:
    """run_cell's request ids: unique per run, ending in the prompt's index."""
    return f"eval-{time.perf_counter_ns()}-{index}"


def _request_index(request_id: str) -> int:
    return int(request_id.rsplit("-", 1)[1])


def _engine(loaded: LoadedModel, proposer: str, max_batch: int, draft_layers: int,
            kv_cache_mib: int = 1536, kv_dtype=None) -> LLMEngine:
    """``kv_dtype``: the KV cache's element type (None: the engine's auto choice)."""
    config = EngineConfig(
        cache=CacheConfig(block_size=16, kv_cache_bytes=kv_cache_mib * 1024**2, kv_dtype=kv_dtype),
        scheduler=SchedulerConfig(max_num_seqs=max_batch, max_num_batched_tokens=1024, max_model_len=2048),
        spec=SpecConfig(proposer=proposer, k=0, max_k=8, draft_layers=draft_layers))
    return LLMEngine(config, loaded)


def _warm(planner, beliefs):
    """The planner, started from ``beliefs`` (a BeliefStore) when given."""
    if beliefs is not None and isinstance(planner, Planner):
        beliefs.load_into(planner)
    return planner


def output_lengths(max_tokens: int, spread: int, num_requests: int, seed: int = 0) -> list[int]:
    """The output length of each request of a cell: ``max_tokens`` each with ``spread`` 0, else
    each drawn once, uniformly from max_tokens - spread .. max_tokens + spread (seeded: the same
    for every decider of a cell, so their outputs stay token for token comparable).

    Why spread them: with every request the same length, SD off runs a closed batch in lockstep
    (B requests start together, prefill in one step, finish together), which no serving traffic
    does; speculation moves requests apart, so its cells end in a drain of steps with fewer than
    B requests (measured at B = 4 on the Q4_1 engine: 12-47 of a cell's ~250 steps, and with
    lengths spread over 32-96 the planner read 0.993x / 1.000x SD off instead of 0.951x / 0.963x:
    reports/output-lengths-zen4-s36)."""
    if spread < 0 or spread >= max_tokens:
        raise ValueError(f"need 0 <= spread < max_tokens, got spread {spread} with max_tokens {max_tokens}")
    if not spread:
        return [max_tokens] * num_requests
    rng = random.Random(seed)
    return [rng.randint(max_tokens - spread, max_tokens + spread) for _ in range(num_requests)]


def run_cell(engine: LLMEngine, prompts: list[list[int]], decider, max_tokens: int | Sequence[int],
             concurrency: int | None = None, proposer: Proposer | None = None,
             on_step: Callable[[StepRecord], None] | None = None) -> dict:
    """All prompts queued at once, at most ``concurrency`` (default: all) running at a time.
    ``max_tokens``: every request's output length, or one per prompt (``output_lengths``).
    ``proposer``: a new proposer for this run (default: a fresh one of the engine's kind).
    ``on_step``: called with every step's record (the engine's ``last_step``) as the cell runs."""
    engine.set_decider(decider)
    engine.set_max_num_seqs(concurrency or len(prompts))
    engine.set_proposer(proposer)  # None: a fresh one, so a suffix cache filled by one run never helps the next
    engine.reset_stats()
    lengths = [max_tokens] * len(prompts) if isinstance(max_tokens, int) else list(max_tokens)
    if len(lengths) != len(prompts):
        raise ValueError(f"{len(lengths)} output lengths for {len(prompts)} prompts")
    ids = [_request_id(i) for i in range(len(prompts))]
    t0 = time.perf_counter()
    for rid, p, n in zip(ids, prompts, lengths):
        engine.add_request(rid, p, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
    while engine.has_unfinished:
        previous = engine.last_step
        engine.step()
        if on_step is not None and engine.last_step is not previous:  # a step with no work records none
            on_step(engine.last_step)
    seconds = time.perf_counter() - t0
    outputs = [engine.pop_finished(rid)[0].token_ids for rid in ids]
    st = engine.stats
    k_steps = sum(st.k_histogram.values())
    return {"seconds": seconds, "output_tokens": sum(len(o) for o in outputs),
            "goodput": sum(len(o) for o in outputs) / seconds, "acceptance": st.acceptance_rate,
            "mean_accepted_length": st.mean_accepted_length,
            "k_zero_share": st.k_histogram.get(0, 0) / k_steps if k_steps else 1.0,
            "mean_k": sum(k * n for k, n in st.k_histogram.items()) / k_steps if k_steps else 0.0,
            "decider_ms_per_step": st.decider_ms_per_step, "decider_share": st.decider_s / seconds,
            "outputs": outputs}


def replayed_reference(engine: LLMEngine, prompts: list[list[int]], max_tokens: int,
                       concurrency: int) -> tuple[list[list[int]], list[list[Replayed]]]:
    """The prompts' outputs with SD off (one run_cell), and those outputs replayed through a fresh
    proposer of the engine's kind and settings (clairvoyant.replay): per request and output length,
    the drafts it would propose and how many of them the target accepts."""
    reference = run_cell(engine, prompts, FixedDecider(0), max_tokens, concurrency=concurrency)["outputs"]
    spec = engine.config.spec
    proposer = make_proposer(spec, None, engine.runner, engine.block_manager, engine.default_generator)
    return reference, replay(proposer, prompts, reference, spec.max_k)


def cell_prompts(tokenizer, workload: str, batch: int, min_requests: int = 4) -> list[list[int]]:
    """The rendered prompts of one closed-loop cell at concurrency ``batch``: max(batch,
    min_requests) of the workload, drawn as ``evaluate`` draws them for a grid whose largest cell
    this is (seed 0). The development scripts that take one cell apart use these."""
    n = max(batch, min_requests)
    return [p.render(tokenizer) for p in load_workload(workload, n, 0)][:n]


def add_cell_arguments(parser, *, proposer: str = "chain", workloads: str = "gsm8k,mtbench", rounds: int = 3) -> None:
    """The options of the development scripts that run one closed-loop cell per workload:
    --profile, --proposer, --batch, --workloads, --rounds, --quantize, --requests (as ``evaluate``'s;
    --requests is its --min-requests: ``cell_prompts``)."""
    parser.add_argument("--profile", required=True)
    parser.add_argument("--proposer", default=proposer)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--workloads", default=workloads)
    parser.add_argument("--rounds", type=int, default=rounds)
    parser.add_argument("--quantize", default=None, help="as specplan evaluate's --quantize (gguf: the Q4_1 engine)")
    parser.add_argument("--requests", type=int, default=4, help="requests a cell at least (evaluate's --min-requests)")


def rotated_rounds(arms: list[str], rounds: int, run: Callable[[str], dict]) -> dict[str, list[dict]]:
    """{arm: [run(arm) per round]}: every arm once a round, the order rotated by one each round, so
    a slow minute of the machine falls on every arm alike. Worked example, arms [a, b, c] and 3
    rounds: a b c, then b c a, then c a b."""
    runs: dict[str, list[dict]] = {arm: [] for arm in arms}
    for r in range(rounds):
        for arm in arms[r % len(arms):] + arms[:r % len(arms)]:
            runs[arm].append(run(arm))
    return runs


def held_out_prompts(tokenizer, workload: str, n: int) -> list[list[int]]:
    """n rendered prompts of a workload that the evaluation does not use (it draws
    EVALUATION_POOL with seed 0): for measurements that set the planner's priors."""
    used = {tuple(p.render(tokenizer)) for p in load_workload(workload, EVALUATION_POOL, 0)}
    fresh = (p.render(tokenizer) for p in load_workload(workload))
    return [ids for ids in fresh if tuple(ids) not in used][:n]


def clairvoyant_for(engine: LLMEngine, prompts: list[list[int]], max_tokens: int | Sequence[int], concurrency: int):
    """(the prompts' outputs, a maker of clairvoyant deciders for runs of them): one run in which
    every request asks for the engine's max_k drafts each step records what the target accepts
    (clairvoyant.py ``AcceptanceRecorder``; any proposer, a draft head's too). ``max_tokens``: as
    ``run_cell``'s."""
    longest = max_tokens if isinstance(max_tokens, int) else max(max_tokens)
    recorder = AcceptanceRecorder(engine.config.spec.max_k, _request_index, len(prompts), longest)
    reference = run_cell(engine, prompts, recorder, max_tokens, concurrency=concurrency)["outputs"]
    return reference, lambda: ClairvoyantDecider(recorder.accepted, _request_index)


def evaluate(loaded: LoadedModel, profile: Profile, proposer: str = "ngram", workloads=WORKLOADS,
             batch_sizes=BATCH_SIZES, static_ks=STATIC_KS, policies=POLICIES, max_tokens: int = 64,
             length_spread: int = 0, draft_layers: int = 8, seed: int = 0, repeats: int = 1, min_requests: int = 4,
             null_control: bool = True, clairvoyant: bool = False, progress: bool = True,
             beliefs=None, on_cell: Callable[[pd.DataFrame], None] | None = None) -> pd.DataFrame:
    """One row per (workload, B, decider): the median over ``repeats`` of goodput and friends. The
    deciders of a cell run interleaved within each repeat, in an order rotated by one each repeat,
    so machine drift hits them alike. A cell runs max(B, min_requests) requests at concurrency B:
    at B = 1 a single 64-token request would make the cell about one prompt (and about 1.5 s of a
    noisy machine). Each request generates ``max_tokens`` tokens, or with ``length_spread`` a length
    drawn once per cell from max_tokens +- length_spread (``output_lengths``).

    ``clairvoyant``: also run the clairvoyant decider, which needs each cell's accepted lengths
    first: one unrecorded run per cell at the engine's max_k gives them (and warms the cell up).

    ``beliefs``: a planner/beliefs.py ``BeliefStore`` every policy's planner starts from (read,
    never written); None: the built-in priors (a cold planner per run).

    ``on_cell``: called with every row so far after each cell ends, so an hour-long grid that is
    stopped still leaves the cells it finished (the CLI rewrites its report from it)."""
    engine = _engine(loaded, proposer, max(batch_sizes), draft_layers)
    deciders = [(f"static:{k}", lambda k=k: FixedDecider(k)) for k in static_ks]
    deciders += [(p, lambda p=p: _warm(planner_from_profile(profile, make_policy(p), proposer=proposer, max_k=8),
                                       beliefs))
                 for p in policies]
    if null_control:
        deciders.append((NULL_CONTROL, lambda: FixedDecider(0)))
    rows = []
    total = len(workloads) * len(batch_sizes) * ((len(deciders) + clairvoyant) * repeats + clairvoyant)
    with Progress(disable=not progress) as bar:
        task = bar.add_task(f"evaluate ({proposer})", total=total)
        for w in workloads:
            pool = [p.render(loaded.tokenizer) for p in load_workload(w, max(*batch_sizes, min_requests), seed)]
            for b in batch_sizes:
                prompts = pool[:max(b, min_requests)]
                lengths = output_lengths(max_tokens, length_spread, len(prompts), seed)
                reference = None
                cell_deciders = list(deciders)
                if clairvoyant:
                    bar.update(task, description=f"{proposer} {w} B={b} reference")
                    reference, make_clairvoyant = clairvoyant_for(engine, prompts, lengths, b)
                    bar.advance(task)
                    cell_deciders.append((CLAIRVOYANT, make_clairvoyant))
                runs: dict[str, list[dict]] = {name: [] for name, _ in cell_deciders}
                for rep in range(repeats):
                    shift = rep % len(cell_deciders)
                    for name, make in cell_deciders[shift:] + cell_deciders[:shift]:
                        bar.update(task, description=f"{proposer} {w} B={b} {name}")
                        r = run_cell(engine, prompts, make(), lengths, concurrency=b)
                        outputs = r.pop("outputs")
                        reference = reference or outputs
                        r["lossless"] = outputs == reference
                        runs[name].append(r)
                        bar.advance(task)
                for name, rs in runs.items():
                    row = {key: statistics.median(r[key] for r in rs) for key in rs[0] if key != "lossless"}
                    rows.append({"proposer": proposer, "workload": w, "batch_size": b, "decider": name,
                                 "requests": len(prompts),
                                 "lossless": all(r["lossless"] for r in rs), "repeats": len(rs),
                                 "goodput_all": [r["goodput"] for r in rs], **row})
                if on_cell is not None:
                    on_cell(pd.DataFrame(rows))
    return pd.DataFrame(rows)


def paired_ratios(runs: dict[str, list[float]], policy: str) -> tuple[float, float]:
    """(vs off, vs best static) for one cell from per-repeat goodputs (lists aligned by repeat):
    medians over repeats of ratios within a repeat. The best static k scored on repeat r is the
    one with the highest mean over the other repeats (with one repeat: over that repeat itself).

    Worked example, three repeats: static:0 = [10, 12, 11], static:2 = [13, 12, 14],
    policy = [13, 13, 12]. vs off: median(13/10, 13/12, 12/11) = 1.09. Leaving out repeat 0,
    static:2 has the larger sum over repeats 1 and 2 (26 vs 23), so repeat 0 scores 13/13;
    repeats 1 and 2 pick static:2 too and score 13/12 and 12/14; the median is 1.0.
    """
    pol = runs[policy]
    statics = {k: v for k, v in runs.items() if k.startswith("static:")}
    repeats = len(pol)
    vs_off = statistics.median(p / o for p, o in zip(pol, runs["static:0"]))
    ratios = []
    for r in range(repeats):
        others = [j for j in range(repeats) if j != r] or [r]
        chosen = max(statics, key=lambda k: sum(statics[k][j] for j in others))
        ratios.append(pol[r] / statics[chosen][r])
    return vs_off, statistics.median(ratios)


def resampled_geomean_ratios(runs: pd.Series, decider: str, draws: int = 2000, seed: int = 0) -> np.ndarray:
    """[draws] the decider's geo-mean goodput over the best single static k's, repeats resampled.

    ``runs`` holds per-repeat goodputs indexed by (workload, batch_size, decider), aligned by repeat
    within a cell. A draw picks, in every cell, as many repeats as it has, with replacement — the
    same picks for every decider of the cell, so a slow spell still hits them alike — and takes each
    decider's median over its picks; then it chooses the best single static k again on that draw
    (the choice is as noisy as the rest). The spread of the draws is the run's own noise on the
    geo-mean. It cannot see drift between runs: another day's run can read further off.

    Example, one cell, three repeats: static:1 = [10, 11, 12], policy = [12, 12, 15]; the picks
    (0, 0, 2) give medians 10 and 12, a ratio of 1.2; the picks (2, 2, 2) give 1.25.
    """
    rng = np.random.default_rng(seed)
    log_medians: dict[str, np.ndarray] = {}  # decider -> [draws], summed over cells
    cells = runs.index.droplevel("decider").unique()
    for cell in cells:
        per_decider = runs.loc[cell]
        goodputs = np.array([list(per_decider[name]) for name in per_decider.index], dtype=float)  # [deciders, R]
        repeats = goodputs.shape[1]
        picks = rng.integers(0, repeats, size=(draws, repeats))  # [draws, R]
        medians = np.median(goodputs[:, picks], axis=2)  # [deciders, draws]
        for name, row in zip(per_decider.index, np.log(medians)):
            log_medians[name] = log_medians.get(name, 0.0) + row
    statics = np.stack([v for name, v in log_medians.items() if name.startswith("static:")])  # [statics, draws]
    return np.exp((log_medians[decider] - statics.max(axis=0)) / len(cells))


def pooled_vs_off(runs: pd.Series, decider: str, draws: int = 2000, seed: int = 0) -> dict:
    """The decider against SD off over every cell and repeat at once: the geo-mean of its per-repeat
    ratios to ``static:0`` of the same repeat, and a 90% interval from resampling repeats within
    each cell. Per cell, a median of 3-10 ratios that each move +-15% cannot tell 2% from 0; pooled
    over 80 ratios it can, and the null control pooled the same way says what 1.0 reads as.

    Example, two cells of two repeats: off [10, 20] and [10, 10], decider [11, 18] and [10, 12]:
    ratios 1.1, 0.9, 1.0, 1.2, geo-mean (1.1 * 0.9 * 1.0 * 1.2) ** (1 / 4) = 1.045.
    """
    rng = np.random.default_rng(seed)
    logs, draws_sum, count = [], np.zeros(draws), 0
    for cell in runs.index.droplevel("decider").unique():
        per_decider = runs.loc[cell]
        if decider not in per_decider.index or "static:0" not in per_decider.index:
            continue
        log_ratios = np.log(np.asarray(per_decider[decider], dtype=float) / np.asarray(per_decider["static:0"], dtype=float))
        logs.extend(log_ratios)
        picks = rng.integers(0, len(log_ratios), size=(draws, len(log_ratios)))  # [draws, R]
        draws_sum += log_ratios[picks].sum(axis=1)
        count += len(log_ratios)
    if not count:
        return {}
    lo, hi = np.exp(np.percentile(draws_sum / count, [5, 95]))
    return {"geomean": float(np.exp(np.mean(logs))), "interval_90": [float(lo), float(hi)], "ratios": count}


def _interval(ratios: np.ndarray) -> dict:
    """The 90% interval of resampled geo-mean ratios, and how often they reach the target."""
    lo, hi = np.percentile(ratios, [5, 95])
    return {"geomean_interval_90": [float(lo), float(hi)],
            "share_of_resamples_at_target": float((ratios >= GEOMEAN_TARGET).mean())}


def summarize(df: pd.DataFrame) -> dict:
    """Each policy against its targets (GEOMEAN_TARGET, PER_CELL_VS_BEST_STATIC, PER_CELL_VS_OFF):
    per cell vs the best static k and vs off; geo-mean vs the single best static k."""
    out = {}
    for proposer, d in df.groupby("proposer"):
        static = d[d.decider.str.startswith("static:")]
        cells = static.groupby(["workload", "batch_size"])
        best = cells["goodput"].max()
        off = static[static.decider == "static:0"].set_index(["workload", "batch_size"])["goodput"]
        geo = static.groupby("decider")["goodput"].apply(lambda g: math.exp(sum(math.log(x) for x in g) / len(g)))
        best_single = geo.idxmax()
        # The oracle (best static k of each cell, in hindsight) bounds what one k per cell can reach;
        # the repeat spread says how much of a cell-to-cell difference is noise.
        oracle_gm = math.exp(sum(math.log(x) for x in best) / len(best))
        # Per-repeat goodputs of each (workload, B, decider); a frame without them has one run each.
        runs = d.set_index(["workload", "batch_size", "decider"])
        runs = (runs["goodput_all"] if "goodput_all" in runs else runs["goodput"].apply(lambda g: [g])).sort_index()
        spread = runs.apply(lambda xs: (max(xs) - min(xs)) / statistics.median(xs) if len(xs) > 1 else 0.0)
        res = {"best_single_static": best_single, "best_single_static_geomean": geo.max(),
               "oracle_geomean_vs_best_single_static": oracle_gm / geo.max(),
               "median_repeat_spread": float(spread.median()), "policies": {}}
        if (d.decider == NULL_CONTROL).any():
            control = {f"{w}/B={b}": paired_ratios({dec: list(r) for dec, r in runs.loc[(w, b)].items()},
                                                   NULL_CONTROL)[0]
                       for w, b in off.index}
            res["null_control"] = {"paired_vs_off": control, "min_vs_off": min(control.values()),
                                   "max_vs_off": max(control.values()), "pooled_vs_off": pooled_vs_off(runs, NULL_CONTROL)}
        def geomean_and_paired(decider: str) -> tuple[pd.Series, float, dict]:
            """Its goodput per cell, their geo-mean, and per cell (vs off, vs best static), paired."""
            g = d[d.decider == decider].set_index(["workload", "batch_size"])["goodput"]
            gm = math.exp(sum(math.log(x) for x in g) / len(g))
            paired = {cell: paired_ratios({dec: list(r) for dec, r in runs.loc[cell].items()}, decider)
                      for cell in g.index}
            return g, gm, paired

        def per_cell(paired: dict) -> dict:
            return {f"{w}/B={b}": {"vs_off": v[0], "vs_best_static": v[1]} for (w, b), v in paired.items()}

        ceiling = None
        if (d.decider == CLAIRVOYANT).any():
            _, ceiling, paired = geomean_and_paired(CLAIRVOYANT)
            res["clairvoyant"] = {
                "geomean_vs_best_single_static": ceiling / geo.max(),
                **_interval(resampled_geomean_ratios(runs, CLAIRVOYANT)),
                "paired_per_cell": per_cell(paired)}
        for pol in d[d.decider.map(_is_policy)].decider.unique():
            g, gm, paired = geomean_and_paired(pol)
            vs_best = (g / best).dropna()
            vs_off = (g / off).dropna()
            paired_off = min(v[0] for v in paired.values())
            paired_best = min(v[1] for v in paired.values())
            res["policies"][pol] = {
                "min_vs_best_static": float(vs_best.min()), "min_vs_off": float(vs_off.min()),
                "geomean": gm, "geomean_vs_best_single_static": gm / geo.max(),
                "pass_per_cell": bool(vs_best.min() >= PER_CELL_VS_BEST_STATIC and vs_off.min() >= PER_CELL_VS_OFF),
                "pass_geomean": bool(gm / geo.max() >= GEOMEAN_TARGET),
                **_interval(resampled_geomean_ratios(runs, pol)),
                "paired_min_vs_best_static": paired_best, "paired_min_vs_off": paired_off,
                "pass_per_cell_paired": bool(paired_best >= PER_CELL_VS_BEST_STATIC and paired_off >= PER_CELL_VS_OFF),
                "paired_per_cell": per_cell(paired), "pooled_vs_off": pooled_vs_off(runs, pol),
            }
            if ceiling is not None:
                res["policies"][pol]["geomean_vs_clairvoyant"] = gm / ceiling
        out[proposer] = res
    return out


def _span(interval: list[float]) -> str:
    return f"{interval[0]:.3f}-{interval[1]:.3f}"


def render_evaluation(df: pd.DataFrame, out_dir: Path, command: str, complete: bool = True,
                      measured: str | None = None) -> Path:
    """The Markdown report, its plot, the parquet and the summary JSON. ``complete=False``: written
    while the grid still runs; the report says so at the top. ``measured``: when and on what the
    grid ran (a sentence: `specplan evaluate` passes its start-end UTC and the machine line),
    printed under the command."""
    from specplan.bench.plots import ratio_panels

    out_dir.mkdir(parents=True, exist_ok=True)
    df.to_parquet(out_dir / "evaluation.parquet")
    summary = summarize(df)
    (out_dir / "evaluation-summary.json").write_text(json.dumps(summary, indent=1))
    lines = ["# Offline evaluation: adaptive speculation vs every static k", "",
             *([] if complete else ["**Partial: the run had not finished when this was written; it holds only "
                                    "the cells finished by then.**", ""]),
             f"Made by `{command}`. Each cell runs max(B, {int(df['requests'].min()) if 'requests' in df else 'B'}) "
             "requests of one workload closed-loop at concurrency B, greedy, the same requests for every "
             "decider (each request as long as `--max-tokens` says, or with `--length-spread S` a length drawn "
             "once per request from max-tokens +- S); goodput = output tokens / wall time (prefill included). "
             "`static:0` is SD off; the oracle "
             "is the best static k per cell in hindsight. The deciders of a cell run back to back within each "
             "repeat, in a rotated order.", "",
             *([measured, ""] if measured else []),
             "Two readings of each check: *medians* compares the median goodput of the policy with the best of the "
             "static k's medians. *Paired* takes ratios within one repeat (the machine's slow spells hit the "
             "deciders of that repeat alike), picks the best static k on the other repeats (so a static k's lucky "
             "run does not become the bar: the winner's curse of taking the best of seven noisy numbers), then "
             "the median over repeats. Geo-means come with a 90% interval from resampling each cell's repeats "
             "(the same picks for every decider of a cell; the best single static k chosen again on each draw): "
             "the run's own noise, not drift between runs, and coarse with few repeats (a median of 3-5 picks "
             "takes few values, so the point can sit near an edge).", ""]
    for proposer, d in df.groupby("proposer"):
        s = summary[proposer]
        lines += [f"## Proposer: {proposer}", "",
                  f"Best single static k across all cells (geometric mean): `{s['best_single_static']}`. "
                  f"The oracle (best static k of each cell, in hindsight) reaches "
                  f"{s['oracle_geomean_vs_best_single_static']:.3f}x its geo-mean. Repeats of one decider in one "
                  f"cell differ by {100 * s['median_repeat_spread']:.0f}% (median of (max - min) / median).", "",
                  f"| policy | reading | min over cells vs best static (target ≥ {PER_CELL_VS_BEST_STATIC:.2f}) | "
                  f"min vs off (≥ {PER_CELL_VS_OFF:.2f}) | "
                  f"cells pass | geo-mean vs best single static (≥ {GEOMEAN_TARGET:.2f}; 90% interval) |",
                  "|---|---|---|---|---|---|"]
        for pol, r in s["policies"].items():
            geo_ok = "yes" if r["pass_geomean"] else "no"
            lines.append(f"| {pol} | medians | {r['min_vs_best_static']:.3f} | {r['min_vs_off']:.3f} | "
                         f"{'yes' if r['pass_per_cell'] else 'no'} | {r['geomean_vs_best_single_static']:.3f} ({geo_ok}; "
                         f"{_span(r['geomean_interval_90'])}) |")
            lines.append(f"| {pol} | paired | {r['paired_min_vs_best_static']:.3f} | {r['paired_min_vs_off']:.3f} | "
                         f"{'yes' if r['pass_per_cell_paired'] else 'no'} | |")
        null = s.get("null_control")
        if null:
            lines += ["", f"Null control: SD off run a second time as its own decider (`{NULL_CONTROL}`) reads "
                      f"{null['min_vs_off']:.3f}-{null['max_vs_off']:.3f}x `static:0` (paired, per cell). A policy "
                      "that reads within that band of off, or of the best static k, cannot be told from it in this run."]
        pooled = {pol: r.get("pooled_vs_off") for pol, r in s["policies"].items()}
        if null and null.get("pooled_vs_off"):
            pooled[NULL_CONTROL] = null["pooled_vs_off"]
        pooled = {name: p for name, p in pooled.items() if p}
        if pooled:
            lines += ["", "Pooled over every cell and repeat (`pooled_vs_off`: the geo-mean of each repeat's ratio to "
                      "`static:0` of the same repeat; 90% interval from resampling repeats within cells): " +
                      ", ".join(f"`{name}` {p['geomean']:.3f}x off ({_span(p['interval_90'])}, {p['ratios']} ratios)"
                                for name, p in pooled.items()) + "."]
        top = s.get("clairvoyant")
        if top:
            per_cell = top["paired_per_cell"].values()
            captured = ", ".join(f"`{pol}` {r['geomean_vs_clairvoyant']:.3f}" for pol, r in s["policies"].items())
            lines += ["", f"Clairvoyant ceiling (`{CLAIRVOYANT}`): a decider that knows before each step how many of "
                      f"each request's {proposer} drafts the target will accept, and asks for exactly those "
                      f"(`specplan/bench/clairvoyant.py`), reaches {top['geomean_vs_best_single_static']:.3f}x the best single "
                      f"static k (geo-mean; 90% interval {_span(top['geomean_interval_90'])}, at or above "
                      f"{GEOMEAN_TARGET:.2f} in {100 * top['share_of_resamples_at_target']:.0f}% of resamples), and "
                      f"{min(v['vs_best_static'] for v in per_cell):.3f}-{max(v['vs_best_static'] for v in per_cell):.3f}x "
                      f"the best static k per cell (paired). " + (
                          "No per-request choice of k with this proposer on this machine gets far past it. "
                          if proposer in LOOKUP_PROPOSERS else
                          "With a draft model this is a reference, not a ceiling: it drafts as deep as the drafts "
                          "will be accepted, and every pass of the deepest request's drafting is paid by the whole "
                          "batch, so above B = 1 a shallower choice can beat it (where it reads under the best "
                          "static k). ") + f"Geo-mean as a share of it: {captured}."]
        pivot = d.pivot_table(index=["workload", "batch_size"], columns="decider", values="goodput")
        # Every policy that ran, in the order it ran (goodput:0 beside goodput, not only POLICIES).
        policies = list(dict.fromkeys(c for c in d.decider if _is_policy(c)))
        order = [c for c in [f"static:{k}" for k in STATIC_KS] + policies + [CLAIRVOYANT, NULL_CONTROL]
                 if c in pivot.columns]
        pivot = pivot[order]
        lines += ["", "Goodput (output tokens/s):", "", "| workload | B | " + " | ".join(order) + " |",
                  "|---|---|" + "---|" * len(order)]
        for (w, b), r in pivot.iterrows():
            best = max(r[c] for c in order if c.startswith("static:"))
            cells = [f"**{r[c]:.1f}**" if c.startswith("static:") and r[c] == best else f"{r[c]:.1f}" for c in order]
            lines.append(f"| {w} | {b} | " + " | ".join(cells) + " |")
        zero = d[d.decider == "goodput"].set_index(["workload", "batch_size"])
        if len(zero):
            paired = s["policies"]["goodput"]["paired_per_cell"]
            control = null["paired_vs_off"] if null else {}
            timed = "decider_ms_per_step" in zero  # frames from before the engine timed its decider lack it
            lines += ["", "Goodput policy per cell: share of request-steps given k = 0, mean k, acceptance, "
                      + ("what the planner's decide() and observe() cost a step (ms, and share of the wall time), "
                         if timed else "")
                      + "and the paired ratios" + (" (null control: off vs itself)" if null else "") + ":", "",
                      "| workload | B | k=0 share | mean k | acceptance |" + (" planner ms/step | planner share |" if timed else "")
                      + " paired vs off | paired vs best static |" + (" null control vs off |" if null else ""),
                      "|---|---|---|---|---|" + ("---|---|" if timed else "") + "---|---|" + ("---|" if null else "")]
            for (w, b), r in zero.iterrows():
                cell = f"{w}/B={b}"
                pr = paired[cell]
                lines.append(f"| {w} | {b} | {r.k_zero_share:.2f} | {r.mean_k:.2f} | {r.acceptance:.2f} | "
                             + (f"{r.decider_ms_per_step:.2f} | {100 * r.decider_share:.1f}% | " if timed else "")
                             + f"{pr['vs_off']:.3f} | {pr['vs_best_static']:.3f} |"
                             + (f" {control[cell]:.3f} |" if null else ""))
        lossless = bool(d["lossless"].all())
        lines += ["", f"Every decider produced identical tokens: {'yes' if lossless else 'NO'}.", ""]
        curves = {}
        for w, g in d.groupby("workload"):
            off = g[g.decider == "static:0"].set_index("batch_size")["goodput"]
            for dec, gg in g.groupby("decider"):
                gg = gg.set_index("batch_size").sort_index()
                curves.setdefault(w, {})[dec] = (list(gg.index), list(gg["goodput"] / off.reindex(gg.index)))
        png = ratio_panels(curves, out_dir / f"evaluation-{proposer}.png", ylabel="goodput / SD off",
                           title=f"proposer {proposer}: goodput relative to SD off", legend_size=6,
                           style=lambda dec: {"linestyle": ":" if dec.startswith("static:") else "-",
                                              "marker": None if dec.startswith("static:") else "o",
                                              "linewidth": 2.5 if dec == "goodput" else 1, "alpha": 0.85})
        lines += [f"![{proposer}]({png.name})", ""]
    path = out_dir / "evaluation.md"
    path.write_text("\n".join(lines) + "\n")
    return path
