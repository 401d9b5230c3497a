"""Acceptance of the EAGLE-3 head (and the chained proposer) on prompts it was never trained on.

For each workload, the prompts the evaluation draws (``load_workload(w, 32, seed=0)``, which
`specplan train-draft` leaves out of its data) run greedy at concurrency B, side by side in one
process: SD off, the head at k, the chain (n-gram where the match is long, the head otherwise) at
k, and n-gram at k, interleaved per repeat. Prints and writes (JSON + Markdown) accepted drafts per
verify step, per-position acceptance and tokens/s. Outputs are checked equal to SD off (greedy is
lossless). Tokens/s on a busy machine is preliminary; acceptance does not depend on load.

    .venv/bin/python scripts/eagle_acceptance.py --workloads mtbench --k 3 --batch 1 --prompts 8
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from specplan.bench.evaluate import run_cell
from specplan.bench.workloads import load_workload
from specplan.engine import FixedDecider, LLMEngine, load_model
from specplan.engine.config import CacheConfig, EngineConfig, SchedulerConfig, SpecConfig
from specplan.profiler.machine import describe, machine_info


def engine_for(loaded, proposer: str, head: str | None, batch: int) -> LLMEngine:
    return LLMEngine(EngineConfig(
        cache=CacheConfig(block_size=16, kv_cache_bytes=512 * 1024**2),
        scheduler=SchedulerConfig(max_num_seqs=batch, max_num_batched_tokens=1024, max_model_len=2048),
        spec=SpecConfig(proposer=proposer, k=0, max_k=8, draft_head=head)), loaded)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workloads", default="mtbench")
    ap.add_argument("--proposers", default="eagle,chain,ngram")
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--head", default=None, help="head folder (default: the shipped one)")
    ap.add_argument("--out", default="reports/eagle")
    args = ap.parse_args()
    loaded = load_model(None)
    proposers = args.proposers.split(",")
    engines = {p: engine_for(loaded, p, args.head, args.batch) for p in proposers}
    rows = []
    for w in args.workloads.split(","):
        prompts = [p.render(loaded.tokenizer) for p in load_workload(w, 32, 0)][:args.prompts]
        arms = [("off", proposers[0], FixedDecider(0))] + [(p, p, FixedDecider(args.k)) for p in proposers]
        results: dict[str, list[dict]] = {name: [] for name, _, _ in arms}
        for rep in range(args.repeats):
            for name, p, decider in arms[rep % len(arms):] + arms[:rep % len(arms)]:
                engine = engines[p]
                r = run_cell(engine, prompts, decider, args.max_tokens, concurrency=args.batch)
                st = engine.stats
                r["accepted_per_step"] = st.num_accepted_tokens / st.num_drafts if st.num_drafts else 0.0
                r["per_position"] = [a / d if d else 0.0 for a, d in zip(st.accepted_per_position, st.drafted_per_position)]
                results[name].append(r)
                print(f"{w} {name}: {r['goodput']:.1f} tok/s, accepted/step {r['accepted_per_step']:.2f}, "
                      f"per position {[round(x, 2) for x in r['per_position']]}", flush=True)
        reference = results["off"][0]["outputs"]
        for name, runs in results.items():
            same = all(r["outputs"] == reference for r in runs)
            gp = sorted(r["goodput"] for r in runs)[len(runs) // 2]
            rows.append({"workload": w, "arm": name, "k": 0 if name == "off" else args.k, "batch": args.batch,
                         "tokens_per_s": gp, "speedup_vs_off": gp / sorted(x["goodput"] for x in results["off"])[len(runs) // 2],
                         "accepted_per_step": runs[0]["accepted_per_step"], "per_position": runs[0]["per_position"],
                         "outputs_equal_sd_off": same})
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    info = machine_info()
    doc = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine": info,
           "settings": vars(args), "rows": rows}
    name = f"acceptance-{args.workloads.replace(',', '-')}-k{args.k}-b{args.batch}"
    (out / f"{name}.json").write_text(json.dumps(doc, indent=1))
    lines = [f"# EAGLE-3 head acceptance, k={args.k}, B={args.batch}", "", f"{doc['date']}. {describe(info)}",
             "", "Prompts: the evaluation's own (load_workload(w, 32, seed=0)), never in the head's training data.",
             "Tokens/s preliminary (shared machine); acceptance does not depend on load.", "",
             "| workload | arm | tok/s | x SD off | accepted drafts / verify step | per position | greedy == SD off |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['workload']} | {r['arm']} | {r['tokens_per_s']:.1f} | {r['speedup_vs_off']:.2f} | "
                     f"{r['accepted_per_step']:.2f} | {', '.join(f'{x:.2f}' for x in r['per_position'])} | "
                     f"{r['outputs_equal_sd_off']} |")
    (out / f"{name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
