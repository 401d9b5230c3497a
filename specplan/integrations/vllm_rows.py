"""Which request sits in which row of vLLM's input batch, from one ``propose`` call to the next.

vLLM hands a ``custom_class`` drafter the input batch as arrays, one row per scheduled request,
and no request ids: ``sampled_token_ids[i]`` (the tokens row i committed in the step that just
ran), ``num_tokens_no_spec[i]`` (its committed length, those tokens included) and
``token_ids_cpu[i, :num_tokens_no_spec[i]]`` (prompt + output). Rows move: when a request
finishes, vLLM condenses the batch by moving later rows into the hole. So a row's request is
recognised by its tokens: a tracked request whose committed length was ``n - s`` last time (n
the row's length now, s its newly sampled tokens) and whose first and last tokens equal the
row's there. Two rows that pass for one another hold the same tokens, so n-gram drafts and
acceptance beliefs carry over correctly either way. A row that matches nobody is a new request
(or one vLLM preempted and recomputed): its beliefs start from the planner's pooled prior.

Pure Python over numpy: importable and testable without vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from specplan.engine.proposers.ngram import NgramIndex

# Tokens compared at each end of the already-known prefix to recognise a request (the n-gram
# proposer's own guard against rewritten token lists re-checks 8 trailing tokens the same way).
HEAD_TOKENS = 16
TAIL_TOKENS = 8


@dataclass(frozen=True)
class LookupConfig:
    """The n-gram lookup's knobs; the defaults are the built-in engine's NgramProposer's."""

    min_n: int = 1
    max_n: int = 4
    max_match_length: int = 16
    max_natural_k: int = 8  # natural_k = min(available, this): what the planner's n-gram prior reads


@dataclass
class TrackedRequest:
    """One request as the plugin knows it: its tokens, its n-gram index, what was proposed last."""

    seq_id: int  # the plugin's own id (vLLM shows the drafter none); the planner keys beliefs on it
    toks: list[int]  # prompt + committed output, a mirror of the row; the index reads it in place
    index: NgramIndex
    first_len: int  # committed length when first seen (the prompt + its first sampled token)
    last_seen: int  # the call that last matched it
    # What the previous call returned for it (the drafts the step that just ran verified):
    asked: int = 0  # k after caps
    proposed: int = 0  # drafts returned (<= asked)
    natural_k: int | None = None
    match_length: int | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.toks)


@dataclass(frozen=True)
class Row:
    """A row of this call's batch that decodes (it sampled tokens in the step that just ran)."""

    row: int  # index into vLLM's arrays
    request: TrackedRequest
    num_sampled: int  # tokens the step committed for it: accepted drafts + 1
    continued: bool  # False: first seen now, so there is no outcome of earlier drafts to learn from

    @property
    def num_accepted(self) -> int:
        """Accepted drafts among those proposed for it last call (vLLM may have scheduled fewer)."""
        return max(0, min(self.num_sampled - 1, self.request.proposed)) if self.continued else 0


@dataclass
class BatchRows:
    """This call's batch as the tracker read it."""

    decodes: list[Row]  # rows that committed tokens, in row order
    num_rows: int  # all rows, those still prefilling included
    prefill_rows: list[int] = field(default_factory=list)  # rows that committed nothing (prompt chunk, discarded)


class RowTracker:
    """Follows requests across calls; owns their n-gram indexes. One per drafter (no globals)."""

    def __init__(self, lookup: LookupConfig = LookupConfig(), forget_after_calls: int = 64):
        self.lookup = lookup
        self.forget_after_calls = forget_after_calls
        self._requests: list[TrackedRequest] = []
        self._next_id = 0
        self._call = 0

    @property
    def num_tracked(self) -> int:
        return len(self._requests)

    def read(self, sampled_token_ids: Sequence[Sequence[int]], num_tokens_no_spec: np.ndarray,
             token_ids_cpu: np.ndarray) -> BatchRows:
        """Match every row to a tracked request (or a new one) and append its new tokens.

        sampled_token_ids: [num_rows] lists; num_tokens_no_spec: [>= num_rows] int;
        token_ids_cpu: [>= num_rows, max_model_len] int (vLLM passes the persistent buffers,
        longer than the batch)."""
        self._call += 1
        by_len: dict[int, list[TrackedRequest]] = {}
        for t in self._requests:
            by_len.setdefault(t.num_tokens, []).append(t)
        decodes, prefill = [], []
        for i, sampled in enumerate(sampled_token_ids):
            s = len(sampled)
            if s == 0:
                prefill.append(i)
                continue
            n = int(num_tokens_no_spec[i])
            row = token_ids_cpu[i]  # [max_model_len]
            t = self._claim(by_len.get(n - s), row, n - s)
            if t is not None:
                t.toks.extend(row[n - s:n].tolist())
                decodes.append(Row(i, t, s, continued=True))
            else:
                t = self._new(row[:n].tolist())
                decodes.append(Row(i, t, s, continued=False))
            t.last_seen = self._call
        horizon = self._call - self.forget_after_calls
        if any(t.last_seen < horizon for t in self._requests):
            # Finished requests just stop appearing; one vLLM did not schedule for a while may return.
            self._requests = [t for t in self._requests if t.last_seen >= horizon]
        return BatchRows(decodes, len(sampled_token_ids), prefill)

    def _claim(self, candidates: list[TrackedRequest] | None, row: np.ndarray, prev_len: int) -> TrackedRequest | None:
        """The candidate (committed length prev_len) whose head and tail tokens the row repeats;
        removed from the candidates so that no two rows claim one request."""
        if not candidates:
            return None
        h = min(HEAD_TOKENS, prev_len)
        lo = max(h, prev_len - TAIL_TOKENS)
        head, tail = row[:h].tolist(), row[lo:prev_len].tolist()
        for j, t in enumerate(candidates):
            if t.toks[:h] == head and t.toks[lo:] == tail and t.last_seen < self._call:
                return candidates.pop(j)
        return None

    def _new(self, toks: list[int]) -> TrackedRequest:
        lk = self.lookup
        t = TrackedRequest(self._next_id, toks, NgramIndex(toks, lk.min_n, lk.max_n, lk.max_match_length),
                           first_len=len(toks), last_seen=self._call)
        self._next_id += 1
        self._requests.append(t)
        return t
