"""The vLLM plugin's planner, step by step inside vLLM: every step it observes written as a JSON line
(drafts, accepted, the measured seconds, the profile's prediction for the step without its drafts
and with them, the learned draft price at that batch size, the drift factor), to read why the
plugin drafts where it does.

    TRACE_PATH=/tmp/trace.jsonl /work/vllm-venv/bin/python scripts/vllm_plugin_trace.py B TOKENS ROUNDS WORKLOAD [PROFILE [K]]

vLLM loads ``vllm_plugin_trace.TracingProposer`` (this script's folder on PYTHONPATH), a
SpecplanProposer whose planner's ``observe`` also writes the line.
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

TRACE = os.environ.get("TRACE_PATH", "vllm-plugin-trace.jsonl")


class TracingProposer:
    def __new__(cls, vllm_config):
        from specplan.integrations.vllm import SpecplanProposer
        from specplan.profiler.latency_model import StepShape

        class Tracing(SpecplanProposer):
            def __init__(self, cfg):
                super().__init__(cfg)
                planner = self.planner
                inner_observe = planner.observe
                out = open(TRACE, "a")

                def observe(record):
                    drafts = sum(r.num_proposed for r in record.requests)
                    accepted = sum(r.num_accepted for r in record.requests)
                    shape = StepShape(record.num_seqs, record.num_tokens, record.context_tokens)
                    base = StepShape(record.num_seqs, record.num_tokens - drafts, record.context_tokens - drafts)
                    model = planner.latency.inner
                    # Per request: drafts sent, accepted, the lookup's match length, and the gains
                    # (expected accepted tokens per draft position) the planner chose them on.
                    chosen = planner._chosen_gains
                    reqs = [[r.num_proposed, r.num_accepted, r.match_length,
                             [round(g, 3) for g in chosen.get(r.seq_id, ((),))[0][:r.num_proposed]]]
                            for r in record.requests]
                    inner_observe(record)
                    n = len(record.requests)
                    p = planner.draft_slope.price(n)
                    out.write(json.dumps({"n": n, "seqs": record.num_seqs, "tokens": record.num_tokens,
                                          "prefill": record.num_prefill_tokens, "drafts": drafts, "accepted": accepted,
                                          "total_s": record.total_s, "forward_s": record.forward_s,
                                          "pred_base_s": model.predict(base), "pred_s": model.predict(shape),
                                          "slope": p.slope, "jump": p.jump, "units": p.units,
                                          "baseline": planner.draft_slope.has_baseline(n), "drift": planner.drift.factor,
                                          "reqs": reqs}) + "\n")
                    out.flush()

                planner.observe = observe

        return Tracing(vllm_config)


def main():
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from specplan.integrations.vllm import PluginOptions
    from specplan.integrations.vllm_serve import model_dir
    from specplan.bench.workloads import load_workload

    batch, tokens, rounds, workload = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    profile = sys.argv[5] if len(sys.argv) > 5 else "reports/vllm-peer-xeon/profile.json"
    k = int(sys.argv[6]) if len(sys.argv) > 6 else 8  # vLLM's K, and the planner's cap
    Path(TRACE).unlink(missing_ok=True)
    os.environ["TRACE_PATH"] = str(Path(TRACE).resolve())  # vLLM's worker reads it on import
    os.environ.update(PluginOptions(policy="goodput", profile=str(Path(profile).resolve()), max_k=k).to_env())
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(__file__).parent), os.environ.get("PYTHONPATH")]))
    llm = LLM(model=str(model_dir(None)), dtype="float32", max_model_len=2048, max_num_seqs=batch, seed=0,
              enable_prefix_caching=False,
              speculative_config={"method": "custom_class", "model": "vllm_plugin_trace.TracingProposer", "num_speculative_tokens": k})
    tok = llm.get_tokenizer()
    prompts = [p.render(tok) for p in load_workload(workload, batch, 0)]
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    for r in range(rounds):
        t0 = time.perf_counter()
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
        dt = time.perf_counter() - t0
        print(f"round {r}: {sum(len(o.outputs[0].token_ids) for o in outs) / dt:.1f} tok/s", flush=True)


if __name__ == "__main__":
    main()
