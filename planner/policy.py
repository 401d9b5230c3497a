"""The interface between the planner and its decision rules: ``Policy.choose(state) -> k per request``.

``PolicyState`` is everything a rule may look at for one engine step, assembled by the planner:
the requests (acceptance estimates and last outcomes), the step's base shape (decodes plus the
prefill chunks already scheduled into it), what steps cost as the planner has learned it
(``StepPricing``), the ITL SLA, the engine's draft budget and, for the roofline rule, the step's
arithmetic intensity. The rules themselves live in specplan.policies and import these types; the
planner never imports them. Policies are tensor-free; a policy may keep per-request memory of
its own (the heuristic does), keyed by ``seq_id``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from ..profiler.latency_model import DraftCost, LatencyModel, StepShape
from .acceptance import AcceptanceEstimate
from .goodput import StepCostModel, with_drafts


@dataclass(frozen=True)
class Outcome:
    """What happened to a request in the last step it was observed in."""

    k: int  # drafts asked (after the engine's caps)
    num_proposed: int
    num_accepted: int


@dataclass(frozen=True)
class RequestState:
    seq_id: int
    request_id: str
    max_k: int  # the most drafts worth asking for (engine cap and planner cap)
    context_tokens: int  # prompt + output so far
    acceptance: AcceptanceEstimate
    last_outcome: Outcome | None  # None until the request was observed
    steps_observed: int  # observed steps in which it speculated (k > 0); changes when last_outcome does
    greedy: bool = True
    # Request-steps of evidence (discounted) behind the pooled belief a request without evidence of
    # its own starts from: 0 while every estimate of its proposer and workload is the prior.
    pool_evidence: float = float("inf")
    # Its drafts were found by a lookup before the decision (n-gram, suffix, a chain's lookup):
    # they cost no pass of a draft model, so they do not deepen the step's draft passes.
    looked_up: bool = False


@runtime_checkable
class Roofline(Protocol):
    """Arithmetic intensity of a step and the machine's ridge point, both in FLOP per byte
    (profiler/roofline.py ``LinearRoofline`` from a profile)."""

    ridge: float

    def intensity(self, shape: StepShape) -> float:
        ...


@dataclass(frozen=True)
class StepPricing:
    """What a step costs, as the planner knows it this step (planner/goodput.py ``StepCostModel``
    turns it into seconds for a choice of drafts)."""

    latency: LatencyModel | None = None  # drift-corrected forward + verify time; None without a profile
    draft_cost: DraftCost = DraftCost()
    overhead_s: float = 0.0  # per-step time outside forward, verify and drafting
    draft_slope: float = 1.0  # drafts' cost relative to the latency model's increment (learned online)
    explore_slope: float = 1.0  # an optimistic draft_slope while evidence is thin (planner/drift.py)
    draft_jump: float = 0.0  # what a step's having drafts at all costs beyond the slope, x the base step
    # Whether a plain decode step of this batch size was measured recently: what the drafts' price
    # is learned against (planner/drift.py ``DraftSlope.has_baseline``).
    draft_baseline: bool = True


@dataclass(frozen=True)
class PolicyState:
    requests: tuple[RequestState, ...]  # decode-ready requests, in batch order
    base: StepShape  # the step with k = 0 everywhere: decodes plus prefill chunks already scheduled
    max_k: int  # the planner's global cap (each request's own is in RequestState.max_k)
    proposer: str
    workload: str
    pricing: StepPricing = StepPricing()
    sla_itl_s: float | None = None  # predicted step time must stay under this
    draft_budget: int | None = None  # drafts the step can carry in all (the engine's token budget)
    roofline: Roofline | None = None
    # Decode-ready requests not in ``requests``: no draft can be given to them this step (their
    # lookup found none), so a policy that ``counts_idle_requests`` reads only their number and
    # context (each emits its one token); the planner leaves them out for such a policy only.
    num_idle: int = 0
    idle_context_tokens: int = 0
    # slope -> the StepCostModel built at it (``cost_model``): the policy's plan, the planner's
    # pause and its predicted step time ask the same step's cost, and each model keeps the curve
    # it priced, so one pricing serves them all.
    _cost_models: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    @property
    def batch_size(self) -> int:
        """Decode-ready requests in the step, the idle ones included (what batch-size tables are keyed on)."""
        return len(self.requests) + self.num_idle

    @property
    def decode_only(self) -> bool:
        """Whether the step carries no prefill chunk beside its decodes."""
        return self.base.num_tokens <= self.batch_size

    def shape_with(self, total_drafts: int) -> StepShape:
        """The step's shape when it carries ``total_drafts`` drafts in all."""
        return with_drafts(self.base, total_drafts)

    def cost_model(self, draft_slope: float | None = None) -> StepCostModel:
        """The step's cost as a function of its drafts, at the learned slope unless told otherwise;
        the prefill chunks' share of the base step is not charged to the decodes. Built once per
        slope: later questions (after the planner has learned from the step) read the prices the
        decision was made at."""
        pricing = self.pricing
        if pricing.latency is None:
            raise ValueError("this policy needs a latency model (a profile); none was given to the planner")
        slope = pricing.draft_slope if draft_slope is None else draft_slope
        cost = self._cost_models.get(slope)
        if cost is None:
            cost = self._cost_models[slope] = StepCostModel(
                pricing.latency, self.base, pricing.draft_cost, pricing.overhead_s, slope, pricing.draft_jump,
                shared_s=self._prefill_seconds(), model_drafted=self.model_drafted)
        return cost

    @property
    def model_drafted(self) -> tuple[bool, ...]:
        """Per request: whether its drafts take draft-model passes (not found by a lookup)."""
        return tuple(not r.looked_up for r in self.requests)

    def _prefill_seconds(self) -> float:
        """The base step's time beyond what its decodes alone would take (0 without prefill chunks)."""
        n = self.batch_size
        if n == 0 or self.decode_only:
            return 0.0
        latency = self.pricing.latency
        decodes = StepShape(n, n, sum(r.context_tokens for r in self.requests) + self.idle_context_tokens)
        return max(0.0, latency.predict(self.base) - latency.predict(decodes))

    def capped(self, k: int) -> list[int]:
        """The same k for every request, within each request's cap."""
        return [max(0, min(k, r.max_k)) for r in self.requests]


@runtime_checkable
class Policy(Protocol):
    name: str  # as make_policy spells it, e.g. "static:4"
    # What the planner must be given for this policy: "latency" (a latency model, i.e. a profile)
    # and/or "roofline". Checked when the planner is built.
    requires: frozenset[str]

    def choose(self, state: PolicyState) -> list[int]:
        """k per request of ``state.requests`` (0 = no speculation), each within its max_k. A policy
        may declare ``counts_idle_requests = True`` (read with getattr, default False): it reads the
        requests that cannot draft only through ``state.num_idle`` (and the batch size), so the
        planner may leave them out of ``state.requests``."""
        ...
