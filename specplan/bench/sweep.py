"""`specplan sweep`: every policy at every load level against specplan's OpenAI-compatible
server, served in-process; writes the results, then the report (``sweep_report``).

The pieces, one file each: ``sla`` (the targets and the metrics, with their definitions),
``arrivals`` (what a level sends, and when), ``client`` (the streaming load generator),
``deciders`` (each policy's decider, and the recorder of the k it ran) and ``server_thread``
(the server on loopback). Here: build each policy's engine once, run its levels from the lowest
load up with the same requests for every policy (a paired comparison), join each response to the
k its request ran (by response id), and write the rows as they come.
"""

from __future__ import annotations

import asyncio
import gc
import json
import math
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any, Callable, Sequence

from specplan.bench.arrivals import LoadRequest, arrival_times, make_requests, render_workload
from specplan.bench.client import ClientOptions, run_load, run_load_in_child
from specplan.bench.deciders import KRecorder, KTally, make_decider, needs_profile
from specplan.bench.server_thread import ServerThread
from specplan.bench.sla import SLA, meets_itl_sla, summarize_level
from specplan.bench.sweep_report import render_report
from specplan.policies import StaticPolicy, make_policy
from specplan.profiler.machine import load_average, machine_info


def run_sweep(policies: Sequence[str], rates: Sequence[float] | None = None, workload: str | Sequence[Any] = "mix",
              sla_ttft_ms: float | None = None, sla_itl_ms: float | None = None, *,
              duration_s: float | None = None, num_requests: int | None = None, out_dir: str | Path = "reports/sweep",
              model: str | None = None, proposer: str = "ngram", profile: Any = None, seed: int = 0,
              concurrency: Sequence[int] | None = None, max_tokens: int = 128, max_input_tokens: int | None = None,
              sla_tpot_ms: float | None = None, sla_e2el_ms: float | None = None, warmup_requests: int = 2,
              drain_timeout_s: float | None = None, burstiness: float = 1.0, temperature: float = 0.0,
              ignore_eos: bool = False, max_k: int = 8, max_queued: int = 1024, loaded: Any = None,
              engine_kwargs: dict | None = None, client_process: bool = True, progress: bool = True,
              command: str | None = None, render: bool = True, beliefs: bool = False, quantize: str = "none") -> Path:
    """Run every policy at every load level and write ``<out>/requests.parquet`` (one row per
    request), ``<out>/levels.parquet`` (one row per policy and level) and ``<out>/sweep.json``;
    then, with ``render``, the report (``sweep_report.render_report``).

    Levels: ``rates`` (req/s, Poisson) or ``concurrency`` (closed loop), each for ``duration_s`` of
    arrivals (default 60 s) or ``num_requests`` requests. Per policy the engine is built once (the model is loaded
    once for the whole sweep; pass ``loaded`` to reuse one) and served in-process on loopback; the
    levels then run from the lowest load up, each after ``warmup_requests`` unrecorded requests.
    ``profile``: a Profile, a path, or None (the cached profile for this model and machine, made if
    missing, when a policy needs one). ``client_process``: run the load generator in a child
    process (default; its timestamps do not wait for the server's GIL). ``beliefs``: every planner
    policy starts from the beliefs saved for this model and machine (specplan/adaptive.py
    ``belief_store``; read, never written). ``quantize``: the weights, as ``load_model`` takes them
    (engine/model/loader.py: "gguf" serves a GGUF's Q4_1 / Q8_0 blocks as stored; unused with
    ``loaded``). Returns the output folder.
    """
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from specplan.engine.server import build_engine, create_app

    if (rates is None) == (concurrency is None):
        raise ValueError("give exactly one of rates and concurrency")
    if duration_s is not None and num_requests is not None:
        raise ValueError("give duration_s or num_requests, not both")
    if duration_s is None and num_requests is None:
        duration_s = 60.0
    if not policies:
        raise ValueError("no policies to sweep")
    mode = "rate" if rates is not None else "concurrency"
    loads = sorted(float(x) for x in (rates if rates is not None else concurrency))  # type: ignore[union-attr]
    if any(not x > 0 for x in loads):
        raise ValueError(f"loads must be > 0, got {loads}")
    if mode == "concurrency" and any(x != int(x) or math.isinf(x) for x in loads):
        raise ValueError("concurrency levels must be whole numbers")
    policies = [p.strip() for p in policies]
    static_ks = [rule.k for rule in map(make_policy, policies) if isinstance(rule, StaticPolicy)]
    max_k = max([max_k, *static_ks])
    sla = SLA(sla_ttft_ms, sla_itl_ms, sla_tpot_ms, sla_e2el_ms)
    drain = drain_timeout_s if drain_timeout_s is not None else max(60.0, duration_s or 0.0)
    t_load = time.perf_counter()
    if loaded is None:
        from specplan.engine import load_model

        loaded = load_model(model, quantize=quantize)  # a bad model or --quantize fails before anything is written
    load_s = time.perf_counter() - t_load
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    engine_kwargs = dict(engine_kwargs or {})
    max_model_len = min(engine_kwargs.get("max_model_len", 2048), loaded.config.max_position_embeddings)
    input_cap = max_model_len - max_tokens
    if input_cap < 1:
        raise ValueError(f"max_tokens {max_tokens} leaves no room for a prompt in a {max_model_len}-token context")
    max_input_tokens = min(max_input_tokens, input_cap) if max_input_tokens is not None else input_cap
    prof_obj, prof_desc = _profile_for(policies, profile, loaded, proposer)
    store = None
    if beliefs and prof_obj is not None:
        from specplan.adaptive import belief_store

        store = belief_store(loaded, prof_obj)

    # The same requests for every policy (paired comparison): per level, send times from its own seed.
    level_sends = {}
    for i, load in enumerate(loads):
        if mode == "rate":
            level_sends[load] = arrival_times(load, duration_s=duration_s, num_requests=num_requests,
                                              seed=seed * 1000 + i, burstiness=burstiness)
        else:
            level_sends[load] = [0.0] * (num_requests if num_requests is not None else int(load))
    pool = max(64, max(len(s) for s in level_sends.values()) + warmup_requests)
    prompts = render_workload(workload, loaded.tokenizer, pool=pool, seed=seed, max_input_tokens=max_input_tokens)

    config = {
        "version": 1, "command": command, "started": time.strftime("%Y-%m-%d %H:%M:%S"), "status": "running",
        "policies": policies, "mode": mode, "loads": loads, "load_unit": "req/s" if mode == "rate" else "concurrency",
        "workload": workload if isinstance(workload, str) else "custom",
        "sla": asdict(sla), "goodput_thresholds_ms": sla.goodput_thresholds(),
        "duration_s": duration_s, "num_requests": num_requests, "max_tokens": max_tokens,
        "max_input_tokens": max_input_tokens, "warmup_requests": warmup_requests, "drain_timeout_s": drain,
        "burstiness": burstiness, "temperature": temperature, "ignore_eos": ignore_eos, "seed": seed,
        "model": loaded.name, "model_arg": model, "weights": loaded.config.quantization or "float32",
        "proposer": proposer, "max_k": max_k,
        "profile": prof_desc, "beliefs": str(store.path) if store is not None else None, "engine_kwargs": {k: str(v) for k, v in engine_kwargs.items()},
        "num_prompts": len(prompts), "client": "subprocess" if client_process else "in-process",
        "machine": {**machine_info(), "load_avg_1m_at_start": (load_average() or [None])[0]},
        "model_load_s": round(load_s, 2), "deciders": {}, "level_wall_s": {},
    }
    _write_json(config, out / "sweep.json")

    all_rows: list[dict] = []
    all_levels: list[dict] = []

    def run_client(url: str, reqs: list[LoadRequest], opts: ClientOptions, advance: Callable[[int], None]):
        if client_process:
            return run_load_in_child(url, reqs, opts, on_done=lambda: advance(1))
        return asyncio.run(run_load(url, reqs, opts, on_done=lambda: advance(1)))

    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, disable=not progress) as bar:
        overall = bar.add_task("sweep (policy × level)", total=len(policies) * len(loads))
        for policy in policies:
            decider, desc = make_decider(policy, proposer=proposer, profile=prof_obj, sla=sla, max_k=max_k,
                                         beliefs=store)
            recorder = KRecorder(decider)
            config["deciders"][policy] = desc
            engine = build_engine(loaded=loaded, proposer=proposer, spec_k=min(4, max_k), max_k=max_k,
                                  decider=recorder, **engine_kwargs)
            app = create_app(engine, loaded.name, max_queued=max_queued)
            with ServerThread(app) as server:
                for li, load in enumerate(loads):
                    t_level = time.perf_counter()
                    label = f"{policy} @ {load:g} {'req/s' if mode == 'rate' else 'concurrent'}"
                    if warmup_requests > 0:
                        warm = make_requests(prompts, [0.0] * warmup_requests, min(max_tokens, 16),
                                             offset=len(prompts) - warmup_requests)
                        # In this process: the warm-up's timings are not kept.
                        asyncio.run(run_load(server.url, warm, ClientOptions(mode="rate", drain_timeout_s=drain,
                                                                             temperature=temperature)))
                    recorder.clear()
                    reqs = make_requests(prompts, level_sends[load], max_tokens)
                    opts = ClientOptions(mode=mode, concurrency=int(load) if mode == "concurrency" else 1,
                                         duration_s=duration_s if mode == "concurrency" else None,
                                         drain_timeout_s=drain, temperature=temperature, ignore_eos=ignore_eos)
                    total = len(reqs) if (mode == "rate" or num_requests is not None) else None
                    task = bar.add_task(label, total=total)
                    rows, dur = run_client(server.url, reqs, opts, lambda n, t=task: bar.advance(t, n))
                    bar.remove_task(task)
                    server.wait_idle()
                    level = {"policy": policy, "mode": mode, "load": load, "level_index": li}
                    for r in rows:
                        r.update(policy=policy, mode=mode, load=load, level_index=li)
                        tally = recorder.pop(r["response_id"] + "-0") if r["response_id"] else None
                        r.update((tally or KTally()).row_fields())
                    level.update(summarize_level(rows, dur, sla))
                    level.update(_engine_counts(recorder), meets_itl_sla=meets_itl_sla(level, sla))
                    all_rows.extend(rows)
                    all_levels.append(level)
                    _write_parquet(all_rows, out / "requests.parquet")
                    _write_parquet(all_levels, out / "levels.parquet")
                    config["level_wall_s"][f"{policy}@{load:g}"] = round(time.perf_counter() - t_level, 2)
                    _write_json(config, out / "sweep.json")
                    bar.advance(overall)
            del engine, app, server, recorder, decider  # free this policy's engine (KV cache) before the next
            gc.collect()
    config["status"] = "complete"
    config["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
    _write_json(config, out / "sweep.json")
    if render:
        render_report(out)
    return out


def _profile_for(policies: Sequence[str], profile: Any, loaded: Any, proposer: str = "ngram") -> tuple[Any, str | None]:
    """(the latency profile the planner policies run with, how it was found): ``profile`` as given
    (a Profile or a path), else the cached or a fresh one when a policy needs one, else None."""
    if profile is None and not needs_profile(policies):
        return None, None
    from specplan.profiler.profile import Profile

    if isinstance(profile, Profile):
        return profile, "given in code"
    from specplan.adaptive import load_or_make_profile

    found = load_or_make_profile(loaded, str(profile) if profile is not None else None, proposers=(proposer,))
    return found, str(profile) if profile is not None else "cached/fresh for this model and machine"


def _engine_counts(recorder: KRecorder) -> dict:
    """A level's engine steps, mean decode batch and mean step time, from the recorder."""
    steps = recorder.num_steps
    return {"engine_steps": steps, "mean_decode_batch": recorder.decode_seqs / steps if steps else 0.0,
            "mean_step_ms": 1000 * recorder.step_s / steps if steps else 0.0}


# The results are rewritten after every level, each through a temporary file, so a sweep stopped
# half way leaves whole files of the levels it finished.
def _write_parquet(rows: list[dict], path: Path) -> None:
    import pandas as pd

    tmp = path.with_suffix(".tmp.parquet")
    pd.DataFrame(rows).to_parquet(tmp, index=False)
    tmp.replace(path)


def _write_json(obj: dict, path: Path) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(obj, indent=1, default=str))
    tmp.replace(path)


__all__ = ["run_sweep"]
