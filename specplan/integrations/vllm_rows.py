"""Which request sits in which row of vLLM's input batch, from one ``propose`` call to the next.

vLLM hands a ``custom_class`` drafter the input batch as arrays, one row per scheduled request,
and no request ids: ``sampled_token_ids[i]`` (the tokens row i committed in the step that just
ran), ``num_tokens_no_spec[i]`` (its committed length, those tokens included) and
``token_ids_cpu[i, :num_tokens_no_spec[i]]`` (prompt + output). Rows move: when a request
finishes, vLLM condenses the batch by moving later rows into the hole. So a row's request is
recognised by its tokens: a tracked request whose committed length was ``n - s`` last time (n
the row's length now, s its newly sampled tokens) and whose first and last tokens equal the
row's there. Two rows that pass for one another hold the same tokens, so drafts and acceptance
beliefs carry over correctly either way. A row that matches nobody is a new request (or one vLLM
preempted and recomputed): its beliefs start from the planner's pooled prior.

Cost (this runs every step, inside vLLM's step loop): almost every row holds the request it held
last call, so that request is checked first, for the whole batch at once in numpy (the row's
length, head and tail tokens against what the previous call kept of it); only rows that fail it
search the other tracked requests.
The tokens a row committed are ``sampled_token_ids[i]`` itself (vLLM writes exactly those into
``token_ids_cpu`` before calling), so nothing else is copied out of the arrays per step.

Pure Python over numpy: importable and testable without vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple, Sequence

import numpy as np

# Tokens compared at each end of the already-known prefix to recognise a request (the n-gram
# proposer's own guard against rewritten token lists re-checks 8 trailing tokens the same way).
HEAD_TOKENS = 16
TAIL_TOKENS = 8
_TAIL_OFFSETS = np.arange(-TAIL_TOKENS, 0)  # [TAIL_TOKENS]: -8 .. -1
_HEAD_COLUMNS = np.arange(HEAD_TOKENS)  # [HEAD_TOKENS]


def _tails(token_ids: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """[R, TAIL_TOKENS]: row i's TAIL_TOKENS tokens before column ends[i], clipped at column 0.
    Worked example: ends = [20, 3] -> columns [[12..19], [0, 0, 0, 0, 0, 0, 1, 2]] (a short row
    repeats its first token; two calls clip alike, as they compare at the same length)."""
    cols = np.maximum(ends[:, None] + _TAIL_OFFSETS, 0)  # [R, TAIL_TOKENS]
    return token_ids[np.arange(len(ends))[:, None], cols]


@dataclass
class TrackedRequest:
    """One request as the plugin knows it: its tokens and what was proposed for it last call.

    It is also what the proposers read (engine/proposers: ``seq_id``, ``token_ids``,
    ``output_token_ids``): a lookup keeps its index per ``seq_id`` and reads ``toks`` in place."""

    seq_id: int  # the plugin's own id (vLLM shows the drafter none); the planner keys beliefs on it
    toks: list[int]  # prompt + committed output, a mirror of the row, appended to in place
    head: list[int]  # toks[:HEAD_TOKENS] when first seen: what recognises it in any row
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

    @property
    def token_ids(self) -> list[int]:
        return self.toks

    @property
    def output_token_ids(self) -> list[int]:
        """What it generated, as far as the plugin can tell (the prompt's length is not shown to
        a drafter: everything from its first sampled token on)."""
        return self.toks[self.first_len - 1:]


class Row(NamedTuple):
    """A row of this call's batch that decodes (it sampled tokens in the step that just ran).
    A named tuple: 32 of them are made every step, at a quarter of a frozen dataclass's cost."""

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
    forgotten: list[TrackedRequest] = field(default_factory=list)  # dropped this call (finished long ago)
    num_moved: int = 0  # decoding rows not holding last call's request (moved or new): the slow path


class RowTracker:
    """Follows requests across calls. One per drafter (no globals)."""

    def __init__(self, forget_after_calls: int = 64, forget_every_calls: int = 16):
        self.forget_after_calls = forget_after_calls
        self.forget_every_calls = forget_every_calls  # how often to look for requests to forget
        self._requests: list[TrackedRequest] = []
        self._by_row: list[TrackedRequest | None] = []  # row -> the request it held last call
        # What recognises that request in its row next call (``_remember``), one entry per row:
        self._kept_lens = np.zeros(0, dtype=np.int64)  # [R]: its committed length (-1: no request)
        self._kept_heads = np.zeros((0, HEAD_TOKENS), dtype=np.int64)  # [R, HEAD_TOKENS]
        self._head_pad = np.zeros((0, HEAD_TOKENS), dtype=bool)  # [R, HEAD_TOKENS]: columns not compared
        self._kept_tails = np.zeros((0, TAIL_TOKENS), dtype=np.int64)  # [R, TAIL_TOKENS]
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
        call = self._call
        num_rows = len(sampled_token_ids)
        lens = num_tokens_no_spec[:num_rows].astype(np.int64)  # [R]
        num_sampled = np.fromiter(map(len, sampled_token_ids), np.int64, num_rows)  # [R]
        prev = np.maximum(lens - num_sampled, 1)  # [R] committed before the step
        heads = token_ids_cpu[:num_rows, :HEAD_TOKENS]  # [R, HEAD_TOKENS], a view
        tails = _tails(token_ids_cpu, prev)  # [R, TAIL_TOKENS]
        held = self._still_held(prev, heads, tails)  # [R] bool
        by_row = self._by_row
        decodes, prefill, moved = [], [], []
        rows_now: list[TrackedRequest | None] = [None] * num_rows
        for i, (sampled, same) in enumerate(zip(sampled_token_ids, held)):
            if not sampled:
                prefill.append(i)
                continue
            if same:
                t = by_row[i]
                t.toks.extend(sampled)
                t.last_seen = call
                rows_now[i] = t
                decodes.append(Row(i, t, len(sampled), continued=True))
            else:
                moved.append(i)
                decodes.append(None)  # filled below, in row order
        if moved:
            self._place_moved(moved, decodes, rows_now, sampled_token_ids, token_ids_cpu, lens.tolist(),
                              prev.tolist(), heads, tails)
        self._remember(rows_now, lens, heads, token_ids_cpu)
        forgotten = []
        horizon = call - self.forget_after_calls
        if call % self.forget_every_calls == 0 and any(t.last_seen < horizon for t in self._requests):
            # Finished requests just stop appearing; one vLLM did not schedule for a while may return.
            forgotten = [t for t in self._requests if t.last_seen < horizon]
            self._requests = [t for t in self._requests if t.last_seen >= horizon]
        return BatchRows(decodes, num_rows, prefill, forgotten, len(moved))

    def _still_held(self, prev: np.ndarray, heads: np.ndarray, tails: np.ndarray) -> list[bool]:
        """[R]: whether row i holds the request it held last call, checked for the whole batch in
        numpy against what ``_remember`` kept: that request's committed length then (which must be
        the row's length before this step), the first tokens of its row (its prompt's, up to its
        head's length) and its last TAIL_TOKENS tokens. The same test as ``_holds``: the row then
        held exactly the request's tokens, and committed tokens do not change."""
        num_rows = len(prev)
        m = min(num_rows, len(self._by_row))
        held = np.zeros(num_rows, dtype=bool)  # [R]
        if m:
            head_ok = ((heads[:m] == self._kept_heads[:m]) | self._head_pad[:m]).all(axis=1)  # [m]
            held[:m] = (prev[:m] == self._kept_lens[:m]) & head_ok & (tails[:m] == self._kept_tails[:m]).all(axis=1)
        return held.tolist()

    def _remember(self, rows_now: list, lens: np.ndarray, heads: np.ndarray, token_ids_cpu: np.ndarray) -> None:
        """Keep what ``_still_held`` checks next call, per row: its request, that request's
        committed length (-1 for a row holding none), its row's head tokens (copied out of vLLM's
        buffer, which the next step rewrites) with the columns past its head's length masked, and
        its last TAIL_TOKENS tokens."""
        self._by_row = rows_now
        head_lens = np.array([len(t.head) if t is not None else 0 for t in rows_now], dtype=np.int64)  # [R]
        self._kept_lens = np.where(head_lens > 0, lens, -1)  # [R]
        self._kept_heads = heads.copy()  # [R, HEAD_TOKENS]
        self._head_pad = _HEAD_COLUMNS >= head_lens[:, None]  # [R, HEAD_TOKENS]: not compared
        self._kept_tails = _tails(token_ids_cpu, lens)  # [R, TAIL_TOKENS]

    @staticmethod
    def _holds(t: TrackedRequest, prev_len: int, head: list[int], tail: list[int]) -> bool:
        """Whether ``t`` (committed length prev_len before the step) is the request in a row whose
        first tokens are ``head`` and whose tokens before the step end in ``tail``."""
        if t.num_tokens != prev_len:
            return False
        h = len(t.head)
        m = min(TAIL_TOKENS, prev_len)
        return head[:h] == t.head and tail[TAIL_TOKENS - m:] == t.toks[-m:]

    def _place_moved(self, moved: list[int], decodes: list, rows_now: list, sampled_token_ids, token_ids_cpu,
                     lens: list[int], prev: list[int], heads: np.ndarray, tails: np.ndarray) -> None:
        """Rows whose request is not the one they held last call: another tracked request (the
        batch condensed) or a new one."""
        call = self._call
        free = [t for t in self._requests if t.last_seen < call]
        slot = 0
        for i in moved:
            while decodes[slot] is not None:
                slot += 1
            sampled = sampled_token_ids[i]
            head, tail = heads[i].tolist(), tails[i].tolist()
            t = next((c for c in free if c.last_seen < call and self._holds(c, prev[i], head, tail)), None)
            if t is not None:
                t.toks.extend(sampled)
                decodes[slot] = Row(i, t, len(sampled), continued=True)
            else:
                t = self._new(token_ids_cpu[i, :lens[i]].tolist())
                decodes[slot] = Row(i, t, len(sampled), continued=False)
            t.last_seen = call
            rows_now[i] = t

    def _new(self, toks: list[int]) -> TrackedRequest:
        t = TrackedRequest(self._next_id, toks, toks[:HEAD_TOKENS], first_len=len(toks), last_seen=self._call)
        self._next_id += 1
        self._requests.append(t)
        return t
