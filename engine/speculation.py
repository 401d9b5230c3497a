"""Speculation inside one engine step: ask the decider for k, reserve lookahead slots, propose,
then verify the target's logits for every sequence that samples this step. (A lookup proposer
whose shorter answers are prefixes of its longer ones proposes first, so the decider sees what
exists.)

Every sampling sequence goes through verification, with or without drafts: a request with no
drafts (k = 0) is verification with zero drafts, whose output is the bonus token (the argmax when
greedy, a sample when not). So plain decoding and speculative decoding share one code path.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from .block_manager import BlockManager
from .decider import RequestView, SpecDecider, StepView
from .model_runner import ScheduledSeq
from .proposers.base import DraftTokens, DraftTree, Proposer
from .sampling import greedy_tokens, probabilities
from .verify import accept_greedy, rejection_sample, verify_greedy, verify_tree


@dataclass
class Verdict:
    """What verification decided for one sequence."""

    tokens: list[int]  # accepted drafts, then the bonus or recovered token
    num_accepted: int
    path: list[int] | None = None  # tree: node indices of the accepted branch (root excluded)


@dataclass
class Proposal:
    """The drafts planned for this step, aligned with the decode-ready work items."""

    k: list[int]  # drafts asked of the proposer (after caps and KV reservation)
    drafts: DraftTokens | None
    decide_s: float = 0.0


class Speculator:
    def __init__(self, proposer: Proposer, decider: SpecDecider, max_k: int, block_manager: BlockManager):
        self.proposer = proposer
        self.decider = decider
        self.max_k = max_k
        self.block_manager = block_manager

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
        up_front = getattr(self.proposer, "proposes_prefixes", False)
        ahead = self.proposer.propose(seqs, caps) if up_front and any(caps) else None
        if ahead is not None:
            caps = [min(cap, ahead.num_drafts(i)) for i, cap in enumerate(caps)]
        view = StepView(
            requests=tuple(RequestView(s.seq_id, s.request_id, s.num_tokens, s.num_output_tokens, cap,
                                       s.params.greedy, cap if up_front else None,
                                       ahead.match_length[i] if ahead is not None and ahead.match_length else None)
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
        if not any(k):
            drafts = None
        elif ahead is not None:
            drafts = ahead.truncated(k)
        else:
            drafts = self.proposer.propose(seqs, k)
        return Proposal(k, drafts, decide_s)

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


def _linear_verifiers(device: torch.device):
    """The Triton kernels on CUDA (same signatures, same results), the torch reference elsewhere."""
    if device.type == "cuda":
        from .verify_triton import rejection_sample_triton, verify_greedy_triton

        return verify_greedy_triton, rejection_sample_triton
    return verify_greedy, rejection_sample


def verify(logits: torch.Tensor, items: list[ScheduledSeq], default_generator: torch.Generator) -> list[Verdict]:
    """logits [sum(num_logits), V] (item i's rows consecutive, in order) -> one Verdict per item."""
    device = logits.device
    greedy_verify, sampled_verify = _linear_verifiers(device)
    starts, row = [], 0
    for w in items:
        starts.append(row)
        row += w.num_logits
    verdicts: list[Verdict | None] = [None] * len(items)
    linear = [i for i, w in enumerate(items) if w.tree is None]
    trees = [i for i, w in enumerate(items) if w.tree is not None]

    def rows_of(idx: list[int]) -> torch.Tensor:
        return torch.tensor([r for i in idx for r in range(starts[i], starts[i] + items[i].num_logits)],
                            dtype=torch.int64, device=device)

    def target_probs(idx: list[int]) -> torch.Tensor:  # [rows, V], each request's own temperature/top-k/top-p
        per_row = [(items[i].seq.params,) * items[i].num_logits for i in idx]
        params = [p for ps in per_row for p in ps]
        return probabilities(logits[rows_of(idx)],
                             torch.tensor([p.temperature for p in params], device=device),
                             torch.tensor([p.top_k for p in params], device=device),
                             torch.tensor([p.top_p for p in params], device=device))

    def drafts_of(idx: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        toks = [t for i in idx for t in items[i].token_ids[len(items[i].token_ids) - items[i].num_drafts:]]
        cu = [0]
        for i in idx:
            cu.append(cu[-1] + items[i].num_drafts)
        return (torch.tensor(toks, dtype=torch.int64, device=device),  # [num_draft]
                torch.tensor(cu, dtype=torch.int32, device=device))  # [B+1]

    def randoms(idx: list[int], num_uniform: list[int], vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
        # Drawn on the CPU from each request's own generator: a seeded request is reproducible
        # whatever else shares its batch.
        uniform, expo = [], torch.empty(len(idx), vocab)
        for j, i in enumerate(idx):
            gen = items[i].seq.generator or default_generator
            expo[j].exponential_(generator=gen)
            uniform.append(torch.rand(num_uniform[j], generator=gen))
        return torch.cat(uniform).to(device), expo.to(device)  # [num_uniform], [B, V]

    vocab = logits.shape[-1]
    argmax_cache: list[torch.Tensor] = []

    def all_argmax() -> torch.Tensor:  # [sum(num_logits)] int64, computed once
        if not argmax_cache:
            argmax_cache.append(greedy_tokens(logits))
        return argmax_cache[0]

    def argmax_of(idx: list[int]) -> torch.Tensor:  # [rows] int64: the rows of these items
        return all_argmax()[rows_of(idx)]

    greedy = [i for i in linear if items[i].seq.params.greedy]
    sampled = [i for i in linear if not items[i].seq.params.greedy]
    if greedy and device.type == "cpu":  # the same rule on the host: no tensor ops for a few ints
        argmax = all_argmax().tolist()
        for i in greedy:
            w = items[i]
            toks = accept_greedy(w.token_ids[len(w.token_ids) - w.num_drafts:], argmax[starts[i]:starts[i] + w.num_logits])
            verdicts[i] = Verdict(toks, len(toks) - 1)
    elif greedy:
        draft_ids, cu = drafts_of(greedy)
        res = greedy_verify(draft_ids, cu, argmax_of(greedy))
        for i, toks in zip(greedy, res.token_lists()):
            verdicts[i] = Verdict(toks, len(toks) - 1)
    if sampled:
        draft_ids, cu = drafts_of(sampled)
        q = None
        if any(items[i].draft_probs is not None for i in sampled):
            # One-hot rows for drafts that came without a distribution (n-gram style).
            parts = [items[i].draft_probs if items[i].draft_probs is not None
                     else torch.nn.functional.one_hot(draft_ids[cu[j]:cu[j + 1]], vocab).float()
                     for j, i in enumerate(sampled)]
            q = torch.cat(parts).to(device)  # [num_draft, V]
        uniform, expo = randoms(sampled, [items[i].num_drafts for i in sampled], vocab)
        res = sampled_verify(draft_ids, cu, q, target_probs(sampled), uniform, expo)
        for i, toks in zip(sampled, res.token_lists()):
            verdicts[i] = Verdict(toks, len(toks) - 1)
    for i in trees:
        w = items[i]
        tree: DraftTree = w.tree
        greedy_tree = w.seq.params.greedy
        tokens = torch.tensor(tree.tokens, dtype=torch.int64, device=device)
        parents = torch.tensor(tree.parents, dtype=torch.int64, device=device)
        cu = torch.tensor([0, len(tree.tokens)], dtype=torch.int32, device=device)
        if greedy_tree:
            res = verify_tree(tokens, parents, cu, argmax_of([i]), greedy=True)
        else:
            uniform, expo = randoms([i], [len(tree.tokens)], vocab)
            res = verify_tree(tokens, parents, cu, target_probs([i]), greedy=False, uniform=uniform,
                              exponential=expo)
        emitted, path = res.token_lists()[0], res.accepted_nodes[0][1:]  # drop the root
        verdicts[i] = Verdict(emitted, len(path), path)
    return verdicts  # type: ignore[return-value]
