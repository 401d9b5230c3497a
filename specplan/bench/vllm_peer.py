"""vLLM as a measured peer: vLLM with speculation off, at vLLM's own static n-gram k, and with
specplan's plugin planning k; and specplan's engine on the same prompts, side by side.

Per (workload, B) cell every arm generates the same prompts (the evaluation's workloads,
specplan/bench/workloads.py), greedy, ``max_tokens`` each with EOS ignored, in waves of B at
once (B = concurrency; at B below ``min_requests`` several waves, so a cell is not one prompt).
All vLLM arms stay loaded (each its own engine-core process) and run interleaved, in an order
rotated each repeat, so the machine's drift hits them alike. vLLM's prefix cache is off: every
repeat runs the same prompts, and from the second on a cached prefill would flatter vLLM against
specplan's engine (which has none); the report gives medians of the
repeats and ratios within each repeat. Every vLLM arm's outputs are compared token for token
with vLLM off (greedy: speculation must not change them). The engine arms (``engine:off``,
``engine:<policy>``) run specplan's engine in this process on the same prompts.

With ``--table FILE`` (``specplan export --format vllm PROFILE > FILE``) one more vLLM arm,
``vllm:table``, runs vLLM's n-gram speculation with the exported batch-size -> k table
(``num_speculative_tokens_per_batch_size``): the planner's choices for users who cannot load
the plugin.

Run it from vLLM's environment (vLLM plus specplan, ``pip install --no-deps -e .``)::

    python -m specplan.bench.vllm_peer --out reports/vllm-peer --profile VLLM_PROFILE.json

Writes ``vllm-peer.json`` (every run, the machine, the command) and ``vllm-peer.md``, rewritten
after every cell so a long run that stops leaves what it measured.

Memory: every vLLM arm stays loaded, each about 2.5 GB (fp32 SmolLM2-135M, compiled: a ~1.9 GB
worker and a 0.66 GB engine core, measured on the Zen 4 VM) plus ``VLLM_CPU_KVCACHE_SPACE`` GiB of
KV cache. Five arms at 2 GiB each filled a 24 GiB machine (no
page cache left; vLLM off read 8 tok/s instead of 10 at B = 1), so size the KV cache to the cell:
1 GiB holds B = 32 of these prompts. vLLM-CPU's start-up (torch.compile) is about 2.5 minutes per
arm on 2 cores. The arms are checked as they load (``check_arms_fit``): seven arms at 1 GiB of KV
cache (~3.5 GB each) overfilled the 24 GiB Zen 4 VM, and the last one loaded read 0.88-0.95x vLLM
off in cells where it drafted nothing; a run whose arms do not fit stops before it measures.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import shlex
import statistics
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable

from specplan.bench.workloads import WORKLOADS, load_workload

PLUGIN = "specplan.integrations.vllm.SpecplanProposer"
OFF = "vllm:off"
NULL_CONTROL = "control:vllm:off"  # vLLM off run a second time in each repeat: what the cell's noise reads
NGRAM = {"method": "ngram", "prompt_lookup_min": 1, "prompt_lookup_max": 4}  # vLLM's own n-gram drafter
# Memory kept free beside the loaded arms: the page cache the model file and the workload's data
# need, and what the arms' first runs add to their footprint.
MEMORY_HEADROOM_BYTES = 2 << 30


def available_memory_bytes() -> int | None:
    """The kernel's estimate of memory available without swapping (None where it gives none)."""
    from specplan.profiler.machine import meminfo_bytes

    return meminfo_bytes("MemAvailable")


def check_arms_fit(before: int | None, after: int | None, arms_left: int,
                   headroom: int = MEMORY_HEADROOM_BYTES) -> None:
    """Raise SystemExit (one line) if the arms still to load, each as large as the one just loaded
    (available memory ``before`` - ``after`` it), would leave less than ``headroom`` free."""
    if before is None or after is None or arms_left <= 0:
        return
    per_arm = max(0, before - after)
    if after - per_arm * arms_left < headroom:
        gb = 1e9
        raise SystemExit(f"the vLLM arms do not fit in memory: each takes ~{per_arm / gb:.1f} GB and {after / gb:.1f} GB "
                         f"is left for {arms_left} more and {headroom / gb:.1f} GB of page cache (an arm loaded into a "
                         f"full machine runs slower than the rest); drop arms (--static-ks, --policies, --table, "
                         f"--other-profile) or lower VLLM_CPU_KVCACHE_SPACE")


@dataclass(frozen=True)
class VllmArm:
    """One vLLM configuration: its speculative config and the plugin's environment."""

    name: str  # vllm:off, vllm:static:K (vLLM's n-gram), vllm:plugin:<policy>
    speculative_config: dict | None = None
    env: dict[str, str] = field(default_factory=dict)


def vllm_arms(static_ks: list[int], policies: list[str], profile: str | None, proposer: str = "ngram",
              max_k: int = 8, table: list[list[int]] | None = None, stats_dir: Path | None = None,
              other_profile: str | None = None) -> list[VllmArm]:
    """vLLM off, vLLM's n-gram at each static k, the exported ``table`` ([[start, end, k], ...];
    all k = 0 runs as off) and the plugin under each policy (its counters written into
    ``stats_dir``, if given: ``PLUGIN_COUNTERS`` per run); with ``other_profile``, each plugin arm
    again on that profile (named ``...~other``: two profiles compared in one run, paired)."""
    arms = [VllmArm(OFF)]
    for k in static_ks:
        arms.append(VllmArm(f"vllm:static:{k}", {**NGRAM, "num_speculative_tokens": k}))
    if table is not None:
        top_k = max((k for _, _, k in table), default=0)
        arms.append(VllmArm("vllm:table", {**NGRAM, "num_speculative_tokens": top_k,
                                           "num_speculative_tokens_per_batch_size": [tuple(r) for r in table]}
                            if top_k else None))
    from specplan.integrations.vllm import PluginOptions

    plugin_arms = [(p, profile, "") for p in policies]
    if other_profile is not None:
        plugin_arms += [(p, other_profile, "~other") for p in policies]
    for arm_policy, arm_profile, tag in plugin_arms:
        # "goodput@K4": the plugin under vLLM's K = 4 instead of ``max_k`` (vLLM sizes its
        # speculative path by K, so the same policy under another K is another arm).
        policy, _, k = arm_policy.partition("@K")
        arm_policy += tag
        stats = str(stats_dir / f"plugin-{arm_policy.replace(':', '_')}.json") if stats_dir is not None else None
        # Counters written at most once a second (a write costs a few ms; after every call it would
        # slow the arm measured): a run's counters are those of its calls up to a second apart.
        options = PluginOptions(policy=policy, profile=arm_profile, proposer=proposer, stats_path=stats,
                                stats_every_s=1.0 if stats else 0.0, max_k=int(k) if k else None)
        arms.append(VllmArm(f"vllm:plugin:{arm_policy}", {"method": "custom_class", "model": PLUGIN,
                                                          "num_speculative_tokens": int(k) if k else max_k},
                            options.to_env()))
    return arms


# What the plugin did in a run: the difference of its counters (integrations/vllm.py ``DrafterStats``)
# read from its stats file before and after the run.
PLUGIN_COUNTERS = ("calls", "request_steps", "decisions", "drafts_proposed", "drafts_accepted", "own_s")


def plugin_counters(stats_path: str | None) -> dict[str, float] | None:
    """The plugin's cumulative counters now (zeros before its first call); None without a stats file."""
    if stats_path is None:
        return None
    try:
        stats = json.loads(Path(stats_path).read_text())
    except (OSError, ValueError):  # not written yet (or being replaced: the write is atomic)
        stats = {}
    return {k: float(stats.get(k, 0.0)) for k in PLUGIN_COUNTERS}


def plugin_run_summary(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """Per run: drafts per request-step, accepted per draft, the plugin's milliseconds per call."""
    d = {k: after[k] - before[k] for k in PLUGIN_COUNTERS}
    return {"calls": d["calls"], "drafts_per_request_step": d["drafts_proposed"] / max(d["request_steps"], 1.0),
            "accepted_per_draft": d["drafts_accepted"] / d["drafts_proposed"] if d["drafts_proposed"] else None,
            "own_ms_per_call": 1e3 * d["own_s"] / max(d["calls"], 1.0)}


class LoadedArm:
    """A vLLM instance of one arm (engine core in its own process, started with the arm's env)."""

    def __init__(self, arm: VllmArm, model_dir: Path, max_batch: int, max_model_len: int, seed: int,
                 enforce_eager: bool = False):
        from vllm import LLM

        saved = {k: v for k, v in os.environ.items() if k.startswith("SPECPLAN_")}
        for k in saved:
            del os.environ[k]
        os.environ.update(arm.env)
        try:
            self.llm = LLM(model=str(model_dir), dtype="float32", max_model_len=max_model_len, max_num_seqs=max_batch,
                           seed=seed, speculative_config=arm.speculative_config, skip_tokenizer_init=True,
                           enforce_eager=enforce_eager, enable_prefix_caching=False)
        finally:
            for k in arm.env:
                os.environ.pop(k, None)
            os.environ.update(saved)
        self.arm = arm

    def run(self, prompts: list[list[int]], batch: int, max_tokens: int) -> dict:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False)
        outputs = []
        stats_path = self.arm.env.get("SPECPLAN_VLLM_STATS")
        before = plugin_counters(stats_path)
        t0 = time.perf_counter()
        for start in range(0, len(prompts), batch):  # waves of B: concurrency B
            wave = [TokensPrompt(prompt_token_ids=p) for p in prompts[start:start + batch]]
            outputs += [list(o.outputs[0].token_ids) for o in self.llm.generate(wave, params, use_tqdm=False)]
        seconds = time.perf_counter() - t0
        tokens = sum(map(len, outputs))
        out = {"seconds": seconds, "output_tokens": tokens, "tokens_per_s": tokens / seconds, "outputs": outputs}
        if before is not None:
            out["plugin"] = plugin_run_summary(before, plugin_counters(stats_path))
        return out


class NullControl:
    """vLLM off again, as its own arm of the rotation (same engine, no extra memory): its paired
    ratio to ``vllm:off`` is how far a cell reads from itself."""

    name = NULL_CONTROL

    def __init__(self, off: LoadedArm):
        self.off = off

    def run(self, prompts: list[list[int]], batch: int, max_tokens: int) -> dict:
        return self.off.run(prompts, batch, max_tokens)


class EngineArm:
    """specplan's engine on the same prompts (bench/evaluate.py's engine and run_cell)."""

    def __init__(self, name: str, loaded, engine, decider_factory):
        self.name, self.loaded, self.engine, self.make = name, loaded, engine, decider_factory

    def run(self, prompts: list[list[int]], batch: int, max_tokens: int) -> dict:
        from specplan.bench.evaluate import run_cell

        r = run_cell(self.engine, prompts, self.make(), max_tokens, concurrency=batch)
        return {"seconds": r["seconds"], "output_tokens": r["output_tokens"], "tokens_per_s": r["goodput"],
                "outputs": r["outputs"]}


def engine_arms(model: str | None, policies: list[str], max_batch: int, profile: str | None,
                quantize: str = "none") -> list[EngineArm]:
    """engine:off and engine:<policy> (engine:<quantize>:... with quantized weights, e.g.
    engine:gguf:off for the default model's own Q4_1 blocks), sharing one loaded engine."""
    from specplan.adaptive import load_or_make_profile
    from specplan.bench.evaluate import _engine
    from specplan.engine import FixedDecider, load_model
    from specplan.planner.from_profile import planner_from_profile
    from specplan.policies import make_policy

    loaded = load_model(model, quantize=quantize)
    engine = _engine(loaded, "ngram", max_batch, 8)
    prefix = "engine:" if quantize == "none" else f"engine:{quantize}:"
    arms = [EngineArm(f"{prefix}off", loaded, engine, lambda: FixedDecider(0))]
    if policies:
        prof = load_or_make_profile(loaded, profile)
        for p in policies:
            arms.append(EngineArm(f"{prefix}{p}", loaded, engine,
                                  lambda p=p: planner_from_profile(prof, make_policy(p), proposer="ngram", max_k=8)))
    return arms


def run_peer(*, model: str | None, workloads: list[str], batch_sizes: list[int], static_ks: list[int],
             policies: list[str], profile: str | None, engine_policies: list[str] | None,
             engine_profile: str | None, max_tokens: int, repeats: int, min_requests: int, seed: int = 0,
             table: list[list[int]] | None = None, enforce_eager: bool = False, progress: bool = True,
             engine_quantize: str = "none", stats_dir: Path | None = None, other_profile: str | None = None,
             on_cell: Callable[[list[dict]], None] | None = None) -> list[dict]:
    """Every arm on every cell, ``repeats`` times interleaved; one dict per (cell, arm, repeat).
    ``on_cell(runs so far)`` is called after each repeat of each cell; ``stats_dir``: where the
    plugin arms write their counters (what each run drafted, and the plugin's time per call)."""
    from rich.progress import Progress
    from transformers import AutoTokenizer

    from specplan.engine.model.loader import hf_model_dir
    from specplan.profiler.vllm_timer import set_vllm_env_defaults

    model_dir, _ = hf_model_dir(model)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    pools = {w: [p.render(tokenizer) for p in load_workload(w, max(*batch_sizes, min_requests), seed)]
             for w in workloads}
    longest = max(len(p) for pool in pools.values() for p in pool)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    set_vllm_env_defaults()
    specs = vllm_arms(static_ks, policies, profile, table=table, stats_dir=stats_dir, other_profile=other_profile)
    arms: list = []
    for i, spec in enumerate(specs):
        before = available_memory_bytes()
        arms.append(LoadedArm(spec, model_dir, max(batch_sizes), longest + max_tokens + 64, seed, enforce_eager))
        check_arms_fit(before, available_memory_bytes(), len(specs) - i - 1)
    arms.append(NullControl(arms[0]))
    if engine_policies is not None:
        arms += engine_arms(model, engine_policies, max(batch_sizes), engine_profile, engine_quantize)
    names = [a.arm.name if isinstance(a, LoadedArm) else a.name for a in arms]
    first = next(iter(pools.values()))[:1]
    for a in arms:  # unrecorded: lazy compilation and first-touch costs land here, not in a cell
        a.run(first, 1, 4)
    runs = []
    total = len(workloads) * len(batch_sizes) * repeats * len(arms)
    with Progress(disable=not progress) as bar:
        task = bar.add_task("vLLM peer", total=total)
        for w in workloads:
            for b in batch_sizes:
                prompts = pools[w][:max(b, min_requests)]
                for rep in range(repeats):
                    shift = rep % len(arms)
                    order = list(range(len(arms)))[shift:] + list(range(len(arms)))[:shift]
                    cell = {}
                    for i in order:
                        bar.update(task, description=f"{w} B={b} {names[i]}")
                        cell[names[i]] = arms[i].run(prompts, b, max_tokens)
                        bar.advance(task)
                    reference = cell[OFF]["outputs"]
                    for name, r in cell.items():
                        outputs = r.pop("outputs")
                        runs.append({"workload": w, "batch_size": b, "arm": name, "repeat": rep,
                                     "requests": len(prompts), "same_as_vllm_off": outputs == reference, **r})
                    if on_cell is not None:
                        on_cell(runs)
    for a in arms:
        del a
    gc.collect()
    return runs


def summarize(runs: list[dict]) -> list[dict]:
    """One row per (workload, B, arm): median tokens/s, and paired ratios (per repeat, then the
    median) against vLLM off and vLLM's best static k of the cell."""
    cells: dict[tuple, dict[str, dict[int, float]]] = {}
    same: dict[tuple, bool] = {}
    plugin: dict[tuple, list[dict]] = {}
    for r in runs:
        key = (r["workload"], r["batch_size"])
        cells.setdefault(key, {}).setdefault(r["arm"], {})[r["repeat"]] = r["tokens_per_s"]
        same[key + (r["arm"],)] = same.get(key + (r["arm"],), True) and r["same_as_vllm_off"]
        if r.get("plugin"):
            plugin.setdefault(key + (r["arm"],), []).append(r["plugin"])
    rows = []
    for (w, b), arms in cells.items():
        statics = {a: statistics.median(v.values()) for a, v in arms.items() if a.startswith("vllm:static:")}
        best = max(statics, key=statics.get) if statics else None
        for arm, by_rep in arms.items():
            def paired(other: str | None) -> float | None:
                if other is None or other not in arms:
                    return None
                return statistics.median(by_rep[i] / arms[other][i] for i in by_rep if i in arms[other])

            row = {"workload": w, "batch_size": b, "arm": arm, "tokens_per_s": statistics.median(by_rep.values()),
                   "vs_vllm_off": paired(OFF), "vs_vllm_best_static": paired(best), "best_static": best,
                   "same_as_vllm_off": same[(w, b, arm)]}
            did = plugin.get((w, b, arm))
            if did:
                row["plugin"] = {k: _median_of_known(x[k] for x in did) for k in did[0]}
            rows.append(row)
    return rows


def _median_of_known(values) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


def run_meta(command: str, vllm_version: str, *, complete: bool = True) -> dict:
    """What a report says about its run: the command, date, machine, vLLM version and settings;
    ``complete=False`` marks a run still going (or cut)."""
    from specplan.profiler.machine import machine_info

    return {"command": command, "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "machine": machine_info(), "vllm": vllm_version, "complete": complete,
            "vllm_env": {k: v for k, v in os.environ.items() if k.startswith("VLLM_CPU")}}


def render(runs: list[dict], out_dir: Path, meta: dict) -> Path:
    """Write vllm-peer.json, vllm-peer.md and vllm-peer.png for the runs so far (``run_meta``)."""
    from specplan.profiler.machine import describe

    out_dir.mkdir(parents=True, exist_ok=True)
    rows = summarize(runs)
    command, now, vllm_version, complete = meta["command"], meta["date"], meta["vllm"], meta.get("complete", True)
    (out_dir / "vllm-peer.json").write_text(json.dumps({**meta, "summary": rows, "runs": runs}, indent=1))
    plot = _plot(rows, out_dir / "vllm-peer.png")
    arms = list(dict.fromkeys(r["arm"] for r in rows))
    lines = [f"# vLLM as a peer: speculation off, vLLM's static n-gram k, specplan's plugin, specplan's engine", "",
             f"Made by `{command}` on {now} with vLLM {vllm_version} "
             f"({', '.join(f'{k}={v}' for k, v in meta['vllm_env'].items()) or 'vLLM-CPU defaults'}). "
             f"{describe(meta['machine'])}", "",
             *([] if complete else ["**Partial: the run had not finished when this was written; cells below are "
                                    "the ones measured so far.**", ""]),
             "Tokens/s per arm (median of repeats); in brackets the paired ratio to vLLM off. "
             "`same` = every output token for token equal to vLLM off (greedy).", "",
             *([f"![tokens/s against vLLM off per cell]({plot.name})", ""] if plot else []),
             "| workload | B | " + " | ".join(arms) + " |", "|---|---|" + "---|" * len(arms)]
    by_cell: dict[tuple, dict[str, dict]] = {}
    for r in rows:
        by_cell.setdefault((r["workload"], r["batch_size"]), {})[r["arm"]] = r
    for (w, b), cell in by_cell.items():
        parts = []
        for a in arms:
            r = cell.get(a)
            if r is None:
                parts.append("")
                continue
            ratio = f" ({r['vs_vllm_off']:.2f}x)" if r["vs_vllm_off"] is not None and a != OFF else ""
            mark = "" if r["same_as_vllm_off"] or a.startswith("engine:") else " **differs**"
            parts.append(f"{r['tokens_per_s']:.1f}{ratio}{mark}")
        lines.append(f"| {w} | {b} | " + " | ".join(parts) + " |")
    plugin_rows = [r for r in rows if r["arm"].startswith("vllm:plugin:") and r["vs_vllm_best_static"]]
    if plugin_rows:
        lines += ["", "Plugin vs vLLM's best static k of each cell (paired):", ""]
        for arm in dict.fromkeys(r["arm"] for r in plugin_rows):
            ratios = [r["vs_vllm_best_static"] for r in plugin_rows if r["arm"] == arm]
            geo = math.exp(statistics.mean(math.log(x) for x in ratios))
            lines.append(f"- {arm}: geo-mean {geo:.3f}x, worst cell {min(ratios):.3f}x ({len(ratios)} cells)")
    off_rows = [r for r in rows if r["arm"] in ("vllm:table", NULL_CONTROL) or r["arm"].startswith("vllm:plugin:")]
    if off_rows:
        lines += ["", f"Worst and best cell against vLLM off (paired; `{NULL_CONTROL}` is vLLM off against "
                  "itself, the cells' noise):", ""]
        for arm in dict.fromkeys(r["arm"] for r in off_rows):
            mine = sorted((r for r in off_rows if r["arm"] == arm), key=lambda r: r["vs_vllm_off"])
            lo, hi = mine[0], mine[-1]
            lines.append(f"- {arm}: {lo['vs_vllm_off']:.3f}x ({lo['workload']} B={lo['batch_size']}) to "
                         f"{hi['vs_vllm_off']:.3f}x ({hi['workload']} B={hi['batch_size']})")
    did = [r for r in rows if r.get("plugin")]
    if did:
        lines += ["", "What the plugin did (medians over repeats): drafts per request-step, accepted drafts per "
                  "draft, and its own milliseconds per `propose` call (reading the batch, the planner's observe "
                  "and decide, the lookups).", "",
                  "| workload | B | arm | vs vLLM off | drafts / request-step | accepted / draft | plugin ms / call |",
                  "|---|---|---|---|---|---|---|"]
        for r in did:
            p = r["plugin"]
            acc = "-" if p["accepted_per_draft"] is None else f"{p['accepted_per_draft']:.2f}"
            lines.append(f"| {r['workload']} | {r['batch_size']} | {r['arm']} | {r['vs_vllm_off']:.3f} | "
                         f"{p['drafts_per_request_step']:.2f} | {acc} | {p['own_ms_per_call']:.2f} |")
    engine_rows = [r for r in rows if r["arm"].startswith("engine:")]
    if engine_rows:
        lines += ["", "specplan's engine vs vLLM off, same prompts and tokens (paired):", ""]
        for r in engine_rows:
            lines.append(f"- {r['workload']} B={r['batch_size']} {r['arm']}: {r['vs_vllm_off']:.2f}x")
    path = out_dir / "vllm-peer.md"
    path.write_text("\n".join(lines) + "\n")
    return path


def _plot(rows: list[dict], path: Path) -> Path | None:
    """One panel per workload: each arm's paired tokens/s over vLLM off against B (None without matplotlib)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return None
    from specplan.bench.plots import ratio_panels

    curves: dict[str, dict[str, tuple[list[int], list[float]]]] = {}
    for r in sorted(rows, key=lambda r: r["batch_size"]):
        if r["arm"] != OFF and r["vs_vllm_off"]:
            b, ratio = curves.setdefault(r["workload"], {}).setdefault(r["arm"], ([], []))
            b.append(r["batch_size"])
            ratio.append(r["vs_vllm_off"])
    return ratio_panels(curves, path, ylabel="tokens/s / vLLM off (paired)",
                        style=lambda arm: {"marker": "o",
                                           "linestyle": "--" if arm.startswith(("engine:", "control:")) else "-"})


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="vLLM off / static k / specplan's plugin, and specplan's engine, "
                                             "on the evaluation's workloads x B")
    ap.add_argument("--model", default=None)
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--batch-sizes", default="1,4,16,32")
    ap.add_argument("--static-ks", default="2,4", help="vLLM's own n-gram speculation at these k")
    ap.add_argument("--policies", default="goodput", help="the plugin's policies (goodput needs --profile); policy@K4: under vLLM's K = 4 (default 8)")
    ap.add_argument("--table", type=Path, default=None,
                    help="a `specplan export --format vllm` JSON: adds the arm vllm:table (vLLM's n-gram with that table)")
    ap.add_argument("--profile", default=None, help="a vLLM profile of the model (specplan profile --engine vllm)")
    ap.add_argument("--other-profile", default=None,
                    help="also run every plugin policy on this profile (arms named ...~other), paired with --profile's")
    ap.add_argument("--engine-policies", default="goodput",
                    help="specplan's engine arms beside engine:off ('none': no engine arms at all)")
    ap.add_argument("--engine-profile", default=None, help="the engine's profile (default: cached or a fresh one)")
    ap.add_argument("--engine-quantize", default="none",
                    help="the engine arms' weights (as `specplan generate --quantize`: none, gguf, int8, q4)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--min-requests", type=int, default=4)
    ap.add_argument("--out", type=Path, default=Path("reports/vllm-peer"))
    ap.add_argument("--rerender", type=Path, default=None, metavar="JSON",
                    help="only rewrite the report (table, plot) from a saved vllm-peer.json, into --out")
    ap.add_argument("--enforce-eager", action="store_true",
                    help="vLLM without torch.compile (starts in seconds, not minutes; not how vLLM serves by default)")
    ap.add_argument("--vllm-reserved-cpus", type=int, default=None,
                    help="VLLM_CPU_NUM_OF_RESERVED_CPU: vLLM-CPU keeps one core per worker for its scheduler "
                         "by default (on 2 cores its model runs on 1); 0 gives the model every core")
    args = ap.parse_args(argv)
    if args.rerender is not None:
        saved = json.loads(args.rerender.read_text())
        meta = {k: v for k, v in saved.items() if k not in ("summary", "runs")}
        print(f"wrote {render(saved['runs'], args.out, meta)}")
        return
    if args.vllm_reserved_cpus is not None:
        os.environ["VLLM_CPU_NUM_OF_RESERVED_CPU"] = str(args.vllm_reserved_cpus)

    def ints(text: str) -> list[int]:
        return [int(x) for x in text.split(",") if x]

    engine_policies = None if args.engine_policies == "none" else [p for p in args.engine_policies.split(",") if p]
    table = json.loads(args.table.read_text())["num_speculative_tokens_per_batch_size"] if args.table else None
    import vllm

    command = "python -m specplan.bench.vllm_peer " + shlex.join(argv or sys.argv[1:])
    stats_dir = args.out / "plugin-stats"  # the plugin arms' counters (vLLM's worker writes them)
    stats_dir.mkdir(parents=True, exist_ok=True)
    runs = run_peer(model=args.model, workloads=args.workloads.split(","), batch_sizes=ints(args.batch_sizes),
                    static_ks=ints(args.static_ks), policies=[p for p in args.policies.split(",") if p],
                    profile=args.profile, engine_policies=engine_policies, engine_profile=args.engine_profile,
                    max_tokens=args.max_tokens, repeats=args.repeats, min_requests=args.min_requests,
                    table=table, enforce_eager=args.enforce_eager, progress=sys.stderr.isatty(),
                    engine_quantize=args.engine_quantize, stats_dir=stats_dir, other_profile=args.other_profile,
                    on_cell=lambda so_far: render(so_far, args.out, run_meta(command, vllm.__version__, complete=False)))
    path = render(runs, args.out, run_meta(command, vllm.__version__))
    print(f"wrote {path} and {path.with_suffix('.json')}")


if __name__ == "__main__":
    main()
