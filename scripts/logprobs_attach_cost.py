"""How much of a B = 32 run the logprobs themselves take: the time spent in the verifier's
``_attach_logprobs`` (one log_softmax and one topk over the emitting rows) against the whole run,
beside the same run without logprobs. The end-to-end ratio of logprobs_bench moves with this VM's
spells; this share does not.

    SPECPLAN_CPU_KERNELS=0 python scripts/logprobs_attach_cost.py [--batch 32] [--tokens 32] [--repeats 4]
"""

from __future__ import annotations

import argparse
import time

import specplan.engine.spec_decode.verifier as verifier
from specplan.engine import LLM, SamplingParams

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=4)
    args = ap.parse_args()
    spent = [0.0]
    attach = verifier._attach_logprobs

    def timed_attach(*a, **k):
        t0 = time.perf_counter()
        attach(*a, **k)
        spent[0] += time.perf_counter() - t0

    verifier._attach_logprobs = timed_attach  # a measuring wrapper in this process only
    llm = LLM(None, max_num_seqs=args.batch)
    llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=4))  # warm up
    for rep in range(args.repeats):
        for name, logprobs in (("none", None), ("logprobs=5", 5)):
            params = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True, logprobs=logprobs)
            spent[0] = 0.0
            t0 = time.perf_counter()
            llm.generate([PROMPT] * args.batch, params)
            elapsed = time.perf_counter() - t0
            print(f"repeat {rep} {name:>10}: {args.batch * args.tokens / elapsed:6.1f} tok/s, "
                  f"logprobs {spent[0] * 1e3:5.0f} ms of {elapsed * 1e3:6.0f} ms ({spent[0] / elapsed:.1%})")


if __name__ == "__main__":
    main()
