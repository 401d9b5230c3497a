"""Lossless verification for speculative decoding: pure functions, random numbers are inputs.

Three verifiers share one output format (``VerifyResult``):

* ``verify_greedy``     – accept the longest prefix of drafts equal to the target argmax.
* ``rejection_sample``  – lossless speculative sampling (Leviathan et al. / Chen et al.): accept
  draft x with probability min(1, p(x)/q(x)); after the first rejection draw the recovered token
  from the residual max(p - q, 0); if every draft was accepted draw the bonus token from p.
* ``verify_tree``       – several one-hot candidates per position (a tree from the suffix
  proposer), greedy or SpecInfer-style multi-candidate sampling.

This module is the torch reference and runs on any device; ``rejection_sampler_triton`` holds
Triton kernels with the same signatures for CUDA. Importing this module never imports triton.
The terms (accepted, bonus, recovered tokens) are defined in this package's glossary (__init__.py).

Layout (flattened; request i has d_i >= 0 drafts, B requests, N = num_draft = sum d_i)
--------------------------------------------------------------------------------------
    draft_token_ids   [N]       int64   request i's drafts are rows cu_num_draft[i] : cu_num_draft[i+1]
    cu_num_draft      [B+1]     int32   cumulative, cu_num_draft[0] == 0
    target rows       [N+B, V]          request i owns d_i + 1 consecutive rows starting at
                                        cu_num_draft[i] + i; its row j < d_i is the target
                                        distribution at draft j's position, row d_i is the one
                                        after all its drafts (the bonus row)

    draft j (global index) of request i = req(j) sits at position pos(j) = j - cu_num_draft[i]
    and is checked against target row j + i; request i's bonus row is cu_num_draft[i+1] + i.

Worked example (B = 3, d = [2, 0, 3])
-------------------------------------
    cu_num_draft      = [0, 2, 2, 5]
    draft_token_ids   = [5, 7, | (none) | 2, 4, 9]          # N = 5
    req(j)            = [0, 0,            2, 2, 2]          # repeat_interleave(arange(B), d)
    pos(j)            = [0, 1,            0, 1, 2]          # j - cu_num_draft[req(j)]
    target row of j   = [0, 1,            4, 5, 6]          # j + req(j)
    bonus row of i    = [2, 3, 7]                           # cu_num_draft[i+1] + i
    target rows (N + B = 8):  0 1 2 | 3 | 4 5 6 7
                              r0----- r1  r2------

    Greedy with target_argmax = [5, 3, 8, | 6, | 2, 4, 1, 0]:
      request 0: 5 == argmax[0] accepted, 7 != argmax[1] = 3 rejected -> num_accepted 1, recovered 3
      request 1: no drafts                                              -> num_accepted 0, bonus 6
      request 2: 2 == 2, 4 == 4 accepted, 9 != argmax[6] = 1            -> num_accepted 2, recovered 1
    accepted(j)       = [T, F,            T, T, F]
    first rejection   : reject_pos(j) = pos(j) if rejected else d_req(j)   = [2, 1, 3, 3, 2]
                        num_accepted  = min over the request's drafts, d_i if none  = [1, 0, 2]
    final row         = cu_num_draft[i] + i + num_accepted[i]  = [1, 3, 6]   (== bonus row iff all
                        accepted; otherwise the row of the first rejected draft)
    output_token_ids  = [[5,  3, -1, -1],                   # [B, max_d + 1], -1 padded
                         [6, -1, -1, -1],
                         [2,  4,  1, -1]]
    Had request 2's last draft been 1, all three would be accepted and the bonus argmax[7] = 0
    appended: [2, 4, 1, 0].

Sampling and exact reproducibility
----------------------------------
All probability arithmetic is float32 (inputs are cast), and every step is a single IEEE
operation whose result does not depend on evaluation order, so the torch reference and the Triton
kernel produce bit-identical tokens from the same random inputs:

* acceptance of draft j (token x, request i):   ``uniform[j] * q(x) < p(x)``
  (one float32 multiply, one compare; equals u < min(1, p/q) up to rounding, without a division;
  one-hot drafts use q(x) = 1, i.e. ``uniform[j] < p(x)``). uniform is in [0, 1).
* recovered token after the first rejection:    ``argmax_v score(v)``, ``score = r / E_i``,
  r = max(p - q, 0) (one-hot drafts: r = p with the rejected draft token's entry set to 0),
  E_i = exponential[i] ~ Exp(1) (the exponential race: argmax r_v / E_v is distributed as
  r / sum(r), so r needs no normalization). Entries with r_v == 0 score 0 (never NaN, even if an
  E_v is 0). If r is all zero (p <= q everywhere, e.g. p == q), r falls back to p.
* bonus token when every draft was accepted:    the same race with r = p.
* ties in the argmax go to the lowest token id (torch.argmax and the kernel agree).
Inputs are expected finite (no NaN); torch's ``exponential_`` gives E > 0.

A greedy request can go through ``rejection_sample`` too: with p one-hot at the target argmax,
every comparison and the residual reduce to exactly the greedy rule.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["VerifyResult", "TreeVerifyResult", "verify_greedy", "rejection_sample", "verify_tree",
           "emitted_tokens"]


@dataclass
class VerifyResult:
    """Per request: the accepted drafts, then exactly one bonus or recovered token."""

    output_token_ids: torch.Tensor  # [B, max_d + 1] int64; accepted drafts, bonus/recovered, then -1
    num_accepted: torch.Tensor  # [B] int32; accepted drafts (not counting the bonus/recovered token)

    def token_lists(self) -> list[list[int]]:
        """Per request, the emitted tokens as a Python list (num_accepted[i] + 1 tokens)."""
        return emitted_tokens(self)


@dataclass
class TreeVerifyResult(VerifyResult):
    # Per request, the local node indices of the kept path: [0 (root), accepted node, ...];
    # len == num_accepted[i] + 1. Global (flattened) index = cu_num_nodes[i] + local index.
    accepted_nodes: list[list[int]] | None = None


def emitted_tokens(result: VerifyResult) -> list[list[int]]:
    """Per request, the list of emitted tokens: accepted drafts then the bonus/recovered token."""
    out = result.output_token_ids.tolist()  # [B][max_d + 1]
    n = result.num_accepted.tolist()  # [B]
    return [row[: k + 1] for row, k in zip(out, n)]


# ----------------------------------------------------------------------------------------------
# Shared index math
# ----------------------------------------------------------------------------------------------


@dataclass
class _DraftIndex:
    num_draft_per_req: torch.Tensor  # [B] int64, d_i
    starts: torch.Tensor  # [B] int64, cu_num_draft[i]
    req: torch.Tensor  # [N] int64, request of each draft
    pos: torch.Tensor  # [N] int64, position of each draft inside its request
    target_row: torch.Tensor  # [N] int64, target row of each draft (j + req(j))
    max_num_draft: int


def _draft_index(draft_token_ids: torch.Tensor, cu_num_draft: torch.Tensor,
                 max_num_draft: int | None) -> _DraftIndex:
    if draft_token_ids.dim() != 1:
        raise ValueError(f"draft_token_ids must be 1-D [num_draft], got {tuple(draft_token_ids.shape)}")
    if cu_num_draft.dim() != 1 or cu_num_draft.numel() < 1:
        raise ValueError(f"cu_num_draft must be 1-D [B+1], got {tuple(cu_num_draft.shape)}")
    device = draft_token_ids.device
    cu = cu_num_draft.to(device=device, dtype=torch.long)  # [B+1]
    n = draft_token_ids.numel()
    d = cu[1:] - cu[:-1]  # [B]
    b = d.numel()
    req = torch.repeat_interleave(torch.arange(b, device=device), d, output_size=n)  # [N]
    pos = torch.arange(n, device=device) - cu[req]  # [N]
    if max_num_draft is None:  # one host sync; callers that know it can pass it
        max_num_draft = int(d.max()) if b > 0 else 0
    target_row = req + torch.arange(n, device=device)  # [N]
    return _DraftIndex(num_draft_per_req=d, starts=cu[:-1], req=req, pos=pos, target_row=target_row,
                       max_num_draft=max_num_draft)


def check_sampling_shapes(n: int, b: int, draft_probs: torch.Tensor | None, target_probs: torch.Tensor,
                          uniform: torch.Tensor, exponential: torch.Tensor) -> int:
    """Raise ValueError unless rejection sampling's inputs fit N = n drafts over B = b requests
    (shapes as in ``rejection_sample``); returns V. The Triton kernel checks the same."""
    if target_probs.dim() != 2 or target_probs.shape[0] != n + b:
        raise ValueError(f"target_probs must be [num_draft + B, V], got {tuple(target_probs.shape)}")
    vocab = target_probs.shape[1]
    if draft_probs is not None and tuple(draft_probs.shape) != (n, vocab):
        raise ValueError(f"draft_probs must be [num_draft, V] = {(n, vocab)}, got {tuple(draft_probs.shape)}")
    if uniform.shape != (n,):
        raise ValueError(f"uniform must be [num_draft], got {tuple(uniform.shape)}")
    if exponential.shape != (b, vocab):
        raise ValueError(f"exponential must be [B, V] = {(b, vocab)}, got {tuple(exponential.shape)}")
    return vocab


def _first_rejection(idx: _DraftIndex, accepted: torch.Tensor) -> torch.Tensor:
    """accepted [N] bool -> num_accepted [B] int64: the position of each request's first
    rejected draft, or d_i when all its drafts were accepted."""
    d = idx.num_draft_per_req  # [B]
    reject_pos = torch.where(accepted, d[idx.req], idx.pos)  # [N]
    return d.clone().scatter_reduce_(0, idx.req, reject_pos, reduce="amin", include_self=True)  # [B]


def _assemble(idx: _DraftIndex, draft_token_ids: torch.Tensor, num_accepted: torch.Tensor,
              final_token: torch.Tensor) -> VerifyResult:
    """Write accepted drafts and the final (bonus/recovered) token into the padded output."""
    b = num_accepted.numel()
    device = draft_token_ids.device
    out = torch.full((b, idx.max_num_draft + 1), -1, dtype=torch.long, device=device)  # [B, max_d+1]
    keep = idx.pos < num_accepted[idx.req]  # [N]
    out[idx.req, idx.pos] = torch.where(keep, draft_token_ids.long(), -1)  # no host sync
    out[torch.arange(b, device=device), num_accepted] = final_token.long()
    return VerifyResult(output_token_ids=out, num_accepted=num_accepted.to(torch.int32))


def _exponential_race(r: torch.Tensor, p: torch.Tensor, exponential: torch.Tensor) -> torch.Tensor:
    """argmax_v r_v / E_v per row, falling back to p where r is all zero.
    r, p [R, V] float32 (r >= 0); exponential [R, V] float32 -> [R] int64."""
    has_mass = r.amax(dim=-1, keepdim=True) > 0  # [R, 1]
    r = torch.where(has_mass, r, p)  # [R, V]
    score = torch.where(r > 0, r / exponential, torch.zeros((), dtype=r.dtype, device=r.device))  # [R, V]
    return score.argmax(dim=-1)  # [R]


# ----------------------------------------------------------------------------------------------
# Linear drafts
# ----------------------------------------------------------------------------------------------


def verify_greedy(draft_token_ids: torch.Tensor, cu_num_draft: torch.Tensor, target_argmax: torch.Tensor,
                  *, max_num_draft: int | None = None) -> VerifyResult:
    """Greedy verification: accept the longest prefix with draft == target argmax.

    draft_token_ids [N] int64; cu_num_draft [B+1] int32; target_argmax [N+B] int64.
    max_num_draft: >= max_i d_i if known (saves a host sync); sets the output width.
    """
    idx = _draft_index(draft_token_ids, cu_num_draft, max_num_draft)
    if target_argmax.shape != (draft_token_ids.numel() + idx.num_draft_per_req.numel(),):
        raise ValueError(f"target_argmax must be [num_draft + B], got {tuple(target_argmax.shape)}")
    target_argmax = target_argmax.long()  # [N+B]
    accepted = draft_token_ids.long() == target_argmax[idx.target_row]  # [N]
    num_accepted = _first_rejection(idx, accepted)  # [B]
    b = num_accepted.numel()
    final_row = idx.starts + torch.arange(b, device=num_accepted.device) + num_accepted  # [B]
    return _assemble(idx, draft_token_ids, num_accepted, target_argmax[final_row])


def accept_greedy(drafts: list[int], target_argmax: list[int]) -> list[int]:
    """verify_greedy for one request on the host: its drafts [d] and target argmax rows [d + 1]
    -> the emitted tokens (the accepted drafts, then the recovered or bonus token). Example:
    drafts [5, 7], argmax [5, 3, 8] -> [5, 3]. On CPU, where the tokens end up in Python lists
    anyway, this costs microseconds where verify_greedy's dozen small tensor ops cost a visible
    share of a step."""
    if len(target_argmax) != len(drafts) + 1:
        raise ValueError(f"{len(drafts)} drafts need {len(drafts) + 1} target rows, got {len(target_argmax)}")
    n = 0
    while n < len(drafts) and drafts[n] == target_argmax[n]:
        n += 1
    return drafts[:n] + [target_argmax[n]]


def rejection_sample(draft_token_ids: torch.Tensor, cu_num_draft: torch.Tensor, draft_probs: torch.Tensor | None,
                     target_probs: torch.Tensor, uniform: torch.Tensor, exponential: torch.Tensor,
                     *, max_num_draft: int | None = None) -> VerifyResult:
    """Lossless speculative sampling; the emitted tokens are distributed exactly as sampling from p.

    draft_token_ids [N] int64; cu_num_draft [B+1] int32;
    draft_probs     [N, V] float, or None for one-hot (deterministic) drafts, q(x_j) = 1;
    target_probs    [N+B, V] float, temperature/top-k/top-p already applied (same as for q);
    uniform         [N] float32 in [0, 1): draft j accepted iff uniform[j] * q(x_j) < p(x_j);
    exponential     [B, V] float32 Exp(1) noise, one vector per request, for the final token.
    max_num_draft: >= max_i d_i if known (saves a host sync); sets the output width.
    """
    idx = _draft_index(draft_token_ids, cu_num_draft, max_num_draft)
    n = draft_token_ids.numel()
    b = idx.num_draft_per_req.numel()
    vocab = check_sampling_shapes(n, b, draft_probs, target_probs, uniform, exponential)
    device = target_probs.device
    draft = draft_token_ids.long()  # [N]
    target_probs = target_probs.float()  # [N+B, V]
    uniform = uniform.float()  # [N]

    # 1. Accept/reject every draft independently; a request keeps the prefix before its first reject.
    p_x = target_probs[idx.target_row, draft]  # [N]
    if draft_probs is None:
        q_x = torch.ones_like(p_x)  # [N]
    else:
        draft_probs = draft_probs.float()  # [N, V]
        q_x = draft_probs[torch.arange(n, device=device), draft]  # [N]
    accepted = uniform * q_x < p_x  # [N]
    num_accepted = _first_rejection(idx, accepted)  # [B]

    # 2. One final token per request from row cu[i] + i + num_accepted[i]: the residual at the first
    #    rejected draft's row, or p at the bonus row.
    rejected = num_accepted < idx.num_draft_per_req  # [B]
    final_row = idx.starts + torch.arange(b, device=device) + num_accepted  # [B]
    p = target_probs[final_row]  # [B, V]
    draft_row = (idx.starts + num_accepted).clamp(max=max(n - 1, 0))  # [B]; valid where rejected
    if n == 0:
        r = p
    elif draft_probs is None:
        rejected_token = draft[draft_row]  # [B]
        hit = torch.arange(vocab, device=device)[None, :] == rejected_token[:, None]  # [B, V]
        r = p.masked_fill(hit & rejected[:, None], 0.0)  # [B, V]
    else:
        q = torch.where(rejected[:, None], draft_probs[draft_row], 0.0)  # [B, V]
        r = (p - q).clamp_min(0.0)  # [B, V]
    final_token = _exponential_race(r, p, exponential.to(device=device, dtype=torch.float32))  # [B]
    return _assemble(idx, draft, num_accepted, final_token)


# ----------------------------------------------------------------------------------------------
# Tree drafts (several one-hot candidates per position)
# ----------------------------------------------------------------------------------------------


def verify_tree(tree_tokens: torch.Tensor, tree_parents: torch.Tensor, cu_num_nodes: torch.Tensor,
                target_probs_or_argmax: torch.Tensor, greedy: bool, uniform: torch.Tensor | None = None,
                exponential: torch.Tensor | None = None) -> TreeVerifyResult:
    """Verify a tree of one-hot draft candidates per request; returns tokens and the kept path.

    tree_tokens   [num_nodes] int64  node tokens, request i's nodes at cu_num_nodes[i] : cu_num_nodes[i+1];
                                     local node 0 is the root (the last committed token, not a draft)
    tree_parents  [num_nodes] int    parent's LOCAL index, -1 for the root, parent < node
    cu_num_nodes  [B+1] int32        cumulative, starts at 0; every request has >= 1 node (its root)
    target_probs_or_argmax           [num_nodes, V] float: target distribution of the token after each
                                     node (same flattened order); greedy also accepts [num_nodes] int64 argmax
    greedy        bool               exact match with the argmax; else SpecInfer-style sampling
    uniform       [num_nodes] float32 in [0, 1), sampled only: entry of node c decides child c (root's unused)
    exponential   [B, V] float32 Exp(1), sampled only: one vector per request for the final token

    Greedy: from the root, move to the first child whose token equals the argmax at the current node;
    when none does, emit that argmax (recovered, or the bonus at a leaf).
    Sampled (lossless for deterministic candidates): at node u, r = p_u; for each child c in node
    order accept iff uniform[c] * sum(r) < r[token(c)] (probability r(t)/sum(r)); on rejection set
    r[token(c)] = 0 and try the next child. If all are rejected (or u is a leaf) emit the exponential
    race argmax(r / exponential[i]) (r falls back to p_u if it is all zero).
    """
    b = cu_num_nodes.numel() - 1
    num_nodes = tree_tokens.numel()
    if tree_tokens.dim() != 1 or tree_parents.shape != tree_tokens.shape:
        raise ValueError("tree_tokens and tree_parents must both be [num_nodes]")
    if target_probs_or_argmax.shape[0] != num_nodes:
        raise ValueError(f"target rows must be [num_nodes = {num_nodes}, ...], got {tuple(target_probs_or_argmax.shape)}")
    cu = cu_num_nodes.tolist()  # [B+1]
    tokens = tree_tokens.tolist()  # [num_nodes]
    parents = tree_parents.tolist()  # [num_nodes]
    if cu[0] != 0 or cu[-1] != num_nodes:
        raise ValueError("cu_num_nodes must start at 0 and end at num_nodes")
    if greedy:
        am = (target_probs_or_argmax if target_probs_or_argmax.dim() == 1
              else target_probs_or_argmax.argmax(dim=-1)).tolist()  # [num_nodes]
    else:
        if target_probs_or_argmax.dim() != 2:
            raise ValueError("sampled tree verification needs target probabilities [num_nodes, V]")
        if uniform is None or exponential is None:
            raise ValueError("sampled tree verification needs uniform and exponential")
        probs = target_probs_or_argmax.float()  # [num_nodes, V]
        u_all = uniform.float().tolist()  # [num_nodes]
        noise = exponential.to(device=probs.device, dtype=torch.float32)  # [B, V]

    emitted: list[list[int]] = []
    paths: list[list[int]] = []
    max_depth = 0
    for i in range(b):
        s, e = cu[i], cu[i + 1]
        if e <= s:
            raise ValueError(f"request {i} has no root node")
        if parents[s] != -1:
            raise ValueError(f"request {i}: node 0 must be the root (parent -1)")
        children: list[list[int]] = [[] for _ in range(e - s)]  # local indices, in node order
        depth = [0] * (e - s)
        for c in range(1, e - s):
            par = parents[s + c]
            if not 0 <= par < c:
                raise ValueError(f"request {i}: node {c} has parent {par}; need 0 <= parent < node")
            children[par].append(c)
            depth[c] = depth[par] + 1
        max_depth = max(max_depth, max(depth))

        u, path, toks = 0, [0], []
        while True:
            if greedy:
                target = am[s + u]
                nxt = next((c for c in children[u] if tokens[s + c] == target), None)
                toks.append(target)  # accepted draft (== target) or the recovered/bonus token
                if nxt is None:
                    break
            else:
                p = probs[s + u]  # [V]
                r = p.clone()  # [V] residual, candidates already rejected at this node zeroed
                nxt = None
                for c in children[u]:
                    t = tokens[s + c]
                    if u_all[s + c] * float(r.sum()) < float(r[t]):
                        nxt = c
                        break
                    r[t] = 0.0
                if nxt is None:
                    toks.append(int(_exponential_race(r[None], p[None], noise[i:i + 1])[0]))
                    break
                toks.append(tokens[s + nxt])
            path.append(nxt)
            u = nxt
        emitted.append(toks)
        paths.append(path)

    device = tree_tokens.device
    out = torch.full((b, max_depth + 1), -1, dtype=torch.long)  # [B, max_depth + 1]
    for i, toks in enumerate(emitted):
        out[i, : len(toks)] = torch.tensor(toks, dtype=torch.long)
    num_accepted = torch.tensor([len(t) - 1 for t in emitted], dtype=torch.int32)  # [B]
    return TreeVerifyResult(output_token_ids=out.to(device), num_accepted=num_accepted.to(device),
                            accepted_nodes=paths)
