"""Verification (engine/verify.py): greedy hand cases, lossless sampling by chi-square, trees."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from scipy.stats import chisquare

from specplan.engine.spec_decode.rejection_sampler import (TreeVerifyResult, VerifyResult, accept_greedy, emitted_tokens,
                                    rejection_sample, verify_greedy, verify_tree)

V = 6
P0 = torch.tensor([0.30, 0.05, 0.25, 0.15, 0.25, 0.00])  # target at draft 0; token 5 impossible
Q0 = torch.tensor([0.00, 0.30, 0.10, 0.30, 0.10, 0.20])  # draft at 0; token 0 never drafted
Q1 = torch.tensor([0.25, 0.05, 0.30, 0.10, 0.10, 0.20])
P2 = torch.tensor([0.10, 0.20, 0.05, 0.30, 0.15, 0.20])  # bonus row


def _p1_table() -> torch.Tensor:
    """[V, V]: the target at draft 1 depends on the first token (a real context dependence)."""
    g = torch.Generator().manual_seed(123)
    t = torch.rand(V, V, generator=g) + 0.25
    return t / t.sum(-1, keepdim=True)


P1 = _p1_table()


def cu(lengths: list[int]) -> torch.Tensor:
    out = torch.zeros(len(lengths) + 1, dtype=torch.int32)  # [B+1]
    out[1:] = torch.tensor(lengths).cumsum(0)
    return out


def assert_matches(tokens: torch.Tensor, probs: torch.Tensor, what: str) -> None:
    """tokens [n] drawn i.i.d. from probs [V]: zero-probability tokens never appear, and a
    chi-square test over the support passes at the 1% level."""
    counts = torch.bincount(tokens, minlength=probs.numel()).double()  # [V]
    support = probs > 0
    assert counts[~support].sum() == 0, f"{what}: emitted a token with probability 0"
    expected = probs[support].double() / probs[support].double().sum() * counts.sum()
    pvalue = chisquare(counts[support].numpy(), expected.numpy()).pvalue
    assert pvalue > 0.01, f"{what}: chi-square p-value {pvalue:.2e}, counts {counts.tolist()}"


def assert_conditional_matches(cond: torch.Tensor, tokens: torch.Tensor, table: torch.Tensor,
                               what: str) -> None:
    """tokens[k] | cond[k] == a  ~ table[a] for each group a (pooled chi-square, 1% level)."""
    obs, exp, groups = [], [], 0
    for a in cond.unique().tolist():
        sel = tokens[cond == a]
        counts = torch.bincount(sel, minlength=V).double()
        support = table[a] > 0
        assert counts[~support].sum() == 0, f"{what}: token with probability 0 after {a}"
        obs.append(counts[support])
        exp.append(table[a][support].double() / table[a][support].double().sum() * sel.numel())
        groups += 1
    obs_t, exp_t = torch.cat(obs), torch.cat(exp)
    pvalue = chisquare(obs_t.numpy(), exp_t.numpy(), ddof=groups - 1).pvalue
    assert pvalue > 0.01, f"{what}: pooled chi-square p-value {pvalue:.2e}"


# ----------------------------------------------------------------------------------------------
# Greedy
# ----------------------------------------------------------------------------------------------


def test_greedy_docstring_example():
    # d = [2, 0, 3]; rows: r0 = 0,1,2 (bonus 2), r1 = 3 (bonus), r2 = 4,5,6,7 (bonus 7)
    res = verify_greedy(torch.tensor([5, 7, 2, 4, 9]), cu([2, 0, 3]), torch.tensor([5, 3, 8, 6, 2, 4, 1, 0]))
    assert isinstance(res, VerifyResult)
    assert res.output_token_ids.tolist() == [[5, 3, -1, -1], [6, -1, -1, -1], [2, 4, 1, -1]]
    assert res.num_accepted.dtype == torch.int32 and res.output_token_ids.dtype == torch.int64
    assert res.num_accepted.tolist() == [1, 0, 2]
    assert res.token_lists() == emitted_tokens(res) == [[5, 3], [6], [2, 4, 1]]


@pytest.mark.parametrize("drafts, argmax, expected, n_acc", [
    ([4, 1, 3], [4, 1, 3, 9], [4, 1, 3, 9], 3),  # all accepted: bonus from the last row
    ([4, 1, 3], [2, 1, 3, 9], [2], 0),  # first rejected: recovered = argmax of row 0
    ([4, 1, 3], [4, 1, 7, 9], [4, 1, 7], 2),  # mid rejection
    ([4, 1, 3], [4, 0, 3, 9], [4, 0], 1),  # later matches after a rejection do not count
    ([], [8], [8], 0),  # no drafts: the bonus only
])
def test_greedy_single_request(drafts, argmax, expected, n_acc):
    res = verify_greedy(torch.tensor(drafts, dtype=torch.long), cu([len(drafts)]), torch.tensor(argmax))
    assert res.token_lists() == [expected]
    assert res.num_accepted.tolist() == [n_acc]
    assert res.output_token_ids.shape == (1, len(drafts) + 1)


@pytest.mark.parametrize("drafts, argmax", [([4, 1, 3], [4, 1, 3, 9]), ([4, 1, 3], [2, 1, 3, 9]),
                                            ([4, 1, 3], [4, 1, 7, 9]), ([4, 1, 3], [4, 0, 3, 9]), ([], [8])])
def test_accept_greedy_matches_verify_greedy(drafts, argmax):
    """The host-side rule the CPU engine uses gives verify_greedy's tokens."""
    res = verify_greedy(torch.tensor(drafts, dtype=torch.long), cu([len(drafts)]), torch.tensor(argmax))
    assert accept_greedy(drafts, argmax) == res.token_lists()[0]


def test_accept_greedy_matches_verify_greedy_at_random():
    g = torch.Generator().manual_seed(11)
    for _ in range(200):
        d = int(torch.randint(0, 7, (1,), generator=g))
        argmax = torch.randint(0, 4, (d + 1,), generator=g)  # a small vocabulary: many matches
        drafts = torch.randint(0, 4, (d,), generator=g)
        want = verify_greedy(drafts, cu([d]), argmax).token_lists()[0]
        assert accept_greedy(drafts.tolist(), argmax.tolist()) == want
    with pytest.raises(ValueError, match="2 drafts need 3 target rows"):
        accept_greedy([1, 2], [1, 2])


def test_greedy_mixed_lengths():
    lengths = [0, 3, 1, 0, 4, 2]
    drafts = [[], [10, 11, 12], [20], [], [40, 41, 42, 43], [50, 51]]
    rows = [[7], [10, 11, 12, 13], [99, 21], [30], [40, 41, 0, 43, 44], [50, 51, 52]]
    res = verify_greedy(torch.tensor(sum(drafts, [])), cu(lengths), torch.tensor(sum(rows, [])))
    assert res.token_lists() == [[7], [10, 11, 12, 13], [99], [30], [40, 41, 0], [50, 51, 52]]
    assert res.num_accepted.tolist() == [0, 3, 0, 0, 2, 2]
    assert res.output_token_ids.shape == (6, 5)
    assert res.output_token_ids[0].tolist() == [7, -1, -1, -1, -1]


def test_greedy_no_drafts_at_all_and_wider_output():
    res = verify_greedy(torch.zeros(0, dtype=torch.long), cu([0, 0, 0]), torch.tensor([3, 4, 5]))
    assert res.token_lists() == [[3], [4], [5]]
    wide = verify_greedy(torch.tensor([1]), cu([1, 0]), torch.tensor([1, 2, 3]), max_num_draft=4)
    assert wide.output_token_ids.tolist() == [[1, 2, -1, -1, -1], [3, -1, -1, -1, -1]]


def test_greedy_equals_rejection_sampling_with_one_hot_target():
    """A greedy request can go through rejection_sample with p one-hot at the argmax."""
    g = torch.Generator().manual_seed(5)
    lengths = [3, 0, 5, 1, 2, 4]
    n, b, vocab = sum(lengths), len(lengths), 50
    argmax = torch.randint(0, vocab, (n + b,), generator=g)
    req = torch.repeat_interleave(torch.arange(b), torch.tensor(lengths))
    drafts = torch.where(torch.rand(n, generator=g) < 0.75, argmax[torch.arange(n) + req],
                         torch.randint(0, vocab, (n,), generator=g))
    p = torch.nn.functional.one_hot(argmax, vocab).float()
    for q in (None, torch.softmax(torch.randn(n, vocab, generator=g), -1)):
        got = rejection_sample(drafts, cu(lengths), q, p, torch.rand(n, generator=g),
                               torch.empty(b, vocab).exponential_(generator=g))
        want = verify_greedy(drafts, cu(lengths), argmax)
        assert torch.equal(got.output_token_ids, want.output_token_ids)
        assert torch.equal(got.num_accepted, want.num_accepted)


# ----------------------------------------------------------------------------------------------
# Rejection sampling: lossless
# ----------------------------------------------------------------------------------------------

R = 24_000  # requests per statistical test, all in one batch


def _two_draft_batch(draft0: torch.Tensor, draft1: torch.Tensor):
    """Target rows [3R, V] per request: P0, P1[draft0], P2 (context dependent second row)."""
    target = torch.stack([P0.expand(R, V), P1[draft0], P2.expand(R, V)], dim=1).reshape(3 * R, V)
    return cu([2] * R), torch.stack([draft0, draft1], 1).reshape(-1), target  # [R+1], [2R], [3R, V]


def _check_lossless(res: VerifyResult, draft0: torch.Tensor, what: str) -> None:
    out, n_acc = res.output_token_ids, res.num_accepted.long()  # [R, 3], [R]
    assert ((n_acc >= 0) & (n_acc <= 2)).all()
    assert (out[torch.arange(R), n_acc] >= 0).all()
    # 1. the first emitted token ~ P0 (marginal over everything else)
    assert_matches(out[:, 0], P0, f"{what}: first token")
    if draft0 is not None:  # ... also within each group of requests with the same first draft
        assert_conditional_matches(draft0, out[:, 0], P0.expand(V, V), f"{what}: first token | draft")
    # 2. the second token, when emitted in this step, ~ P1[first token]
    two = n_acc >= 1
    assert_conditional_matches(out[two, 0], out[two, 1], P1, f"{what}: second token")
    # 3. the bonus after two accepted drafts ~ P2
    assert_matches(out[n_acc == 2, 2], P2, f"{what}: bonus")


def test_rejection_sampling_is_lossless_sampled_drafts():
    g = torch.Generator().manual_seed(0)
    draft0 = torch.multinomial(Q0, R, replacement=True, generator=g)  # [R]
    draft1 = torch.multinomial(Q1, R, replacement=True, generator=g)  # [R]
    cu_, drafts, target = _two_draft_batch(draft0, draft1)
    q = torch.stack([Q0.expand(R, V), Q1.expand(R, V)], 1).reshape(2 * R, V)  # [2R, V]
    res = rejection_sample(drafts, cu_, q, target, torch.rand(2 * R, generator=g),
                           torch.empty(R, V).exponential_(generator=g))
    _check_lossless(res, None, "sampled drafts")
    # draft 0 proposes token 5 (p = 0) 20% of the time: always rejected
    assert (res.num_accepted[draft0 == 5] == 0).all()


def test_rejection_sampling_is_lossless_one_hot_drafts():
    ids = torch.arange(R)
    draft0 = ids % V  # deterministic drafts, every token incl. the impossible 5
    draft1 = (ids // V) % V
    cu_, drafts, target = _two_draft_batch(draft0, draft1)
    g = torch.Generator().manual_seed(1)
    res = rejection_sample(drafts, cu_, None, target, torch.rand(2 * R, generator=g),
                           torch.empty(R, V).exponential_(generator=g))
    _check_lossless(res, draft0, "one-hot drafts")
    # acceptance rate of a one-hot draft x is p(x)
    acc0 = torch.stack([(res.num_accepted[draft0 == x] >= 1).float().mean() for x in range(V)])
    assert torch.allclose(acc0, P0, atol=0.03)


def test_q_equal_p_accepts_every_draft():
    g = torch.Generator().manual_seed(2)
    lengths = [3, 0, 5, 1, 7, 2] * 50
    n, b, vocab = sum(lengths), len(lengths), 40
    target = torch.softmax(2 * torch.randn(n + b, vocab, generator=g), -1)  # [N+B, V]
    req = torch.repeat_interleave(torch.arange(b), torch.tensor(lengths))  # [N]
    q = target[torch.arange(n) + req]  # [N, V] == p at each draft's row
    drafts = torch.multinomial(q, 1, generator=g).squeeze(1)
    uniform = torch.rand(n, generator=g)
    uniform[:50] = 1.0 - 2.0**-24  # the largest float32 below 1 still accepts
    res = rejection_sample(drafts, cu(lengths), q, target, uniform, torch.empty(b, vocab).exponential_(generator=g))
    assert res.num_accepted.tolist() == lengths
    assert (res.output_token_ids[torch.arange(b), torch.tensor(lengths)] >= 0).all()


def test_recovered_token_avoids_rejected_one_hot_draft_and_falls_back_when_residual_is_empty():
    # one-hot draft 2 rejected (u >= p(2) = 0.4): the recovered token is never 2
    p = torch.tensor([[0.1, 0.2, 0.4, 0.3], [0.25, 0.25, 0.25, 0.25]])
    n = 2000
    res = rejection_sample(torch.full((n,), 2), cu([1] * n), None, p.repeat(n, 1),
                           torch.full((n,), 0.5), torch.empty(n, 4).exponential_(generator=torch.Generator().manual_seed(3)))
    assert (res.num_accepted == 0).all()
    first = res.output_token_ids[:, 0]
    assert (first != 2).all() and set(first.tolist()) == {0, 1, 3}
    # p = q / 2 (unnormalized): p <= q everywhere, residual all zero -> fall back to p
    q = torch.tensor([[0.0, 0.5, 0.5, 0.0]])
    res = rejection_sample(torch.tensor([1]), cu([1]), q, torch.cat([q / 2, q]), torch.tensor([0.9]),
                           torch.tensor([[1.0, 1.0, 2.0, 1.0]]))
    assert res.token_lists() == [[1]]


def test_exponential_race_ties_go_to_the_lowest_token():
    p = torch.full((1, 8), 0.125)
    res = rejection_sample(torch.zeros(0, dtype=torch.long), cu([0]), None, p, torch.zeros(0), torch.ones(1, 8))
    assert res.token_lists() == [[0]]


def test_shape_errors():
    with pytest.raises(ValueError):
        rejection_sample(torch.tensor([1]), cu([1]), None, torch.rand(1, 4), torch.rand(1), torch.ones(1, 4))
    with pytest.raises(ValueError):
        verify_greedy(torch.tensor([1]), cu([1]), torch.tensor([1]))


def test_importing_verify_does_not_import_triton():
    code = "import sys, specplan.engine.spec_decode.rejection_sampler; assert 'triton' not in sys.modules, 'triton imported'"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


# ----------------------------------------------------------------------------------------------
# Trees
# ----------------------------------------------------------------------------------------------

# request 0:            root(9)                 request 1: root only        request 2: root(1)
#                 /        |        \                                       /     \
#            1:(3)       2:(5)      3:(5)                               1:(4)    2:(6)
#             |          /    \
#           4:(1)     5:(7)   6:(8)
#                               |
#                             7:(2)
TREE_TOKENS = [9, 3, 5, 5, 1, 7, 8, 2] + [4] + [1, 4, 6]
TREE_PARENTS = [-1, 0, 0, 0, 1, 2, 2, 6] + [-1] + [-1, 0, 0]
TREE_CU = [0, 8, 9, 12]


def test_tree_greedy_hand_cases():
    # argmax per node (flattened): request 0 goes root -> 2 (5) -> 6 (8) -> 7 (2), a leaf: bonus 11
    argmax = torch.tensor([5, 0, 8, 0, 0, 0, 2, 11] + [13] + [7, 0, 0])
    res = verify_tree(torch.tensor(TREE_TOKENS), torch.tensor(TREE_PARENTS), torch.tensor(TREE_CU, dtype=torch.int32),
                      argmax, greedy=True)
    assert isinstance(res, TreeVerifyResult)
    assert res.token_lists() == [[5, 8, 2, 11], [13], [7]]
    assert res.num_accepted.tolist() == [3, 0, 0]
    assert res.accepted_nodes == [[0, 2, 6, 7], [0], [0]]
    assert res.output_token_ids.shape == (3, 4)  # max depth 3, + 1

    # request 0 stops at node 2 (5): argmax 9 matches neither child -> recovered 9; probabilities work too
    argmax[2] = 9
    probs = torch.nn.functional.one_hot(argmax, 16).float()
    res = verify_tree(torch.tensor(TREE_TOKENS), torch.tensor(TREE_PARENTS), torch.tensor(TREE_CU), probs, greedy=True)
    assert res.token_lists() == [[5, 9], [13], [7]]
    assert res.accepted_nodes == [[0, 2], [0], [0]]


def test_tree_greedy_chain_equals_linear_greedy():
    g = torch.Generator().manual_seed(7)
    lengths = [0, 4, 2, 5, 1]
    vocab = 5
    drafts = [torch.randint(0, vocab, (d,), generator=g).tolist() for d in lengths]
    rows = [torch.randint(0, vocab, (d + 1,), generator=g).tolist() for d in lengths]
    tokens, parents = [], []
    for d, ds in zip(lengths, drafts):
        tokens += [0] + ds
        parents += list(range(-1, d))
    cu_nodes = cu([d + 1 for d in lengths])
    tree = verify_tree(torch.tensor(tokens), torch.tensor(parents), cu_nodes, torch.tensor(sum(rows, [])), greedy=True)
    lin = verify_greedy(torch.tensor(sum(drafts, []), dtype=torch.long), cu(lengths), torch.tensor(sum(rows, [])))
    assert torch.equal(tree.output_token_ids, lin.output_token_ids)
    assert torch.equal(tree.num_accepted, lin.num_accepted)
    assert tree.accepted_nodes == [list(range(k + 1)) for k in lin.num_accepted.tolist()]


def test_tree_rejects_bad_parents():
    with pytest.raises(ValueError):
        verify_tree(torch.tensor([0, 1, 2]), torch.tensor([-1, 2, 0]), cu([3]), torch.tensor([0, 0, 0]), greedy=True)


def test_tree_sampling_is_lossless():
    """One tree shape for all requests, root candidates [2, 4, 2 (duplicate), 5 (p = 0)]."""
    tokens = [0, 2, 4, 2, 5, 3, 1, 0]
    parents = [-1, 0, 0, 0, 0, 1, 1, 2]
    m = len(tokens)
    # node rows: root P0; node c after token t: P1[t]; deeper nodes P2
    node_rows = torch.stack([P0, P1[2], P1[4], P1[2], P1[5], P2, P2, P2])  # [m, V]
    g = torch.Generator().manual_seed(4)
    res = verify_tree(torch.tensor(tokens).repeat(R), torch.tensor(parents).repeat(R), cu([m] * R),
                      node_rows.repeat(R, 1), greedy=False, uniform=torch.rand(m * R, generator=g),
                      exponential=torch.empty(R, V).exponential_(generator=g))
    out, n_acc = res.output_token_ids, res.num_accepted.long()
    assert_matches(out[:, 0], P0, "tree: first token")
    two = n_acc >= 1
    assert_conditional_matches(out[two, 0], out[two, 1], P1, "tree: second token")
    assert_matches(out[n_acc == 2, 2], P2, "tree: bonus")
    paths = res.accepted_nodes
    assert all(len(p) == k + 1 and p[0] == 0 for p, k in zip(paths, n_acc.tolist()))
    assert not any(len(p) > 1 and p[1] in (3, 4) for p in paths)  # duplicate / impossible never taken
    # emitted tokens are the path's node tokens
    assert all(out[i, j].item() == tokens[paths[i][j + 1]] for i in range(200) for j in range(len(paths[i]) - 1))
