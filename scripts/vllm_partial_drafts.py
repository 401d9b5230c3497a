"""vLLM's step time when only some of the batch's requests carry drafts.

`specplan profile --engine vllm` times steps in which every request verifies the same number of
tokens; the plugin mostly sends drafts for a few requests of a batch (those whose lookup matched
well). This times those steps: B decoding requests, of which r carry k random drafts (almost all
rejected, so the context grows one token a step), r cycling through ``--drafting`` one step each;
per r, the median step time and its ratio to the step without drafts. A step is timed from the
end of one ``propose`` call to the start of the next (all of vLLM's step, none of the drafter's),
as the profiler does.

Run with vLLM's python, from the repo root (vLLM imports the drafter from this folder):

    /work/vllm-venv/bin/python scripts/vllm_partial_drafts.py --batch 16 --drafting 0,1,2,4,8,16
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

DRAFTING_ENV = "SPECPLAN_PARTIAL_DRAFTING"  # comma-separated r values
K_ENV = "SPECPLAN_PARTIAL_K"
OUT_ENV = "SPECPLAN_PARTIAL_OUT"


class PartialDrafts:
    """A vLLM ``custom_class`` drafter: k random drafts for the first r rows, none for the rest."""

    def __init__(self, vllm_config: Any):
        self.vocab = int(vllm_config.model_config.get_vocab_size())
        self.drafting = [int(r) for r in os.environ[DRAFTING_ENV].split(",")]
        self.k = int(os.environ[K_ENV])
        self.rng = np.random.default_rng(0)
        self.out = open(os.environ[OUT_ENV], "a", buffering=1)
        self.calls = 0
        self._end: float | None = None  # perf_counter when the previous call returned
        self._r = 0  # rows the previous call gave drafts

    def propose(self, sampled_token_ids, num_tokens_no_spec, token_ids_cpu, slot_mappings=None, **_: Any):
        start = time.perf_counter()
        rows = len(sampled_token_ids)
        decoding = sum(1 for s in sampled_token_ids if s)
        if self._end is not None and decoding == rows:
            self.out.write(json.dumps({"rows": rows, "drafting": self._r, "seconds": start - self._end}) + "\n")
        if decoding < rows:  # prompts still prefilling: nothing to time yet
            self._end, self._r = time.perf_counter(), 0
            return [[] for _ in range(rows)]
        r = min(self.drafting[self.calls % len(self.drafting)], rows)
        self.calls += 1
        self._r = r
        drafts = [self.rng.integers(0, self.vocab, size=self.k).tolist() if i < r else [] for i in range(rows)]
        self._end = time.perf_counter()
        return drafts

    def load_model(self, *args: Any, **kwargs: Any) -> None:
        """Random drafts need no model."""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--drafting", default="0,1,2,4,8,16", help="requests given drafts, cycled one step each")
    ap.add_argument("--k", type=int, default=1, help="drafts per drafting request")
    ap.add_argument("--prompt-tokens", type=int, default=200)
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--model", default=None, help="HF dir or .gguf (default SmolLM2-135M-Instruct)")
    args = ap.parse_args()

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from specplan.integrations.vllm_serve import model_dir
    from specplan.profiler.vllm_timer import set_vllm_env_defaults

    out = Path(tempfile.mkdtemp(prefix="specplan-partial-")) / "steps.jsonl"
    os.environ.update({DRAFTING_ENV: args.drafting, K_ENV: str(args.k), OUT_ENV: str(out)})
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    here = str(Path(__file__).resolve().parent)  # vLLM's worker imports PartialDrafts from here
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [here, os.environ.get("PYTHONPATH")]))
    set_vllm_env_defaults()
    llm = LLM(model=str(model_dir(args.model)), dtype="float32", max_model_len=args.prompt_tokens + args.steps + 64,
              max_num_seqs=args.batch, seed=0, skip_tokenizer_init=True, enable_prefix_caching=False,
              speculative_config={"method": "custom_class", "model": "vllm_partial_drafts.PartialDrafts",
                                  "num_speculative_tokens": max(args.k, 1)})
    rng = np.random.default_rng(1)
    prompts = [TokensPrompt(prompt_token_ids=rng.integers(100, 40000, size=args.prompt_tokens).tolist())
               for _ in range(args.batch)]
    llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=args.steps, ignore_eos=True, detokenize=False),
                 use_tqdm=False)
    by: dict[int, list[float]] = {}
    for line in out.read_text().splitlines()[6:]:  # the first steps build kernels for new shapes
        step = json.loads(line)
        by.setdefault(step["drafting"], []).append(step["seconds"])
    if 0 not in by:
        sys.exit("no step without drafts was timed: include 0 in --drafting")
    plain = statistics.median(by[0])
    for r in sorted(by):
        s = statistics.median(by[r])
        print(f"B={args.batch} k={args.k}: {r:3d} requests drafting: median step {1e3 * s:7.1f} ms "
              f"({s / plain:.3f}x the step without drafts; {len(by[r])} steps)")


if __name__ == "__main__":
    main()
