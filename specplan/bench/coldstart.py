"""`specplan bench coldstart`: the planner on traffic it has not seen (issue #32).

The evaluation grid (specplan/bench/evaluate.py) runs many requests per cell in one process, so
its planner is warm after the first few. A new user's first `specplan generate --adaptive` is not:
one request, one process, a planner that knows only its built-in priors. This benchmark measures
that, beside the steady state:

* **cold-start cells** – each of the workloads at B = 1, one request per *process* (a child
  ``python -m specplan.bench.coldstart``; the model load and one short SD-off request warm the
  engine first and are not timed, so what differs between arms is the decider alone). Arms: SD
  off (``static:0``), each static k, the goodput planner from its priors (``adaptive``), and the
  same planner started from beliefs saved by an earlier process that ran *other* prompts of the
  same workload (``adaptive+beliefs``; planner/beliefs.py). Each run sends every prompt once per
  arm, arms interleaved (rotated by one each run) so a slow spell hits them alike; a run's reading
  of an arm is its output tokens over its seconds summed over the prompts. Reported: median over
  runs, the spread ((max - min) / median), and ratios paired within a run (evaluate.py
  ``paired_ratios``: the best static k is picked on the other runs). A single request's tok/s
  moves 10-20% from one minute to the next on a shared VM, in every arm alike, so the spread is
  also read *paired*: the spread of an arm's tok/s over SD off's in the same run (the processes
  run back to back), which leaves what the arm itself adds to the machine's drift. SD off run a
  second time as its own arm (``control:off``, the null control) shows what pairing alone reads.
* **mixed-batch cells** – all workloads in one B = batch closed batch (batch / 4 prompts of each,
  interleaved): SD off, each static k, the planner (cold, a fresh one per run), in one process.
* **calibration** – one planner, cold, serving a workload's requests one after another (B = 1):
  for the requests right after 0, 10 and 100 were served, per match-length bucket, what it
  predicted (first-draft acceptance and accepted drafts per drafted step, calibrated, as the policy
  saw them) against what the target accepted.

Greedy throughout, so every arm must produce the same tokens: the run checks it.
"""

from __future__ import annotations

import hashlib
import json
import math
import statistics
import subprocess
import sys
import time
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

WORKLOADS = ("humaneval", "gsm8k", "mtbench", "xsum")
STATIC_KS = (1, 2, 3, 4)
OFF, ADAPTIVE, WARM = "static:0", "adaptive", "adaptive+beliefs"
# The bar of issue #32 (paired, median of runs).
COLD_VS_BEST_STATIC, WARM_VS_BEST_STATIC, MIXED_VS_OFF = 0.95, 0.98, 0.98
CALIBRATION_AFTER = (0, 10, 100)
BUCKET_NAMES = {None: "none", 1: "1", 2: "2", 3: "3", 4: "4-7", 5: "8-15", 6: "16+"}  # acceptance.match_bucket
# One request of up to 2,048 tokens: SmolLM2-135M keeps ~46 KB of K/V per token (~94 MB). The
# evaluation's 1.5 GiB cache took longer to allocate in each child than the request took to run.
B1_KV_CACHE_MIB = 256
WARMUP_PROMPT = "The quick brown fox jumps over the lazy dog. " * 4


@dataclass(frozen=True)
class ChildJob:
    """What one child process runs: ``prompts`` (token ids) one after another at B = 1 under one
    decider; with ``save_beliefs`` the planner's beliefs are saved there afterwards."""

    arm: str  # static:K, adaptive, adaptive+beliefs
    prompts: list[list[int]]
    max_tokens: int
    profile: str  # path of the profile every process steers by
    model: str | None = None
    proposer: str = "ngram"
    beliefs: str | None = None  # load from (read only)
    save_beliefs: str | None = None
    quantize: str = "none"  # the weights (engine/model/loader.py ``load_model``)


def _digest(tokens: list[int]) -> str:
    return hashlib.sha1(json.dumps(tokens).encode()).hexdigest()[:12]


def _store(loaded, profile, path: str):
    from specplan.adaptive import belief_store

    return belief_store(loaded, profile, path=Path(path))


def _decider(job: ChildJob, loaded, profile):
    from specplan.bench.evaluate import NULL_CONTROL
    from specplan.engine import FixedDecider
    from specplan.planner.from_profile import planner_from_profile
    from specplan.policies import make_policy

    if job.arm == NULL_CONTROL:
        return FixedDecider(0)
    if job.arm.startswith("static:"):
        return FixedDecider(int(job.arm.split(":")[1]))
    planner = planner_from_profile(profile, make_policy("goodput"), proposer=job.proposer, max_k=8)
    if job.beliefs is not None:
        _store(loaded, profile, job.beliefs).load_into(planner)
    return planner


def run_job(job: ChildJob) -> dict:
    """Run a job in this process (what the child does): per prompt tokens, seconds and a digest."""
    from specplan.bench.evaluate import _engine, run_cell
    from specplan.engine import FixedDecider, load_model
    from specplan.profiler.profile import Profile

    profile = Profile.load(job.profile)  # a bad path fails before the model loads
    loaded = load_model(job.model, quantize=job.quantize)
    engine = _engine(loaded, job.proposer, 1, 8, kv_cache_mib=B1_KV_CACHE_MIB)
    run_cell(engine, [loaded.tokenizer.encode(WARMUP_PROMPT)], FixedDecider(0), 8, concurrency=1)  # untimed
    decider = _decider(job, loaded, profile)
    out = {"arm": job.arm, "tokens": [], "seconds": [], "digests": [], "mean_k": [], "k_zero_share": [],
           "bytes_per_weight": loaded.bytes_per_weight()}
    for prompt in job.prompts:
        r = run_cell(engine, [prompt], decider, job.max_tokens, concurrency=1)
        out["tokens"].append(r["output_tokens"])
        out["seconds"].append(r["seconds"])
        out["digests"].append(_digest(r["outputs"][0]))
        out["mean_k"].append(r["mean_k"])
        out["k_zero_share"].append(r["k_zero_share"])
    if job.save_beliefs is not None:
        _store(loaded, profile, job.save_beliefs).save(decider)
    return out


def spawn(job: ChildJob) -> dict:
    """Run a job in a fresh process (one request per process: nothing carries over)."""
    proc = subprocess.run([sys.executable, "-m", "specplan.bench.coldstart"], input=json.dumps(asdict(job)),
                          capture_output=True, text=True)
    if proc.returncode != 0:
        tail = " | ".join(proc.stderr.strip().splitlines()[-3:])
        raise RuntimeError(f"coldstart child ({job.arm}) failed with exit {proc.returncode}: {tail}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


# ------------------------------------------------------------------------------------ cells


def _prompts(loaded, workload: str, n: int, skip: int = 0) -> list[list[int]]:
    """n prompts the evaluation grid draws (seed 0), after the first ``skip``."""
    from specplan.bench.evaluate import EVALUATION_POOL
    from specplan.bench.workloads import load_workload

    pool = load_workload(workload, EVALUATION_POOL, 0)
    return [p.render(loaded.tokenizer) for p in pool[skip:skip + n]]


def cold_start_rows(loaded, profile_path: Path, *, workloads=WORKLOADS, prompts: int = 3, runs: int = 5,
                    static_ks=STATIC_KS, max_tokens: int = 128, train_prompts: int = 8, model: str | None = None,
                    proposer: str = "ngram", null_control: bool = True, quantize: str = "none", out_dir: Path,
                    bar=None) -> list[dict]:
    """One row per (workload, arm, run, prompt): a child process each. The beliefs of the
    ``adaptive+beliefs`` arm come from one child per workload that served ``train_prompts``
    prompts the evaluation does not use (evaluate.py ``held_out_prompts``) and saved them.
    ``null_control``: SD off runs a second time as its own arm (``control:off``)."""
    from specplan.bench.evaluate import NULL_CONTROL, held_out_prompts

    arms = [OFF] + [f"static:{k}" for k in static_ks if k] + [ADAPTIVE, WARM] + ([NULL_CONTROL] if null_control else [])
    rows = []
    task = bar.add_task("cold start", total=len(workloads) * (1 + runs * prompts * len(arms))) if bar else None

    def job(arm: str, ps: list[list[int]], **kw) -> ChildJob:
        return ChildJob(arm, ps, max_tokens, str(profile_path), model, proposer, quantize=quantize, **kw)

    for w in workloads:
        beliefs = out_dir / f"beliefs-{w}.json"
        beliefs.unlink(missing_ok=True)
        if bar:
            bar.update(task, description=f"cold start {w}: learning beliefs on other prompts")
        spawn(job(ADAPTIVE, held_out_prompts(loaded.tokenizer, w, train_prompts), save_beliefs=str(beliefs)))
        if bar:
            bar.advance(task)
        cold = _prompts(loaded, w, prompts)
        for run in range(runs):
            order = arms[run % len(arms):] + arms[:run % len(arms)]
            for i, prompt in enumerate(cold):
                for arm in order:
                    if bar:
                        bar.update(task, description=f"cold start {w} run {run + 1}/{runs} prompt {i + 1} {arm}")
                    r = spawn(job(arm, [prompt], beliefs=str(beliefs) if arm == WARM else None))
                    rows.append({"workload": w, "arm": arm, "run": run, "prompt": i, "tokens": r["tokens"][0],
                                 "seconds": r["seconds"][0], "digest": r["digests"][0], "mean_k": r["mean_k"][0],
                                 "k_zero_share": r["k_zero_share"][0]})
                    if bar:
                        bar.advance(task)
    return rows


def mixed_prompts(loaded, batch: int = 16, workloads=WORKLOADS) -> list[list[int]]:
    """The mixed batch's prompts: batch / len(workloads) of each workload, interleaved
    (humaneval, gsm8k, mtbench, xsum, humaneval, ...)."""
    per = max(1, batch // len(workloads))
    sets = [_prompts(loaded, w, per) for w in workloads]
    return [s[i] for i in range(per) for s in sets][:batch]


def mixed_rows(loaded, profile, *, batch: int = 16, runs: int = 5, static_ks=STATIC_KS, max_tokens: int = 128,
               workloads=WORKLOADS, proposer: str = "ngram", bar=None) -> list[dict]:
    """One row per (arm, run): every workload in one closed batch of ``batch`` requests."""
    from specplan.bench.evaluate import NULL_CONTROL, _engine, run_cell
    from specplan.engine import FixedDecider
    from specplan.planner.from_profile import planner_from_profile
    from specplan.policies import make_policy

    prompts = mixed_prompts(loaded, batch, workloads)
    engine = _engine(loaded, proposer, len(prompts), 8)
    makers = [(OFF, lambda: FixedDecider(0))] + [(f"static:{k}", lambda k=k: FixedDecider(k)) for k in static_ks if k]
    makers.append((ADAPTIVE, lambda: planner_from_profile(profile, make_policy("goodput"), proposer=proposer, max_k=8)))
    makers.append((NULL_CONTROL, lambda: FixedDecider(0)))  # SD off again: what the cell's noise alone reads
    task = bar.add_task("mixed batch", total=runs * len(makers)) if bar else None
    rows = []
    for run in range(runs):
        shift = run % len(makers)
        for arm, make in makers[shift:] + makers[:shift]:
            if bar:
                bar.update(task, description=f"mixed B={len(prompts)} run {run + 1}/{runs} {arm}")
            r = run_cell(engine, prompts, make(), max_tokens, concurrency=len(prompts))
            rows.append({"arm": arm, "run": run, "batch": len(prompts), "tokens": r["output_tokens"],
                         "seconds": r["seconds"], "goodput": r["goodput"], "mean_k": r["mean_k"],
                         "k_zero_share": r["k_zero_share"], "digest": _digest(r["outputs"])})
            if bar:
                bar.advance(task)
    return rows


@dataclass
class CalibrationRecorder:
    """A SpecDecider around a planner: per drafted request-step, the match bucket, what the policy
    was shown (calibrated estimate: first-draft acceptance, expected accepted drafts for the k
    the engine ran) and what was accepted; ``requests_seen`` tags the rows."""

    planner: Any
    requests_seen: int = 0
    rows: list = field(default_factory=list)
    _pending: dict = field(default_factory=dict)

    def decide(self, view) -> list[int]:
        from specplan.planner.acceptance import match_bucket

        ks = self.planner.decide(view)
        if not any(ks):  # a paused planner keeps no state for the step
            return ks
        for rv, state, k in zip(view.requests, self.planner.last_state.requests, ks):
            if k:
                self._pending[rv.seq_id] = (match_bucket(rv.match_length), state.acceptance.gains)
        return ks

    def observe(self, record) -> None:
        self.planner.observe(record)
        for rr in record.requests:
            pending = self._pending.pop(rr.seq_id, None)
            if pending is None or rr.k == 0:
                continue
            bucket, gains = pending
            self.rows.append({"requests_seen": self.requests_seen, "bucket": BUCKET_NAMES.get(bucket, str(bucket)),
                              "k": rr.k, "predicted_first": gains[0], "first_accepted": float(rr.num_accepted > 0),
                              "predicted_accepted": sum(gains[:rr.k]), "accepted": rr.num_accepted})

    @property
    def predicted_step_s(self):
        return self.planner.predicted_step_s


def calibration_rows(loaded, profile, *, workloads=WORKLOADS, after=CALIBRATION_AFTER, window: int = 5,
                     max_tokens: int = 128, proposer: str = "ngram", bar=None) -> list[dict]:
    """One row per drafted request-step of a cold planner serving each workload's prompts one
    after another (source order, from the first), up to max(after) + window requests."""
    from specplan.bench.evaluate import _engine, run_cell
    from specplan.bench.workloads import load_workload
    from specplan.planner.from_profile import planner_from_profile
    from specplan.policies import make_policy

    total = max(after) + window
    task = bar.add_task("calibration", total=len(workloads) * total) if bar else None
    engine = _engine(loaded, proposer, 1, 8, kv_cache_mib=B1_KV_CACHE_MIB)
    rows = []
    for w in workloads:
        prompts = load_workload(w)
        recorder = CalibrationRecorder(planner_from_profile(profile, make_policy("goodput"), proposer=proposer, max_k=8))
        for i in range(total):
            if bar:
                bar.update(task, description=f"calibration {w}: request {i + 1}/{total}")
            recorder.requests_seen = i
            # Only the checkpoints' windows are recorded; the requests between them teach the planner.
            run_cell(engine, [prompts[i % len(prompts)].render(loaded.tokenizer)], recorder, max_tokens, concurrency=1)
            if bar:
                bar.advance(task)
        rows += [{"workload": w, **r} for r in recorder.rows
                 if any(c <= r["requests_seen"] < c + window for c in after)]
    return rows


# ------------------------------------------------------------------------------------ summary


def spread(xs: list[float]) -> float:
    """Run-to-run spread: (max - min) / median (0 for one run)."""
    return (max(xs) - min(xs)) / statistics.median(xs) if len(xs) > 1 else 0.0


def paired_spread(runs: dict[str, list[float]], arm: str) -> float:
    """The spread of ``arm``'s reading over SD off's in the same run (lists aligned by run).

    Worked example: off [10, 12, 11], arm [13, 15, 13] -> ratios [1.3, 1.25, 1.18], spread
    (1.3 - 1.18) / 1.25 = 0.09, where the raw spread of the arm is (15 - 13) / 13 = 0.15: the
    machine's slower third run is common to both."""
    return spread([a / o for a, o in zip(runs[arm], runs[OFF])])


def pooled_spread(cells: dict[str, dict[str, list[float]]], arm: str, paired: bool = False) -> tuple[float, int]:
    """(variance, degrees of freedom) of ``arm``'s log tok/s over runs, pooled over the cells (each
    cell's runs about their own mean); ``paired``: of log(arm / SD off in the same run). Cells
    without the arm, or with one run, add nothing.

    Why pooled: the bar asks whether the planner's runs spread wider than static k's, and the
    range of 5 runs is a coin flip between two arms of equal spread (its own sampling error is
    ~35%). Pooled over the four workloads the variance rests on 16 degrees of freedom, and a
    variance ratio can be tested (``spread_test``).

    Worked example: runs [10, 11, 12] in one cell and [20, 22] in another: the log deviations
    about each cell's mean give sums of squares 0.0166 + 0.0045, over 2 + 1 degrees of freedom:
    variance 0.0071 (a sd of 8.4%)."""
    total, df = 0.0, 0
    for xs in _log_runs(cells, arm, paired):
        mean = sum(xs) / len(xs)
        total += sum((x - mean) ** 2 for x in xs)
        df += len(xs) - 1
    return (total / df if df else math.nan), df


def _log_runs(cells: dict[str, dict[str, list[float]]], arm: str, paired: bool) -> list[list[float]]:
    """Per cell with at least two runs of ``arm``: its log tok/s per run (``paired``: over SD off's)."""
    out = []
    for runs in cells.values():
        if arm not in runs or (paired and OFF not in runs):
            continue
        xs = [math.log(a / o) if paired else math.log(a)
              for a, o in zip(runs[arm], runs[OFF] if paired else runs[arm])]
        if len(xs) >= 2:
            out.append(xs)
    return out


def _deviations(cells: dict[str, dict[str, list[float]]], arm: str, paired: bool) -> list[float]:
    """|x - the cell's median| of every run of ``arm`` (x as in ``_log_runs``): what the
    Brown-Forsythe reading of ``spread_test`` compares."""
    return [abs(x - statistics.median(xs)) for xs in _log_runs(cells, arm, paired) for x in xs]


def spread_test(cells: dict[str, dict[str, list[float]]], arm: str, paired: bool = False) -> dict | None:
    """``arm``'s pooled variance against the static k arms' (k >= 1; their mean variance, their
    summed degrees of freedom): the ratio, and the one-sided F-test's p-value that the arm spreads
    wider than static k does (small p: wider, beyond what the runs' own noise explains). None
    without static k arms or runs to compare.

    The F-test assumes normal runs, and one slow run (a process that met a busy minute) can
    carry it; ``p_wider_robust`` reads the same question the Brown-Forsythe way: each run's
    absolute deviation from its cell's median, the arm's against the static k arms' (one-sided
    Welch t-test), with ``deviation_ratio`` their means' ratio. Where the two disagree, the
    wider spread is a run or two, not the arm's runs as a whole."""
    from scipy import stats

    statics = sorted({a for runs in cells.values() for a in runs if a.startswith("static:") and a != OFF})
    variance, df = pooled_spread(cells, arm, paired)
    pooled = [pooled_spread(cells, a, paired) for a in statics]
    pooled = [(v, d) for v, d in pooled if d]
    if not df or not pooled:
        return None
    static_variance = sum(v for v, _ in pooled) / len(pooled)
    static_df = sum(d for _, d in pooled)
    if static_variance > 0:
        ratio = variance / static_variance
    else:  # static k's runs all alike: any spread of the arm's is wider, none is not
        ratio = math.inf if variance > 0 else 1.0
    arm_dev = _deviations(cells, arm, paired)
    static_dev = [d for a in statics for d in _deviations(cells, a, paired)]
    mean_static_dev = statistics.fmean(static_dev)
    if mean_static_dev > 0:
        deviation_ratio = statistics.fmean(arm_dev) / mean_static_dev
        with warnings.catch_warnings():  # runs alike to the last digits (a synthetic report) only lose precision
            warnings.simplefilter("ignore", RuntimeWarning)
            robust = stats.ttest_ind(arm_dev, static_dev, equal_var=False, alternative="greater").pvalue
    else:  # as above: the static arms' runs all alike
        deviation_ratio = math.inf if any(arm_dev) else 1.0
        robust = 0.0 if any(arm_dev) else 1.0
    return {"sd": math.sqrt(variance), "static_sd": math.sqrt(static_variance), "variance_ratio": ratio,
            "df": df, "static_df": static_df, "p_wider": float(stats.f.sf(ratio, df, static_df)),
            "deviation_ratio": deviation_ratio, "p_wider_robust": float(robust)}


def spread_readings(cells: dict[str, dict[str, list[float]]]) -> dict[str, dict[str, dict | None]]:
    """``spread_test`` of each adaptive arm present, raw and paired: arm -> reading -> test."""
    return {arm: {kind: spread_test(cells, arm, kind == "paired") for kind in ("raw", "paired")}
            for arm in (ADAPTIVE, WARM) if any(arm in runs for runs in cells.values())}


def report_cells(result: dict) -> dict[str, dict[str, list[float]]]:
    """A written report's cold-start cells as ``spread_test`` reads them: workload -> arm -> tok/s per run."""
    return {w: cell["tok_s_runs"] for w, cell in result["summary"]["cold_start"].items()}


def pooled_cells(results: dict[str, dict]) -> dict[str, dict[str, list[float]]]:
    """The cells of several reports (name -> its coldstart.json), keyed "name/workload": each
    report's workload stays a cell of its own, so two hours of different speed add no spread,
    and ``spread_test`` over them rests on every report's degrees of freedom (16 per report of
    four workloads and five runs, where one report's reading has flipped with the hour)."""
    return {f"{name}/{w}": runs for name, result in results.items() for w, runs in report_cells(result).items()}


def summarize(cold: list[dict], mixed: list[dict], calibration: list[dict], *, after=CALIBRATION_AFTER,
              window: int = 5) -> dict:
    """Per cell: each arm's median and spread over runs, the adaptive arms' paired ratios and the
    bar; calibration per (workload, checkpoint, bucket); whether every arm produced the same tokens."""
    from specplan.bench.evaluate import NULL_CONTROL, paired_ratios

    out: dict[str, Any] = {"cold_start": {}, "mixed": None, "calibration": {}}
    by_cell: dict[str, dict[str, dict[int, list[dict]]]] = {}
    for r in cold:
        by_cell.setdefault(r["workload"], {}).setdefault(r["arm"], {}).setdefault(r["run"], []).append(r)
    for w, arms in by_cell.items():
        runs = {arm: [sum(x["tokens"] for x in per[run]) / sum(x["seconds"] for x in per[run]) for run in sorted(per)]
                for arm, per in arms.items()}
        digests = {arm: {(x["prompt"], x["digest"]) for rs in per.values() for x in rs} for arm, per in arms.items()}
        cell = {"tok_s_median": {a: statistics.median(v) for a, v in runs.items()},
                "spread": {a: spread(v) for a, v in runs.items()}, "tok_s_runs": runs,
                "paired_spread": {a: paired_spread(runs, a) for a in runs if a != OFF} if OFF in runs else {},
                "lossless": len({frozenset(d) for d in digests.values()}) == 1}
        if NULL_CONTROL in runs and OFF in runs:
            cell["null_control_vs_off"] = paired_ratios(runs, NULL_CONTROL)[0]
        statics = {a: v for a, v in runs.items() if a.startswith("static:")}
        best = max(statics, key=lambda a: statistics.median(statics[a]))
        cell["best_static"] = best
        for arm, bar in ((ADAPTIVE, COLD_VS_BEST_STATIC), (WARM, WARM_VS_BEST_STATIC)):
            if arm in runs:
                vs_off, vs_best = paired_ratios(runs, arm)
                paired = cell["paired_spread"]
                # SD off's paired spread is 0 by construction: where off is the best static k, the
                # null control's (off against off, run to run) stands for it.
                versus = best if best != OFF else NULL_CONTROL
                cell[arm] = {"paired_vs_off": vs_off, "paired_vs_best_static": vs_best, "bar": bar,
                             "meets_bar": vs_best >= bar,
                             "spread_no_wider_than_best_static": cell["spread"][arm] <= cell["spread"][best],
                             "paired_spread_no_wider_than_best_static": (
                                 paired[arm] <= paired[versus] if arm in paired and versus in paired else None)}
        out["cold_start"][w] = cell
    tok_s = {w: c["tok_s_runs"] for w, c in out["cold_start"].items()}
    out["spread_pooled"] = spread_readings(tok_s)
    if mixed:
        runs: dict[str, list[float]] = {}
        for r in sorted(mixed, key=lambda r: r["run"]):
            runs.setdefault(r["arm"], []).append(r["goodput"])
        vs_off, vs_best = paired_ratios(runs, ADAPTIVE) if ADAPTIVE in runs else (math.nan, math.nan)
        null = paired_ratios(runs, NULL_CONTROL)[0] if NULL_CONTROL in runs else None
        out["mixed"] = {"batch": mixed[0]["batch"], "goodput_median": {a: statistics.median(v) for a, v in runs.items()},
                        "spread": {a: spread(v) for a, v in runs.items()}, "goodput_runs": runs,
                        "paired_vs_off": vs_off, "paired_vs_best_static": vs_best, "null_control_vs_off": null,
                        "meets_bar": vs_off >= MIXED_VS_OFF and vs_best >= 1.0,
                        "lossless": len({r["digest"] for r in mixed}) == 1}
    for r in calibration:
        for checkpoint in (c for c in after if c <= r["requests_seen"] < c + window):  # windows may overlap
            cell = out["calibration"].setdefault(r["workload"], {}).setdefault(str(checkpoint), {}).setdefault(
                r["bucket"], {"steps": 0, "predicted_first": 0.0, "first_accepted": 0.0, "predicted_accepted": 0.0,
                              "accepted": 0.0})
            cell["steps"] += 1
            for key in ("predicted_first", "first_accepted", "predicted_accepted", "accepted"):
                cell[key] += r[key]
    for per_w in out["calibration"].values():
        for per_c in per_w.values():
            for cell in per_c.values():
                for key in ("predicted_first", "first_accepted", "predicted_accepted", "accepted"):
                    cell[key] /= cell["steps"]
    out["calibration_error"] = {w: {c: calibration_error(per_c) for c, per_c in per_w.items()}
                                for w, per_w in out["calibration"].items()}
    return out


def calibration_error(buckets: dict[str, dict]) -> dict:
    """One checkpoint's buckets in three numbers, each bucket weighted by its drafted steps: the mean
    |predicted - measured| of the first draft's acceptance and of the accepted drafts per step, and
    predicted over measured accepted drafts in all (1.0: unbiased; above 1: the planner expects
    more than it gets). Worked example: buckets with (steps, predicted, measured) drafts (10, 2.0,
    1.0) and (30, 0.5, 0.7) read |err| (10 * 1.0 + 30 * 0.2) / 40 = 0.4 and ratio (20 + 15) /
    (10 + 21) = 1.13."""
    steps = sum(c["steps"] for c in buckets.values())
    measured = sum(c["steps"] * c["accepted"] for c in buckets.values())
    return {"steps": steps,
            "first_abs_error": sum(c["steps"] * abs(c["predicted_first"] - c["first_accepted"])
                                   for c in buckets.values()) / steps,
            "drafts_abs_error": sum(c["steps"] * abs(c["predicted_accepted"] - c["accepted"])
                                    for c in buckets.values()) / steps,
            "predicted_over_measured": (sum(c["steps"] * c["predicted_accepted"] for c in buckets.values()) / measured
                                        if measured else None)}


def _bucket_order(name: str) -> int:
    """Match buckets in length order: none, 1, 2, 3, 4-7, 8-15, 16+."""
    digits = name.split("-")[0].rstrip("+")
    return int(digits) if digits.isdigit() else -1


# ------------------------------------------------------------------------------------ report


def render(result: dict, out_dir: Path) -> Path:
    """coldstart.md and coldstart.png from a result (``run_coldstart``'s JSON)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from specplan.bench.evaluate import NULL_CONTROL

    s, cfg = result["summary"], result["config"]
    cold, timed = s["cold_start"], s["cold_start"] or s.get("mixed")
    lines = ["# Cold start: the planner on traffic it has not seen", "",
             f"Command: `{result['command']}`  ", f"Date: {result['date']}  ", result["machine"], "",
             f"Model {cfg.get('model', '?')}, weights {cfg.get('quantize', 'none')}; proposer {cfg['proposer']}, "
             f"greedy, {cfg['max_tokens']} output tokens per request."]
    if timed:
        lines[-1] += (f" {cfg['runs']} runs (arms interleaved, rotated each run). Cold-start cells: B = 1, one "
                      f"request per process, {cfg['prompts']} prompts per workload; a run's reading of an arm is its "
                      "tokens over its seconds summed over the prompts (the model load and one short SD-off request "
                      f"before each measured request are not timed). `{WARM}` starts from beliefs saved by one "
                      f"process that served {cfg['train_prompts']} other prompts of the workload. Ratios are paired "
                      "within a run; the best static k is picked on the other runs (evaluate.py `paired_ratios`). "
                      "Spread: (max - min) / median over runs; paired spread: the same of an arm's tok/s over SD "
                      "off's in the same run (the machine's drift, common to both, cancels; "
                      f"`{NULL_CONTROL}`, SD off run again as its own arm, shows what is left of it).")
    lines.append("")
    if result.get("busy_machine_note") and timed:  # calibration alone reads acceptance, not speed
        lines += [f"**{result['busy_machine_note']}**", ""]
    if cold:
        arms = list(next(iter(cold.values()))["tok_s_median"])
        lines += ["## Cold start, B = 1", "", "Median tok/s (spread):", "",
                  "| workload | " + " | ".join(arms) + " |", "|---|" + "---|" * len(arms)]
        for w, c in cold.items():
            lines.append(f"| {w} | " + " | ".join(f"{c['tok_s_median'][a]:.1f} ({100 * c['spread'][a]:.0f}%)"
                                                 for a in arms) + " |")
        paired_arms = [a for a in arms if a != OFF]
        if any(c.get("paired_spread") for c in cold.values()):
            lines += ["", "Paired spread (each arm's tok/s over SD off's in the same run):", "",
                      "| workload | " + " | ".join(paired_arms) + " |", "|---|" + "---|" * len(paired_arms)]
            for w, c in cold.items():
                ps = c.get("paired_spread", {})
                lines.append(f"| {w} | " + " | ".join(f"{100 * ps[a]:.0f}%" if a in ps else "-" for a in paired_arms)
                             + " |")
        lines += ["", f"Paired ratios (bar: `{ADAPTIVE}` >= {COLD_VS_BEST_STATIC} x the best static k, `{WARM}` >= "
                  f"{WARM_VS_BEST_STATIC} x, spread no wider than the best static k's, raw and paired; where SD off "
                  f"is the best static k, its paired spread is the null control's):", "",
                  "| workload | best static | arm | vs off | vs best static | bar | spread <= best static's | "
                  "paired spread <= best static's | null control vs off | lossless |",
                  "|---|---|---|---|---|---|---|---|---|---|"]

        def yes_no(v) -> str:
            return "-" if v is None else "yes" if v else "no"

        for w, c in cold.items():
            for arm in (ADAPTIVE, WARM):
                if arm in c:
                    a = c[arm]
                    null = c.get("null_control_vs_off")
                    lines.append(f"| {w} | {c['best_static']} | {arm} | {a['paired_vs_off']:.3f} | "
                                 f"{a['paired_vs_best_static']:.3f} | {yes_no(a['meets_bar'])} | "
                                 f"{yes_no(a['spread_no_wider_than_best_static'])} | "
                                 f"{yes_no(a.get('paired_spread_no_wider_than_best_static'))} | "
                                 f"{'-' if null is None else f'{null:.3f}'} | {'yes' if c['lossless'] else 'NO'} |")
        pooled = s.get("spread_pooled") or {}  # absent from reports written before it existed
        tests = [(arm, kind, t) for arm, kinds in pooled.items() for kind, t in kinds.items() if t]
        if tests:
            lines += ["", "Spread pooled over the workloads (the sd of log tok/s over runs, each workload about its own "
                      "mean; paired: of the arm's tok/s over SD off's in the same run), against the static k arms' "
                      "(k >= 1, their mean variance): the variance ratio and a one-sided F-test's p that the arm "
                      "spreads wider (the range of 5 runs cannot tell two equal spreads apart; this can); and the "
                      "same read robustly (Brown-Forsythe: each run's absolute deviation from its workload's median, "
                      "the arm's mean against static k's, one-sided Welch test), which one slow run does not carry:",
                      "", "| arm | reading | sd | static k's sd | variance ratio | p (wider) | degrees of freedom | "
                      "deviation ratio | p (wider), robust |", "|---|---|---|---|---|---|---|---|---|"]
            for arm, kind, t in tests:
                robust = (f"{t['deviation_ratio']:.2f} | {t['p_wider_robust']:.3f}" if "p_wider_robust" in t
                          else "- | -")  # reports written before it existed
                lines.append(f"| {arm} | {kind} | {100 * t['sd']:.2f}% | {100 * t['static_sd']:.2f}% | "
                             f"{t['variance_ratio']:.2f} | {t['p_wider']:.3f} | {t['df']}, {t['static_df']} | {robust} |")
    mixed = s.get("mixed")
    if mixed:
        arms = list(mixed["goodput_median"])
        lines += ["", f"## Mixed batch, B = {mixed['batch']} (every workload in one batch)", "",
                  "| | " + " | ".join(arms) + " |", "|---|" + "---|" * len(arms),
                  "| goodput (tok/s) | " + " | ".join(f"{mixed['goodput_median'][a]:.1f}" for a in arms) + " |",
                  "| spread | " + " | ".join(f"{100 * mixed['spread'][a]:.0f}%" for a in arms) + " |", "",
                  f"`{ADAPTIVE}` paired: {mixed['paired_vs_off']:.3f}x SD off, {mixed['paired_vs_best_static']:.3f}x "
                  f"the best static k (bar: >= {MIXED_VS_OFF} and >= 1.0: {'met' if mixed['meets_bar'] else 'not met'}). "
                  f"Identical tokens in every arm: {'yes' if mixed['lossless'] else 'NO'}."]
        if mixed.get("null_control_vs_off") is not None:
            lines += ["", f"Null control: SD off run a second time as its own arm (`{NULL_CONTROL}`) reads "
                      f"{mixed['null_control_vs_off']:.3f}x SD off, paired the same way: the cell's noise."]
    calib = s["calibration"]
    if calib:
        lines += ["", "## Calibration: predicted vs measured acceptance per match-length bucket", "",
                  f"A cold planner serving a workload's requests one after another; the {cfg['calibration_window']} "
                  "requests right after the checkpoint's count. First draft: the policy's (calibrated) chance that "
                  "the first draft is accepted vs the share accepted; drafts: expected vs accepted drafts per drafted "
                  "request-step.", ""]
        errors = s.get("calibration_error") or {}  # absent from reports written before it existed
        if errors:
            lines += ["Per checkpoint, over its buckets (weighted by drafted steps; `calibration_error`): the mean "
                      "|predicted - measured| of the first draft's acceptance and of the accepted drafts per "
                      "step, and the predicted over the measured accepted drafts (1.00: unbiased).", "",
                      "| workload | after requests | drafted steps | first draft abs error | drafts abs error | "
                      "predicted / measured drafts |", "|---|---|---|---|---|---|"]
            for w, per_w in errors.items():
                for c, e in per_w.items():
                    ratio = "-" if e["predicted_over_measured"] is None else f"{e['predicted_over_measured']:.2f}"
                    lines.append(f"| {w} | {c} | {e['steps']} | {e['first_abs_error']:.3f} | "
                                 f"{e['drafts_abs_error']:.2f} | {ratio} |")
            lines += ["", "Per bucket:", ""]
        lines += ["| workload | after requests | bucket | drafted steps | first draft predicted | measured | "
                  "drafts predicted | measured |", "|---|---|---|---|---|---|---|---|"]
        for w, per_w in calib.items():
            for c, per_c in per_w.items():
                for b, cell in sorted(per_c.items(), key=lambda item: _bucket_order(item[0])):
                    lines.append(f"| {w} | {c} | {b} | {cell['steps']} | {cell['predicted_first']:.2f} | "
                                 f"{cell['first_accepted']:.2f} | {cell['predicted_accepted']:.2f} | "
                                 f"{cell['accepted']:.2f} |")

    panels = [p for p, on in (("cold", bool(cold)), ("mixed", bool(mixed)), ("calibration", bool(calib))) if on]
    fig, axes = plt.subplots(1, max(1, len(panels)), figsize=(5 * max(1, len(panels)), 3.8), squeeze=False)
    for ax, panel in zip(axes[0], panels):
        if panel == "cold":
            arms = list(next(iter(cold.values()))["tok_s_median"])
            width = 0.8 / len(arms)
            for j, arm in enumerate(arms):
                ys, lo, hi = [], [], []
                for c in cold.values():
                    norm = c["tok_s_median"][c["best_static"]]
                    runs = c["tok_s_runs"][arm]
                    ys.append(c["tok_s_median"][arm] / norm)
                    lo.append(ys[-1] - min(runs) / norm)
                    hi.append(max(runs) / norm - ys[-1])
                ax.bar([i + j * width for i in range(len(cold))], ys, width, yerr=[lo, hi], label=arm, capsize=2)
            ax.set_xticks([i + 0.4 - width / 2 for i in range(len(cold))], list(cold))
            ax.axhline(1.0, color="k", lw=0.8)
            ax.set_ylabel("tok/s / best static k (median; bars: min-max)")
            ax.set_title("cold start, B = 1, one request per process")
            ax.legend(fontsize=6)
        elif panel == "mixed":
            arms = list(mixed["goodput_median"])
            off = mixed["goodput_median"][OFF]
            ys = [mixed["goodput_median"][a] / off for a in arms]
            err = [[y - min(mixed["goodput_runs"][a]) / off for a, y in zip(arms, ys)],
                   [max(mixed["goodput_runs"][a]) / off - y for a, y in zip(arms, ys)]]
            ax.bar(arms, ys, yerr=err, capsize=2)
            ax.axhline(1.0, color="k", lw=0.8)
            ax.set_ylabel("goodput / SD off")
            ax.set_title(f"mixed batch, B = {mixed['batch']}")
            ax.tick_params(axis="x", labelrotation=45, labelsize=7)
        else:
            markers = dict(zip(map(str, cfg["calibration_after"]), "os^D"))
            for w, per_w in calib.items():
                for c, per_c in per_w.items():
                    xs = [cell["predicted_first"] for cell in per_c.values()]
                    ys = [cell["first_accepted"] for cell in per_c.values()]
                    ax.scatter(xs, ys, marker=markers.get(c, "x"), label=f"{w}, after {c}", alpha=0.7)
            ax.plot([0, 1], [0, 1], "k:", lw=0.8)
            ax.set_xlabel("predicted first-draft acceptance")
            ax.set_ylabel("measured")
            ax.set_title("calibration per match bucket")
            ax.legend(fontsize=5)
    fig.tight_layout()
    png = out_dir / "coldstart.png"
    fig.savefig(png, dpi=110)
    plt.close(fig)
    lines += ["", f"![cold start]({png.name})", ""]
    path = out_dir / "coldstart.md"
    path.write_text("\n".join(lines) + "\n")
    return path


def run_coldstart(out_dir: Path, *, model: str | None = None, profile: str | None = None, workloads=WORKLOADS,
                  prompts: int = 3, runs: int = 5, static_ks=STATIC_KS, max_tokens: int = 128,
                  train_prompts: int = 8, mixed_batch: int = 16, calibration_after=CALIBRATION_AFTER,
                  calibration_window: int = 5, proposer: str = "ngram", null_control: bool = True, quantize: str = "none",
                  progress: bool = True, command: str = "specplan bench coldstart") -> Path:
    """Every part (``mixed_batch`` 0 or an empty ``calibration_after`` leaves one out); writes
    coldstart.json, coldstart.md and coldstart.png into ``out_dir`` and returns the Markdown's path."""
    from rich.progress import Progress

    from specplan.adaptive import load_or_make_profile
    from specplan.engine import load_model
    from specplan.profiler.machine import describe, load_average, machine_info

    out_dir.mkdir(parents=True, exist_ok=True)
    # Read before this run's own work: a fresh quick profile keeps both cores busy for minutes, and
    # read after it the load would call a quiet machine busy.
    load_before = (load_average() or [None])[0]
    loaded = load_model(model, quantize=quantize)
    prof = load_or_make_profile(loaded, profile)
    profile_path = out_dir / "profile.json"
    prof.save(profile_path)  # every child steers by this very profile
    t0 = time.time()
    with Progress(disable=not progress) as bar:
        cold = cold_start_rows(loaded, profile_path, workloads=workloads, prompts=prompts, runs=runs,
                               static_ks=static_ks, max_tokens=max_tokens, train_prompts=train_prompts, model=model,
                               proposer=proposer, null_control=null_control, quantize=quantize,
                               out_dir=out_dir, bar=bar) if prompts and runs else []
        mixed = mixed_rows(loaded, prof, batch=mixed_batch, runs=runs, static_ks=static_ks, max_tokens=max_tokens,
                           workloads=workloads, proposer=proposer, bar=bar) if mixed_batch else []
        calibration = calibration_rows(loaded, prof, workloads=workloads, after=calibration_after,
                                       window=calibration_window, max_tokens=max_tokens, proposer=proposer,
                                       bar=bar) if calibration_after else []
    result = {
        "command": command, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(t0)),
        "machine": describe(machine_info()), "load_avg_1m_at_start": load_before,
        "config": {"workloads": list(workloads), "prompts": prompts, "runs": runs, "static_ks": list(static_ks),
                   "max_tokens": max_tokens, "train_prompts": train_prompts, "mixed_batch": mixed_batch,
                   "calibration_after": list(calibration_after), "calibration_window": calibration_window,
                   "proposer": proposer, "null_control": null_control, "model": loaded.name,
                   "quantize": quantize},
        "summary": summarize(cold, mixed, calibration, after=calibration_after, window=calibration_window),
        "rows": {"cold_start": cold, "mixed": mixed, "calibration": calibration},
    }
    if load_before is not None and load_before > 0.5:
        result["busy_machine_note"] = (f"The machine was busy when this run started (1-minute load {load_before:.1f}): "
                                       "its throughputs are not a measurement to publish.")
    (out_dir / "coldstart.json").write_text(json.dumps(result, indent=1, default=str))
    return render(result, out_dir)


__all__ = ["ChildJob", "CalibrationRecorder", "cold_start_rows", "mixed_rows", "calibration_rows", "summarize",
           "render", "run_coldstart", "run_job", "spawn"]


def _child_main() -> None:
    job = ChildJob(**json.loads(sys.stdin.read()))
    print(json.dumps(run_job(job)))


if __name__ == "__main__":
    _child_main()
