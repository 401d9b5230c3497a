"""The plugin's draft sources: specplan's own lookup proposers over the rows the tracker follows.

Both proposers are the built-in engine's (engine/proposers/ngram.py ``NgramIndex``,
engine/proposers/suffix.py ``SuffixProposer``): one implementation each. They are asked before
the planner decides, for each request's cap, as the engine asks a lookup proposer
(``proposes_prefixes``): a shorter k keeps a prefix of the drafts. What a lookup returns per
request is ``Found``: the drafts, the proposer's natural length (the planner's proposal-length
prior reads it) and the match length (its acceptance beliefs are kept per match length).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from specplan.engine.proposers.ngram import NgramIndex
from specplan.engine.proposers.suffix import SuffixProposer
from specplan.planner.filler import filler

from .vllm_rows import TrackedRequest

@dataclass(frozen=True)
class Found:
    drafts: list[int]  # up to the cap asked for
    natural_k: int  # the proposer's own preferred length (n-gram: the tokens available, capped)
    match_length: int  # trailing tokens the lookup matched (0: no match)


NOTHING = Found([], 0, 0)
_found = filler(Found)  # one per request per step (planner/filler.py)


class Lookup(Protocol):
    name: str  # the proposer's name, as the planner's priors and the profile's draft costs key it

    def lookup(self, requests: list[TrackedRequest], caps: list[int]) -> list[Found]:
        """Drafts for every request, at most caps[i] (0: none asked, NOTHING)."""
        ...

    def forget(self, request: TrackedRequest) -> None:
        """The request is gone (finished, or not scheduled for a long while)."""
        ...


class NgramLookup:
    """Prompt lookup over each request's own tokens (the engine's ``NgramProposer`` defaults)."""

    name = "ngram"

    def __init__(self, min_n: int = 1, max_n: int = 4, max_match_length: int = 16, max_natural_k: int = 8):
        NgramIndex([], min_n, max_n, max_match_length)  # checks the parameters once, here
        self.min_n, self.max_n, self.max_match_length = min_n, max_n, max_match_length
        self.max_natural_k = max_natural_k
        self._indexes: dict[int, NgramIndex] = {}  # seq_id -> the index over that request's toks

    def lookup(self, requests: list[TrackedRequest], caps: list[int]) -> list[Found]:
        out = []
        indexes = self._indexes
        for t, cap in zip(requests, caps):
            if not cap:
                out.append(NOTHING)
                continue
            index = indexes.get(t.seq_id)
            if index is None:
                index = indexes[t.seq_id] = NgramIndex(t.toks, self.min_n, self.max_n, self.max_match_length)
            drafts, available, match_length = index.lookup(cap)
            out.append(_found(drafts, min(available, self.max_natural_k), match_length) if drafts else NOTHING)
        return out

    def forget(self, request: TrackedRequest) -> None:
        self._indexes.pop(request.seq_id, None)


class SuffixLookup:
    """SuffixDecoding over each request's tokens and the outputs of recent finished requests.
    vLLM verifies one chain per request, so the plugin sends the tree's best branch (the
    proposer's ``token_ids``)."""

    name = "suffix"

    def __init__(self, proposer: SuffixProposer | None = None):
        self.proposer = proposer or SuffixProposer()

    def lookup(self, requests: list[TrackedRequest], caps: list[int]) -> list[Found]:
        answer = self.proposer.propose(requests, caps)  # TrackedRequest reads as an engine Sequence
        return [_found(drafts, natural, matched) if drafts else NOTHING
                for drafts, natural, matched in zip(answer.token_ids, answer.natural_k, answer.match_length)]

    def forget(self, request: TrackedRequest) -> None:
        self.proposer.on_finished(request)  # its output joins the global cache


LOOKUPS = {"ngram": NgramLookup, "suffix": SuffixLookup}


def make_lookup(name: str) -> Lookup:
    """The draft source called ``name`` (ValueError naming the choices otherwise)."""
    make = LOOKUPS.get(name)
    if make is None:
        raise ValueError(f"unknown proposer {name!r}; choose one of {', '.join(LOOKUPS)}")
    return make()
