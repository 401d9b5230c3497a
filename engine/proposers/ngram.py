"""Prompt lookup decoding: copy what followed the most recent earlier occurrence of the current suffix.

For a sequence with tokens ``t[0:L]`` (prompt + output) the proposer looks for the longest n in
``max_n .. min_n`` such that the n-gram ``t[L-n:L]`` also ends at some earlier position ``e < L``;
among those it takes the most recent ``e`` and proposes ``t[e:e+k]`` (shorter when the sequence
ends first). The continuation may run into the current suffix itself; that is fine.

It also reports the match length: n, followed further back while the tokens before ``e`` agree
with those before ``L - n`` (up to ``max_match_length``). Only an n = max_n match can extend. The
planner prices drafts by it: a long match is a passage being copied.

Cost: each sequence keeps an incremental index ``n-gram -> most recent end position`` that is
updated only with the tokens appended since the previous call (``max_n - min_n + 1`` dict writes
per new token), so one lookup is at most ``max_n - min_n + 1`` dict reads whatever the context
length, plus at most ``max_match_length`` comparisons for the match length. The index is keyed by
``seq_id`` and dropped in :meth:`NgramProposer.on_finished`.
"""

from __future__ import annotations

import time

from ..sequence import Sequence
from ..drafts import DraftTokens

# How many trailing tokens of the already-indexed prefix are re-checked on each call when the
# token list is the same object as last time (a cheap guard against in-place rewrites). A new
# list object is compared in full.
_TAIL_CHECK = 8
# From this many new positions on, ``NgramIndex.update`` indexes them a whole n at a time (a
# 400-token prompt in a third of the time); below it, a position at a time (a decode step's few).
_BULK = 8


class TokenMirror:
    """A private copy of a sequence's tokens that follows appends incrementally.

    ``sync(seq)`` returns the index of the first token not seen before, or -1 when the sequence's
    tokens no longer extend the copy (shrunk or rewritten): the caller must then rebuild.
    """

    __slots__ = ("ref", "toks")

    def __init__(self) -> None:
        self.ref: list[int] | None = None
        self.toks: list[int] = []

    def sync(self, seq: Sequence) -> int:
        cur = seq.token_ids
        toks = self.toks
        n = len(toks)
        if len(cur) < n:
            return -1
        if cur is self.ref:
            lo = max(0, n - _TAIL_CHECK)
            if cur[lo:n] != toks[lo:n]:
                return -1
        elif cur[:n] != toks:
            return -1
        self.ref = cur
        if len(cur) > n:
            toks.extend(cur[n:])
        return n


class NgramIndex:
    """The lookup over one growing token list: the one implementation of prompt lookup, used by
    ``NgramProposer`` here and by the vLLM plugin (specplan/integrations/vllm.py) over vLLM's
    token rows. It reads nothing but its token list (no engine type, no tensor).

    ``toks`` is held by reference: its owner appends to it and calls :meth:`update` before a
    lookup (a list that was rewritten needs a new index).
    """

    __slots__ = ("toks", "min_n", "max_n", "max_match_length", "_index", "_indexed_end")

    def __init__(self, toks: list[int], min_n: int = 1, max_n: int = 4, max_match_length: int = 16):
        if min_n < 1 or max_n < min_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
        if max_match_length < max_n:
            raise ValueError(f"max_match_length must be >= max_n ({max_n}), got {max_match_length}")
        self.toks = toks
        self.min_n = min_n
        self.max_n = max_n
        self.max_match_length = max_match_length
        # (token, ..., token) -> the most recent end position e (exclusive) with t[e-n:e] == key,
        # for every e <= _indexed_end. The current end L is never indexed, so a hit is "earlier".
        self._index: dict[tuple[int, ...], int] = {}
        self._indexed_end = 0

    def update(self) -> None:
        """Index the n-grams ending at positions _indexed_end+1 .. len(toks)-1 (those appended since)."""
        toks, index = self.toks, self._index
        first, last_end = self._indexed_end + 1, len(toks) - 1
        if last_end - first >= _BULK:
            self._update_bulk(first, last_end)
        else:  # a decode step's few tokens
            lo_n, hi_n = self.min_n, self.max_n
            for e in range(first, last_end + 1):
                top = min(hi_n, e)
                longest = tuple(toks[e - top:e])  # the shorter n-grams ending at e are its tails
                for n in range(lo_n, top + 1):
                    index[longest[top - n:]] = e
        if last_end > self._indexed_end:
            self._indexed_end = last_end

    def _update_bulk(self, first: int, last_end: int) -> None:
        """``update`` for many new positions (a prompt): each n's keys built by zipping n shifted
        slices, so the loop runs in C; later positions overwrite earlier ones as in ``update``.
        Worked example, n = 2, toks = [5, 6, 7, 8], positions e = 2..3: the slices [5, 6] and
        [6, 7] zip to the keys (5, 6) -> 2 and (6, 7) -> 3."""
        toks, index = self.toks, self._index
        for n in range(self.min_n, self.max_n + 1):
            start = max(first, n)  # the first end position with n tokens before it
            if start <= last_end:
                shifted = [toks[start - n + i:last_end - n + i + 1] for i in range(n)]
                index.update(zip(zip(*shifted), range(start, last_end + 1)))

    def match(self) -> tuple[int, int]:
        """(n, e): the longest matched n-gram length and the end of its most recent earlier
        occurrence, or (0, -1) when nothing matches. Call :meth:`update` first."""
        toks, index = self.toks, self._index
        L = len(toks)
        top = min(self.max_n, L - 1)
        suffix = tuple(toks[L - top:]) if top > 0 else ()  # the shorter suffixes are its tails
        for n in range(top, self.min_n - 1, -1):
            e = index.get(suffix[top - n:])
            if e is not None:
                return n, e
        return 0, -1

    def lookup(self, k: int) -> tuple[list[int], int, int]:
        """(drafts, available, match_length): up to k drafts, how many tokens follow the match in
        all (>= 1 on a match), and the match length; ([], 0, 0) when nothing matches."""
        self.update()
        n, e = self.match()
        if n == 0:
            return [], 0, 0
        toks = self.toks
        return toks[e:e + k], len(toks) - e, self.match_length(n, e)

    def match_length(self, n: int, e: int) -> int:
        """The matched n-gram followed further back: how many trailing tokens agree with the ones
        before ``e`` (up to ``max_match_length``). The drafts come from the n-gram alone; the length
        tells the planner how much to trust them: after 16 matching tokens a passage is being
        copied, after 4 it may be a common phrase.
        Worked example: toks = [1, 2, 3, 4, 9, 2, 3, 4], n = 3 (2 3 4), e = 4; before it,
        toks[0] = 1 against toks[4] = 9: no further agreement, so 3."""
        toks = self.toks
        last = len(toks) - 1
        m = n
        limit = min(self.max_match_length, e)  # toks[e - m - 1] must exist
        while m < limit and toks[e - m - 1] == toks[last - m]:
            m += 1
        return m


def scan_rows(token_ids, lens, rows, caps, min_n, max_n, max_match_length, drafts, found) -> None:
    """``NgramIndex.lookup`` for many rows of a token array at once, by scanning instead of
    indexing: the same drafts, available tokens and match length, for a compiler (the vLLM plugin
    compiles it with numba, which vLLM ships, and runs it over vLLM's own token rows: no index to
    build over a new prompt and no Python per row; specplan/integrations/vllm_lookup.py). Plain
    Python over arrays, so it also runs (slowly) uncompiled, as the tests run it.

    token_ids [R, max_len] and lens [R]: row r holds token_ids[r, :lens[r]]; rows [B] and caps [B]:
    the row and the most drafts for each of B requests. Writes drafts [B, >= max(caps)] (the first
    found[i, 0] entries of row i) and found [B, 3]: (drafts written, available, match length),
    zeros where nothing matches or caps[i] <= 0.

    The scan: walking the end positions e = L-1, L-2, ..., 1 of a row of length L, the tokens
    before e agree with the row's last tokens over some length j (capped at n_top = min(max_n,
    L - 1)). The longest n-gram that matches is the largest j seen, and its most recent
    occurrence the first e where it was seen; a j of n_top ends the walk. Worked example:
    t = [7, 8, 9, 7, 8], L = 5, max_n 4 (n_top 4): e = 4 (t[3] = 7 against 8: no), e = 3
    (t[2] = 9: no), e = 2 (t[1] = 8 = t[4], t[0] = 7 = t[3], then e runs out: j = 2): n = 2, e = 2,
    drafts t[2:] = [9, 7, 8], available 3."""
    for i in range(rows.shape[0]):
        found[i, 0] = 0
        found[i, 1] = 0
        found[i, 2] = 0
        k = caps[i]
        if k <= 0:
            continue
        row = rows[i]
        length = lens[row]
        top = min(max_n, length - 1)
        if top < min_n:
            continue
        last = token_ids[row, length - 1]
        best_n, best_e = 0, -1
        e = length - 1
        while e >= 1:
            if token_ids[row, e - 1] == last:
                j = 1
                while j < top and j < e and token_ids[row, e - 1 - j] == token_ids[row, length - 1 - j]:
                    j += 1
                if j > best_n:
                    best_n, best_e = j, e
                    if j == top:
                        break
            e -= 1
        if best_n < min_n:
            continue
        available = length - best_e
        n = min(k, available)
        for x in range(n):
            drafts[i, x] = token_ids[row, best_e + x]
        m = best_n  # as NgramIndex.match_length
        limit = min(max_match_length, best_e)
        while m < limit and token_ids[row, best_e - m - 1] == token_ids[row, length - 1 - m]:
            m += 1
        found[i, 0] = n
        found[i, 1] = available
        found[i, 2] = m


class _NgramState:
    __slots__ = ("mirror", "index")

    def __init__(self, proposer: "NgramProposer") -> None:
        self.mirror = TokenMirror()
        self.index = NgramIndex(self.mirror.toks, proposer.min_n, proposer.max_n, proposer.max_match_length)


class NgramProposer:
    """Prompt lookup decoding (n-gram matching over the request's own prompt and output)."""

    name = "ngram"
    proposes_prefixes = True  # t[e:e+k] is a prefix of t[e:e+k'] for k <= k'; a lookup is ~free

    def __init__(self, min_n: int = 1, max_n: int = 4, max_natural_k: int = 8, max_match_length: int = 16):
        NgramIndex([], min_n, max_n, max_match_length)  # checks the parameters once, here
        if max_natural_k < 1:
            raise ValueError(f"max_natural_k must be >= 1, got {max_natural_k}")
        self.min_n = min_n
        self.max_n = max_n
        self.max_natural_k = max_natural_k
        self.max_match_length = max_match_length
        self._states: dict[int, _NgramState] = {}

    # ------------------------------------------------------------------ state

    def _state(self, seq: Sequence) -> _NgramState:
        st = self._states.get(seq.seq_id)
        if st is None:
            st = self._states[seq.seq_id] = _NgramState(self)
        if st.mirror.sync(seq) < 0:  # tokens were replaced: start over
            st = self._states[seq.seq_id] = _NgramState(self)
            st.mirror.sync(seq)
        st.index.update()
        return st

    # --------------------------------------------------------------- protocol

    def match(self, seq: Sequence) -> tuple[int, int]:
        """(n, e): the longest matched n-gram length and the end of its most recent earlier
        occurrence, or (0, -1) when nothing matches."""
        return self._state(seq).index.match()

    def propose(self, seqs: list[Sequence], k: list[int]) -> DraftTokens:
        t0 = time.perf_counter()
        if len(k) != len(seqs):
            raise ValueError(f"got {len(seqs)} sequences but {len(k)} k values")
        out: list[list[int]] = []
        natural: list[int] = []
        matched: list[int] = []
        for seq, ki in zip(seqs, k):
            drafts, available, match_length = self._state(seq).index.lookup(ki) if ki > 0 else ([], 0, 0)
            out.append(drafts)
            natural.append(min(available, self.max_natural_k))
            matched.append(match_length)
        return DraftTokens(token_ids=out, natural_k=natural, match_length=matched, seconds=time.perf_counter() - t0)

    def on_finished(self, seq: Sequence) -> None:
        self._states.pop(seq.seq_id, None)

    def num_tracked(self) -> int:
        """How many sequences currently hold an index (for tests and memory checks)."""
        return len(self._states)
