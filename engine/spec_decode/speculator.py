"""Planning the speculation of one engine step: ask the decider for k, reserve lookahead slots,
propose. (A lookup proposer whose shorter answers are prefixes of its longer ones proposes first,
so the decider sees what exists.) Verification is verifier.py.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from ..block_manager import BlockManager
from ..decider import RequestView, SpecDecider, StepOutline, StepView, draft_stop, may_speculate
from ..model_runner import ScheduledSeq
from ..drafts import DraftTokens
from ..proposers.base import LooksUpFirst, Proposer, ReadsTargetFeatures, StopsEarly


@dataclass
class Proposal:
    """The drafts planned for this step, aligned with the decode-ready work items."""

    k: list[int]  # drafts asked of the proposer (after caps and KV reservation)
    drafts: DraftTokens | None
    decide_s: float = 0.0
    stopped: bool = False  # the decider's DraftStop was handed to the proposer (drafts may be < k)


class Speculator:
    def __init__(self, proposer: Proposer, decider: SpecDecider, max_k: int, block_manager: BlockManager):
        self.proposer = proposer
        self.decider = decider
        self.max_k = max_k
        self.block_manager = block_manager

    @property
    def proposer(self) -> Proposer:
        return self._proposer

    @proposer.setter
    def proposer(self, proposer: Proposer) -> None:
        # What the proposer can do, read once: an isinstance against a runtime-checkable protocol
        # walks the protocol's attributes, ~30 us each, and the step asked three of them.
        self._proposer = proposer
        self._looks_up_first = isinstance(proposer, LooksUpFirst)
        self._stops_early = isinstance(proposer, StopsEarly)
        self.feature_reader = proposer if isinstance(proposer, ReadsTargetFeatures) else None

    def plan(self, ready: list[ScheduledSeq], view_extra: dict, budget: int, max_model_len: int) -> Proposal:
        """Decide k per decode-ready sequence, reserve lookahead slots, propose drafts.

        A proposer whose shorter answers are prefixes of its longer ones (n-gram and suffix lookup)
        is asked first, for each sequence's cap: the decider then sees how many drafts each request
        really has, and k never exceeds it."""
        seqs = [w.seq for w in ready]
        caps = []
        for s in seqs:
            remaining = min(s.params.max_tokens - s.num_output_tokens, max_model_len - s.num_tokens)
            caps.append(max(0, min(self.max_k, remaining - 1)))  # k drafts emit at most k + 1 tokens
        forced = any(s.params.num_speculative_tokens for s in seqs)
        if any(caps) and not forced:
            outline = StepOutline(len(seqs), sum(s.num_tokens for s in seqs), view_extra["num_prefill_tokens"],
                                  view_extra["num_prefill_seqs"], view_extra["context_tokens"], max(caps), budget)
            t0 = time.perf_counter()
            if not may_speculate(self.decider, outline):  # no lookup, no decision: every k is 0
                return Proposal([0] * len(seqs), None, decide_s=time.perf_counter() - t0)
        up_front = self.proposer.proposes_prefixes
        ahead = self.proposer.propose(seqs, caps) if up_front and any(caps) else None
        if ahead is not None:
            caps = [min(cap, ahead.num_drafts(i)) for i, cap in enumerate(caps)]
        # Drafts known to exist before k is chosen (None: unknown until then).
        available: list[int | None] = list(caps) if up_front else [None] * len(seqs)
        matched = ahead
        if ahead is None and self._looks_up_first and any(caps):
            # A chain: the requests its lookup serves are capped at what the lookup found; the
            # decider sees every request's match length, so it can price the two sources apart.
            matched = self.proposer.lookup_ahead(seqs, caps)
            for i, drafts in enumerate(matched.token_ids):
                if drafts:
                    caps[i] = available[i] = min(caps[i], len(drafts))
        view = StepView(
            requests=tuple(RequestView(s.seq_id, s.request_id, s.num_tokens, s.num_output_tokens, cap,
                                       s.params.greedy, available[i],
                                       matched.match_length[i] if matched is not None and matched.match_length else None)
                           for i, (s, cap) in enumerate(zip(seqs, caps))),
            proposer=self.proposer.name, draft_budget=budget, **view_extra)
        t0 = time.perf_counter()
        asked = self.decider.decide(view)
        decide_s = time.perf_counter() - t0
        k = []
        for s, cap, want in zip(seqs, caps, asked):
            forced = s.params.num_speculative_tokens
            want = min(cap, forced if forced is not None else int(want))
            want = max(0, min(want, budget))
            # Lookahead slots are reserved before the forward; if blocks run short, speculate less.
            while want > 0 and not self.block_manager.ensure_capacity(s, s.num_computed_tokens + 1 + want):
                want -= 1
            budget -= want
            k.append(want)
        stop = draft_stop(self.decider) if self._stops_early else None
        if not any(k):
            drafts = None
        elif ahead is not None:
            drafts = ahead.truncated(k)
        elif stop is not None:
            drafts = self.proposer.propose(seqs, k, stop)
        else:
            drafts = self.proposer.propose(seqs, k)
        return Proposal(k, drafts, decide_s, stopped=stop is not None)

    @staticmethod
    def draft_items(ready: list[ScheduledSeq], proposal: Proposal) -> list[ScheduledSeq]:
        """The decode work items with their drafts appended (or the draft tree's nodes)."""
        if proposal.drafts is None:
            return ready
        d = proposal.drafts
        items = []
        for i, w in enumerate(ready):
            tree = d.trees[i] if d.trees is not None else None
            if tree is not None and tree.num_drafts > 0 and not tree.is_chain():
                items.append(ScheduledSeq(w.seq, list(tree.tokens), w.start_position, len(tree.tokens), tree=tree))
                continue
            toks = list(tree.tokens[1:]) if tree is not None else d.token_ids[i][:proposal.k[i]]
            q = d.draft_probs[i] if d.draft_probs is not None else None
            items.append(ScheduledSeq(w.seq, w.token_ids + toks, w.start_position, 1 + len(toks),
                                      draft_probs=q[:len(toks)] if q is not None else None))
        return items
