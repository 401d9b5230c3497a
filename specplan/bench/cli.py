"""`specplan bench ...`: benchmarks that write reports under reports/ (CI runs tests, not these)."""

from __future__ import annotations

import shlex
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from specplan import cli_checks as check
from specplan.cli_checks import reports_errors

bench_app = typer.Typer(add_completion=False, no_args_is_help=True,
                        help="Benchmarks: measured side by side in one run, medians of repeats.")


LLAMA_CPP_FIX = "install it with `pip install -e '.[bench]'` (builds from source, about 9 minutes)"


@bench_app.command("engine")
@reports_errors
def bench_engine(
    out: Annotated[Path, typer.Option(help="Report folder.")] = Path("reports"),
    model: Annotated[Optional[str], typer.Option(help="HF directory or .gguf (default: embedded SmolLM2).")] = None,
    repeats: Annotated[int, typer.Option(help="Timed steps per cell and single-stream runs per engine (medians).")] = 5,
    batch_sizes: Annotated[str, typer.Option(help="Comma-separated B values.")] = "1,2,4,8,16,32",
    tokens_per_seq: Annotated[str, typer.Option(help="Comma-separated T values (1 + k).")] = "1,2,3,5,8,9",
    context: Annotated[int, typer.Option(help="Context tokens per sequence.")] = 256,
    no_hf: Annotated[bool, typer.Option("--no-hf", help="Skip Hugging Face transformers.")] = False,
    llama_cpp: Annotated[bool, typer.Option(help="Include llama.cpp (needs the bench extra).")] = True,
) -> None:
    """Step time vs Hugging Face transformers and the roofline floor; single-stream generation."""
    check.at_least(repeats, 1, "--repeats")
    sizes = check.int_list(batch_sizes, "--batch-sizes", 1)
    widths = check.int_list(tokens_per_seq, "--tokens-per-seq", 1)
    check.at_least(context, 1, "--context")
    check.model_path(model)
    if not no_hf:
        check.installed("transformers", "transformers", "install it with `pip install transformers` or pass --no-hf")
    if llama_cpp:
        check.installed("llama_cpp", "llama-cpp-python", LLAMA_CPP_FIX + " or pass --no-llama-cpp")
    check.output_dir(out, "--out")
    from specplan.bench.engine_bench import run_engine_bench

    gguf = None
    if llama_cpp:
        from specplan.bench.spec_bench import f32_gguf

        gguf = f32_gguf()
    path = run_engine_bench(out, model, repeats, sizes, widths, context,
                            include_hf=not no_hf, llama_cpp_gguf=gguf,
                            command="specplan " + shlex.join(sys.argv[1:]))
    typer.echo(f"wrote {path}")


@bench_app.command("quant")
@reports_errors
def bench_quant(
    out: Annotated[Path, typer.Option(help="Report folder.")] = Path("reports"),
    model: Annotated[Optional[str], typer.Option(help="A .gguf with Q4_1 blocks, or an HF directory (default: embedded SmolLM2).")] = None,
    repeats: Annotated[int, typer.Option(help="Rounds, every engine once per round (medians).")] = 3,
    new_tokens: Annotated[int, typer.Option(help="Greedy tokens per stream.")] = 128,
    batch_size: Annotated[int, typer.Option(help="Concurrent streams of the batched run.")] = 32,
    ppl_docs: Annotated[int, typer.Option(help="XSum articles for perplexity.")] = 8,
    ppl_tokens: Annotated[int, typer.Option(help="Tokens per article for perplexity.")] = 512,
    llama_cpp: Annotated[bool, typer.Option(help="Include llama.cpp (needs the bench extra).")] = True,
) -> None:
    """Quantized weights: fp32 / Q8_0 / Q4_1 tok/s, perplexity and greedy agreement, vs llama.cpp."""
    for value, option in ((repeats, "--repeats"), (new_tokens, "--new-tokens"), (batch_size, "--batch-size"),
                          (ppl_docs, "--ppl-docs"), (ppl_tokens, "--ppl-tokens")):
        check.at_least(value, 1, option)
    check.model_path(model)
    if llama_cpp:
        check.installed("llama_cpp", "llama-cpp-python", LLAMA_CPP_FIX + " or pass --no-llama-cpp")
    from specplan.bench.workloads import data_files

    data_files()
    check.output_dir(out, "--out")
    from specplan.bench.quant_bench import run_quant_bench

    path = run_quant_bench(out, model, repeats=repeats, new_tokens=new_tokens, batch_size=batch_size,
                           ppl_docs=ppl_docs, ppl_tokens=ppl_tokens, llama_cpp=llama_cpp,
                           command="specplan " + shlex.join(sys.argv[1:]))
    typer.echo(f"wrote {path}")


@bench_app.command("spec")
@reports_errors
def bench_spec(
    out: Annotated[Path, typer.Option(help="Report folder.")] = Path("reports"),
    prompts_per_workload: Annotated[int, typer.Option(help="Prompts per workload (code, summarization, chat).")] = 1,
    max_new_tokens: Annotated[int, typer.Option(help="Tokens generated per prompt (EOS ignored).")] = 128,
    repeats: Annotated[int, typer.Option(help="Repeats per cell (median).")] = 3,
    ks: Annotated[str, typer.Option(help="Comma-separated static k values.")] = "0,1,2,4,8",
    proposers: Annotated[str, typer.Option(help="Comma-separated proposers.")] = "ngram,suffix,layer-skip",
    no_hf: Annotated[bool, typer.Option("--no-hf", help="Skip Hugging Face transformers.")] = False,
    no_llama_cpp: Annotated[bool, typer.Option("--no-llama-cpp", help="Skip llama.cpp.")] = False,
) -> None:
    """Batch-1 speculative decoding: specplan's proposers x k vs transformers and llama.cpp prompt lookup."""
    for value, option in ((prompts_per_workload, "--prompts-per-workload"), (max_new_tokens, "--max-new-tokens"),
                          (repeats, "--repeats")):
        check.at_least(value, 1, option)
    static_ks = check.int_list(ks, "--ks", 0)
    proposer_names = check.choices(proposers, ("ngram", "suffix", "layer-skip"), "--proposers")
    if not no_hf:
        check.installed("transformers", "transformers", "install it with `pip install transformers` or pass --no-hf")
    if not no_llama_cpp:
        check.installed("llama_cpp", "llama-cpp-python", LLAMA_CPP_FIX + " or pass --no-llama-cpp")
    from specplan.bench.workloads import data_files

    data_files()
    check.output_dir(out, "--out")
    from specplan.bench.spec_bench import run_spec_bench

    try:
        run_spec_bench(out_dir=out, prompts_per_workload=prompts_per_workload, max_new_tokens=max_new_tokens,
                       repeats=repeats, ks=static_ks, proposers=proposer_names,
                       include_hf=not no_hf, include_llama_cpp=not no_llama_cpp,
                       command="specplan " + shlex.join(sys.argv[1:]))
    except AssertionError as e:  # a speculative output differed from plain greedy: the report says where
        typer.secho(f"error: {e}", fg=typer.colors.RED, err=True)
        raise typer.Exit(1)
    typer.echo(f"wrote {out / 'spec-bench.md'}")


@bench_app.command("coldstart")
@reports_errors
def bench_coldstart(
    out: Annotated[Path, typer.Option(help="Report folder.")] = Path("reports/coldstart"),
    model: Annotated[Optional[str], typer.Option(help="HF directory or .gguf (default: embedded SmolLM2).")] = None,
    profile: Annotated[Optional[str], typer.Option(help="Latency profile JSON (default: cached or a fresh quick one).")] = None,
    workloads: Annotated[str, typer.Option(help="Comma-separated workloads.")] = "humaneval,gsm8k,mtbench,xsum",
    prompts: Annotated[int, typer.Option(help="Cold-start prompts per workload (each arm: one process per prompt per run); 0 skips the cold-start cells.")] = 3,
    runs: Annotated[int, typer.Option(help="Runs per cell (medians and spread over them).")] = 5,
    static_ks: Annotated[str, typer.Option(help="Comma-separated static k arms (SD off always runs).")] = "1,2,3,4",
    max_tokens: Annotated[int, typer.Option(help="Output tokens per request.")] = 128,
    train_prompts: Annotated[int, typer.Option(help="Other prompts of the workload the beliefs are learned on.")] = 8,
    mixed_batch: Annotated[int, typer.Option(help="B of the mixed-workload cell (0 skips it).")] = 16,
    calibration_after: Annotated[str, typer.Option(help="Comma-separated request counts to read calibration after ('' skips it).")] = "0,10,100",
    calibration_window: Annotated[int, typer.Option(help="Requests read at each calibration checkpoint.")] = 5,
    null_control: Annotated[bool, typer.Option(help="Run SD off a second time as its own cold-start arm (control:off): what pairing alone reads.")] = True,
    quantize: check.Quantize = "none",
) -> None:
    """The planner on traffic it has not seen: one cold request per process (off, static k, adaptive
    with and without saved beliefs), a mixed-workload batch, and calibration after 0, 10, 100 requests."""
    from specplan.bench.evaluate import WORKLOADS

    workload_names = check.choices(workloads, WORKLOADS, "--workloads")
    ks = check.int_list(static_ks, "--static-ks", 1)
    after = check.int_list(calibration_after, "--calibration-after", 0) if calibration_after.strip() else []
    for value, option in ((prompts, "--prompts"), (mixed_batch, "--mixed-batch")):
        check.at_least(value, 0, option)
    for value, option in ((runs, "--runs"), (max_tokens, "--max-tokens"), (train_prompts, "--train-prompts"),
                          (calibration_window, "--calibration-window")):
        check.at_least(value, 1, option)
    check.model_path(model)
    check.profile_file(profile)
    from specplan.bench.workloads import data_files

    data_files()
    check.output_dir(out, "--out")
    from specplan.bench.coldstart import run_coldstart

    path = run_coldstart(out, model=model, profile=profile, workloads=workload_names, prompts=prompts, runs=runs,
                         static_ks=ks, max_tokens=max_tokens, train_prompts=train_prompts, mixed_batch=mixed_batch,
                         calibration_after=after, calibration_window=calibration_window, null_control=null_control,
                         quantize=quantize, progress=sys.stderr.isatty(), command="specplan " + shlex.join(sys.argv[1:]))
    typer.echo(f"wrote {path}")
