"""The one way to build a Planner for serving and benchmarks: from a measured Profile (what
`specplan serve --adaptive` and `generate --adaptive` use), or from none for rules that need no
latency model."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..profiler.latency_model import DraftCost
from .controller import Planner, PlannerConfig
from .policy import Policy

if TYPE_CHECKING:  # the profile module imports torch; the planner reads the profile by attribute only
    from ..profiler.profile import Profile


def planner_from_profile(profile: Profile | None, policy: Policy, *, proposer: str, sla_itl_s: float | None = None,
                         max_k: int = 8, **options: Any) -> Planner:
    """A planner steered by ``profile``'s latency model, drafting cost for ``proposer`` and
    roofline; with no profile it has none of them (enough for static, heuristic and table rules;
    the Planner refuses a policy that needs them). ``options``: further ``PlannerConfig`` fields."""
    config = PlannerConfig(max_k=max_k, **options)
    if profile is None:
        return Planner(policy, config=config, sla_itl_s=sla_itl_s, proposer=proposer)
    return Planner(policy, profile.model(), config=config, sla_itl_s=sla_itl_s, proposer=proposer,
                   draft_cost=profile.draft_costs.get(proposer, DraftCost()), roofline=profile.roofline())
