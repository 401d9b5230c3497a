"""A Planner steered by a measured Profile (what `specplan serve --adaptive` and `generate
--adaptive` build)."""

from __future__ import annotations

from typing import Any

from specplan.policies.roofline import LinearRoofline
from specplan.profiler.profile import Profile

from .goodput import DraftCost


def roofline_of(profile: Profile) -> LinearRoofline:
    """The step's analytic intensity from the profile's cost constants (verify steps: every query
    token gets a row of logits, so the LM head is priced per token)."""
    c = profile.cost
    return LinearRoofline(ridge=profile.ceilings.ridge, flops_per_token=c.flops_per_token + c.lm_head_flops_per_row,
                          bytes_per_step=c.weight_bytes, bytes_per_context_token=c.kv_bytes_per_token,
                          attention_flops=c.attention_flops_per_token_pair)


def planner_from_profile(profile: Profile, policy: Any = "goodput", *, proposer: str,
                         sla_itl_s: float | None = None, max_k: int = 8, **options: Any):
    from .controller import Planner

    measured = profile.draft_costs.get(proposer)
    draft_cost = DraftCost(per_pass_s=measured.per_step, per_token_s=measured.per_token) if measured else DraftCost()
    return Planner(policy, profile.model(), sla_itl_s=sla_itl_s, proposer=proposer, max_k=max_k,
                   draft_cost=draft_cost, roofline=roofline_of(profile), **options)
