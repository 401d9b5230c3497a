"""The Triton verification kernels equal the torch reference exactly (TRITON_INTERPRET=1 on CPU).

Triton decides between compiling and interpreting when it decorates a function (its own library
functions included, at ``import triton``), so the flag must be set before triton is first imported
and stay set. This module sets it at the top. If triton was already imported in this process
without the flag, the in-process tests are skipped and one test reruns this file in a fresh
Python process instead.
"""

from __future__ import annotations

import os
import subprocess
import sys

_PREIMPORTED = "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1"
os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

try:
    import triton  # noqa: E402, F401
except Exception as exc:  # pragma: no cover - depends on the environment
    pytest.skip(f"triton cannot be imported: {exc!r}", allow_module_level=True)

from specplan.engine.spec_decode.rejection_sampler import rejection_sample, verify_greedy  # noqa: E402

if _PREIMPORTED:
    vt = None
else:
    from triton.runtime.interpreter import InterpretedFunction

    from specplan.engine.spec_decode import rejection_sampler_triton as vt

    assert isinstance(vt._rejection_sample_kernel, InterpretedFunction), "verify_triton imported without the flag"

in_process = pytest.mark.skipif(_PREIMPORTED, reason="triton was imported without TRITON_INTERPRET=1 "
                                "in this process; test_in_a_fresh_process runs these instead")


if _PREIMPORTED:

    def test_in_a_fresh_process():
        proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__],
                              env={**os.environ, "TRITON_INTERPRET": "1"}, capture_output=True, text=True,
                              timeout=300)
        assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]


def _cu(lengths: list[int]) -> torch.Tensor:
    out = torch.zeros(len(lengths) + 1, dtype=torch.int32)  # [B+1]
    out[1:] = torch.tensor(lengths, dtype=torch.int32).cumsum(0)
    return out


def _random_case(seed: int, b: int, vocab: int, max_d: int):
    """Drafts from q; p is q perturbed (so a realistic mix of accepts and rejects), rows peaked."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, max_d + 1, (b,), generator=g).tolist()
    lengths[0] = 0  # always one request without drafts
    n = sum(lengths)
    req = torch.repeat_interleave(torch.arange(b), torch.tensor(lengths))  # [N]
    logits = 3 * torch.randn(n + b, vocab, generator=g)  # [N+B, V]
    target = torch.softmax(logits, -1)  # [N+B, V]
    q = torch.softmax(logits[torch.arange(n) + req] + torch.randn(n, vocab, generator=g), -1)  # [N, V]
    drafts = torch.multinomial(q, 1, generator=g).squeeze(1) if n else torch.zeros(0, dtype=torch.long)  # [N]
    uniform = torch.rand(n, generator=g)  # [N]
    exponential = torch.empty(b, vocab).exponential_(generator=g)  # [B, V]
    return lengths, drafts, q, target, uniform, exponential


def _assert_same(a, b):
    assert torch.equal(a.output_token_ids, b.output_token_ids), (a.output_token_ids, b.output_token_ids)
    assert torch.equal(a.num_accepted, b.num_accepted)
    assert b.num_accepted.dtype == torch.int32 and b.output_token_ids.dtype == torch.int64


CASES = [(0, 1, 100, 3), (1, 4, 257, 5), (2, 9, 1000, 4), (3, 16, 128, 6), (4, 3, 640, 0)]


@in_process
@pytest.mark.parametrize("seed, b, vocab, max_d", CASES)
@pytest.mark.parametrize("one_hot", [False, True])
def test_rejection_sample_kernel_equals_reference(seed, b, vocab, max_d, one_hot):
    lengths, drafts, q, target, uniform, exponential = _random_case(seed, b, vocab, max_d)
    if one_hot:  # a deterministic draft (e.g. n-gram): the draft model's argmax, q(x) = 1
        drafts, q = q.argmax(-1) if len(drafts) else drafts, None
    want = rejection_sample(drafts, _cu(lengths), q, target, uniform, exponential)
    # small blocks exercise the running (max, index) across blocks and the masked tail
    got = vt.rejection_sample_triton(drafts, _cu(lengths), q, target, uniform, exponential, block_v=128)
    _assert_same(want, got)
    if seed == 2:  # both accepts and rejections happened, and the default block size agrees too
        assert 0 < int(want.num_accepted.sum()) < sum(lengths)
        _assert_same(want, vt.rejection_sample_triton(drafts, _cu(lengths), q, target, uniform, exponential))


@in_process
@pytest.mark.parametrize("seed, b, vocab, max_d", CASES)
def test_greedy_kernel_equals_reference(seed, b, vocab, max_d):
    lengths, drafts, _, target, _, _ = _random_case(seed, b, vocab, max_d)
    g = torch.Generator().manual_seed(100 + seed)
    argmax = target.argmax(-1)  # [N+B]
    req = torch.repeat_interleave(torch.arange(b), torch.tensor(lengths))
    n = len(drafts)
    drafts = torch.where(torch.rand(n, generator=g) < 0.8, argmax[torch.arange(n) + req], drafts)
    want = verify_greedy(drafts, _cu(lengths), argmax)
    got = vt.verify_greedy_triton(drafts, _cu(lengths), argmax)
    _assert_same(want, got)


@in_process
def test_kernel_edge_cases_ties_fallback_and_wide_output():
    # ties: uniform p and constant noise -> token 0 in both
    p = torch.full((2, 300), 1 / 300)
    for f in (rejection_sample, vt.rejection_sample_triton):
        assert f(torch.zeros(0, dtype=torch.long), _cu([0, 0]), None, p, torch.zeros(0), torch.ones(2, 300)
                 ).token_lists() == [[0], [0]]
    # all-zero residual (p = q / 2) falls back to p; max_num_draft widens the output
    q = torch.zeros(1, 300)
    q[0, 7] = q[0, 200] = 0.5
    target = torch.cat([q / 2, torch.full((1, 300), 1 / 300)])
    e = torch.empty(1, 300).exponential_(generator=torch.Generator().manual_seed(0))
    args = (torch.tensor([7]), _cu([1]), q, target, torch.tensor([0.9]), e)
    want = rejection_sample(*args, max_num_draft=3)
    got = vt.rejection_sample_triton(*args, max_num_draft=3, block_v=64)
    _assert_same(want, got)
    assert want.num_accepted.tolist() == [0] and want.token_lists()[0][0] in (7, 200)
    assert want.output_token_ids.shape == (1, 4)
    # greedy without any drafts
    _assert_same(verify_greedy(torch.zeros(0, dtype=torch.long), _cu([0, 0, 0]), torch.tensor([4, 5, 6])),
                 vt.verify_greedy_triton(torch.zeros(0, dtype=torch.long), _cu([0, 0, 0]), torch.tensor([4, 5, 6])))
