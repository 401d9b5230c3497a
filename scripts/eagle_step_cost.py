"""What an EAGLE-3 head adds to a B = 1 step: propose / forward / verify milliseconds per step at
k = 0..3, with the head's projections in fp32 and in Q8_0 (SpecConfig.draft_head_weights), side by
side on one MT-Bench prompt, formats interleaved, medians over the decode steps of each run.

    .venv/bin/python scripts/eagle_step_cost.py --max-tokens 96 --repeats 3
"""

from __future__ import annotations

import argparse
import statistics

from specplan.bench.workloads import load_workload
from specplan.engine import LLM, FixedDecider, SamplingParams, load_model
from specplan.profiler.machine import describe, machine_info


class Recording(FixedDecider):
    def __init__(self, k: int):
        super().__init__(k)
        self.records = []

    def observe(self, record) -> None:
        self.records.append(record)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    loaded = load_model(None)
    prompt = load_workload("mtbench", 32, 0)[1].render(loaded.tokenizer)
    llms = {fmt: LLM(loaded=loaded, speculative_config={"proposer": "eagle", "k": 3, "draft_head_weights": fmt})
            for fmt in ("fp32", "q8_0")}
    rows: dict[tuple[str, int], list[dict]] = {}
    for rep in range(args.repeats):
        for fmt, llm in (list(llms.items())[rep % 2:] + list(llms.items())[:rep % 2]):
            for k in (0, 1, 2, 3):
                decider = Recording(k)
                llm.engine.set_decider(decider)
                llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=args.max_tokens))
                steps = [r for r in decider.records if r.num_prefill_tokens == 0][3:]
                med = lambda f: 1000 * statistics.median(f(r) for r in steps)  # noqa: E731
                rows.setdefault((fmt, k), []).append({"propose": med(lambda r: r.propose_s),
                                                      "forward": med(lambda r: r.forward_s),
                                                      "total": med(lambda r: r.total_s)})
    print(describe(machine_info()))
    print("| head weights | k | propose ms | forward ms | step ms |\n|---|---|---|---|---|")
    for (fmt, k), rs in sorted(rows.items()):
        m = {key: statistics.median(r[key] for r in rs) for key in rs[0]}
        print(f"| {fmt} | {k} | {m['propose']:.2f} | {m['forward']:.2f} | {m['total']:.2f} |")


if __name__ == "__main__":
    main()
