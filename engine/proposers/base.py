"""The proposer interface: guess up to k_i tokens for each request, cheaply.

What a proposer answers (``DraftTokens``, ``DraftTree``) is defined in engine/drafts.py; the
terms (draft, accepted, bonus, recovered tokens, lookahead slots) in the glossary of
engine/spec_decode/__init__.py.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, runtime_checkable

import torch

from ..drafts import DraftTokens, DraftTree  # noqa: F401  (re-exported: the proposer's answer)
from ..sequence import Sequence

if TYPE_CHECKING:
    from ..decider import DraftStop
    from ..model_runner import ScheduledSeq


@runtime_checkable
class Proposer(Protocol):
    """A source of draft tokens, one file per kind in this folder."""

    name: str
    # True when asking for fewer tokens returns a prefix of the longer answer and proposing costs
    # little (n-gram and suffix lookup): the engine then proposes before k is decided and shows
    # the decider how many drafts each request has.
    proposes_prefixes: bool

    def propose(self, seqs: list[Sequence], k: list[int]) -> DraftTokens:
        """Drafts for each sequence; at most k[i] draft tokens for sequence i (k[i] == 0: none)."""
        ...

    def on_finished(self, seq: Sequence) -> None:
        """A sequence finished (proposers that learn across requests may keep its output)."""
        ...


@runtime_checkable
class LooksUpFirst(Protocol):
    """A proposer that drafts some requests by lookup and others with a model (the chain): before
    k is decided it shows the lookup's answer (``DraftTokens`` with drafts only for the requests
    the lookup will serve, ``match_length`` for all), so the decider can price each request by its
    own source and the engine can cap those requests at the drafts that exist."""

    def lookup_ahead(self, seqs: list[Sequence], k: list[int]) -> DraftTokens:
        ...


@runtime_checkable
class StopsEarly(Protocol):
    """A proposer that drafts token by token with a confidence for each (an EAGLE head) and can
    stop a request's draft where the decider's ``DraftStop`` says the next token no longer pays."""

    stops_early: bool  # the marker the engine checks (a plain ``propose`` looks alike from outside)

    def propose(self, seqs: list[Sequence], k: list[int], stop: "DraftStop | None" = None) -> DraftTokens:
        """As ``Proposer.propose``, at most k[i] drafts each, fewer where ``stop`` says so."""
        ...


@runtime_checkable
class ReadsTargetFeatures(Protocol):
    """A proposer that drafts from the target's own hidden states (an EAGLE-3 head): the engine
    keeps the residual stream entering ``target_layers`` in every forward it runs and hands it over."""

    target_layers: tuple[int, ...]

    def observe_target(self, work: list["ScheduledSeq"], captured: torch.Tensor) -> None:
        """captured [N, len(target_layers) * hidden]: the features of every query token of the
        forward that ran ``work`` (batch order), rejected drafts included."""
        ...
