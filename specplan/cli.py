"""The `specplan` command line: generate (more commands join as the product grows)."""

from __future__ import annotations

import json
import sys
import time
from typing import Annotated, Optional

import typer

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="specplan: adaptive speculative decoding, planned from the roofline.")


@app.callback()
def _root() -> None:
    """specplan: adaptive speculative decoding, planned from the roofline."""


def fail(message: str) -> None:
    """One clear line on stderr, no traceback."""
    typer.secho(f"error: {message}", fg=typer.colors.RED, err=True)
    raise typer.Exit(1)


@app.command()
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
    proposer: Annotated[Optional[str], typer.Option(help="Speculate with: ngram | suffix | layer-skip | draft.")] = None,
    spec_k: Annotated[int, typer.Option(help="Draft tokens per request per step (with --proposer).")] = 4,
    draft_model: Annotated[Optional[str], typer.Option(help="Draft model for --proposer draft.")] = None,
    draft_layers: Annotated[int, typer.Option(help="Target layers kept by --proposer layer-skip.")] = 4,
) -> None:
    """Generate text for each prompt with the built-in engine."""
    from specplan.engine import LLM, RequestError, SamplingParams
    from specplan.engine.loader import ModelLoadError

    try:
        params = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed,
                                max_tokens=max_tokens, stop=tuple(stop or ()))
    except ValueError as e:
        fail(str(e))
    if any(not p for p in prompts):
        fail("a prompt is empty")
    spec = None
    if proposer is not None:
        spec = {"proposer": proposer, "k": spec_k, "max_k": max(spec_k, 8), "draft_model": draft_model,
                "draft_layers": draft_layers}
    t0 = time.perf_counter()
    try:
        llm = LLM(model, speculative_config=spec)
    except (ModelLoadError, ValueError) as e:
        fail(str(e))
    load_s = time.perf_counter() - t0
    try:
        inputs = [llm.apply_chat_template([{"role": "user", "content": p}]) for p in prompts] if chat else prompts
        t0 = time.perf_counter()
        outputs = llm.generate(inputs, params, progress=not as_json and sys.stderr.isatty())
        elapsed = time.perf_counter() - t0
    except (RequestError, ValueError) as e:
        fail(str(e))
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
            line += (f"; {proposer} k={spec_k}: acceptance {st.acceptance_rate:.0%}, "
                     f"mean accepted length {st.mean_accepted_length:.2f}")
        typer.secho(line + "]", err=True, fg=typer.colors.BRIGHT_BLACK)


def _tokens_per_s(output) -> float:
    """Generated tokens over the request's own wall time (arrival to finish)."""
    m = output.metrics
    seconds = (m["finish_time"] or time.perf_counter()) - m["arrival_time"]
    return len(output.token_ids) / seconds if seconds > 0 else 0.0


def main() -> None:
    app()


if __name__ == "__main__":
    main()
