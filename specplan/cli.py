"""The `specplan` command line: generate, serve, profile, bench."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Annotated, Optional

import typer

from specplan import cli_checks as check
from specplan.bench.cli import bench_app
from specplan.cli_checks import KvCacheDtype, Quantize, fail, reports_errors

# Engine sizing options shared by `serve` and `sweep`.
MaxNumSeqs = Annotated[int, typer.Option(help="Sequences in the running batch at once.")]
MaxModelLen = Annotated[int, typer.Option(help="Prompt plus output tokens per request.")]
KvCacheMib = Annotated[int, typer.Option(help="KV cache budget in MiB.")]

Beliefs = Annotated[bool, typer.Option("--beliefs/--no-beliefs", help="Start the planner from what earlier runs learned for this model and machine (saved beside the profile); --no-beliefs: from its built-in priors.")]

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="specplan: adaptive speculative decoding, planned from the roofline.")


@app.callback()
def _root() -> None:
    """specplan: adaptive speculative decoding, planned from the roofline."""


PROPOSERS = ("ngram", "suffix", "layer-skip", "draft", "eagle", "chain")  # engine/proposers/factory.py
# Commands without a --draft-model option take the proposers that need no second model (eagle and
# chain use the head shipped for the model).
SELF_DRAFTING = ("ngram", "suffix", "layer-skip", "eagle", "chain")
DraftHead = Annotated[Optional[str], typer.Option(
    help="EAGLE-3 head folder for --proposer eagle/chain (default: the head shipped for the model; `specplan train-draft`).")]
LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")  # uvicorn's


def _check_speculation(proposer: str | None, spec_k: int | None, max_k: int | None, draft_model: str | None,
                       draft_layers: int, model: str | None, draft_head: str | None = None) -> None:
    """The options shared by generate and serve, before anything loads."""
    check.model_path(model)
    if proposer is not None:
        check.choice(proposer, PROPOSERS, "--proposer")
    check.at_least(spec_k, 1, "--spec-k")
    check.at_least(max_k, 1, "--max-k")
    check.at_least(draft_layers, 1, "--draft-layers")
    if proposer == "draft" and draft_model is None:
        fail("--proposer draft needs a draft model; pass --draft-model PATH (a model with the target's vocabulary)")
    check.model_path(draft_model, "--draft-model")
    if draft_head is not None:
        if proposer not in ("eagle", "chain"):
            fail("--draft-head only applies with --proposer eagle or chain; add one of them or drop it")
        if not Path(draft_head).is_dir():
            fail(f"--draft-head {draft_head} is not a folder; pass the folder `specplan train-draft --out` wrote")


def _check_adaptive(adaptive: bool, policy: str | None, profile: str | None, sla_itl_ms: float | None) -> None:
    if not adaptive and (policy is not None or profile is not None or sla_itl_ms is not None):
        fail("--policy, --profile and --sla-itl-ms only apply with --adaptive; add --adaptive or drop them")
    if policy is not None:
        check.policy(policy)
    check.positive(sla_itl_ms, "--sla-itl-ms")
    check.profile_file(profile)


@app.command()
@reports_errors
def generate(
    prompts: Annotated[list[str], typer.Argument(help="One or more prompts.")],
    model: Annotated[Optional[str], typer.Option(help="HF directory or .gguf file (default: embedded SmolLM2-135M-Instruct).")] = None,
    max_tokens: Annotated[int, typer.Option(help="Tokens to generate per prompt.")] = 64,
    temperature: Annotated[float, typer.Option(help="0 = greedy.")] = 0.0,
    top_p: Annotated[float, typer.Option()] = 1.0,
    top_k: Annotated[int, typer.Option(help="0 = no limit.")] = 0,
    seed: Annotated[Optional[int], typer.Option(help="Per-request seed (same seed, same output).")] = None,
    stop: Annotated[Optional[list[str]], typer.Option(help="Stop string (repeatable).")] = None,
    chat: Annotated[bool, typer.Option(help="Wrap each prompt in the model's chat template.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="One JSON object per prompt.")] = False,
    proposer: Annotated[Optional[str], typer.Option(help="Speculate with: ngram | suffix | layer-skip | draft | eagle | chain.")] = None,
    spec_k: Annotated[int, typer.Option(help="Draft tokens per request per step (with --proposer).")] = 4,
    draft_model: Annotated[Optional[str], typer.Option(help="Draft model for --proposer draft.")] = None,
    draft_layers: Annotated[int, typer.Option(help="Target layers kept by --proposer layer-skip.")] = 4,
    draft_head: DraftHead = None,
    adaptive: Annotated[bool, typer.Option(help="Let the planner choose k per request per step.")] = False,
    policy: Annotated[Optional[str], typer.Option(help="Planner policy, e.g. goodput, goodput:stop (a draft head stops on its confidence), static:4, heuristic (with --adaptive).")] = None,
    profile: Annotated[Optional[str], typer.Option(help="Latency profile JSON (with --adaptive; default: cached or a fresh quick one).")] = None,
    sla_itl_ms: Annotated[Optional[float], typer.Option(help="ITL target in ms (with --adaptive).")] = None,
    quantize: Quantize = "none",
    kv_cache_dtype: KvCacheDtype = "auto",
    beliefs: Beliefs = True,
) -> None:
    """Generate text for each prompt with the built-in engine."""
    if any(not p for p in prompts):
        fail("a prompt is empty; pass non-empty text, e.g. specplan generate 'Hello'")
    check.at_least(max_tokens, 1, "--max-tokens")
    check.at_least(temperature, 0, "--temperature")
    if not 0 < top_p <= 1:
        fail(f"--top-p must be in (0, 1], got {top_p}; pass e.g. --top-p 0.9 (1 = no limit)")
    check.at_least(top_k, 0, "--top-k")
    if stop is not None and not all(stop):
        fail("--stop got an empty string; pass the text to stop at, e.g. --stop '\\n\\n'")
    _check_speculation(proposer, spec_k, None, draft_model, draft_layers, model, draft_head)
    _check_adaptive(adaptive, policy, profile, sla_itl_ms)
    kv_dtype = check.kv_cache_dtype(kv_cache_dtype)
    from specplan.engine import LLM, SamplingParams, load_model

    params = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed,
                            max_tokens=max_tokens, stop=tuple(stop or ()))
    if adaptive:
        proposer = proposer or "ngram"
    spec = None
    if proposer is not None:
        spec = {"proposer": proposer, "k": spec_k, "max_k": max(spec_k, 8), "draft_model": draft_model,
                "draft_layers": draft_layers, "draft_head": draft_head}
    t0 = time.perf_counter()
    loaded = load_model(model, quantize=quantize)
    decider = store = None
    if adaptive:
        from specplan.adaptive import make_planner

        decider, store = make_planner(loaded, proposer=proposer, policy=policy, profile_path=profile,
                                      sla_itl_ms=sla_itl_ms, max_k=max(spec_k, 8), beliefs=beliefs, kv_dtype=kv_dtype)
    llm = LLM(speculative_config=spec, decider=decider, loaded=loaded, kv_cache_dtype=kv_cache_dtype)
    load_s = time.perf_counter() - t0
    inputs = [llm.apply_chat_template([{"role": "user", "content": p}]) for p in prompts] if chat else prompts
    t0 = time.perf_counter()
    outputs = llm.generate(inputs, params, progress=not as_json and sys.stderr.isatty())
    elapsed = time.perf_counter() - t0
    if store is not None:
        from specplan.adaptive import SavesBeliefs

        SavesBeliefs(decider, store).save()  # what this run learned, for the next one
    total = sum(len(o.token_ids) for o in outputs)
    for prompt, o in zip(prompts, outputs):
        if as_json:
            print(json.dumps({
                "prompt": prompt, "text": o.text, "token_ids": o.token_ids,
                "prompt_tokens": len(o.prompt_token_ids), "output_tokens": len(o.token_ids),
                "finish_reason": o.finish_reason, "tokens_per_s": round(_tokens_per_s(o), 2),
                **({"spec": o.metrics["spec"]} if spec else {}),
            }))
        else:
            typer.echo(o.text)
    if not as_json:
        line = (f"[{llm.engine.model_name}: load {load_s:.1f}s, {total} tokens in {elapsed:.2f}s, "
                f"{total / elapsed:.1f} tok/s")
        if spec:
            st = llm.engine.stats
            how = f"adaptive ({policy or 'goodput'})" if adaptive else f"k={spec_k}"
            line += (f"; {proposer} {how}: acceptance {st.acceptance_rate:.0%}, "
                     f"mean accepted length {st.mean_accepted_length:.2f}")
        typer.secho(line + "]", err=True, fg=typer.colors.BRIGHT_BLACK)


ENGINES = ("specplan", "vllm")


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
@reports_errors
def serve(
    ctx: typer.Context,
    model: Annotated[Optional[str], typer.Option(help="HF directory or .gguf file (default: embedded SmolLM2-135M-Instruct).")] = None,
    proposer: Annotated[Optional[str], typer.Option(help="Speculate with: ngram | suffix | layer-skip | draft | eagle | chain (default: no speculation).")] = None,
    spec_k: Annotated[int, typer.Option(help="Draft tokens per request per step (fixed-k decider, with --proposer).")] = 4,
    max_k: Annotated[Optional[int], typer.Option(help="Cap on any request's k, also a forced spec.k (default: max(spec-k, 8)).")] = None,
    draft_model: Annotated[Optional[str], typer.Option(help="Draft model for --proposer draft.")] = None,
    draft_layers: Annotated[int, typer.Option(help="Target layers kept by --proposer layer-skip.")] = 4,
    draft_head: DraftHead = None,
    host: Annotated[str, typer.Option(help="Address to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to listen on.")] = 8000,
    served_model_name: Annotated[Optional[str], typer.Option(help="Model id clients send (default: the model's name).")] = None,
    max_num_seqs: MaxNumSeqs = 64,
    max_num_batched_tokens: Annotated[int, typer.Option(help="Query tokens per engine step.")] = 512,
    max_model_len: MaxModelLen = 2048,
    kv_cache_mib: KvCacheMib = 512,
    max_queued: Annotated[int, typer.Option(help="Sequences allowed to wait before new requests get 429.")] = 256,
    adaptive: Annotated[bool, typer.Option(help="Let the planner choose k per request per step.")] = False,
    policy: Annotated[Optional[str], typer.Option(help="Planner policy, e.g. goodput, goodput:stop, static:4 (with --adaptive).")] = None,
    profile: Annotated[Optional[str], typer.Option(help="Latency profile JSON (with --adaptive).")] = None,
    sla_itl_ms: Annotated[Optional[float], typer.Option(help="ITL target in ms (with --adaptive).")] = None,
    log_level: Annotated[str, typer.Option(help="uvicorn log level.")] = "info",
    quantize: Quantize = "none",
    kv_cache_dtype: KvCacheDtype = "auto",
    beliefs: Beliefs = True,
    engine: Annotated[str, typer.Option(help="specplan (the built-in engine) or vllm (vLLM's OpenAI server with specplan's plugin; options specplan does not know go to `vllm serve`).")] = "specplan",
) -> None:
    """Serve the model over an OpenAI-compatible HTTP API (completions, chat, streaming, /metrics)."""
    check.choice(engine, ENGINES, "--engine")
    if engine == "vllm":
        if quantize != "none":
            fail("--quantize is for the built-in engine; pass vLLM its own --quantization after --engine vllm")
        if kv_cache_dtype != "auto":
            fail("--kv-cache-dtype here is the built-in engine's; pass vLLM its own --kv-cache-dtype after --engine vllm")
        _serve_vllm(ctx.args, model=model, proposer=proposer, spec_k=spec_k, max_k=max_k, host=host, port=port,
                    served_model_name=served_model_name, max_num_seqs=max_num_seqs,
                    max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_model_len, adaptive=adaptive,
                    policy=policy, profile=profile, sla_itl_ms=sla_itl_ms)
        return
    if ctx.args:
        fail(f"unknown option(s) {' '.join(ctx.args)}; see `specplan serve --help` (options for vLLM go with --engine vllm)")
    _check_speculation(proposer, spec_k, max_k, draft_model, draft_layers, model, draft_head)
    _check_adaptive(adaptive, policy, profile, sla_itl_ms)
    for value, option in ((max_num_seqs, "--max-num-seqs"), (max_num_batched_tokens, "--max-num-batched-tokens"),
                          (max_model_len, "--max-model-len"), (kv_cache_mib, "--kv-cache-mib")):
        check.at_least(value, 1, option)
    check.at_least(max_queued, 0, "--max-queued")
    check.choice(log_level, LOG_LEVELS, "--log-level")
    check.listen_address(host, port)
    kv_dtype = check.kv_cache_dtype(kv_cache_dtype)
    from specplan.engine import load_model
    from specplan.engine.server import build_engine
    from specplan.engine.server.app import serve as run_server

    t0 = time.perf_counter()
    loaded = load_model(model, quantize=quantize)
    decider = saver = None
    if adaptive:
        from specplan.adaptive import SavesBeliefs, make_planner

        proposer = proposer or "ngram"
        decider, store = make_planner(loaded, proposer=proposer, policy=policy, profile_path=profile,
                                      sla_itl_ms=sla_itl_ms, max_k=max_k if max_k is not None else 8, beliefs=beliefs,
                                      kv_dtype=kv_dtype)
        if store is not None:
            decider = saver = SavesBeliefs(decider, store)  # every minute, and at shutdown below
    engine = build_engine(model, proposer=proposer, spec_k=spec_k, max_k=max_k, draft_model=draft_model,
                          draft_layers=draft_layers, draft_head=draft_head, max_num_seqs=max_num_seqs,
                          max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_model_len,
                          kv_cache_bytes=kv_cache_mib * 1024**2, decider=decider, loaded=loaded, kv_dtype=kv_dtype)
    spec_line = f"{proposer} k={spec_k}" if proposer else "no speculation"
    if adaptive:
        spec_line = f"{proposer}, adaptive ({policy or 'goodput'} policy" + (
            f", ITL SLA {sla_itl_ms:g} ms)" if sla_itl_ms else ")")
    typer.secho(f"[{engine.model_name}: loaded in {time.perf_counter() - t0:.1f}s; {spec_line}; "
                f"{engine.block_manager.num_blocks} KV blocks ({str(engine.kv_dtype).removeprefix('torch.')}); "
                f"http://{host}:{port}/v1]",
                err=True, fg=typer.colors.BRIGHT_BLACK)
    try:
        run_server(host=host, port=port, served_model_name=served_model_name, max_queued=max_queued,
                   log_level=log_level, engine=engine)
    finally:
        if saver is not None:
            saver.save()


def _serve_vllm(extra: list[str], *, model: str | None, proposer: str | None, spec_k: int, max_k: int | None,
                host: str, port: int, served_model_name: str | None, max_num_seqs: int, max_num_batched_tokens: int,
                max_model_len: int, adaptive: bool, policy: str | None, profile: str | None,
                sla_itl_ms: float | None) -> None:
    """`serve --engine vllm`: check, find the vLLM profile, then become vLLM's server."""
    from specplan.integrations.vllm_serve import VllmServe, check_extra_args, checked_vllm_version, find_vllm_profile

    if proposer is not None:
        check.choice(proposer, ("ngram", "suffix"), "--proposer (with --engine vllm)")
    if proposer == "suffix" and not adaptive:
        fail("--proposer suffix with --engine vllm runs through specplan's plugin; add --adaptive (e.g. --policy static:4)")
    check.at_least(spec_k, 1, "--spec-k")
    check.at_least(max_k, 1, "--max-k")
    _check_adaptive(adaptive, policy, profile, sla_itl_ms)
    check.listen_address(host, port)
    check.model_path(model)
    check_extra_args(extra)
    version = checked_vllm_version()
    from specplan.integrations.vllm import PluginOptions
    from specplan.integrations.vllm_serve import model_dir
    from specplan.policies import make_policy
    from specplan.profiler.vllm_timer import vllm_device, vllm_kernels

    directory = model_dir(model)
    options = None
    if adaptive:
        rule = make_policy(policy or "goodput")
        if profile is None and ("latency" in rule.requires or "roofline" in rule.requires):
            kernels = vllm_kernels(version, vllm_device())
            name = _model_name(model)
            found = find_vllm_profile(name, kernels)
            if found is None:
                from specplan.profiler.run import profile_cache_dir
                from specplan.profiler.vllm_timer import run_vllm_profile

                typer.secho(f"[no vLLM profile of {name} on {kernels} yet: measuring a quick one (a few minutes; "
                            f"cached for later runs)]", err=True, fg=typer.colors.BRIGHT_BLACK)
                _, found, _ = run_vllm_profile(model, quick=True, report_dir=profile_cache_dir(),
                                               progress=sys.stderr.isatty())
            profile = str(found)
            typer.secho(f"[using vLLM profile {profile}]", err=True, fg=typer.colors.BRIGHT_BLACK)
        options = PluginOptions(policy=policy or "goodput", profile=profile, proposer=proposer or "ngram",
                                sla_itl_ms=sla_itl_ms, max_k=max_k)
    k = max_k if max_k is not None else (8 if adaptive else spec_k)
    launch = VllmServe(model=directory, host=host, port=port, served_model_name=served_model_name or _model_name(model),
                       max_num_seqs=max_num_seqs, max_model_len=max_model_len,
                       max_num_batched_tokens=max_num_batched_tokens, num_speculative_tokens=k, plugin=options,
                       fixed_ngram=proposer is not None and not adaptive, extra_args=tuple(extra), device=vllm_device())
    how = (f"specplan plans {options.proposer} speculation ({options.policy}, K={k})" if options is not None
           else f"vLLM's n-gram k={k}" if launch.fixed_ngram else "no speculation")
    typer.secho(f"[vLLM {version}: {directory}; {how}; http://{host}:{port}/v1]", err=True,
                fg=typer.colors.BRIGHT_BLACK)
    launch.exec()


def _model_name(model: str | None) -> str:
    from specplan.engine.model.loader import hf_model_dir

    return hf_model_dir(model)[1]


@app.command("profile")
@reports_errors
def profile_cmd(
    model: Annotated[Optional[str], typer.Option(help="HF directory or .gguf file (default: embedded SmolLM2-135M-Instruct).")] = None,
    quick: Annotated[bool, typer.Option("--quick/--full", help="Quick grid (under 3 minutes) or the full one.")] = True,
    out: Annotated[Optional[Path], typer.Option(help="Profile JSON path (default: the cache, where serve --adaptive finds it).")] = None,
    report_dir: Annotated[Path, typer.Option(help="Where the Markdown report and plots go.")] = Path("reports"),
    draft_layers: Annotated[int, typer.Option(help="Layer-skip draft depth whose cost is measured.")] = 8,
    quantize: Quantize = "none",
    kv_cache_dtype: KvCacheDtype = "auto",
    reset_beliefs: Annotated[bool, typer.Option("--reset-beliefs", help="Forget what the planner learned for this model and machine (its saved beliefs) and exit; measures nothing.")] = False,
    engine: Annotated[str, typer.Option(help="specplan (the built-in engine) or vllm (vLLM's own steps, forced through specplan's timing drafter; run from vLLM's environment).")] = "specplan",
    refit: Annotated[Optional[Path], typer.Option(help="Fit the latency model of this profile again from the grid it measured (this version's fit), write it to --out (default: in place) and exit; times nothing.")] = None,
) -> None:
    """Measure this machine and model: roofline ceilings, step-time grid, drafting costs, latency fit."""
    import shlex
    import sys

    if refit is not None:
        from specplan.profiler.profile import refit_profile

        check.output_file(out, "--out", "profile.json")
        profile = refit_profile(refit)
        path = out or refit
        if profile.grid_file and path.resolve().parent != refit.resolve().parent:
            import shutil

            shutil.copyfile(refit.parent / profile.grid_file, path.parent / profile.grid_file)
        profile.save(path)
        model = profile.model()
        tile = (f"; row tile {model.row_tile} ({'single edge' if model.row_block_limit == 1 else 'staircase'}, "
                f"{1e3 * model.per_row_block:.1f} ms)" if model.row_tile else "; no row tile")
        typer.echo(f"profile: {path}\nlatency model error on held-out cells: {profile.fit.heldout_mape:.1f}%{tile}")
        return
    check.choice(engine, ENGINES, "--engine")
    check.model_path(model)
    kv_dtype = check.kv_cache_dtype(kv_cache_dtype)
    if reset_beliefs:
        from specplan.adaptive import belief_store
        from specplan.engine import load_model

        store = belief_store(load_model(model, quantize=quantize), None, kv_dtype=kv_dtype)
        typer.echo(f"{'removed' if store.reset() else 'no saved beliefs at'} {store.path}")
        return
    check.at_least(draft_layers, 1, "--draft-layers")
    check.output_file(out, "--out", "profile.json")
    check.output_dir(report_dir, "--report-dir")
    command = "specplan " + shlex.join(sys.argv[1:])
    if engine == "vllm":
        from specplan.integrations.vllm_serve import checked_vllm_version
        from specplan.profiler.vllm_timer import run_vllm_profile

        if quantize != "none" or kv_cache_dtype != "auto":
            fail("--quantize and --kv-cache-dtype are for the built-in engine; vLLM loads the model as its own "
                 "--dtype/--quantization say")
        checked_vllm_version()
        profile, path, report = run_vllm_profile(model, quick=quick, out=out, report_dir=report_dir,
                                                 progress=sys.stderr.isatty(), command=command)
    else:
        from specplan.engine import load_model
        from specplan.profiler.run import run_profile

        profile, path, report = run_profile(model, quick=quick, out=out, report_dir=report_dir,
                                            layer_skip_layers=draft_layers, command=command,
                                            loaded=load_model(model, quantize=quantize), kv_dtype=kv_dtype)
    f = profile.fit
    typer.echo(f"profile: {path}\nreport:  {report}\nlatency model error on held-out cells: {f.heldout_mape:.1f}% "
               f"(pure roofline: {f.roofline_mape:.1f}%)")
    busy = f.busy_machine_warning()
    if busy:
        typer.secho(f"warning: {busy}", err=True, fg=typer.colors.YELLOW)


@app.command()
@reports_errors
def sweep(
    policies: Annotated[str, typer.Option(help="Comma-separated policies: off, static:K, batch_table, heuristic, roofline, goodput.")] = "off,static:2,static:4,batch_table,heuristic,goodput",
    rates: Annotated[Optional[str], typer.Option(help="Comma-separated request rates (req/s, Poisson arrivals; 'inf' = all at once).")] = None,
    concurrency: Annotated[Optional[str], typer.Option(help="Comma-separated concurrency levels (closed loop) instead of --rates.")] = None,
    workload: Annotated[str, typer.Option(help="humaneval | gsm8k | mtbench | xsum | mix.")] = "mix",
    sla_ttft_ms: Annotated[Optional[float], typer.Option(help="TTFT target (ms) for goodput.")] = None,
    sla_itl_ms: Annotated[Optional[float], typer.Option(help="ITL target (ms): p90 ITL per level, the planner's step-time cap, and the goodput TPOT threshold.")] = None,
    sla_tpot_ms: Annotated[Optional[float], typer.Option(help="Goodput TPOT threshold (ms) if not the ITL target.")] = None,
    sla_e2el_ms: Annotated[Optional[float], typer.Option(help="Goodput end-to-end latency threshold (ms).")] = None,
    duration_s: Annotated[Optional[float], typer.Option(help="Seconds of arrivals per level (default 60 unless --num-requests).")] = None,
    num_requests: Annotated[Optional[int], typer.Option(help="Requests per level instead of --duration-s.")] = None,
    out: Annotated[Path, typer.Option(help="Output folder (e.g. reports/<name>).")] = Path("reports/sweep"),
    model: Annotated[Optional[str], typer.Option(help="HF directory or .gguf file (default: embedded SmolLM2-135M-Instruct).")] = None,
    proposer: Annotated[str, typer.Option(help="ngram | suffix | layer-skip | eagle | chain.")] = "ngram",
    profile: Annotated[Optional[str], typer.Option(help="Latency profile JSON (default: cached for this model and machine, or a fresh quick one).")] = None,
    seed: Annotated[int, typer.Option(help="Seed for prompts and arrivals (the same requests for every policy).")] = 0,
    max_tokens: Annotated[int, typer.Option(help="Output tokens per request (max_tokens).")] = 128,
    max_input_tokens: Annotated[Optional[int], typer.Option(help="Leave out prompts longer than this (default: what fits the context).")] = None,
    ignore_eos: Annotated[bool, typer.Option(help="Generate max_tokens every time.")] = False,
    temperature: Annotated[float, typer.Option(help="0 = greedy.")] = 0.0,
    warmup_requests: Annotated[int, typer.Option(help="Unrecorded requests before each level.")] = 2,
    drain_timeout_s: Annotated[Optional[float], typer.Option(help="How long in-flight requests may run after the last arrival (default max(60, duration)).")] = None,
    burstiness: Annotated[float, typer.Option(help="1 = Poisson; <1 burstier, >1 more regular (gamma intervals).")] = 1.0,
    max_k: Annotated[int, typer.Option(help="Cap on k per request.")] = 8,
    max_num_seqs: MaxNumSeqs = 64,
    kv_cache_mib: KvCacheMib = 512,
    max_model_len: MaxModelLen = 2048,
    in_process_client: Annotated[bool, typer.Option(help="Run the load generator in the server's process (default: a child process).")] = False,
    beliefs: Beliefs = True,
    quantize: Quantize = "none",
) -> None:
    """Run every policy at every load level against an in-process server; write parquet results and the report."""
    import shlex

    if (rates is None) == (concurrency is None):
        fail("give exactly one of --rates and --concurrency, e.g. --rates 1,2,4")
    if duration_s is not None and num_requests is not None:
        fail("give --duration-s or --num-requests, not both")
    if duration_s is None and num_requests is None:
        duration_s = 60.0
    names = [check.policy(p, "--policies") for p in check.items(policies, "--policies")]
    levels = (check.float_list(rates, "--rates") if rates is not None
              else check.int_list(concurrency, "--concurrency", 1))
    check.choice(workload, _workload_names(), "--workload")
    check.choice(proposer, SELF_DRAFTING, "--proposer")
    for value, option in ((sla_ttft_ms, "--sla-ttft-ms"), (sla_itl_ms, "--sla-itl-ms"), (sla_tpot_ms, "--sla-tpot-ms"),
                          (sla_e2el_ms, "--sla-e2el-ms"), (duration_s, "--duration-s"),
                          (drain_timeout_s, "--drain-timeout-s"), (burstiness, "--burstiness")):
        check.positive(value, option)
    for value, option in ((num_requests, "--num-requests"), (max_tokens, "--max-tokens"),
                          (max_input_tokens, "--max-input-tokens"), (max_k, "--max-k"),
                          (max_num_seqs, "--max-num-seqs"), (kv_cache_mib, "--kv-cache-mib"),
                          (max_model_len, "--max-model-len")):
        check.at_least(value, 1, option)
    check.at_least(warmup_requests, 0, "--warmup-requests")
    check.at_least(temperature, 0, "--temperature")
    check.model_path(model)
    check.profile_file(profile)
    _check_workload_data(workload)
    check.output_dir(out, "--out")
    from specplan.bench.sweep import run_sweep

    path = run_sweep(names, rates=levels if rates is not None else None, workload=workload,
                     sla_ttft_ms=sla_ttft_ms, sla_itl_ms=sla_itl_ms, sla_tpot_ms=sla_tpot_ms, sla_e2el_ms=sla_e2el_ms,
                     duration_s=duration_s, num_requests=num_requests, out_dir=out, model=model, proposer=proposer,
                     profile=profile, seed=seed, concurrency=[int(x) for x in levels] if concurrency is not None else None,
                     max_tokens=max_tokens, max_input_tokens=max_input_tokens, warmup_requests=warmup_requests,
                     drain_timeout_s=drain_timeout_s, burstiness=burstiness, temperature=temperature,
                     ignore_eos=ignore_eos, max_k=max_k, client_process=not in_process_client, beliefs=beliefs,
                     quantize=quantize,
                     engine_kwargs={"max_num_seqs": max_num_seqs, "kv_cache_bytes": kv_cache_mib * 1024**2,
                                    "max_model_len": max_model_len},
                     progress=sys.stderr.isatty(), command="specplan " + shlex.join(sys.argv[1:]))
    typer.echo(f"results: {path}/requests.parquet, {path}/levels.parquet\nreport:  {path}/report.md")


def _workload_names() -> tuple[str, ...]:
    from specplan.bench.workloads import WORKLOADS

    return (*WORKLOADS, "mix")


def _check_workload_data(*names: str) -> None:
    """The workloads' data packages are installed (WorkloadUnavailableError names the pip package)."""
    from specplan.bench.workloads import data_files

    if names:
        data_files()  # every workload's file: cheap, and "mix" needs them all


@app.command()
@reports_errors
def report(
    out: Annotated[Path, typer.Argument(help="A sweep folder (what `specplan sweep --out` wrote).")],
    sla_ttft_ms: Annotated[Optional[float], typer.Option(help="Re-judge with this TTFT target (ms).")] = None,
    sla_itl_ms: Annotated[Optional[float], typer.Option(help="Re-judge with this ITL target (ms).")] = None,
) -> None:
    """Render <out>/report.md and its plots from a sweep's stored results (no re-run)."""
    import dataclasses

    from specplan.bench.sla import SLA
    from specplan.bench.sweep_report import load_results, render_report

    check.positive(sla_ttft_ms, "--sla-ttft-ms")
    check.positive(sla_itl_ms, "--sla-itl-ms")
    if not out.exists():
        fail(f"{out} does not exist; give the folder a sweep wrote (specplan sweep --out {out})")
    if not out.is_dir():
        fail(f"{out} is a file; give the folder a sweep wrote (the one holding sweep.json)")
    sla = None
    try:
        if sla_ttft_ms is not None or sla_itl_ms is not None:
            config, _, _ = load_results(out)
            sla = dataclasses.replace(SLA(**config.get("sla", {})),
                                      **{k: v for k, v in (("ttft_ms", sla_ttft_ms), ("itl_ms", sla_itl_ms)) if v is not None})
        path = render_report(out, sla=sla)
    except FileNotFoundError as e:
        fail(str(e) if e.filename is None else f"{e.filename} is missing; run `specplan sweep --out {out}` again")
    except (KeyError, TypeError, ValueError, OSError) as e:  # pyarrow's errors are OSError/ValueError kinds
        fail(f"{out} holds corrupted or foreign sweep results ({type(e).__name__}: {e}); "
             f"run `specplan sweep --out {out}` again")
    typer.echo(f"wrote {path}")


@app.command("evaluate")
@reports_errors
def evaluate_cmd(
    model: Annotated[Optional[str], typer.Option(help="HF directory or .gguf file (default: embedded SmolLM2-135M-Instruct).")] = None,
    proposers: Annotated[str, typer.Option(help="Comma-separated proposers to evaluate.")] = "ngram",
    workloads: Annotated[str, typer.Option(help="Comma-separated workloads.")] = "humaneval,gsm8k,mtbench,xsum",
    batch_sizes: Annotated[str, typer.Option(help="Comma-separated concurrency levels B.")] = "1,4,16,32",
    policies: Annotated[str, typer.Option(help="Planner policies compared with every static k.")] = "batch_table,heuristic,roofline,goodput",
    static_ks: Annotated[str, typer.Option(help="Comma-separated static k the policies are compared with (0 = SD off, always run).")] = "0,1,2,3,4,6,8",
    max_tokens: Annotated[int, typer.Option(help="Output tokens per request.")] = 64,
    length_spread: Annotated[int, typer.Option(help="Draw each request's output length from --max-tokens +- this (seeded, the same for every decider of a cell; 0: all equal).")] = 0,
    repeats: Annotated[int, typer.Option(help="Runs per cell, deciders interleaved; the report shows medians.")] = 3,
    min_requests: Annotated[int, typer.Option(help="Requests per cell at least (run at concurrency B).")] = 4,
    profile: Annotated[Optional[str], typer.Option(help="Latency profile JSON (default: cached or a fresh quick one).")] = None,
    null_control: Annotated[bool, typer.Option(help="Also run SD off a second time: how far a cell reads from itself.")] = True,
    clairvoyant: Annotated[bool, typer.Option(help="Also run a decider that knows each step's accepted lengths: the ceiling of per-request k.")] = True,
    out: Annotated[Path, typer.Option(help="Report folder.")] = Path("reports"),
    quantize: Quantize = "none",
    beliefs: Beliefs = True,
) -> None:
    """Every policy against every static k on the same closed batches, offline (greedy, goodput)."""
    import shlex

    import pandas as pd

    proposer_names = check.choices(proposers, SELF_DRAFTING, "--proposers")
    workload_names = check.choices(workloads, _workload_names()[:-1], "--workloads")
    sizes = check.int_list(batch_sizes, "--batch-sizes", 1)
    policy_names = tuple(check.policy(p, "--policies") for p in check.items(policies, "--policies"))
    ks = tuple(sorted({0, *check.int_list(static_ks, "--static-ks", 0)}))  # SD off is every ratio's base
    for value, option in ((max_tokens, "--max-tokens"), (repeats, "--repeats"), (min_requests, "--min-requests")):
        check.at_least(value, 1, option)
    check.at_least(length_spread, 0, "--length-spread")
    if length_spread >= max_tokens:
        check.fail(f"--length-spread {length_spread} must be below --max-tokens {max_tokens} (lengths are "
                   f"max-tokens +- spread, at least 1)")
    check.model_path(model)
    check.profile_file(profile)
    _check_workload_data(*workload_names)
    check.output_dir(out, "--out")
    from datetime import datetime, timezone

    from specplan.adaptive import belief_store, load_or_make_profile
    from specplan.bench.evaluate import evaluate, render_evaluation
    from specplan.engine import load_model
    from specplan.profiler.machine import describe, machine_info

    loaded = load_model(model, quantize=quantize)
    prof = load_or_make_profile(loaded, profile, proposers=proposer_names)
    store = belief_store(loaded, prof) if beliefs else None  # read only: the evaluation saves nothing
    if store is not None and store.document() is not None:
        typer.secho(f"[every planner starts from the beliefs in {store.path}; --no-beliefs for cold ones]",
                    err=True, fg=typer.colors.BRIGHT_BLACK)
    command = "specplan " + shlex.join(sys.argv[1:])
    frames: list[pd.DataFrame] = []
    started = datetime.now(timezone.utc)
    machine = describe(machine_info())

    def measured() -> str:
        return f"Measured {started:%Y-%m-%d %H:%M}-{datetime.now(timezone.utc):%H:%M} UTC. {machine}"

    def write_partial(rows: pd.DataFrame) -> None:  # a stopped run keeps the cells it finished
        render_evaluation(pd.concat([*frames, rows], ignore_index=True), out, command, complete=False,
                          measured=measured())

    for p in proposer_names:
        frames.append(evaluate(loaded, prof, proposer=p, workloads=workload_names, batch_sizes=sizes,
                               static_ks=ks, policies=policy_names, max_tokens=max_tokens,
                               length_spread=length_spread, repeats=repeats,
                               min_requests=min_requests, null_control=null_control, clairvoyant=clairvoyant,
                               beliefs=store, on_cell=write_partial))
    path = render_evaluation(pd.concat(frames, ignore_index=True), out, command, measured=measured())
    typer.echo(f"wrote {path}")


@app.command("train-draft")
@reports_errors
def train_draft_cmd(
    out: Annotated[Path, typer.Option(help="Folder for the head (config.json + model.safetensors, vLLM's eagle3 layout).")] = Path("draft-head"),
    work_dir: Annotated[Path, typer.Option(help="Cache of the stages (responses, features, checkpoints): rerun to resume.")] = Path("draft-work"),
    model: Annotated[Optional[str], typer.Option(help="HF directory or .gguf file (default: embedded SmolLM2-135M-Instruct).")] = None,
    sources: Annotated[Optional[str], typer.Option(help="Comma-separated prompt sources to use (vicuna, mtbench, gsm8k, xsum, humaneval, gpqa; default: all).")] = None,
    prompts: Annotated[Optional[int], typer.Option(help="Prompts in the training pool (default: 238, chat-heavy; scaled per source).")] = None,
    max_tokens: Annotated[int, typer.Option(help="Response tokens the target generates per prompt.")] = 256,
    steps: Annotated[int, typer.Option(help="Optimizer steps.")] = 600,
    batch_tokens: Annotated[int, typer.Option(help="Tokens per training batch (padded).")] = 4096,
    lr: Annotated[float, typer.Option(help="AdamW learning rate (peak).")] = 1e-3,
    ttt_steps: Annotated[int, typer.Option(help="Unrolled drafting steps in training (EAGLE-3's training-time test).")] = 3,
    draft_vocab: Annotated[int, typer.Option(help="Draft vocabulary size (the target's most frequent tokens).")] = 8192,
    layers: Annotated[Optional[str], typer.Option(help="Target layers read, e.g. 2,15,27 (default: 2, L/2, L-3 as vLLM).")] = None,
    train_lm_head: Annotated[bool, typer.Option(help="Train the output layer too (default: keep the target's embedding rows).")] = False,
    seed: Annotated[int, typer.Option(help="Seed for the prompt split, batches and initialisation.")] = 0,
    stop_after: Annotated[Optional[str], typer.Option(help="Stop after a stage: data | features.")] = None,
    data_minutes: Annotated[Optional[float], typer.Option(help="Generate responses for at most this long (keeps what exists, partial answers too).")] = None,
    minutes: Annotated[Optional[float], typer.Option(help="Budget for the whole run, data and training (a resumed run counts what it spent): the data stage gets a third unless --data-minutes says otherwise, training as many steps as fit (at most --steps).")] = None,
) -> None:
    """Train an EAGLE-3 draft head for the model on this machine (self-distillation; resumable)."""
    import shlex

    from specplan.train_draft import DEFAULT_QUOTAS, TrainSettings, run

    for value, option in ((max_tokens, "--max-tokens"), (steps, "--steps"), (batch_tokens, "--batch-tokens"),
                          (ttt_steps, "--ttt-steps"), (draft_vocab, "--draft-vocab"), (prompts, "--prompts")):
        check.at_least(value, 1, option)
    check.positive(lr, "--lr")
    check.positive(data_minutes, "--data-minutes")
    check.positive(minutes, "--minutes")
    check.model_path(model)
    if stop_after is not None:
        check.choice(stop_after, ("data", "features"), "--stop-after")
    target_layers = tuple(check.int_list(layers, "--layers", 0)) if layers is not None else None
    quotas = dict(DEFAULT_QUOTAS)
    if sources is not None:
        quotas = {k: quotas[k] for k in check.choices(sources, tuple(DEFAULT_QUOTAS), "--sources")}
    if prompts is not None:
        total = sum(quotas.values())
        quotas = {k: max(1, round(v * prompts / total)) for k, v in quotas.items()}
    settings = TrainSettings(out=out, work_dir=work_dir, model=model, seed=seed, quotas=quotas, max_tokens=max_tokens,
                             steps=steps, batch_tokens=batch_tokens, lr=lr, ttt_steps=ttt_steps,
                             draft_vocab_size=draft_vocab, target_layers=target_layers, train_lm_head=train_lm_head,
                             stop_after=stop_after, data_minutes=data_minutes, minutes=minutes, command="specplan " + shlex.join(sys.argv[1:]))
    run(settings, echo=typer.echo)


app.add_typer(bench_app, name="bench")


def _tokens_per_s(output) -> float:
    """Generated tokens over the request's own wall time (arrival to finish)."""
    m = output.metrics
    seconds = (m["finish_time"] or time.perf_counter()) - m["arrival_time"]
    return len(output.token_ids) / seconds if seconds > 0 else 0.0


@app.command("export")
@reports_errors
def export_cmd(
    profile: Annotated[Path, typer.Argument(help="A profile JSON (`specplan profile`).")],
    format: Annotated[str, typer.Option("--format", help="vllm (num_speculative_tokens_per_batch_size) or trtllm (draft_len_schedule).")] = "vllm",
    proposer: Annotated[str, typer.Option(help="Whose acceptance prior to assume (ngram, suffix).")] = "ngram",
    acceptance: Annotated[Optional[float], typer.Option(help="Measured per-draft acceptance in [0, 1], instead of the proposer's prior.")] = None,
    max_batch: Annotated[Optional[int], typer.Option(help="Largest batch size in the table (default: the profile's).")] = None,
    max_k: Annotated[int, typer.Option(help="Deepest k to consider.")] = 8,
    context: Annotated[int, typer.Option(help="Context tokens per request the table is priced at.")] = 512,
) -> None:
    """The batch-size -> k table for engines that cannot load specplan's plugin, from a profile's
    latency model and an acceptance estimate (the planner's goodput math, uniform k per batch)."""
    from specplan.export import FORMATS, k_table, prior_estimate, render
    from specplan.profiler.latency_model import DraftCost
    from specplan.profiler.profile import Profile

    if format not in FORMATS:
        fail(f"--format {format!r} is not one of {', '.join(FORMATS)}; pass --format vllm or --format trtllm")
    prof = Profile.load(profile)  # a bad profile: ProfileError, one line (reports_errors)
    estimate = prior_estimate(proposer, max(max_k, 1), acceptance)
    batches = max_batch or prof.max_batch
    rows = k_table(prof.model(), estimate, max_batch=batches, max_k=max_k, context_tokens=context,
                   draft_cost=prof.draft_costs.get(proposer, DraftCost()))
    meta = {"profile": str(profile), "proposer": proposer, "acceptance": acceptance if acceptance is not None else "prior",
            "context_tokens": context, "max_batch": batches,
            "profile_engine": prof.fingerprint.kernels, "model": prof.fingerprint.model}
    doc, snippet = render(format, rows, meta)
    typer.echo(json.dumps({**doc, "snippet": snippet}, indent=1))  # stdout: JSON only, for `> table.json`
    typer.secho(snippet, err=True, fg=typer.colors.BRIGHT_BLACK)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
