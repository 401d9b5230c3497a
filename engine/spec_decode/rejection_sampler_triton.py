"""Triton kernels for speculative verification; same signatures and bit-identical outputs as the
torch reference in ``rejection_sampler.py`` (read its docstring for the layout, index math and formulas).

Used on CUDA only; import this module lazily (it imports triton). Tested on CPU tensors with
``TRITON_INTERPRET=1`` set before triton is imported (the flag is read when ``@triton.jit`` runs).

One program per request (grid = (B,)):

1. Walk the request's drafts j = cu[i] + k, k = 0 .. d_i - 1, in order. Draft j (token x) is
   checked against target row j + i: greedy ``x == target_argmax[j + i]``; sampled ``uniform[j] * q(x) < p(x)``
   (q(x) = 1 for one-hot drafts). A flag ``alive`` stays 1 until the first rejection; accepted
   drafts are stored at out[i, k] while alive, and num_accepted counts them.
2. Final token from row cu[i] + i + num_accepted (bonus row if all accepted, else the row of the
   first rejected draft). Greedy: load target_argmax there. Sampled: the exponential race over V in
   blocks of BLOCK_V, r = max(p - q, 0) (one-hot: p with the rejected token zeroed; bonus: r = p),
   score = r / E (``div_rn``: IEEE-rounded, as torch's division), 0 where r == 0; running
   (max, first index) per block, keeping the lower index on ties. Two races run side by side, on
   r and on p, so the all-zero-residual fallback to p needs no second pass.

Worked example, the same as ``rejection_sampler.py``'s: B = 3, cu = [0, 2, 2, 5], program 2 has start = 2,
end = 5, checks drafts 2, 3, 4 against target rows 4, 5, 6, rejects draft 4 -> num_accepted = 2,
final row 2 + 2 + 2 = 6, writes out[2, 0:2] = drafts 2, 3 and out[2, 2] = the recovered token.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .rejection_sampler import VerifyResult, check_sampling_shapes

__all__ = ["rejection_sample_triton", "verify_greedy_triton"]


@triton.jit
def _greedy_kernel(
    out_ptr,  # [B, out_stride] int64, prefilled with -1
    num_accepted_ptr,  # [B] int32
    draft_ptr,  # [N] int64
    cu_ptr,  # [B+1] int32
    argmax_ptr,  # [N+B] int64
    out_stride,
):
    i = tl.program_id(0)
    start = tl.load(cu_ptr + i)
    end = tl.load(cu_ptr + i + 1)
    alive = tl.full([], 1, tl.int32)  # 1 until the first rejection
    n_acc = tl.full([], 0, tl.int32)
    for k in range(0, end - start):
        j = start + k  # global draft index (a tensor, also under the interpreter)
        x = tl.load(draft_ptr + j)
        ok = x == tl.load(argmax_ptr + j + i)
        alive = tl.where(ok, alive, 0)
        tl.store(out_ptr + i * out_stride + k, x, mask=alive == 1)
        n_acc += alive
    final = tl.load(argmax_ptr + start + i + n_acc)
    tl.store(out_ptr + i * out_stride + n_acc, final)
    tl.store(num_accepted_ptr + i, n_acc)


@triton.jit
def _rejection_sample_kernel(
    out_ptr,  # [B, out_stride] int64, prefilled with -1
    num_accepted_ptr,  # [B] int32
    draft_ptr,  # [N] int64
    cu_ptr,  # [B+1] int32
    q_ptr,  # [N, V] float32 (unused if not HAS_Q)
    p_ptr,  # [N+B, V] float32
    uniform_ptr,  # [N] float32
    exp_ptr,  # [B, V] float32
    V,
    out_stride,
    HAS_Q: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    i = tl.program_id(0)
    start = tl.load(cu_ptr + i)
    end = tl.load(cu_ptr + i + 1)
    alive = tl.full([], 1, tl.int32)  # 1 until the first rejection
    n_acc = tl.full([], 0, tl.int32)
    rejected_token = tl.full([], -1, tl.int64)  # the first rejected draft's token

    # 1. Accept/reject the drafts in order.
    for k in range(0, end - start):
        j = start + k  # global draft index (a tensor, also under the interpreter)
        x = tl.load(draft_ptr + j)
        p_x = tl.load(p_ptr + (j + i).to(tl.int64) * V + x)
        if HAS_Q:
            q_x = tl.load(q_ptr + j.to(tl.int64) * V + x)
        else:
            q_x = 1.0
        ok = tl.load(uniform_ptr + j) * q_x < p_x
        rejected_token = tl.where((alive == 1) & (ok == 0), x, rejected_token)
        alive = tl.where(ok, alive, 0)
        tl.store(out_ptr + i * out_stride + k, x, mask=alive == 1)
        n_acc += alive

    # 2. Exponential race over V for the recovered (or bonus) token.
    p_row = p_ptr + (start + i + n_acc).to(tl.int64) * V
    q_row = q_ptr + (start + n_acc).to(tl.int64) * V  # only read when rejected
    e_row = exp_ptr + i.to(tl.int64) * V
    best_r = tl.full([], -float("inf"), tl.float32)  # running max score and its first index
    best_p = tl.full([], -float("inf"), tl.float32)
    idx_r = tl.full([], 0, tl.int32)
    idx_p = tl.full([], 0, tl.int32)
    max_r = tl.full([], 0.0, tl.float32)  # > 0 iff the residual has mass
    for v0 in range(0, V, BLOCK_V):
        offs = v0 + tl.arange(0, BLOCK_V)  # [BLOCK_V]
        in_v = offs < V
        # rejected, broadcast by a vector compare (the interpreter turns `bool vector & bool
        # scalar` into int32, which tl.load rejects as a mask)
        rej_v = (offs * 0 + n_acc) < end - start  # [BLOCK_V]
        p = tl.load(p_row + offs, mask=in_v, other=0.0)  # [BLOCK_V]
        if HAS_Q:
            q = tl.load(q_row + offs, mask=in_v & rej_v, other=0.0)  # [BLOCK_V], 0 for the bonus
            r = tl.maximum(p - q, 0.0)  # [BLOCK_V]
        else:
            r = tl.where((offs == rejected_token) & rej_v, 0.0, p)  # [BLOCK_V]
        e = tl.load(e_row + offs, mask=in_v, other=1.0)  # [BLOCK_V]
        score_r = tl.where(r > 0, tl.math.div_rn(r, e), 0.0)  # [BLOCK_V]
        score_p = tl.where(p > 0, tl.math.div_rn(p, e), 0.0)  # [BLOCK_V]
        score_r = tl.where(in_v, score_r, -float("inf"))
        score_p = tl.where(in_v, score_p, -float("inf"))
        blk_r = tl.max(score_r, axis=0)  # scalar
        blk_p = tl.max(score_p, axis=0)
        blk_idx_r = tl.min(tl.where(score_r == blk_r, offs, V), axis=0)  # first index of the max
        blk_idx_p = tl.min(tl.where(score_p == blk_p, offs, V), axis=0)
        # strictly greater: an equal score in a later block keeps the earlier (lower) index
        idx_r = tl.where(blk_r > best_r, blk_idx_r, idx_r)
        best_r = tl.maximum(best_r, blk_r)
        idx_p = tl.where(blk_p > best_p, blk_idx_p, idx_p)
        best_p = tl.maximum(best_p, blk_p)
        max_r = tl.maximum(max_r, tl.max(tl.where(in_v, r, 0.0), axis=0))
    final = tl.where(max_r > 0, idx_r, idx_p)
    tl.store(out_ptr + i * out_stride + n_acc, final.to(tl.int64))
    tl.store(num_accepted_ptr + i, n_acc)


def _prepare(draft_token_ids: torch.Tensor, cu_num_draft: torch.Tensor, max_num_draft: int | None):
    draft = draft_token_ids.to(torch.int64).contiguous()  # [N]
    cu = cu_num_draft.to(device=draft.device, dtype=torch.int32).contiguous()  # [B+1]
    b = cu.numel() - 1
    if max_num_draft is None:
        max_num_draft = int((cu[1:] - cu[:-1]).max()) if b > 0 else 0
    out = torch.full((b, max_num_draft + 1), -1, dtype=torch.int64, device=draft.device)  # [B, max_d+1]
    num_accepted = torch.empty(b, dtype=torch.int32, device=draft.device)  # [B]
    n = draft.numel()
    if n == 0:  # never read then; an empty tensor's null pointer is not a valid kernel argument
        draft = torch.zeros(1, dtype=torch.int64, device=draft.device)
    return draft, n, cu, b, out, num_accepted


def verify_greedy_triton(draft_token_ids: torch.Tensor, cu_num_draft: torch.Tensor, target_argmax: torch.Tensor,
                         *, max_num_draft: int | None = None) -> VerifyResult:
    """Same as ``rejection_sampler.verify_greedy``. draft_token_ids [N]; cu_num_draft [B+1]; target_argmax [N+B]."""
    draft, n, cu, b, out, num_accepted = _prepare(draft_token_ids, cu_num_draft, max_num_draft)
    if target_argmax.shape != (n + b,):
        raise ValueError(f"target_argmax must be [num_draft + B], got {tuple(target_argmax.shape)}")
    if b > 0:
        argmax = target_argmax.to(torch.int64).contiguous()  # [N+B]
        _greedy_kernel[(b,)](out, num_accepted, draft, cu, argmax, out.shape[1])
    return VerifyResult(output_token_ids=out, num_accepted=num_accepted)


def rejection_sample_triton(draft_token_ids: torch.Tensor, cu_num_draft: torch.Tensor,
                            draft_probs: torch.Tensor | None, target_probs: torch.Tensor, uniform: torch.Tensor,
                            exponential: torch.Tensor, *, max_num_draft: int | None = None,
                            block_v: int = 1024) -> VerifyResult:
    """Same as ``rejection_sampler.rejection_sample`` (bit-identical tokens from the same random inputs).

    draft_token_ids [N] int64; cu_num_draft [B+1]; draft_probs [N, V] or None (one-hot drafts);
    target_probs [N+B, V]; uniform [N] float32; exponential [B, V] float32.
    block_v: V elements per step of the final-token race (a power of two).
    """
    draft, n, cu, b, out, num_accepted = _prepare(draft_token_ids, cu_num_draft, max_num_draft)
    vocab = check_sampling_shapes(n, b, draft_probs, target_probs, uniform, exponential)
    if b == 0:
        return VerifyResult(output_token_ids=out, num_accepted=num_accepted)
    p = target_probs.to(torch.float32).contiguous()  # [N+B, V]
    has_q = draft_probs is not None and n > 0
    q = draft_probs.to(torch.float32).contiguous() if has_q else p  # [N, V] (p is a placeholder)
    u = uniform.to(device=p.device, dtype=torch.float32).contiguous()  # [N]
    if n == 0:  # never read then; give the kernel a valid pointer
        u = torch.zeros(1, dtype=torch.float32, device=p.device)
    e = exponential.to(device=p.device, dtype=torch.float32).contiguous()  # [B, V]
    block = min(block_v, triton.next_power_of_2(vocab))
    _rejection_sample_kernel[(b,)](out, num_accepted, draft, cu, q, p, u, e, vocab,
                                   out.shape[1], HAS_Q=has_q, BLOCK_V=block)
    return VerifyResult(output_token_ids=out, num_accepted=num_accepted)
