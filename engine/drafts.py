"""What a proposer answers: linear drafts per request, or a tree of candidates.

A linear proposal is a list of tokens. A tree proposal (several candidate continuations, from the
suffix proposer) is a list of nodes: node 0 is the request's last committed token (the root,
not a draft), node i > 0 holds a draft token and its parent's index (< i). A linear proposal of
n tokens is the chain ``parents = [-1, 0, 1, ..., n-1]``. The model runner builds tree attention
from a ``DraftTree``; verification walks it (spec_decode/).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DraftTree:
    tokens: tuple[int, ...]  # [num_nodes]; tokens[0] is the root (last committed token)
    parents: tuple[int, ...]  # [num_nodes]; parents[0] == -1, parents[i] < i
    counts: tuple[int, ...] = ()  # [num_nodes] how often each branch was seen (suffix proposer)

    @property
    def num_drafts(self) -> int:
        return len(self.tokens) - 1

    def depth(self) -> list[int]:
        d = [0] * len(self.tokens)
        for i in range(1, len(self.tokens)):
            d[i] = d[self.parents[i]] + 1
        return d

    def is_chain(self) -> bool:
        return all(p == i - 1 for i, p in enumerate(self.parents) if i > 0)

    def prefix(self, num_drafts: int) -> "DraftTree | None":
        """The root and the first ``num_drafts`` draft nodes (None for none): a valid tree, as every
        node's parent comes before it. A best-first tree built with a budget of n nodes is this
        prefix of the same tree built with a larger budget."""
        if num_drafts <= 0:
            return None
        n = min(num_drafts, self.num_drafts) + 1
        return DraftTree(self.tokens[:n], self.parents[:n], self.counts[:n])


@dataclass
class DraftTokens:
    """A proposer's answer for B requests (in the order asked)."""

    token_ids: list[list[int]]  # per request, the linear draft (len <= k_i; [] = no proposal)
    # Per request [len_i, V] draft distributions q, for a sampled model draft; None = one-hot drafts.
    draft_probs: list[torch.Tensor | None] | None = None
    # Per request, a tree of candidates instead of (or as well as) the linear draft; None = linear.
    trees: list[DraftTree | None] | None = None
    # Per request, the length the proposer itself would choose (e.g. from the match length).
    natural_k: list[int] | None = None
    # Per request, how many trailing tokens a lookup proposer matched to find its drafts (0: no
    # match); None for proposers without one. Longer matches are accepted far more often
    # (measured: reports/README.md#engine-measurements).
    match_length: list[int] | None = None
    # Per request, per draft token: the proposer's own probability of that token (a model draft:
    # the head's softmax for greedy requests, q(token) for sampled ones); None for proposers
    # without one (lookup drafts). A planner may stop drafting where it falls (issue #33).
    confidence: list[list[float]] | None = None
    seconds: float = 0.0  # wall time spent proposing
    # Forward passes of a draft model (or head) run for this proposal, the catch-up included; None
    # for lookups (no pass). Under a confidence stop the pass that finds a draft not worth it is
    # run and its draft dropped, so passes may exceed the deepest draft.
    passes: int | None = None

    def num_drafts(self, i: int) -> int:
        if self.trees is not None and self.trees[i] is not None:
            return self.trees[i].num_drafts
        return len(self.token_ids[i])

    def truncated(self, k: list[int]) -> "DraftTokens":
        """At most k[i] drafts for request i: what a proposer whose shorter answers are prefixes of
        its longer ones (``Proposer.proposes_prefixes``) would have answered when asked for k."""
        return DraftTokens(
            token_ids=[t[:ki] for t, ki in zip(self.token_ids, k, strict=True)],
            draft_probs=None if self.draft_probs is None else
            [None if q is None else q[:ki] for q, ki in zip(self.draft_probs, k, strict=True)],
            trees=None if self.trees is None else
            [None if t is None else t.prefix(ki) for t, ki in zip(self.trees, k, strict=True)],
            natural_k=self.natural_k, match_length=self.match_length,
            confidence=None if self.confidence is None else
            [c[:ki] for c, ki in zip(self.confidence, k, strict=True)], seconds=self.seconds, passes=self.passes)
