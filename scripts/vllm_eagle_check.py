"""The shipped EAGLE-3 head loaded by vLLM's own ``eagle3`` method: does vLLM read the checkpoint
format `specplan train-draft` writes, and does it accept what specplan's engine accepts?

Runs from vLLM's environment (vLLM plus specplan, ``pip install --no-deps -e .``), greedy, on the
evaluation's MT-Bench prompts (never in the head's training data): vLLM with speculation off, and
vLLM with ``method: eagle3`` and the head at k; then specplan's engine with the same head at the
same k on the same prompts. Prints accepted drafts per verify step and per position for both, and
whether vLLM's outputs equal its own with speculation off.

    VLLM_CPU_KVCACHE_SPACE=2 /work/vllm-venv/bin/python scripts/vllm_eagle_check.py --prompts 6 --k 3
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path


def vllm_spec_counters(llm) -> dict:
    """vLLM's spec-decode counters (vllm:spec_decode_num_drafts, ..._num_accepted_tokens, per position)."""
    out: dict = {"per_position": {}}
    for m in llm.get_metrics():
        if m.name == "vllm:spec_decode_num_drafts":
            out["drafts"] = m.value
        elif m.name == "vllm:spec_decode_num_draft_tokens":
            out["draft_tokens"] = m.value
        elif m.name == "vllm:spec_decode_num_accepted_tokens":
            out["accepted"] = m.value
        elif m.name == "vllm:spec_decode_num_accepted_tokens_per_pos":
            out["per_position"] = list(m.values)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--workload", default="mtbench")
    ap.add_argument("--out", default="reports/eagle/vllm-eagle3.json")
    args = ap.parse_args()

    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from specplan.bench.evaluate import run_cell
    from specplan.bench.workloads import load_workload
    from specplan.engine import FixedDecider, load_model
    from specplan.engine.config import CacheConfig, EngineConfig, SchedulerConfig, SpecConfig
    from specplan.engine.engine import LLMEngine
    from specplan.engine.model.loader import hf_model_dir
    from specplan.engine.proposers.eagle import SHIPPED_HEADS

    model_dir, _ = hf_model_dir(None)
    head = next(d for d in sorted(SHIPPED_HEADS.iterdir()) if (d / "config.json").exists())
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompts = [p.render(tokenizer) for p in load_workload(args.workload, 32, 0)][:args.prompts]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True, detokenize=False)
    inputs = [TokensPrompt(prompt_token_ids=p) for p in prompts]
    common = dict(model=str(model_dir), dtype="float32", max_model_len=2048, max_num_seqs=1, seed=0,
                  skip_tokenizer_init=True, disable_log_stats=False)

    def generate(llm) -> tuple[list[list[int]], float]:
        t0 = time.perf_counter()
        outs = [list(llm.generate([x], params, use_tqdm=False)[0].outputs[0].token_ids) for x in inputs]  # B = 1
        return outs, sum(map(len, outs)) / (time.perf_counter() - t0)

    off = LLM(**common)
    reference, off_tps = generate(off)
    del off
    spec = LLM(**common, speculative_config={"method": "eagle3", "model": str(head),
                                            "num_speculative_tokens": args.k, "draft_tensor_parallel_size": 1})
    outputs, spec_tps = generate(spec)
    counters = vllm_spec_counters(spec)
    drafts = counters.get("drafts") or 0
    vllm_row = {"tokens_per_s": spec_tps, "off_tokens_per_s": off_tps, "same_as_off": outputs == reference,
                "accepted_per_step": counters.get("accepted", 0) / drafts if drafts else None,
                "per_position": [a / drafts for a in counters["per_position"]] if drafts else None}

    loaded = load_model(None)
    engine = LLMEngine(EngineConfig(cache=CacheConfig(block_size=16, kv_cache_bytes=256 * 1024**2),
                                    scheduler=SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=1024,
                                                              max_model_len=2048),
                                    spec=SpecConfig(proposer="eagle", k=args.k, max_k=8)), loaded)
    r = run_cell(engine, prompts, FixedDecider(args.k), args.max_tokens, concurrency=1)
    st = engine.stats
    engine_row = {"tokens_per_s": r["goodput"], "same_as_vllm_off": r["outputs"] == reference,
                  "accepted_per_step": st.num_accepted_tokens / st.num_drafts if st.num_drafts else None,
                  "per_position": [a / st.num_drafts for a in st.accepted_per_position] if st.num_drafts else None}
    import vllm

    doc = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "vllm": vllm.__version__,
           "head": str(head), "workload": args.workload, "prompts": args.prompts, "k": args.k,
           "max_tokens": args.max_tokens, "vllm_eagle3": vllm_row, "specplan_engine": engine_row}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(doc, indent=1))
    print(json.dumps(doc, indent=1))


if __name__ == "__main__":
    main()
