"""What logprobs cost: greedy generation with ``logprobs=5`` against none, same engine, same run.

For each batch size B, the two settings alternate repeat after repeat (so drift on a shared
machine hits both alike); the report is each setting's median tokens/s and their ratio.

    python -m specplan.bench.logprobs_bench                       # default model, B=1 and 32, 128 tokens
    python -m specplan.bench.logprobs_bench --tokens 8 --batch 2 --repeats 1   # a quick check
"""

from __future__ import annotations

import argparse
import statistics
import time

from specplan.engine import LLM, SamplingParams

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
    args = ap.parse_args(argv)
    llm = LLM(args.model, max_num_seqs=max(args.batch))
    plain = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True)
    asked = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True, logprobs=args.logprobs)
    tokens_per_s(llm, 1, SamplingParams(temperature=0.0, max_tokens=4))  # warm up
    print(f"greedy, {args.tokens} tokens, median of {args.repeats}; logprobs={args.logprobs} vs none")
    print(f"{'B':>4} {'none tok/s':>11} {'logprobs tok/s':>15} {'ratio':>7}")
    for batch in args.batch:
        runs: dict[str, list[float]] = {"none": [], "logprobs": []}
        for _ in range(args.repeats):
            runs["none"].append(tokens_per_s(llm, batch, plain))
            runs["logprobs"].append(tokens_per_s(llm, batch, asked))
        none, lp = statistics.median(runs["none"]), statistics.median(runs["logprobs"])
        print(f"{batch:>4} {none:>11.1f} {lp:>15.1f} {lp / none:>7.3f}")


if __name__ == "__main__":
    main()
