"""Suffix proposer: a speculation tree from what followed the current suffix before (SuffixDecoding).

Two sources of evidence, both behaving like a suffix trie of bounded depth with counts:

* per request: the request's own prompt and output (everything before the current end);
* global: the outputs of the most recent finished requests (fed by :meth:`on_finished`), bounded
  by ``max_cached_requests`` and ``max_cached_tokens``; the oldest are evicted first.

Representation (an implicit suffix trie). A materialized trie of depth D holds up to D nodes per
token, which in Python is several kB per token. Instead each source keeps, for a small set of
context lengths ``m`` (1, 2, 3, 4, 6, 8, 12, 16, 24 for D = 24), a dict from the polynomial hash
of every m-gram to the end positions where it occurs. The trie node of a context ``c`` is the
set of positions where ``c`` ends; its count is the size of that set and its children are those
positions grouped by the token that follows. So the subtree below a matched context is
materialized lazily, only for the few nodes a proposal expands. Updates are incremental: each new
token adds one prefix hash and one index entry per context length (O(len(lengths)) work), the
per-request index only ever sees the tokens appended since the previous call.

Matching. For each source, binary search over the context lengths for the longest suffix of the
request that occurred before (existence is monotone in m). The source with the longer match wins
(a longer context is more specific evidence); when both match equally long, their occurrences are
pooled, so the counts add up. At most ``max_occurrences`` most recent occurrences per source are
used (recent text is the better predictor, and it bounds the work per step).

Tree. Best-first expansion from the matched context: a candidate's score is the product of the
conditional frequencies along its path (count(child) / occurrences of the parent that continue),
i.e. the estimated probability that the whole branch is accepted. The best candidate is added
and its children become candidates, until ``min(k, max_tree_nodes)`` drafts are placed or no
candidate reaches ``min_prob`` (or ``min_count`` occurrences). Ties prefer the most recent
occurrence, then per-request evidence. ``token_ids`` is the greedy most-frequent chain (up to
``min(k, max_depth)`` tokens, same thresholds); its prefix is the tree's best branch.

``natural_k`` follows SuffixDecoding: ``ceil(spec_factor * match_length)``, capped by
``max_tree_nodes`` and by the longest continuation any occurrence has.

Asked before k is decided (``proposes_prefixes``): the engine proposes each request's cap, shows
the decider the tree's size and the match length, and keeps the first k nodes. That costs every
step what the old ask-after-deciding path cost only on drafting steps, about 1% of a large
step, and paid for itself at B=1 while costing little at B=32 (an A/B against the old path,
since retired: reports/README.md#engine-measurements).
"""

from __future__ import annotations

import heapq
import math
import time
from collections import deque

from ..sequence import Sequence
from ..drafts import DraftTokens, DraftTree
from .ngram import TokenMirror

_MOD = (1 << 61) - 1  # Mersenne prime modulus for the polynomial hash
_BASE = 0x1F3D5B79A2C4E6 % _MOD  # fixed odd base: hashes are comparable across sources and runs
_SEG_SHIFT = 32  # global occurrence code = segment_id << 32 | end position

# An occurrence is (token list, position of the next token); lists of them are newest first.
_Occ = tuple[list[int], int]


def context_lengths(max_depth: int) -> list[int]:
    """1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, ... up to and including max_depth."""
    out = {m for m in (1, 2, 3) if m <= max_depth}
    p = 4
    while p <= max_depth:
        out.add(p)
        if p * 3 // 2 <= max_depth:
            out.add(p * 3 // 2)
        p *= 2
    out.add(max_depth)
    return sorted(out)


def _prefix_hashes(toks: list[int], h: list[int] | None = None) -> list[int]:
    """Extend h (prefix hashes, h[i] = hash of toks[:i]) to cover all of toks."""
    if h is None:
        h = [0]
    cur = h[-1]
    for t in toks[len(h) - 1:]:
        cur = (cur * _BASE + t + 1) % _MOD
        h.append(cur)
    return h


def _add(d: dict, key: int, code: int) -> None:
    v = d.get(key)
    if v is None:
        d[key] = code
    elif type(v) is int:
        d[key] = [v, code]
    else:
        v.append(code)


def _recent(v, limit: int) -> list[int]:
    """The most recent `limit` codes of an index value, newest first."""
    if type(v) is int:
        return [v]
    return v[:-limit - 1:-1] if len(v) > limit else v[::-1]


class _ReqState:
    __slots__ = ("mirror", "hashes", "index", "indexed_end")

    def __init__(self, num_lengths: int) -> None:
        self.mirror = TokenMirror()
        self.hashes: list[int] = [0]
        self.index: list[dict] = [{} for _ in range(num_lengths)]  # per length: hash -> end(s)
        self.indexed_end = 0  # m-grams ending at 1..indexed_end are indexed (never the current end)


class _GlobalStore:
    """Outputs of recent finished requests, indexed like a request; oldest evicted first."""

    def __init__(self, lengths: list[int], powers: list[int]) -> None:
        self.lengths = lengths
        self.powers = powers
        self.index: list[dict] = [{} for _ in lengths]
        self.segments: dict[int, list[int]] = {}
        self.order: deque[int] = deque()
        self.num_tokens = 0
        self._next_id = 0

    def _entries(self, toks: list[int]):
        """(length slot, hash, end) for every m-gram with at least one token after it."""
        h = _prefix_hashes(toks)
        lengths, powers = self.lengths, self.powers
        for e in range(1, len(toks)):
            he = h[e]
            for j, m in enumerate(lengths):
                if m > e:
                    break
                yield j, (he - h[e - m] * powers[j]) % _MOD, e

    def add(self, toks: list[int]) -> None:
        sid = self._next_id
        self._next_id += 1
        toks = list(toks)
        self.segments[sid] = toks
        self.order.append(sid)
        self.num_tokens += len(toks)
        base = sid << _SEG_SHIFT
        index = self.index
        for j, key, e in self._entries(toks):
            _add(index[j], key, base | e)

    def evict_oldest(self) -> None:
        sid = self.order.popleft()
        toks = self.segments.pop(sid)
        self.num_tokens -= len(toks)
        index = self.index
        for j, key, _e in self._entries(toks):
            d = index[j]
            v = d.get(key)
            if v is None:
                continue
            if type(v) is int:
                if v >> _SEG_SHIFT == sid:
                    del d[key]
                continue
            # Codes are ascending and this is the oldest segment: its codes lead the list.
            i = 0
            while i < len(v) and v[i] >> _SEG_SHIFT == sid:
                i += 1
            if i:
                del v[:i]
                if not v:
                    del d[key]
                elif len(v) == 1:
                    d[key] = v[0]

    def num_entries(self) -> int:
        return sum(len(d) for d in self.index)


class SuffixProposer:
    """SuffixDecoding-style proposer: speculation trees from the request's and recent outputs."""

    name = "suffix"
    # The tree of budget k is the first k nodes of any larger budget's tree (best-first placement
    # does not depend on the budget), and the chain of k tokens the prefix of a longer chain: the
    # engine can propose for each request's cap before k is decided, and the decider sees each
    # request's match length and how many drafts it has (as for n-gram).
    proposes_prefixes = True

    def __init__(self, max_depth: int = 24, max_tree_nodes: int = 16, max_cached_requests: int = 256,
                 max_cached_tokens: int = 131_072, max_occurrences: int = 32, min_prob: float = 0.1,
                 min_count: int = 1, spec_factor: float = 1.0, use_global: bool = True):
        if max_depth < 1:
            raise ValueError(f"max_depth must be >= 1, got {max_depth}")
        if max_tree_nodes < 1:
            raise ValueError(f"max_tree_nodes must be >= 1, got {max_tree_nodes}")
        if max_cached_requests < 0 or max_cached_tokens < 0:
            raise ValueError("max_cached_requests and max_cached_tokens must be >= 0")
        if max_occurrences < 1:
            raise ValueError(f"max_occurrences must be >= 1, got {max_occurrences}")
        if not 0.0 <= min_prob <= 1.0:
            raise ValueError(f"min_prob must be in [0, 1], got {min_prob}")
        self.max_depth = max_depth
        self.max_tree_nodes = max_tree_nodes
        self.max_cached_requests = max_cached_requests
        self.max_cached_tokens = max_cached_tokens
        self.max_occurrences = max_occurrences
        self.min_prob = min_prob
        self.min_count = max(1, min_count)
        self.spec_factor = spec_factor
        self.use_global = use_global
        self.lengths = context_lengths(max_depth)
        self.powers = [pow(_BASE, m, _MOD) for m in self.lengths]
        self._requests: dict[int, _ReqState] = {}
        self._global = _GlobalStore(self.lengths, self.powers)

    # ------------------------------------------------------------ per request

    def _state(self, seq: Sequence) -> _ReqState:
        st = self._requests.get(seq.seq_id)
        if st is None:
            st = self._requests[seq.seq_id] = _ReqState(len(self.lengths))
        if st.mirror.sync(seq) < 0:  # tokens were replaced: start over
            st = self._requests[seq.seq_id] = _ReqState(len(self.lengths))
            st.mirror.sync(seq)
        toks = st.mirror.toks
        h = _prefix_hashes(toks, st.hashes)
        index, lengths, powers = st.index, self.lengths, self.powers
        for e in range(st.indexed_end + 1, len(toks)):  # every end but the current one
            he = h[e]
            for j, m in enumerate(lengths):
                if m > e:
                    break
                _add(index[j], (he - h[e - m] * powers[j]) % _MOD, e)
        st.indexed_end = max(st.indexed_end, len(toks) - 1)
        return st

    def _suffix_hashes(self, st: _ReqState) -> list[int]:
        h, L = st.hashes, len(st.hashes) - 1
        return [(h[L] - h[L - m] * p) % _MOD for m, p in zip(self.lengths, self.powers) if m <= L]

    @staticmethod
    def _longest(index: list[dict], keys: list[int]):
        """(slot, value) of the longest context length whose suffix hash is in index, or (-1, None)."""
        lo, hi, best, val = 0, len(keys) - 1, -1, None
        while lo <= hi:
            mid = (lo + hi) // 2
            v = index[mid].get(keys[mid])
            if v is None:
                hi = mid - 1
            else:
                best, val, lo = mid, v, mid + 1
        return best, val

    def _match(self, seq: Sequence) -> tuple[int, list[_Occ], str]:
        """(match length, occurrences newest first, source) for the current suffix of seq."""
        st = self._state(seq)
        keys = self._suffix_hashes(st)
        r_slot, r_val = self._longest(st.index, keys)
        g_slot, g_val = (self._longest(self._global.index, keys) if self.use_global and self._global.order
                         else (-1, None))
        slot = max(r_slot, g_slot)
        if slot < 0:
            return 0, [], "none"
        occ: list[_Occ] = []
        limit = self.max_occurrences
        if r_slot == slot:
            toks = st.mirror.toks
            occ.extend((toks, e) for e in _recent(r_val, limit))
        if g_slot == slot:
            segs = self._global.segments
            mask = (1 << _SEG_SHIFT) - 1
            occ.extend((segs[c >> _SEG_SHIFT], c & mask) for c in _recent(g_val, limit))
        source = "both" if r_slot == g_slot else ("request" if r_slot == slot else "global")
        return self.lengths[slot], occ, source

    def match(self, seq: Sequence) -> tuple[int, int, str]:
        """(match length, number of occurrences used, source) — for tests and diagnostics."""
        m, occ, source = self._match(seq)
        return m, len(occ), source

    # ------------------------------------------------------------------ tree

    @staticmethod
    def _group(occ: list[_Occ]) -> dict[int, list[_Occ]]:
        """Next token -> the occurrences continuing with it (newest first; dict order = recency)."""
        g: dict[int, list[_Occ]] = {}
        for lst, p in occ:
            if p < len(lst):
                t = lst[p]
                b = g.get(t)
                if b is None:
                    g[t] = [(lst, p + 1)]
                else:
                    b.append((lst, p + 1))
        return g

    def _build(self, root_token: int, occ: list[_Occ], budget: int, chain_budget: int
               ) -> tuple[DraftTree | None, list[int]]:
        min_prob, min_count, max_depth = self.min_prob, self.min_count, self.max_depth
        if len(occ) == 1 and min_count <= 1:  # a single occurrence: the tree is its continuation
            lst, p = occ[0]
            cont = lst[p:p + min(budget, max_depth)]
            n = len(cont)
            tree = (DraftTree((root_token, *cont), tuple(range(-1, n)), (1,) * (n + 1)) if n else None)
            return tree, lst[p:p + chain_budget]
        group = self._group
        tokens, parents, counts = [root_token], [-1], [len(occ)]
        node_occ: list[list[_Occ]] = [occ]  # per node, the occurrences that reach it
        node_score = [1.0]
        first_child: dict[int, int] = {}  # node -> its first placed child (its most frequent)
        # Heap entries (-score, tie, parent, token, occurrences, depth). token == -1 marks a
        # pending expansion of node `parent`: its children score at most its own score, so
        # expanding it only when it reaches the top keeps the order exactly best-first while
        # never grouping the occurrences of nodes whose children would not be used.
        heap: list = [(-1.0, 0, 0, -1, occ, 0)]
        tie = 1
        heappush, heappop = heapq.heappush, heapq.heappop
        while heap and len(tokens) - 1 < budget:
            neg, _, par, t, b, depth = heappop(heap)
            if t >= 0:  # place a draft node, then queue its expansion
                idx = len(tokens)
                tokens.append(t)
                parents.append(par)
                counts.append(len(b))
                node_occ.append(b)
                node_score.append(-neg)
                if par not in first_child:
                    first_child[par] = idx
                if depth < max_depth:
                    heappush(heap, (neg, tie, idx, -1, b, depth))
                    tie += 1
                continue
            if len(b) == 1 and min_count <= 1:  # one occurrence: one child, same score, no grouping
                lst, p = b[0]
                if p < len(lst):
                    heappush(heap, (neg, tie, par, lst[p], [(lst, p + 1)], depth + 1))
                    tie += 1
                continue
            g = group(b)
            total = 0
            for c in g.values():
                total += len(c)
            score = -neg
            for ct, c in g.items():
                n = len(c)
                s = score * n / total
                if n >= min_count and s >= min_prob:
                    heappush(heap, (-s, tie, par, ct, c, depth + 1))
                    tie += 1

        # The greedy most-frequent chain. Inside the tree it is the path of first children (a
        # node's first placed child is its best-scoring one, ties to the newest occurrence, as
        # below); past the tree's leaf it continues by grouping that leaf's occurrences.
        chain: list[int] = []
        node = 0
        while len(chain) < chain_budget and node in first_child:
            node = first_child[node]
            chain.append(tokens[node])
        cur, score = node_occ[node], node_score[node]
        while len(chain) < chain_budget:
            g = group(cur)
            if not g:
                break
            total = 0
            best_t, best_b = -1, None
            for t, b in g.items():
                total += len(b)
                if best_b is None or len(b) > len(best_b):
                    best_t, best_b = t, b
            score *= len(best_b) / total
            if len(best_b) < min_count or score < min_prob:
                break
            chain.append(best_t)
            cur = best_b

        tree = DraftTree(tuple(tokens), tuple(parents), tuple(counts)) if len(tokens) > 1 else None
        return tree, chain

    # --------------------------------------------------------------- protocol

    def propose(self, seqs: list[Sequence], k: list[int]) -> DraftTokens:
        t0 = time.perf_counter()
        if len(k) != len(seqs):
            raise ValueError(f"got {len(seqs)} sequences but {len(k)} k values")
        token_ids: list[list[int]] = []
        trees: list[DraftTree | None] = []
        natural: list[int] = []
        matched: list[int] = []
        for seq, ki in zip(seqs, k):
            m, occ = (self._match(seq)[:2] if ki > 0 and seq.token_ids else (0, []))
            matched.append(m)
            if m == 0:
                token_ids.append([])
                trees.append(None)
                natural.append(0)
                continue
            root = seq.token_ids[-1]
            tree, chain = self._build(root, occ, min(ki, self.max_tree_nodes), min(ki, self.max_depth))
            token_ids.append(chain)
            trees.append(tree)
            available = max(len(lst) - p for lst, p in occ)
            natural.append(max(1, min(math.ceil(self.spec_factor * m), self.max_tree_nodes, available)))
        return DraftTokens(token_ids=token_ids, trees=trees, natural_k=natural, match_length=matched,
                           seconds=time.perf_counter() - t0)

    def on_finished(self, seq: Sequence) -> None:
        self._requests.pop(seq.seq_id, None)
        if not self.use_global or self.max_cached_requests == 0:
            return
        out = seq.output_token_ids
        if len(out) < 2 or len(out) > self.max_cached_tokens:
            return
        g = self._global
        g.add(out)
        while g.order and (len(g.order) > self.max_cached_requests or g.num_tokens > self.max_cached_tokens):
            g.evict_oldest()

    # ------------------------------------------------------------ diagnostics

    def num_tracked(self) -> int:
        return len(self._requests)

    def num_cached_requests(self) -> int:
        return len(self._global.order)

    def num_cached_tokens(self) -> int:
        return self._global.num_tokens

    def num_index_entries(self) -> int:
        """Entries in the global index (for memory checks: 0 once everything is evicted)."""
        return self._global.num_entries()
