"""The proposer interface: guess up to k_i tokens for each request, cheaply.

Glossary (as in vLLM's spec-decode):
  draft tokens      the proposer's guesses for the next tokens of a request
  accepted tokens   the longest prefix of the drafts the target model agrees with
  bonus token       the target's own next token when every draft was accepted
  recovered token   the token sampled from the residual distribution after a rejection
  lookahead slots   KV slots reserved for the draft tokens before the verify forward pass

What a proposer answers (``DraftTokens``, ``DraftTree``) is defined in engine/drafts.py.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from ..drafts import DraftTokens, DraftTree  # noqa: F401  (re-exported: the proposer's answer)
from ..sequence import Sequence


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
