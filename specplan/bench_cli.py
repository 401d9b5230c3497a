"""`specplan bench ...`: benchmarks that write reports under reports/ (CI runs tests, not these)."""

from __future__ import annotations

import shlex
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

bench_app = typer.Typer(add_completion=False, no_args_is_help=True,
                        help="Benchmarks: measured side by side in one run, medians of repeats.")


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x.strip())


@bench_app.command("engine")
def bench_engine(
    out: Annotated[Path, typer.Option(help="Report folder.")] = Path("reports"),
    model: Annotated[Optional[str], typer.Option(help="HF directory or .gguf (default: embedded SmolLM2).")] = None,
    repeats: Annotated[int, typer.Option(help="Timed steps per cell (median).")] = 5,
    batch_sizes: Annotated[str, typer.Option(help="Comma-separated B values.")] = "1,2,4,8,16,32",
    tokens_per_seq: Annotated[str, typer.Option(help="Comma-separated T values (1 + k).")] = "1,2,3,5,9",
    context: Annotated[int, typer.Option(help="Context tokens per sequence.")] = 256,
    no_hf: Annotated[bool, typer.Option("--no-hf", help="Skip Hugging Face transformers.")] = False,
    llama_cpp: Annotated[bool, typer.Option(help="Include llama.cpp (needs the bench extra).")] = True,
) -> None:
    """Step time vs Hugging Face transformers and the roofline floor; single-stream generation."""
    from specplan.profiler.engine_bench import run_engine_bench

    gguf = None
    if llama_cpp:
        try:
            import llama_cpp  # noqa: F401

            from specplan.profiler.spec_bench import f32_gguf_path

            gguf = f32_gguf_path()
        except ImportError:
            typer.secho("llama.cpp not installed (pip install -e '.[bench]'): skipping it", err=True)
    path = run_engine_bench(out, model, repeats, _ints(batch_sizes), _ints(tokens_per_seq), context,
                            include_hf=not no_hf, llama_cpp_gguf=gguf,
                            command="specplan " + shlex.join(sys.argv[1:]))
    typer.echo(f"wrote {path}")
