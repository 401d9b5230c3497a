"""The hook through which a planner steers speculation: ``SpecDecider``.

Each step the engine shows the decider the requests that are ready to decode (a ``StepView``) and
asks for k per request (0 = no speculation for that request). After the step it reports what
happened (a ``StepRecord``): per request how many drafts were proposed and accepted, and the
step's time split into propose / forward / verify. The engine defines this protocol and ships a
fixed-k decider; specplan's planner implements it (the engine never imports the planner).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable


@dataclass(frozen=True)
class RequestView:
    seq_id: int
    request_id: str
    num_tokens: int  # context length (prompt + output so far)
    num_output_tokens: int
    max_k: int  # the most drafts worth verifying (bounded by max_tokens, context and the engine's k cap)
    greedy: bool
    # Drafts the proposer already has for this request this step (a lookup proposer is asked
    # before the decision: a lookup costs little); None when unknown until k is chosen.
    available_drafts: int | None = None
    # How many trailing tokens the lookup matched to find those drafts (DraftTokens.match_length).
    match_length: int | None = None


@dataclass(frozen=True)
class StepView:
    requests: tuple[RequestView, ...]  # decode-ready requests, in batch order
    num_prefill_tokens: int  # prefill-chunk tokens already scheduled into this step
    num_prefill_seqs: int
    context_tokens: int  # KV tokens the step's attention reads, over all its sequences
    proposer: str
    # Query tokens left in the step's token budget for drafts, shared by all requests (None: no
    # limit). 0 when a prefill chunk took the rest: the engine then runs no drafts, whatever k.
    draft_budget: int | None = None
    # Decode-ready requests left out of ``requests`` because no draft can be given to them this
    # step (their lookup found none), and their context lengths summed: each gets 0. Only for a
    # decider that ``takes_idle_requests``; at B = 32 under vLLM most rows of most steps.
    idle_seq_ids: tuple[int, ...] = ()
    idle_context_tokens: int = 0

    @property
    def num_decodes(self) -> int:
        """Decode-ready requests in the step, the idle ones included."""
        return len(self.requests) + len(self.idle_seq_ids)


@dataclass(frozen=True)
class RequestRecord:
    seq_id: int
    request_id: str
    k: int  # drafts asked for (after the engine's caps and KV reservation)
    num_proposed: int  # drafts the proposer produced (<= k; 0 when it found no match)
    num_accepted: int  # accepted drafts (the bonus / recovered token not counted)
    num_emitted: int  # tokens appended this step (accepted + 1, less if a stop truncated)
    natural_k: int | None = None  # the proposer's own preferred length, if it has one
    match_length: int | None = None  # trailing tokens the lookup matched (DraftTokens.match_length)
    # The proposer's probability of each proposed draft (DraftTokens.confidence; nan for a lookup
    # token in a chained proposal), None for proposers without one.
    confidence: tuple[float, ...] | None = None
    # Whether the decider's DraftStop was in force for this request (the proposer may have drafted
    # fewer than k: a short proposal then says nothing about how long proposals run).
    stop_rule: bool = False

    @property
    def k_in_effect(self) -> int:
        """The drafts this request was given: k, but under the decider's stop rule the drafts it
        ran to (k is then its cap, and where it stopped was the rule's choice, not the proposer
        running out). What the planner learns from and the engine's k statistics count."""
        return self.num_proposed if self.stop_rule else self.k

    @property
    def accepted_per_position(self) -> tuple[bool, ...]:
        """Position j was accepted iff j < num_accepted (drafts are verified left to right)."""
        return tuple(j < self.num_accepted for j in range(self.num_proposed))


@dataclass(frozen=True)
class StepRecord:
    requests: tuple[RequestRecord, ...]  # decode requests of this step, in batch order
    num_seqs: int  # all sequences in the step (decodes and prefill chunks)
    num_tokens: int  # query tokens in the forward pass
    num_prefill_tokens: int
    context_tokens: int
    propose_s: float
    forward_s: float
    verify_s: float
    total_s: float
    # Draft-model (head) passes the step's proposal ran (DraftTokens.passes); None: no draft model
    # ran or the proposer does not say (a lookup).
    draft_passes: int | None = None
    # Decode requests left out of ``requests``: given no drafts, each emitted one token (only from
    # an engine whose decider ``takes_idle_requests``; StepView.idle_seq_ids).
    num_idle: int = 0

    @property
    def num_decodes(self) -> int:
        """Decode requests in the step, the idle ones included."""
        return len(self.requests) + self.num_idle


@dataclass(frozen=True)
class StepOutline:
    """A step as the engine knows it before any lookup: counts only, no request of its own."""

    num_decodes: int  # decode-ready requests
    decode_context_tokens: int  # their context lengths summed
    num_prefill_tokens: int
    num_prefill_seqs: int
    context_tokens: int  # as StepView.context_tokens
    max_k: int  # the most drafts any one request may get
    draft_budget: int | None = None  # as StepView.draft_budget


@runtime_checkable
class SpecDecider(Protocol):
    def decide(self, view: StepView) -> list[int]:
        """k per request of ``view.requests`` (0 = no speculation); the engine caps each at max_k."""
        ...

    def observe(self, record: StepRecord) -> None:
        """What happened in the step (acceptance, timings): for deciders that learn."""
        ...


@runtime_checkable
class DraftStop(Protocol):
    """Where a model draft stops early, from its own confidence (issue #33; the planner's
    ``ConfidenceStop`` implements it). A proposer that reports a probability per draft token
    (``DraftTokens.confidence``, an EAGLE head) keeps drafting request i while

        accept_probability(c_1) * ... * accept_probability(c_j) >= min_gain,

    the chance that drafts 1..j are all accepted, and keeps exactly those drafts: the j-th draft
    adds that many expected tokens to the step, and ``min_gain`` is what one more query token
    costs, in tokens (the step's goodput times its marginal seconds). Worked example: min_gain
    0.3 and confidences 0.9, 0.7, 0.4 read as acceptances 0.85, 0.6, 0.3: the products 0.85,
    0.51, 0.15 keep two drafts, and the third head pass is the last one run.

    ``pass_gain`` (read with ``getattr``, default 0): what one more head pass costs, in tokens.
    The first pass runs for every request given drafts anyway (it also keeps the head's cache
    current), so a first draft only has to pay for its query token. A later pass is shared by the
    requests still drafting, so it runs only while their products so far exceed ``min_gain`` by
    ``pass_gain`` in all: sum_i max(0, product_i - min_gain) >= pass_gain. Worked example: min_gain
    0.2, pass_gain 0.25, two requests whose first drafts read 0.5 and 0.3: 0.3 + 0.1 >= 0.25, the
    second pass runs; had they read 0.3 and 0.25 (0.1 + 0.05), both stop at one draft."""

    min_gain: float

    def accept_probability(self, confidence: float) -> float:
        """P(a draft is accepted | the proposer's confidence in it, the drafts before it accepted)."""
        ...


class StopsDrafts(Protocol):
    """Optional for a ``SpecDecider``: the ``DraftStop`` of its latest decision (None: drafts run
    to k). Read it through ``draft_stop()``."""

    draft_stop: DraftStop | None


def draft_stop(decider: SpecDecider) -> DraftStop | None:
    """The decider's ``draft_stop`` for the step it just decided, or None when it declares none."""
    return getattr(decider, "draft_stop", None)


class ScreensSteps(Protocol):
    """Optional for a ``SpecDecider``: whether a step shaped like ``outline`` could give drafts to
    anyone. False means ``decide`` would answer 0 for every request whatever the proposer found
    (SD off, or a compute-bound step where even drafts that were all accepted would not pay), so
    the engine skips the lookups and the decision; the decider counts the step as decided all 0.
    Read it through ``may_speculate()``."""

    def may_speculate(self, outline: StepOutline) -> bool:
        ...


def may_speculate(decider: SpecDecider, outline: StepOutline) -> bool:
    """The decider's answer for this step, or True when it does not screen steps."""
    screen = getattr(decider, "may_speculate", None)
    return True if screen is None else bool(screen(outline))


class TakesIdleRequests(Protocol):
    """Optional for a ``SpecDecider``: True when ``decide`` may be shown only the requests that have
    drafts, the others summarised in ``StepView.idle_seq_ids`` (answered 0), and ``observe`` only
    the requests that were given drafts, the others counted in ``StepRecord.num_idle``. The same
    decisions either way; an engine that builds a view per request per step (the vLLM plugin at
    B = 32, where most rows have no draft) then builds a few. Read it through
    ``takes_idle_requests()``."""

    takes_idle_requests: bool


def takes_idle_requests(decider: SpecDecider) -> bool:
    """The decider's ``takes_idle_requests``, False when it does not declare it."""
    return bool(getattr(decider, "takes_idle_requests", False))


class PredictsStepTime(Protocol):
    """Optional for a ``SpecDecider``: the step time it predicted when it made its latest decision.

    ``predicted_step_s`` is in seconds, or None when the decider makes no prediction. The server
    exports it beside the measured step time. It is kept apart from ``SpecDecider`` because a
    decider that predicts nothing need not declare it; read it through ``predicted_step_s()``.
    """

    predicted_step_s: float | None


def predicted_step_s(decider: SpecDecider) -> float | None:
    """The decider's ``predicted_step_s``, or None when it does not declare one (see
    ``PredictsStepTime``): the one place that tolerates its absence."""
    value = getattr(decider, "predicted_step_s", None)
    return float(value) if value is not None else None


class FixedDecider:
    """The same k for every request, every step (what serving stacks do today)."""

    predicted_step_s: float | None = None  # it makes no prediction

    def __init__(self, k: int):
        if k < 0:
            raise ValueError("k must be >= 0")
        self.k = k

    def decide(self, view: StepView) -> list[int]:
        return [self.k] * len(view.requests)

    def may_speculate(self, outline: StepOutline) -> bool:
        return self.k > 0  # SD off looks nothing up

    def observe(self, record: StepRecord) -> None:
        pass
