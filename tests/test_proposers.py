"""The model-free proposers: n-gram prompt lookup and the suffix (SuffixDecoding-style) tree."""

from __future__ import annotations

import random
import statistics
import time

import pytest

from specplan.engine import DraftTokens, DraftTree, NgramProposer, Proposer
from specplan.engine.proposers.suffix import SuffixProposer, context_lengths
from specplan.engine.proposers.ngram import NgramIndex
from specplan.engine import SamplingParams, Sequence


def make_seq(tokens, seq_id: int = 0, num_prompt: int | None = None) -> Sequence:
    tokens = list(tokens)
    n = len(tokens) if num_prompt is None else num_prompt
    seq = Sequence(seq_id=seq_id, request_id=str(seq_id), prompt_token_ids=tokens[:n], params=SamplingParams())
    seq.token_ids.extend(tokens[n:])
    return seq


def ngram_reference(toks: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Brute force: the longest n, the most recent earlier occurrence, what followed it."""
    L = len(toks)
    for n in range(min(max_n, L - 1), min_n - 1, -1):
        suffix = toks[L - n:]
        for e in range(L - 1, n - 1, -1):
            if toks[e - n:e] == suffix:
                return toks[e:e + k]
    return []


def random_text(n: int, rng: random.Random, vocab: int = 12, repeat_p: float = 0.3) -> list[int]:
    out: list[int] = []
    while len(out) < n:
        if out and rng.random() < repeat_p:
            s = rng.randrange(len(out))
            out.extend(out[s:s + rng.randint(2, 12)])
        else:
            out.append(rng.randrange(vocab))
    return out[:n]


def check_tree(tree: DraftTree, k: int) -> None:
    assert tree.parents[0] == -1
    assert len(tree.tokens) == len(tree.parents) == len(tree.counts)
    assert 1 <= tree.num_drafts <= k
    for i in range(1, len(tree.tokens)):
        assert 0 <= tree.parents[i] < i
        assert tree.counts[i] <= tree.counts[tree.parents[i]]
    siblings = {}
    for i in range(1, len(tree.tokens)):
        key = (tree.parents[i], tree.tokens[i])
        assert key not in siblings, "two children of one node hold the same token"
        siblings[key] = i


# ----------------------------------------------------------------------------- n-gram


def test_protocol():
    assert isinstance(NgramProposer(), Proposer) and NgramProposer.name == "ngram"
    assert isinstance(SuffixProposer(), Proposer) and SuffixProposer.name == "suffix"


def test_ngram_longest_n_wins():
    # The last 1-gram (3) last occurred at position 7 (followed by 50), but the 3-gram (1, 2, 3)
    # occurred only at the start, followed by 10 11 12.
    toks = [1, 2, 3, 10, 11, 12, 9, 3, 50, 1, 2, 3]
    p = NgramProposer(min_n=1, max_n=4)
    assert p.match(make_seq(toks)) == (3, 3)
    d = p.propose([make_seq(toks, 1)], [3])
    assert d.token_ids == [[10, 11, 12]]
    # With max_n = 1 only the 1-gram is looked up: its most recent occurrence wins.
    assert NgramProposer(1, 1).propose([make_seq(toks)], [2]).token_ids == [[50, 1]]


def test_ngram_most_recent_occurrence():
    toks = [7, 8, 1, 7, 8, 2, 7, 8, 3, 5, 7, 8]
    d = NgramProposer(min_n=2, max_n=2).propose([make_seq(toks)], [2])
    assert d.token_ids == [[3, 5]]


def test_ngram_k_caps_and_sequence_end():
    toks = [4, 5, 6, 7, 8, 9, 4, 5]
    p = NgramProposer()
    assert p.propose([make_seq(toks)], [1]).token_ids == [[6]]
    assert p.propose([make_seq(toks)], [4]).token_ids == [[6, 7, 8, 9]]
    # Fewer than k when the sequence ends; the continuation may run into the suffix itself.
    d = p.propose([make_seq(toks)], [20])
    assert d.token_ids == [[6, 7, 8, 9, 4, 5]]
    assert d.natural_k == [6]
    # Period-1 text: the most recent earlier occurrence is one token back.
    d = p.propose([make_seq([3, 3, 3, 3, 3])], [4])
    assert d.token_ids == [[3]] and d.natural_k == [1]


def test_ngram_no_match_and_k_zero():
    p = NgramProposer()
    d = p.propose([make_seq([1, 2, 3, 4], 0), make_seq([1, 2, 1], 1), make_seq([5], 2)], [4, 0, 4])
    assert d.token_ids == [[], [], []]
    assert d.natural_k == [0, 0, 0]
    assert d.seconds >= 0.0
    assert NgramProposer(min_n=2).propose([make_seq([1, 2, 3, 1])], [3]).token_ids == [[]]


def test_ngram_reports_how_many_tokens_it_matched():
    # [.., 7, 8, 9] ends with 8, 9 (matched at 1-2), 9 alone (at 4), and nothing longer: n = 2.
    seqs = [make_seq([7, 8, 9, 1, 9, 5, 8, 9], 0), make_seq([1, 2, 3, 1], 1), make_seq([1, 2, 3, 4], 2),
            make_seq([4, 5, 6, 7, 4, 5, 6, 7], 3)]
    d = NgramProposer(max_n=4).propose(seqs, [3, 3, 3, 0])
    assert d.match_length == [2, 1, 0, 0]  # k = 0: not looked up
    assert d.token_ids == [[1, 9, 5], [2, 3, 1], [], []]
    assert NgramProposer(max_n=4).propose(seqs[3:], [2]).match_length == [4]  # nothing before to follow


def test_ngram_match_length_follows_the_match_back():
    # 1 2 3 4 is the longest n-gram (max_n = 4) and it ends at 6; the 5 6 before both agree too.
    toks = [5, 6, 1, 2, 3, 4, 9, 8, 5, 6, 1, 2, 3, 4]
    d = NgramProposer(max_n=4).propose([make_seq(toks)], [2])
    assert d.token_ids == [[9, 8]] and d.match_length == [6]
    assert NgramProposer(max_n=4, max_match_length=5).propose([make_seq(toks)], [2]).match_length == [5]
    # a shorter n-gram cannot extend (or the longer one would have matched): the docstring's example
    assert NgramProposer(max_n=4).propose([make_seq([1, 2, 3, 4, 9, 2, 3, 4])], [1]).match_length == [3]
    with pytest.raises(ValueError, match="max_match_length"):
        NgramProposer(max_n=4, max_match_length=3)


def test_ngram_natural_k_is_capped():
    toks = list(range(30)) + [0, 1, 2]
    d = NgramProposer(max_natural_k=8).propose([make_seq(toks)], [4])
    assert d.token_ids == [[3, 4, 5, 6]] and d.natural_k == [8]


@pytest.mark.parametrize("min_n,max_n", [(1, 4), (2, 3), (1, 1)])
def test_ngram_incremental_matches_fresh_and_reference(min_n, max_n):
    rng = random.Random(min_n * 10 + max_n)
    full = random_text(400, rng)
    seq = make_seq(full[:50], seq_id=3)
    inc = NgramProposer(min_n, max_n)
    for t in full[50:]:
        seq.token_ids.append(t)
        k = rng.randint(0, 6)
        got = inc.propose([seq], [k]).token_ids[0]
        fresh = NgramProposer(min_n, max_n).propose([make_seq(seq.token_ids, seq_id=3)], [k]).token_ids[0]
        assert got == fresh == (ngram_reference(seq.token_ids, k, min_n, max_n) if k else [])
        if rng.random() < 0.2:  # the list did not grow between two calls
            assert inc.propose([seq], [k]).token_ids[0] == got


@pytest.mark.parametrize("min_n,max_n", [(1, 4), (2, 3)])
def test_ngram_index_grown_in_chunks_equals_one_token_at_a_time(min_n, max_n):
    # Chunks of 9 and more new tokens (a prompt, a long accepted run) are indexed a whole n at a
    # time; the index must be the one a token at a time builds (the most recent end per key).
    rng = random.Random(max_n)
    for _ in range(30):
        text = [rng.randrange(4) for _ in range(rng.randint(1, 120))]  # 4 symbols: keys recur
        chunked, single = NgramIndex([], min_n, max_n), NgramIndex([], min_n, max_n)
        pos = 0
        while pos < len(text):
            step = rng.choice([1, 2, 8, 9, 30])
            chunked.toks.extend(text[pos:pos + step])
            chunked.update()
            for t in text[pos:pos + step]:
                single.toks.append(t)
                single.update()
            pos += step
            assert chunked._index == single._index and chunked.match() == single.match()


def test_ngram_batch_and_rebuild_and_finish():
    p = NgramProposer()
    a, b = make_seq([1, 2, 3, 1, 2], 0), make_seq([9, 8, 9], 1)
    assert p.propose([a, b], [2, 2]).token_ids == [[3, 1], [8, 9]]
    # The tokens were replaced (e.g. a recomputed sequence): the index is rebuilt.
    a.token_ids = [5, 6, 7, 5]
    assert p.propose([a], [3]).token_ids == [[6, 7, 5]]
    a.token_ids[:] = [5, 6, 7, 8, 5, 6]  # rewritten in place, same list object
    assert p.propose([a], [3]).token_ids == [[7, 8, 5]]
    assert p.num_tracked() == 2
    p.on_finished(a)
    p.on_finished(b)
    assert p.num_tracked() == 0


def test_ngram_cost_under_a_millisecond_at_2000_tokens():
    rng = random.Random(0)
    batch, ctx, steps = 8, 2000, 300
    seqs = [make_seq(random_text(ctx, rng, vocab=2000), seq_id=i) for i in range(batch)]
    cont = [random_text(steps, rng, vocab=2000) for _ in seqs]
    p = NgramProposer()
    p.propose(seqs, [8] * batch)  # the first call indexes the prompts
    per_request = []
    for s in range(steps):
        for q, c in zip(seqs, cont):
            q.token_ids.append(c[s])
        t0 = time.perf_counter()
        p.propose(seqs, [8] * batch)
        per_request.append((time.perf_counter() - t0) / batch)
    assert statistics.median(per_request) < 1e-3


# ----------------------------------------------------------------------------- suffix


def test_context_lengths():
    assert context_lengths(24) == [1, 2, 3, 4, 6, 8, 12, 16, 24]
    assert context_lengths(5) == [1, 2, 3, 4, 5]
    assert context_lengths(1) == [1]


def test_suffix_repeated_pattern_gives_the_chain():
    toks = [5, 6, 7, 8, 9, 1, 2, 3, 5, 6, 7]
    d = SuffixProposer().propose([make_seq(toks)], [4])
    assert d.token_ids == [[8, 9, 1, 2]]
    tree = d.trees[0]
    assert tree.tokens == (7, 8, 9, 1, 2) and tree.is_chain() and tree.counts == (1, 1, 1, 1, 1)
    assert d.natural_k == [3]  # matched 3 tokens, spec_factor 1


def test_suffix_periodic_text_and_natural_k():
    toks = [7, 8, 9, 10] * 3 + [7, 8]
    p = SuffixProposer()
    # The longest indexed context length that occurred before is 8 (ending at position 10).
    assert p.match(make_seq(toks)) == (8, 1, "request")
    d = p.propose([make_seq(toks)], [6])
    assert d.token_ids == [[9, 10, 7, 8]]  # its continuation stops at the sequence's end
    assert d.trees[0].is_chain() and d.natural_k == [4]
    # A match of 12 (ceil(spec_factor * 12) drafts) with a long continuation.
    toks = list(range(100, 130)) + list(range(100, 112))
    d = p.propose([make_seq(toks, seq_id=1)], [4])
    assert d.token_ids == [[112, 113, 114, 115]] and d.natural_k == [12]
    assert SuffixProposer(spec_factor=0.5).propose([make_seq(toks)], [4]).natural_k == [6]


def test_suffix_siblings_for_different_continuations():
    toks = [1, 2, 3, 4, 1, 2, 3, 5, 1, 2, 3, 6, 1, 2, 3]
    d = SuffixProposer().propose([make_seq(toks)], [3])
    tree = d.trees[0]
    check_tree(tree, 3)
    assert tree.tokens == (3, 6, 5, 4)  # siblings, the most recent continuation first
    assert tree.parents == (-1, 0, 0, 0)
    assert tree.counts == (3, 1, 1, 1)
    assert d.token_ids == [[6, 1, 2]]  # linear path: most frequent (ties: most recent) child


def test_suffix_counts_reflect_frequencies():
    toks = [1, 2, 3, 9, 1, 2, 3, 9, 1, 2, 3, 7, 1, 2, 3]
    p = SuffixProposer()
    d = p.propose([make_seq(toks)], [1])
    assert d.trees[0].tokens == (3, 9) and d.trees[0].counts == (3, 2)
    # Best-first: the 9-branch (2/3) goes deep before the 7-branch (1/3) is added as a sibling.
    d = p.propose([make_seq(toks)], [5])
    tree = d.trees[0]
    check_tree(tree, 5)
    assert tree.tokens == (3, 9, 1, 2, 3, 7)
    assert tree.parents == (-1, 0, 1, 2, 3, 0)
    assert tree.counts == (3, 2, 2, 2, 2, 1)
    assert d.token_ids == [[9, 1, 2, 3, 7]]
    # The tree never exceeds max_tree_nodes, the linear path may be longer (up to k).
    d = SuffixProposer(max_tree_nodes=2).propose([make_seq(toks)], [5])
    assert d.trees[0].num_drafts == 2 and len(d.token_ids[0]) == 5


def test_suffix_min_prob_prunes_rare_branches():
    toks = [1, 3] * 9 + [1, 4, 1]  # after 1: nine times 3, once 4
    d = SuffixProposer(max_depth=1, min_prob=0.2).propose([make_seq(toks)], [4])
    assert d.trees[0].tokens == (1, 3) and d.trees[0].counts == (10, 9)
    d = SuffixProposer(max_depth=1, min_prob=0.05).propose([make_seq(toks)], [4])
    assert d.trees[0].tokens == (1, 3, 4) and d.trees[0].counts == (10, 9, 1)
    assert d.token_ids == [[3]]  # max_depth bounds the linear path too
    d = SuffixProposer(min_count=2, min_prob=0.0).propose([make_seq(toks)], [2])
    assert 4 not in d.trees[0].tokens


def test_suffix_no_match_and_k_zero():
    p = SuffixProposer()
    d = p.propose([make_seq([1, 2, 3], 0), make_seq([1, 2, 1], 1), make_seq([4], 2)], [4, 0, 4])
    assert d.token_ids == [[], [], []]
    assert d.trees == [None, None, None]
    assert d.natural_k == [0, 0, 0]
    assert isinstance(d, DraftTokens) and d.num_drafts(0) == 0


def test_suffix_trees_are_valid_on_random_text():
    rng = random.Random(1)
    p = SuffixProposer(max_tree_nodes=16)
    for i in range(60):
        seq = make_seq(random_text(rng.randint(2, 300), rng, vocab=rng.choice([3, 6, 20])), seq_id=i)
        k = rng.randint(1, 20)
        d = p.propose([seq], [k])
        tree, path = d.trees[0], d.token_ids[0]
        assert len(path) <= k
        if tree is None:
            assert path == []
            continue
        check_tree(tree, min(k, 16))
        assert tree.tokens[0] == seq.token_ids[-1]
        assert max(tree.depth()) <= p.max_depth
        # The linear path starts with the tree's most frequent branch.
        node = 0
        for t in path:
            kids = [j for j in range(1, len(tree.tokens)) if tree.parents[j] == node]
            if not kids:
                break
            assert tree.tokens[kids[0]] == t
            assert tree.counts[kids[0]] == max(tree.counts[j] for j in kids)
            node = kids[0]
        assert 1 <= d.natural_k[0] <= 16


@pytest.mark.parametrize("min_prob,min_count", [(0.1, 1), (0.0, 1), (0.3, 2)])
def test_suffix_shorter_answers_are_prefixes_of_longer_ones(min_prob, min_count):
    """What lets the engine propose before k is decided (``proposes_prefixes``): asking for k
    drafts gives the first k nodes of the tree, and the first k tokens of the chain, that asking
    for more gives, with the request's and the global evidence, on random and repetitive text."""
    rng = random.Random(3)
    p = SuffixProposer(max_tree_nodes=12, max_depth=8, min_prob=min_prob, min_count=min_count)
    assert p.proposes_prefixes
    for i in range(80):
        text = random_text(rng.randint(2, 250), rng, vocab=rng.choice([3, 6, 20]))
        seq = make_seq(text, seq_id=i)
        cap = rng.randint(1, 16)
        full = p.propose([seq], [cap])
        for k in range(cap + 1):
            direct = p.propose([seq], [k])
            cut = full.truncated([k])
            assert cut.token_ids == direct.token_ids, (i, k)
            assert cut.trees == direct.trees, (i, k)
            if direct.trees[0] is not None:
                assert direct.match_length[0] > 0  # a tree comes from a match (not every match gives one)
        assert full.match_length[0] == p.match(seq)[0]
        if rng.random() < 0.3:
            p.on_finished(seq)  # later requests also match the global store


def test_draft_tree_prefix():
    tree = DraftTree((9, 1, 2, 3, 4), (-1, 0, 0, 1, 3), (5, 3, 2, 2, 1))
    assert tree.prefix(0) is None
    assert tree.prefix(2) == DraftTree((9, 1, 2), (-1, 0, 0), (5, 3, 2))
    assert tree.prefix(3).parents == (-1, 0, 0, 1)
    assert tree.prefix(10) == tree


def test_suffix_incremental_matches_fresh():
    rng = random.Random(2)
    full = random_text(300, rng, vocab=8)
    seq = make_seq(full[:40], seq_id=5)
    inc = SuffixProposer()
    for t in full[40:]:
        seq.token_ids.append(t)
        k = rng.randint(1, 10)
        got = inc.propose([seq], [k])
        fresh = SuffixProposer().propose([make_seq(seq.token_ids, seq_id=5)], [k])
        assert got.token_ids == fresh.token_ids
        assert got.trees == fresh.trees
        assert got.natural_k == fresh.natural_k
    seq.token_ids = [1, 2, 1]  # replaced: rebuilt
    assert inc.propose([seq], [2]).token_ids == [[2, 1]]


def test_suffix_finished_output_helps_a_new_request():
    p = SuffixProposer()
    a = make_seq([100, 101, 102], seq_id=0)
    a.token_ids.extend([10, 11, 12, 13, 14, 15])
    p.propose([a], [2])
    p.on_finished(a)
    assert p.num_tracked() == 0 and p.num_cached_requests() == 1 and p.num_cached_tokens() == 6
    b = make_seq([200, 201, 10, 11, 12], seq_id=1)
    assert SuffixProposer().propose([b], [3]).token_ids == [[]]  # nothing of its own to match
    m, n_occ, source = p.match(b)
    assert (m, n_occ, source) == (3, 1, "global")
    d = p.propose([b], [3])
    assert d.token_ids == [[13, 14, 15]]
    # Only outputs are cached: the finished request's prompt teaches nothing.
    c = make_seq([300, 100, 101], seq_id=2)
    assert p.propose([c], [2]).token_ids == [[]]
    # A longer per-request match beats a shorter global one; equal lengths pool their counts.
    e = make_seq([10, 11, 12, 50, 60, 10, 11, 12], seq_id=3)
    d = p.propose([e], [2])
    assert p.match(e)[2] == "both"
    assert d.trees[0].tokens == (12, 50, 13) and d.trees[0].counts == (2, 1, 1)
    f = make_seq([9, 10, 11, 12, 77, 9, 10, 11, 12], seq_id=4)
    assert p.match(f)[2] == "request" and p.propose([f], [1]).token_ids == [[77]]


def test_suffix_global_memory_is_bounded():
    rng = random.Random(3)
    p = SuffixProposer(max_cached_requests=3)
    outputs = [[rng.randrange(1000) for _ in range(rng.randint(5, 40))] for _ in range(10)]
    for i, out in enumerate(outputs):
        s = make_seq([7, 7], seq_id=i)
        s.token_ids.extend(out)
        p.on_finished(s)
        assert p.num_cached_requests() == min(i + 1, 3)
    assert p.num_cached_tokens() == sum(map(len, outputs[-3:]))
    # Eviction removed every index entry of the evicted outputs.
    q = SuffixProposer(max_cached_requests=3)
    for i, out in enumerate(outputs[-3:]):
        s = make_seq([7, 7], seq_id=i)
        s.token_ids.extend(out)
        q.on_finished(s)
    assert p.num_index_entries() == q.num_index_entries()
    # An evicted output no longer helps; a kept one does.
    old, kept = outputs[0], outputs[-1]
    assert p.propose([make_seq([5000, *old[:6]], seq_id=99)], [2]).token_ids[0] != old[6:8]
    assert p.propose([make_seq([5000, *kept[:3]], seq_id=98)], [2]).token_ids == [kept[3:5]]
    # The token bound evicts too.
    r = SuffixProposer(max_cached_tokens=50)
    for i, out in enumerate(outputs):
        s = make_seq([7, 7], seq_id=i)
        s.token_ids.extend(out)
        r.on_finished(s)
        assert r.num_cached_tokens() <= 50
    # Per-request state is dropped when a request finishes.
    assert p.num_tracked() == 2
    p.on_finished(make_seq([1, 2], seq_id=99))
    p.on_finished(make_seq([1, 2], seq_id=98))
    assert p.num_tracked() == 0


def test_suffix_cost_is_low_at_2000_tokens():
    rng = random.Random(4)
    batch, ctx, steps = 4, 2000, 150
    seqs = [make_seq(random_text(ctx, rng, vocab=2000), seq_id=i) for i in range(batch)]
    cont = [random_text(steps, rng, vocab=2000) for _ in seqs]
    p = SuffixProposer()
    p.propose(seqs, [8] * batch)
    per_request = []
    for s in range(steps):
        for q, c in zip(seqs, cont):
            q.token_ids.append(c[s])
        t0 = time.perf_counter()
        p.propose(seqs, [8] * batch)
        per_request.append((time.perf_counter() - t0) / batch)
    assert statistics.median(per_request) < 2e-3  # measured ~30 us; loose for a shared machine
