"""Chained proposer: n-gram lookup where the context offers a match, the EAGLE-3 head otherwise.

Per request and per step: a lookup whose match is at least ``min_match`` tokens long takes the
request (its drafts cost nothing, and a longer match is accepted far more often:
reports/README.md#engine-measurements); every other request drafts with the head. The engine's
default, 2 (engine/config.py ``SpecConfig.chain_min_match``), leaves 1-token matches to the head:
the shipped SmolLM2 head's first draft is accepted about twice as often as theirs (reports/eagle). The head's
features keep arriving for all requests (``observe_target``), so it catches up whenever a request
comes back to it.
"""

from __future__ import annotations

import math
import time

import torch

from ..decider import DraftStop
from ..drafts import DraftTokens
from ..sequence import Sequence
from .eagle import EagleProposer
from .ngram import NgramProposer


class ChainProposer:
    name = "chain"
    proposes_prefixes = False  # the head's share costs a forward per draft token
    stops_early = True  # the head's drafts take the decider's DraftStop (lookup drafts are free: kept)

    def __init__(self, lookup: NgramProposer, head: EagleProposer, min_match: int = 2):
        if min_match < 1:
            raise ValueError(f"min_match must be >= 1, got {min_match}")
        self.lookup = lookup
        self.head = head
        self.draft = head.draft  # the drafter the engine reuses
        self.min_match = min_match

    @property
    def target_layers(self) -> tuple[int, ...]:
        return self.head.target_layers

    def observe_target(self, work, captured: torch.Tensor) -> None:
        self.head.observe_target(work, captured)

    def _served(self, looked: DraftTokens) -> tuple[list[bool], list[int]]:
        """Per request: whether the lookup serves it (a match of >= min_match tokens), and the
        match length the planner should read: 0 for the head's requests, whose drafts are the
        head's whatever the lookup matched (a 1-token match's belief is a lookup's, not the head's)."""
        by_lookup = [bool(t) and m >= self.min_match for t, m in zip(looked.token_ids, looked.match_length)]
        return by_lookup, [m if served else 0 for m, served in zip(looked.match_length, by_lookup)]

    def lookup_ahead(self, seqs: list[Sequence], k: list[int]) -> DraftTokens:
        """The lookup's drafts for the requests it will serve ([] for the head's), and their match
        lengths (0 for the head's) (proposers/base.py LooksUpFirst)."""
        looked = self.lookup.propose(seqs, k)
        by_lookup, match_length = self._served(looked)
        served = [t if b else [] for t, b in zip(looked.token_ids, by_lookup)]
        return DraftTokens(token_ids=served, natural_k=looked.natural_k, match_length=match_length)

    def propose(self, seqs: list[Sequence], k: list[int], stop: DraftStop | None = None) -> DraftTokens:
        """Lookup drafts for requests with a match of >= min_match tokens, head drafts for the
        rest. ``confidence`` holds the head's probabilities, nan for lookup tokens (no probability)."""
        t0 = time.perf_counter()
        looked = self.lookup.propose(seqs, k)
        by_lookup, match_length = self._served(looked)
        head_k = [0 if by_lookup[i] else ki for i, ki in enumerate(k)]
        drafted = self.head.propose(seqs, head_k, stop) if any(head_k) else None
        tokens, confidence, probs = [], [], []
        for i in range(len(seqs)):
            if by_lookup[i]:
                tokens.append(looked.token_ids[i])
                confidence.append([math.nan] * len(looked.token_ids[i]))
                probs.append(None)  # one-hot: the verifier's default for drafts without q
            else:
                tokens.append(drafted.token_ids[i] if drafted is not None else [])
                confidence.append(drafted.confidence[i] if drafted is not None else [])
                probs.append(drafted.draft_probs[i] if drafted is not None and drafted.draft_probs is not None
                             else None)
        return DraftTokens(token_ids=tokens, draft_probs=probs if any(p is not None for p in probs) else None,
                           natural_k=looked.natural_k, match_length=match_length, confidence=confidence,
                           seconds=time.perf_counter() - t0, passes=drafted.passes if drafted is not None else 0)

    def on_finished(self, seq: Sequence) -> None:
        self.lookup.on_finished(seq)
        self.head.on_finished(seq)
