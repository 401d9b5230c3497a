"""``Planner``: the online controller that implements the engine's ``SpecDecider``.

Each step ``decide`` turns the engine's ``StepView`` into a ``PolicyState`` — per-request
acceptance estimates, the batch composition (decodes plus prefill chunks already scheduled), the
drift-corrected latency model, drafting cost and overhead, the SLA — and asks the policy for k per
request. ``observe`` feeds the step's outcome back: acceptance per request (and into the pooled
prior for its proposer and workload), accepted vs expected over the drafts the policy chose
(calibration), measured vs predicted step time (drift), and the time spent outside forward +
verify (overhead and drafting cost).

The engine never imports this module; the planner reads the engine's view and record objects by
attribute only, so importing it does not pull in the engine (or torch).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Callable, Mapping

from ..profiler.latency_model import DraftCost, LatencyModel, StepShape
from .acceptance import (LOOKUP_PROPOSERS, AcceptanceConfig, AcceptanceEstimate, PooledAcceptance, ProposerPrior,
                         RequestAcceptance, default_prior, match_bucket)
from .calibration import AcceptanceCalibration, CalibrationConfig
from .confidence import ConfidenceCalibration, ConfidenceConfig, ConfidenceStop
from .drift import DraftSlope, DraftSlopeConfig, DriftConfig, DriftCorrectedLatency, DriftCorrection
from .filler import filler
from .goodput import draft_increment, marginal_draft_prices, priced_seconds
from .pause import PauseConfig, PlanningPause
from .policy import Outcome, Policy, PolicyState, RequestState, Roofline, StepPricing
from .timing import StepTimingLearner, TimingConfig

_request_state = filler(RequestState)  # built per request per step (planner/filler.py)
_outcome = filler(Outcome)


def _uncalibrated_scale(estimate: AcceptanceEstimate, belief: RequestAcceptance, factor: float) -> float:
    """What the gains of ``estimate`` are multiplied by to undo the calibration ``factor`` (every
    gain is proportional to the first draft's acceptance, which the factor scaled): the
    calibration compares accepted drafts with the uncalibrated expectation. 1 / factor unless the
    scaled acceptance was capped at 1; then the request's own posterior says what it was."""
    first = estimate.alpha_first
    if first <= 0.0:
        return 1.0  # every gain is 0 either way
    return (belief.alphas()[1] if first >= 1.0 else first / factor) / first


if TYPE_CHECKING:  # protocol and data types only; importing the engine package would import torch
    from ..engine.decider import StepOutline, StepRecord, StepView


@dataclass(frozen=True)
class PlannerConfig:
    """The planner's knobs (the defaults are what serving runs with)."""

    max_k: int = 8  # the planner's cap on drafts per request (each request's engine cap applies too)
    # Refine drafting cost and fixed overhead online from step records (planner/timing.py); off:
    # drafting costs what the profile says, and overhead is 0.
    learn_timing: bool = True
    forget_after_steps: int = 256  # a request unseen for this many steps is forgotten
    priors: Mapping[str, ProposerPrior] | None = None  # per proposer; default: acceptance.py DEFAULT_PRIORS
    acceptance: AcceptanceConfig | None = None  # None: the defaults, tracking max_k draft positions
    calibration: CalibrationConfig | None = CalibrationConfig()  # None: estimates as they are
    # A draft head's confidence -> acceptance (planner/confidence.py), and with a policy that
    # ``stops_on_confidence``, drafts that run to each request's cap and stop where one more no
    # longer pays (the engine's DraftStop). None: model drafts run to the k the policy chose.
    confidence: ConfidenceConfig | None = ConfidenceConfig()
    drift: DriftConfig = DriftConfig()
    draft_slope: DraftSlopeConfig = DraftSlopeConfig()
    timing: TimingConfig = TimingConfig()
    # A screen that said "drafts may pay" for a step shape is believed for this many following
    # screens without asking the policy again (0: ask every step). Only a yes is reused: a stale yes costs
    # one ``decide`` that may answer 0 for all, so decisions stay exactly what they would be.
    screen_reuse_steps: int = 8
    # Stop planning for a while where the drafts chosen were predicted to save less time than the
    # planner spent choosing them (planner/pause.py), with a policy that weighs its choices in
    # seconds (``weighs_planning_cost``: goodput). None: plan every step.
    pause: PauseConfig | None = PauseConfig()

    def __post_init__(self) -> None:
        if self.screen_reuse_steps < 0:
            raise ValueError(f"screen_reuse_steps must be >= 0, got {self.screen_reuse_steps}")
        if self.max_k < 0:
            raise ValueError(f"max_k must be >= 0, got {self.max_k}")
        if self.acceptance is not None and self.acceptance.max_k < self.max_k:
            raise ValueError(f"acceptance max_k {self.acceptance.max_k} < planner max_k {self.max_k}")

    @property
    def tracked_acceptance(self) -> AcceptanceConfig:
        """The acceptance config in force (the default one tracks max_k positions)."""
        return self.acceptance or AcceptanceConfig(max_k=max(self.max_k, 1))


@dataclass
class _Tracked:
    """The planner's memory of one request."""

    pool_key: tuple[str, str, bool]  # (proposer, workload, greedy)
    # One acceptance belief per match-length bucket (planner/acceptance.py ``match_bucket``; None
    # for drafts without a match length): a first draft after a short n-gram match is accepted far
    # less often than after a long one, and a request's drafts mix both.
    by_match: dict[int | None, RequestAcceptance] = field(default_factory=dict)
    last_outcome: Outcome | None = None
    last_seen_step: int = 0


class Planner:
    """A SpecDecider that asks a policy for k per request, from learned acceptance and step cost.

    policy: the decision rule (specplan.policies ``make_policy("goodput")``, ...). It is this
        planner's own: a rule may remember requests between steps (the heuristic does), so give
        each planner a fresh one.
    latency: the profile's LatencyModel (forward + verify seconds per step shape); required by
        the goodput policy, optional for rules that ignore cost.
    config: the planner's knobs (``PlannerConfig``).
    sla_itl_s: predicted step time (the ITL of every request in it) must stay under this.
    proposer: the proposer's name for priors; default: the name the engine reports each step.
    workload: the workload tag for pooled priors: one tag for every request, or a function of
        the request id (then policies see the step's workload as "mixed").
    draft_cost: drafting time per pass / per draft token (~0 for ngram and suffix; a draft
        model's pass is a fraction of a target step). Refined online when learn_timing is on.
    roofline: step intensity and ridge point, for the roofline policy.
    """

    def __init__(self, policy: Policy, latency: LatencyModel | None = None, *,
                 config: PlannerConfig = PlannerConfig(), sla_itl_s: float | None = None,
                 proposer: str | None = None, workload: str | Callable[[str], str] = "default",
                 draft_cost: DraftCost = DraftCost(), roofline: Roofline | None = None):
        if sla_itl_s is not None and not sla_itl_s > 0:
            raise ValueError(f"sla_itl_s must be > 0, got {sla_itl_s}")
        self.policy = policy
        self.config = config
        self.drift = DriftCorrection(config.drift)
        self.latency = DriftCorrectedLatency(latency, self.drift) if latency is not None else None
        self.draft_slope = DraftSlope(config.draft_slope)
        # None: the policy sees each request's posterior as is (planner/calibration.py).
        self.calibration = AcceptanceCalibration(config.calibration) if config.calibration is not None else None
        # seq_id -> the last decided draft gains, and what undoes their calibration (``_uncalibrated_scale``)
        self._chosen_gains: dict[int, tuple[tuple[float, ...], float]] = {}
        self.confidence = ConfidenceCalibration(config.confidence) if config.confidence is not None else None
        self.draft_stop: ConfidenceStop | None = None  # the engine's StopsDrafts: the latest decision's rule
        self.roofline = roofline
        missing = [f for f in policy.requires if getattr(self, f, None) is None]
        if missing:
            raise ValueError(f"policy {policy.name!r} needs {', '.join(sorted(missing))}; "
                             f"pass {', '.join(sorted(missing))}= to the Planner")
        self.sla_itl_s = sla_itl_s
        self.proposer = proposer
        self.workload = workload if isinstance(workload, str) else "mixed"
        self._workload_of = workload if callable(workload) else None
        self.draft_cost_prior = draft_cost
        self.timing: StepTimingLearner | None = None  # made once the proposer's name is known
        if proposer is not None:
            self._timing_for(proposer)
        self.acceptance_config = config.tracked_acceptance
        # What a request with no draft this step is valued at: nothing (``_no_drafts``).
        self._zero_estimate = AcceptanceEstimate(0.0, (0.0,) * self.acceptance_config.max_k, 0.0)
        # Pools per (proposer, workload, greedy, match bucket): sampled requests accept less than
        # greedy ones, drafts from short lookup matches less than from long ones.
        self._pools: dict[tuple[str, str, bool, int | None], PooledAcceptance] = {}
        self._requests: dict[int, _Tracked] = {}
        self._step = 0
        # Screens asked so far, and (decodes, cap, with prefill) -> the last screen that the latest
        # yes for that shape covers. Counted in screens, not decisions: a step whose lookups find
        # nothing runs no ``decide``, and a yes must still expire then.
        self._screens = 0
        self._screen_yes_until: dict[tuple[int, int, bool], int] = {}
        self.last_state: PolicyState | None = None
        self.last_ks: list[int] = []  # the latest decision, aligned with last_state.requests
        self.num_decisions = 0  # request-steps decided
        self.num_zero_decisions = 0  # of which k = 0
        weighs = getattr(policy, "weighs_planning_cost", False) and self.latency is not None
        self.pause = PlanningPause(config.pause) if config.pause is not None and weighs else None
        self._screen_s = 0.0  # the latest screen's own seconds, charged to the step it screened
        self._pause_answered = False  # the pause answered the latest step (its observe learns nothing)
        # Whether the latest record ran a prompt: its step and the one after it are not timed for
        # the overhead learner (``_times_overhead``).
        self._prefilled = False

    # ------------------------------------------------------------------ helpers

    @property
    def steps(self) -> int:
        """Steps answered so far (decided, screened out or paused)."""
        return self._step

    @property
    def zero_share(self) -> float:
        """Share of request-steps given k = 0 so far (for reports)."""
        return self.num_zero_decisions / self.num_decisions if self.num_decisions else 0.0

    @property
    def predicted_step_s(self) -> float | None:
        """Seconds the latest decision's step was predicted to take (the engine's
        ``PredictsStepTime``; the server exports it beside the measured step time). None before
        the first decision or without a latency model."""
        state = self.last_state
        if state is None or state.pricing.latency is None:
            return None
        return state.cost_model().seconds(self.last_ks)

    @property
    def draft_cost(self) -> DraftCost:
        return self.timing.draft_cost if self.config.learn_timing and self.timing is not None else self.draft_cost_prior

    @property
    def overhead_s(self) -> float:
        return self.timing.overhead_s if self.config.learn_timing and self.timing is not None else 0.0

    def _timing_for(self, proposer: str) -> StepTimingLearner:
        if self.timing is None:
            self.timing = StepTimingLearner(self.draft_cost_prior, self.config.timing,
                                            fit_per_pass=proposer not in LOOKUP_PROPOSERS)
        return self.timing

    @property
    def pools(self) -> Mapping[tuple[str, str, bool, int | None], PooledAcceptance]:
        """Every pooled belief so far, by (proposer, workload, greedy, match bucket) (read-only view)."""
        return MappingProxyType(self._pools)

    def pool(self, proposer: str, workload: str, greedy: bool = True, match: int | None = None) -> PooledAcceptance:
        """The pooled belief for new requests' drafts; ``match``: a match-length bucket."""
        key = (proposer, workload, greedy, match)
        p = self._pools.get(key)
        if p is None:
            prior = (self.config.priors or {}).get(proposer) or default_prior(proposer)
            if match is not None:
                prior = prior.for_match(match)
            p = self._pools[key] = PooledAcceptance(prior, self.acceptance_config)
        return p

    def _tracked(self, seq_id: int, request_id: str, proposer: str, greedy: bool = True) -> _Tracked:
        t = self._requests.get(seq_id)
        if t is None:
            tag = self._workload_of(request_id) if self._workload_of is not None else self.workload
            t = self._requests[seq_id] = _Tracked((proposer, tag, greedy))
        return t

    def acceptance(self, t: _Tracked, match_length: int | None) -> RequestAcceptance:
        """A request's belief about drafts found by a ``match_length``-token lookup."""
        bucket = match_bucket(match_length)
        acc = t.by_match.get(bucket)
        if acc is None:
            acc = t.by_match[bucket] = RequestAcceptance(self.pool(*t.pool_key, match=bucket))
        return acc

    def _pricing(self, num_decodes: int) -> StepPricing:
        """What a step of this many decodes costs, as learned so far."""
        slope = self.draft_slope
        price = slope.price(num_decodes)
        # No plain baseline step is asked for while a prefill's next steps settle: it would not be learned from.
        return StepPricing(latency=self.latency, draft_cost=self.draft_cost, overhead_s=self.overhead_s,
                           draft_slope=price.slope, explore_slope=slope.explore_slope(num_decodes, price),
                           draft_jump=price.jump, draft_baseline=slope.has_baseline(num_decodes) or slope.settling)

    def _forget_stale(self) -> None:
        # Finished requests simply stop appearing; a preempted one may come back, so wait a while.
        horizon = self._step - self.config.forget_after_steps
        for seq_id in [s for s, t in self._requests.items() if t.last_seen_step < horizon]:
            del self._requests[seq_id]

    # ------------------------------------------------------------ SpecDecider

    def may_speculate(self, outline: StepOutline) -> bool:
        """The engine's screen before any lookup (engine/decider.py ``ScreensSteps``): False when
        the policy says no request could be given drafts in a step of this shape even if every
        draft were accepted (a compute-bound step), so lookups and ``decide`` are skipped. Such a
        step is counted as decided 0 for all, and its off step time is still predicted. Also False
        while the planner pauses (planner/pause.py: planning did not pay for itself); ``decide``
        answers 0 for all then too, for an engine that does not screen."""
        may_pay = getattr(self.policy, "may_pay", None)
        n = outline.num_decodes
        if n == 0:
            return True
        pause = self._pause_for(n)
        start = pause.clock() if pause is not None else 0.0
        self._screen_s = 0.0
        if pause is not None and pause.paused(self._step + 1, n, outline.num_prefill_seqs > 0):
            self._answer_zeros(n)
            self._pause_answered = True
            return False
        if may_pay is None:
            return True
        cap = max(0, min(outline.max_k, self.config.max_k))
        shape = (n, cap, outline.num_prefill_seqs > 0)
        self._screens += 1
        if self._screen_yes_until.get(shape, -1) >= self._screens:
            return True
        # The policy reads the requests' number, cap and summed context (the prefill's share of
        # the step), nothing per request: one stand-in, n times (its context rounded down).
        stand_in = RequestState(-1, "", cap, outline.decode_context_tokens // n,
                                AcceptanceEstimate(1.0, (1.0,) * cap), None, 1)
        reqs = (stand_in,) * n
        base = StepShape(n + outline.num_prefill_seqs, n + outline.num_prefill_tokens, outline.context_tokens)
        state = PolicyState(requests=reqs, base=base, max_k=cap, proposer=self.proposer or "",
                            workload=self.workload, pricing=self._pricing(n), sla_itl_s=self.sla_itl_s,
                            draft_budget=outline.draft_budget, roofline=self.roofline)
        if may_pay(state):
            self._screen_s = pause.clock() - start if pause is not None else 0.0
            self._screen_yes_until[shape] = self._screens + self.config.screen_reuse_steps
            return True
        self._answer_zeros(n)
        self.last_state = state
        if pause is not None:  # a step planned at the screen's cost, saving nothing
            pause.planned(self._step, n, pause.clock() - start, 0.0)
        return False

    def _pause_for(self, num_decodes: int) -> PlanningPause | None:
        """The pause, where a step of this many decodes is weighed by it; None elsewhere (no clock
        is read and no saving priced for a small step)."""
        pause = self.pause
        return pause if pause is not None and pause.weighs(num_decodes) else None

    def _answer_zeros(self, n: int) -> None:
        """Count a step whose n decodes are all given 0 without a decision (the screen, a pause)."""
        self._step += 1
        self.num_decisions += n
        self.num_zero_decisions += n
        self.draft_stop = None
        self._chosen_gains = {}
        self.last_state, self.last_ks = None, [0] * n

    @property
    def takes_idle_requests(self) -> bool:
        """The engine's ``TakesIdleRequests``: whether ``decide`` may be shown only the requests with
        drafts (the rest in ``StepView.idle_seq_ids``). Yes when the policy reads requests without
        drafts only through their number (``counts_idle_requests``); the heuristic, which
        remembers every request it sees, does not."""
        return bool(getattr(self.policy, "counts_idle_requests", False))

    def decide(self, view: StepView) -> list[int]:
        idle = view.idle_seq_ids
        if idle and not self.takes_idle_requests:
            raise ValueError(f"policy {self.policy.name!r} must see every request; "
                             "this planner does not take idle requests (StepView.idle_seq_ids)")
        num_all = len(view.requests) + len(idle)
        pause = self._pause_for(num_all)
        start = pause.clock() if pause is not None else 0.0
        if pause is not None and pause.paused(self._step + 1, num_all, view.num_prefill_seqs > 0):
            self._answer_zeros(num_all)  # an engine that does not screen steps
            self._pause_answered = True
            return [0] * len(view.requests)
        self._pause_answered = False
        self._step += 1
        proposer = self.proposer or view.proposer
        planner_cap = self.config.max_k
        step = self._step
        for seq_id in idle:  # seen (not forgotten), and nothing else: ``_no_drafts`` without its state
            t = self._requests.get(seq_id)
            if t is not None:
                t.last_seen_step = step
        # Each draft's gain scaled by what the chosen drafts have yielded against their estimates.
        factor = self.calibration.factor if self.calibration is not None else 1.0
        reqs, beliefs = [], []
        for rv in view.requests:
            t = self._tracked(rv.seq_id, rv.request_id, proposer, rv.greedy)
            t.last_seen_step = step
            if rv.available_drafts == 0:
                # Looked up and nothing found: no draft can be given, whatever the belief, so none
                # is looked up or built (at B = 32 most rows of most steps; ``_no_drafts``).
                reqs.append(self._no_drafts(rv, t, max(0, min(rv.max_k, planner_cap))))
                beliefs.append(None)
                continue
            acc = self.acceptance(t, rv.match_length)
            beliefs.append(acc)
            # available_drafts: proposed before deciding (n-gram, suffix), so their number is known.
            estimate = acc.estimate(rv.available_drafts, factor)
            reqs.append(_request_state(rv.seq_id, rv.request_id, max(0, min(rv.max_k, planner_cap)), rv.num_tokens,
                                       estimate, t.last_outcome, acc.steps_observed, rv.greedy, acc.pool.evidence,
                                       rv.available_drafts is not None))
        num_decodes = len(reqs) + len(idle)
        base = StepShape(num_decodes + view.num_prefill_seqs, num_decodes + view.num_prefill_tokens,
                         view.context_tokens)
        # When no request can be given a draft (the lookup found none, or every cap is 0), every
        # policy's answer is 0 after the clamp below: neither the learned price nor the policy is
        # consulted, and the state prices no draft. At B = 1 on the Q4_1 engine, where a step takes
        # ~9 ms and most chat steps find no n-gram match, they cost ~0.5 ms a step.
        may_draft = any(r.max_k for r in reqs)
        pricing = (self._pricing(num_decodes) if may_draft else
                   StepPricing(latency=self.latency, draft_cost=self.draft_cost, overhead_s=self.overhead_s))
        state = PolicyState(requests=tuple(reqs), base=base, max_k=planner_cap, proposer=proposer,
                            workload=self.workload, pricing=pricing, sla_itl_s=self.sla_itl_s,
                            draft_budget=view.draft_budget, roofline=self.roofline, num_idle=len(idle),
                            idle_context_tokens=view.idle_context_tokens)
        if may_draft:
            ks = self.policy.choose(state)
            if len(ks) != len(reqs):
                raise RuntimeError(f"policy {self.policy.name!r} returned {len(ks)} k values for {len(reqs)} requests")
            ks = [max(0, min(int(k), r.max_k)) for k, r in zip(ks, reqs)]
        else:
            ks = [0] * len(reqs)
        self.draft_stop = None
        if (self.confidence is not None and getattr(self.policy, "stops_on_confidence", False)
                and proposer not in LOOKUP_PROPOSERS and any(k and not r.looked_up for k, r in zip(ks, reqs))):
            ks, self.draft_stop = self._confident_drafts(state, ks)
        if self.calibration is not None:  # what the chosen drafts were expected to yield, uncalibrated
            self._chosen_gains = {r.seq_id: (r.acceptance.gains, _uncalibrated_scale(r.acceptance, acc, factor))
                                  for r, acc, k in zip(reqs, beliefs, ks) if k}
        self.last_state, self.last_ks = state, ks
        self.num_decisions += num_decodes
        self.num_zero_decisions += ks.count(0) + len(idle)
        if step % 64 == 0:
            self._forget_stale()
        if pause is not None and not pause.measures(num_decodes):  # the measured rule times the step in observe
            saved = self._predicted_saving_s(state, ks) if any(ks) else 0.0
            pause.planned(step, num_decodes, self._screen_s + pause.clock() - start, saved)
            self._screen_s = 0.0
        return ks

    def _no_drafts(self, rv, t: _Tracked, cap: int) -> RequestState:
        """The state of a request whose lookup found no draft this step: no gains (the engine caps
        it at 0 drafts too), its last outcome and observed steps as any request's (the heuristic
        reads them), and no pooled evidence behind a belief it was not given. Its belief for this
        step's match bucket is neither made nor read."""
        acc = t.by_match.get(match_bucket(rv.match_length))
        return _request_state(rv.seq_id, rv.request_id, cap, rv.num_tokens, self._zero_estimate, t.last_outcome,
                              acc.steps_observed if acc is not None else 0, rv.greedy, float("inf"), True)

    @staticmethod
    def _predicted_saving_s(state: PolicyState, ks: list[int]) -> float:
        """Seconds the step with these drafts is predicted to save: its expected tokens at SD off's
        seconds per token, less its own seconds (both charged to the decodes)."""
        cost = state.cost_model()
        off_s = cost.charged_seconds((0,) * len(ks))
        # A request given no draft emits its one token (expected_emitted(0) is 1.0, the same float).
        tokens = state.num_idle + sum(r.acceptance.expected_emitted(k) if k else 1.0
                                      for r, k in zip(state.requests, ks))
        return tokens * off_s / state.batch_size - cost.charged_seconds(ks)

    def _confident_drafts(self, state: PolicyState, ks: list[int]) -> tuple[list[int], ConfidenceStop]:
        """With drafts chosen for a model proposer: each request it drafts for may draft up to its
        cap, and stops at the first draft whose chance of being emitted (the head's calibrated
        confidence, times the drafts' before it) is below what one more query token costs in this
        step, and a pass after the first runs only while the drafts it may yield pay for it
        (``marginal_draft_prices``). Lookup-served requests (a chain's) keep the chosen k: their
        drafts are all verified, none is stopped. Without room under the SLA or the step's draft
        budget for the deeper drafts, the chosen k stay as they are."""
        cost = state.cost_model()
        token, pass_ = marginal_draft_prices([r.acceptance for r in state.requests], ks, cost, state.num_idle)
        deeper = [r.max_k if k and not r.looked_up else k for r, k in zip(state.requests, ks)]
        fits = ((state.sla_itl_s is None or cost.seconds(deeper) <= state.sla_itl_s)
                and (state.draft_budget is None or sum(deeper) <= state.draft_budget))
        return (deeper if fits else ks), self.confidence.stop(token, pass_)

    def observe(self, record: StepRecord) -> None:
        n = len(record.requests) + getattr(record, "num_idle", 0)
        pause = self.pause
        weighed = pause is not None and n > 0 and pause.weighs(n)
        # Only the measured rule (B = 2-7) times steps here; at larger B nothing is read or summed.
        measured = weighed and pause.measures(n)
        start = pause.clock() if measured else 0.0
        answered, self._pause_answered = self._pause_answered, False
        prefill = record.num_prefill_tokens > 0
        if not (answered and weighed):
            self._learn(record)
        else:
            # A paused step drafted nothing, and the learners pick up again when planning does:
            # only what the settling after a prompt needs.
            self._prefilled = prefill
            if prefill:
                self.draft_slope.prefilled()
        if measured or (prefill and pause is not None):
            tokens = getattr(record, "num_idle", 0) + sum(rr.num_emitted for rr in record.requests)
            seconds = record.total_s + (pause.clock() - start if measured else 0.0)
            pause.timed(self._step, n, tokens, seconds, paused=answered and weighed, prefill=prefill)

    def _learn(self, record: StepRecord) -> None:
        """``observe`` of a step the planner planned: acceptance, calibration, step time, overhead."""
        proposer = self.proposer or (self.last_state.proposer if self.last_state is not None else "unknown")
        touched = set()
        total_drafts = deepest = 0
        for rr in record.requests:
            confidence = getattr(rr, "confidence", None)
            if confidence and self.confidence is not None:
                self.confidence.observe(confidence, rr.num_accepted)
            # Under a confidence stop a short draft is the stop rule's choice, not the proposer
            # running out: the request is read as having asked for what it drafted.
            k = rr.k_in_effect
            if k <= 0:
                # Not asked for drafts: nothing about them was observed (OutcomeCounts.add), so
                # neither belief moves. Most rows of a large batch, every step (at B = 32 under
                # vLLM nearly all): skipping them is most of this loop's cost there.
                continue
            t = self._tracked(rr.seq_id, rr.request_id, proposer)
            acc = self.acceptance(t, rr.match_length)
            acc.observe(k, rr.num_proposed, rr.num_accepted, rr.natural_k)
            touched.add(acc.pool)
            chosen = self._chosen_gains.get(rr.seq_id)  # empty without calibration
            if chosen is not None:
                gains, scale = chosen
                self.calibration.observe(sum(gains[:k]) * scale, rr.num_accepted)
            t.last_outcome = _outcome(k, rr.num_proposed, rr.num_accepted)
            total_drafts += k
            deepest = max(deepest, k)
        for p in touched:
            p.refresh()
        if self.latency is not None:
            self._observe_step_time(record, sum(rr.num_proposed for rr in record.requests))
        if self.config.learn_timing and self._times_overhead(record):
            # The passes a draft model ran, as the engine reports them (a stop's last pass too; none
            # for a chain's lookup drafts); else the deepest k.
            passes = getattr(record, "draft_passes", None)
            self._timing_for(proposer).observe(record.total_s - record.forward_s - record.verify_s, total_drafts,
                                               deepest if passes is None else passes)

    def _times_overhead(self, record: StepRecord) -> bool:
        """Whether this step's time outside forward + verify is learned from: not a step that ran a
        prompt, nor the one right after it. That next step carries the work for the new requests
        (their lookup index built over the whole prompt: the engine's proposer indexes it in the
        first decode step, the vLLM plugin in the call after the prompt ran, whose time goes to the
        next step), and when it also carried drafts, the fit read that work as what drafting costs.
        Traced in vLLM at B = 16 (reports/vllm-peer-xeon, "The first step after the prompts"): a
        21 ms first call beside 2 drafts taught a lookup proposer's drafts 8.5 ms each, on a 156 ms
        step, and the plugin drafted nothing for the rest of the run (its steps without drafts
        cannot teach that cost back)."""
        after_prefill, self._prefilled = self._prefilled, record.num_prefill_tokens > 0
        return not (after_prefill or self._prefilled)

    def _observe_step_time(self, record: StepRecord, drafts: int) -> None:
        """Closed loop on step time: the drift factor from every step, the drafts' slope from
        steps with drafts against plain steps of the same batch size (planner/drift.py)."""
        shape = StepShape(record.num_seqs, record.num_tokens, record.context_tokens)
        measured = record.forward_s + record.verify_s
        model = self.latency.inner
        drafts = min(drafts, record.num_tokens - record.num_seqs)
        num_decodes = len(record.requests) + getattr(record, "num_idle", 0)
        # The slope compares decode steps of one batch size with each other: a step that also
        # (or only) prefills is another regime, e.g. a 400-token prompt at B = 1 would become the
        # plain baseline its next decode steps are measured against.
        decode_only = num_decodes > 0 and record.num_prefill_tokens == 0
        if record.num_prefill_tokens > 0:
            self.draft_slope.prefilled()
        if drafts <= 0:
            predicted = model.predict(shape)
            self.drift.update(predicted, measured)
            if decode_only:
                self.draft_slope.observe_plain(num_decodes, predicted, measured)
            return
        base = StepShape(record.num_seqs, record.num_tokens - drafts, record.context_tokens - drafts)
        base_s = model.predict(base)
        increment = draft_increment(base_s, model.predict(shape), drafts, base.num_tokens)
        price = self.draft_slope.price(num_decodes)
        self.drift.update(priced_seconds(base_s, increment, price.slope, price.jump), measured)
        if decode_only:
            self.draft_slope.observe_drafts(num_decodes, base_s, increment, measured)
