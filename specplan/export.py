"""A profile's batch-size -> k table, for engines that take one instead of a planner.

vLLM's ``num_speculative_tokens_per_batch_size`` and TensorRT-LLM's ``draft_len_schedule`` give
every request of a batch the same k, chosen by the batch size alone. This derives that table from
a profile's latency model and an acceptance estimate with the planner's own goodput math
(planner/goodput.py: ``StepCostModel`` prices a step with drafts, ``step_goodput`` divides the
expected tokens by it): at each batch size B the k in 0..max_k that maximises the predicted
goodput of a decode step of B requests with k drafts each, where speculation must beat k = 0 by
the goodput policy's margin, as in serving. A memory-bound step gets deep drafts, a
compute-bound one none.

Formats:
  vllm:   ``[(start, end, k), ...]``, inclusive batch-size ranges from 1, no gaps
          (``SpeculativeConfig.num_speculative_tokens_per_batch_size``, vLLM 0.32), with
          ``num_speculative_tokens`` = the largest k.
  trtllm: ``{end: k, ...}``, each key the largest batch size of a range; batch sizes past the
          last key run k = 0 (TensorRT-LLM's ``draft_len_schedule``, NVIDIA/TensorRT-LLM#10860).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Sequence

from specplan.planner.acceptance import AcceptanceConfig, AcceptanceEstimate, PooledAcceptance, default_prior
from specplan.planner.goodput import StepCostModel, step_goodput
from specplan.policies.goodput import GoodputPolicy
from specplan.profiler.latency_model import DraftCost, LatencyModel, StepShape

FORMATS = ("vllm", "trtllm")


def prior_estimate(proposer: str, max_k: int, acceptance: float | None = None) -> AcceptanceEstimate:
    """What the planner expects of a new request's drafts before it has seen any: the proposer's
    prior (its pooled belief at the start). ``acceptance`` (measured, e.g. vLLM's draft
    acceptance rate) replaces the prior's per-draft acceptance; the prior's proposal lengths stay."""
    prior = PooledAcceptance(default_prior(proposer), AcceptanceConfig(max_k=max_k)).estimate()
    if acceptance is None:
        return prior
    if not 0.0 <= acceptance <= 1.0:
        raise ValueError(f"acceptance must be in [0, 1], got {acceptance}")
    return AcceptanceEstimate(acceptance, prior.p_len_ge, acceptance)


def best_uniform_k(latency: LatencyModel, estimate: AcceptanceEstimate, batch_size: int, *, max_k: int,
                   context_tokens: int, draft_cost: DraftCost = DraftCost(),
                   min_relative_gain: float = GoodputPolicy.min_relative_gain) -> tuple[int, float]:
    """(k, predicted goodput over k = 0) for a decode step of ``batch_size`` requests of
    ``context_tokens`` each, all given the same k."""
    cost = StepCostModel(latency, StepShape(batch_size, batch_size, batch_size * context_tokens), draft_cost)
    estimates = [estimate] * batch_size
    off = step_goodput(estimates, [0] * batch_size, cost)
    best_k, best = 0, off * (1.0 + min_relative_gain)
    for k in range(1, max_k + 1):
        g = step_goodput(estimates, [k] * batch_size, cost)
        if g > best:
            best_k, best = k, g
    return best_k, (best if best_k else off) / off


def k_table(latency: LatencyModel, estimate: AcceptanceEstimate, *, max_batch: int, max_k: int,
            context_tokens: int, draft_cost: DraftCost = DraftCost()) -> list[tuple[int, int, int]]:
    """[(start, end, k), ...]: inclusive batch-size ranges covering 1..max_batch, one k each."""
    if max_batch < 1 or max_k < 0 or context_tokens < 0:
        raise ValueError(f"need max_batch >= 1, max_k >= 0, context_tokens >= 0; got {max_batch}, {max_k}, "
                         f"{context_tokens}")
    rows: list[tuple[int, int, int]] = []
    for b in range(1, max_batch + 1):
        k, _ = best_uniform_k(latency, estimate, b, max_k=max_k, context_tokens=context_tokens, draft_cost=draft_cost)
        if rows and rows[-1][2] == k:
            rows[-1] = (rows[-1][0], b, k)
        else:
            rows.append((b, b, k))
    return rows


def trtllm_schedule(rows: Sequence[tuple[int, int, int]]) -> dict[int, int]:
    """{end: k}; trailing k = 0 ranges dropped (TensorRT-LLM runs k = 0 past the last key)."""
    rows = list(rows)
    while rows and rows[-1][2] == 0:
        rows.pop()
    return {end: k for _, end, k in rows}


def render(fmt: str, rows: Sequence[tuple[int, int, int]], meta: dict[str, Any]) -> tuple[dict[str, Any], str]:
    """(the JSON document, a snippet ready to paste) for ``fmt``."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r}; choose one of {', '.join(FORMATS)}")
    top_k = max((k for _, _, k in rows), default=0)
    if fmt == "vllm":
        table = [list(r) for r in rows]
        doc = {"format": "vllm", "num_speculative_tokens": top_k, "num_speculative_tokens_per_batch_size": table, **meta}
        if top_k == 0:
            snippet = "# speculation never pays at these batch sizes: run vLLM without speculative_config"
        else:
            spec = {"method": "ngram", "prompt_lookup_min": 1, "prompt_lookup_max": 4, "num_speculative_tokens": top_k,
                    "num_speculative_tokens_per_batch_size": table}
            snippet = (f"LLM(model=..., speculative_config={spec!r})\n"
                       f"vllm serve MODEL --speculative-config '{json.dumps(spec)}'")
        return doc, snippet
    schedule = trtllm_schedule(rows)
    doc = {"format": "trtllm", "max_draft_len": top_k, "draft_len_schedule": {str(b): k for b, k in schedule.items()},
           **meta}
    snippet = ("# speculation never pays at these batch sizes: run without a speculative_config" if top_k == 0 else
               f"speculative_config = NGramDecodingConfig(max_draft_len={top_k}, draft_len_schedule={schedule!r})")
    return doc, snippet
