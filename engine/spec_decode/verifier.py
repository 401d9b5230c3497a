"""Verification of one step: the target's logits against each sequence's drafts -> a ``Verdict``.

Every sampling sequence goes through here, with or without drafts: a request with no drafts
(k = 0) is verification with zero drafts, whose output is the bonus token (the argmax when greedy,
a sample when not). So plain decoding and speculative decoding share one code path. The rules
themselves (greedy match, rejection sampling, trees) are pure tensor functions in
rejection_sampler.py; this module lays the step's rows out for them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..drafts import DraftTree
from ..model_runner import ScheduledSeq
from ..sampling import TokenLogprob, greedy_tokens, probabilities, token_logprobs
from .rejection_sampler import accept_greedy, rejection_sample, verify_greedy, verify_tree


@dataclass
class Verdict:
    """What verification decided for one sequence."""

    tokens: list[int]  # accepted drafts, then the bonus or recovered token
    num_accepted: int
    path: list[int] | None = None  # tree: node indices of the accepted branch (root excluded)
    logprobs: list[TokenLogprob] | None = None  # per token, when the request asked (params.logprobs)

    @property
    def rows(self) -> list[int]:
        """Per emitted token, the row of its item's logits it was judged against (the target's
        distribution at that token's position).

        Linear drafts: row j scores the token after query token j, so emitted token j is row j.
        Tree: row t scores the token after node t; an accepted node was judged at its parent's
        row, the final token at the last accepted node's row. Worked example: root r (node 0)
        with children x (1) and y (2), y with children z (3) and w (4). Accepting y then w gives
        path [2, 4] and emits [y, w, b]: y judged at row 0 (after r), w at row 2 (after y), b
        (bonus or recovered) at row 4 (after w); rows = [0] + path = [0, 2, 4]."""
        if self.path is None:
            return list(range(len(self.tokens)))
        return [0] + self.path



def _linear_verifiers(device: torch.device):
    """The Triton kernels on CUDA (same signatures, same results), the torch reference elsewhere."""
    if device.type == "cuda":
        from .rejection_sampler_triton import rejection_sample_triton, verify_greedy_triton

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
    _attach_logprobs(logits, items, starts, verdicts)  # type: ignore[arg-type]
    return verdicts  # type: ignore[return-value]


def _attach_logprobs(logits: torch.Tensor, items: list[ScheduledSeq], starts: list[int],
                     verdicts: list[Verdict]) -> None:
    """Score every emitted token of the items that asked for logprobs, in one batched pass over
    just their rows (nothing runs when no request asked)."""
    asking = [i for i, w in enumerate(items) if w.seq.params.logprobs is not None]
    if not asking:
        return
    rows = [starts[i] + r for i in asking for r in verdicts[i].rows]
    tokens = [t for i in asking for t in verdicts[i].tokens]
    num_top = [items[i].seq.params.logprobs for i in asking for _ in verdicts[i].tokens]
    index = torch.tensor(rows, dtype=torch.int64, device=logits.device)  # [rows]
    scored = iter(token_logprobs(logits[index], tokens, num_top))
    for i in asking:
        verdicts[i].logprobs = [next(scored) for _ in verdicts[i].tokens]
