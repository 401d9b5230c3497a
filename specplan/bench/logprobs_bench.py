"""What logprobs cost: greedy generation with ``logprobs=5`` against none, same engine, same run.

For each batch size B, the two settings alternate repeat after repeat (so drift on a shared
machine hits both alike); the report is each setting's median tokens/s and their ratio.

    python -m specplan.bench.logprobs_bench                       # default model, B=1 and 32, 128 tokens
    python -m specplan.bench.logprobs_bench --tokens 8 --batch 2 --repeats 1   # a quick check

Each batch size runs twice: with speculation off and with n-gram k = ``--spec-k`` (logprobs are
read from the verify rows, so speculation is where they could cost more). ``--out`` writes the
medians, every repeat and the machine as JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from specplan.engine import LLM, SamplingParams
from specplan.profiler.machine import load_average, machine_info

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def tokens_per_s(llm: LLM, batch: int, params: SamplingParams) -> float:
    t0 = time.perf_counter()
    outs = llm.generate([PROMPT] * batch, params)
    elapsed = time.perf_counter() - t0
    return sum(len(o.token_ids) for o in outs) / elapsed


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="model path (default: the embedded SmolLM2-135M)")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--logprobs", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--spec-k", type=int, default=4, help="k of the n-gram arm (0: no speculative arm)")
    ap.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    args = ap.parse_args(argv)
    arms = {"off": LLM(args.model, max_num_seqs=max(args.batch))}
    if args.spec_k > 0:
        arms[f"ngram k={args.spec_k}"] = LLM(args.model, max_num_seqs=max(args.batch),
                                             speculative_config={"proposer": "ngram", "k": args.spec_k})
    plain = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True)
    asked = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True, logprobs=args.logprobs)
    for llm in arms.values():
        tokens_per_s(llm, 1, SamplingParams(temperature=0.0, max_tokens=4))  # warm up
    print(f"greedy, {args.tokens} tokens, median of {args.repeats}; logprobs={args.logprobs} vs none")
    print(f"{'speculation':>12} {'B':>4} {'none tok/s':>11} {'logprobs tok/s':>15} {'ratio':>7}")
    rows = []
    for name, llm in arms.items():
        for batch in args.batch:
            runs: dict[str, list[float]] = {"none": [], "logprobs": []}
            for _ in range(args.repeats):
                runs["none"].append(tokens_per_s(llm, batch, plain))
                runs["logprobs"].append(tokens_per_s(llm, batch, asked))
            none, lp = statistics.median(runs["none"]), statistics.median(runs["logprobs"])
            print(f"{name:>12} {batch:>4} {none:>11.1f} {lp:>15.1f} {lp / none:>7.3f}")
            rows.append({"speculation": name, "batch": batch, "none_tok_s": none, "logprobs_tok_s": lp,
                         "ratio": lp / none, "runs": runs})
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"command": "python -m specplan.bench.logprobs_bench", "tokens": args.tokens,
                                        "logprobs": args.logprobs, "repeats": args.repeats, "rows": rows,
                                        "machine": machine_info(), "load_average_after": load_average(),
                                        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z")}, indent=1))


if __name__ == "__main__":
    main()
