"""CPU paged-attention kernel (engine/attention_cpu.py + engine/csrc/paged_attention.cpp) against the
torch reference (engine/attention.py) on random caches, shuffled block tables and mixed batches."""

from __future__ import annotations

import os
import random
import shutil

import pytest
import torch

from specplan.engine.model.attention import AttentionPlan, paged_attention
from specplan.engine.batch import TokenBatch
from specplan.engine.model_runner import _ancestor_bits, _ancestor_mask
from specplan.engine import DraftTree

TOL = 1e-5


@pytest.fixture(scope="module")
def kernel():
    from specplan.engine.model.attention_cpu import load_kernel

    if shutil.which(os.environ.get("CXX", "c++")) is None:
        pytest.skip("no C++ compiler on PATH: the engine uses the torch reference")
    op = load_kernel()
    assert op is not None, "a compiler is available but the kernel failed to build (see the warning)"
    return op


def make_batch(specs: list[tuple[int, int]], block_size: int, seed: int, extra_blocks: int = 0,
               tree: dict[int, torch.Tensor] | None = None) -> tuple[TokenBatch, int]:
    """specs: (cached context, query tokens) per request. Blocks come from a shuffled pool; tables
    are padded with 0 like ModelRunner.build_batch. Returns the batch and the pool size."""
    rng = random.Random(seed)
    need = sum(-(-(c + n) // block_size) + extra_blocks for c, n in specs)
    num_blocks = need + 5  # some blocks belong to nobody
    pool = list(range(num_blocks))
    rng.shuffle(pool)
    tables, positions, slots, qsl, seq_lens = [], [], [], [0], []
    for ctx, n in specs:
        length = ctx + n
        blocks = [pool.pop() for _ in range(-(-length // block_size) + extra_blocks)]
        tables.append(blocks)
        pos = list(range(ctx, length))
        positions += pos
        slots += [blocks[p // block_size] * block_size + p % block_size for p in pos]
        qsl.append(qsl[-1] + n)
        seq_lens.append(length)
    width = max(len(t) for t in tables)
    tables = [t + [0] * (width - len(t)) for t in tables]
    n_tok = len(positions)
    qlens = [n for _, n in specs]
    batch = TokenBatch(
        input_ids=torch.zeros(n_tok, dtype=torch.int64),
        positions=torch.tensor(positions, dtype=torch.int64),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        block_tables=torch.tensor(tables, dtype=torch.int32),
        logits_indices=torch.arange(n_tok, dtype=torch.int64),
        query_lens_host=qlens,
        seq_lens_host=seq_lens,
        tree_masks=tree,
    )
    return batch, num_blocks


def make_tensors(batch: TokenBatch, num_blocks: int, block_size: int, heads: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    # One [2, ...] allocation like a layer of the engine's kv_cache: head-major storage seen as
    # [2, num_blocks, block_size, KVH, D] (model_runner.allocate_kv_cache). Every block (used or
    # not) is random, so reading a wrong block or slot shows up as a mismatch.
    kv = torch.randn(2, num_blocks, kv_heads, block_size, head_dim, generator=g, dtype=dtype).transpose(2, 3)
    q = 2 * torch.randn(batch.num_tokens, heads, head_dim, generator=g, dtype=dtype)  # peaky softmax
    return q, kv[0], kv[1]


def reference(q, k_cache, v_cache, batch, window):
    block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    plan = AttentionPlan.build(batch, block_size, q.shape[1] // kv_heads, window)
    return paged_attention(q, k_cache, v_cache, plan, q.shape[-1] ** -0.5)


def check(specs, *, heads=9, kv_heads=3, head_dim=64, block_size=16, window=None, dtype=torch.float32,
          seed=0, extra_blocks=0, cache_transform=None):
    from specplan.engine.model.attention_cpu import paged_attention_cpu

    batch, num_blocks = make_batch(specs, block_size, seed, extra_blocks)
    q, k_cache, v_cache = make_tensors(batch, num_blocks, block_size, heads, kv_heads, head_dim, dtype, seed)
    if cache_transform is not None:
        k_cache, v_cache = cache_transform(k_cache), cache_transform(v_cache)
    with torch.inference_mode():
        ref = reference(q, k_cache, v_cache, batch, window)
        out = paged_attention_cpu(q, k_cache, v_cache, batch, head_dim ** -0.5, window)
    assert out.shape == q.shape and out.dtype == q.dtype
    err = (out - ref).abs().max().item()
    assert err <= TOL, f"max abs error {err:.3g} > {TOL}"
    return out


# decodes (T=1), verifies (T=2..9), a prefill chunk of 100 tokens after 150 cached ones, a fresh
# 40-token prefill; contexts from 1 to 600 (partial last blocks almost everywhere).
MIXED = [(0, 1), (16, 1), (255, 1), (599, 1), (36, 9), (4, 5), (127, 2), (300, 7), (150, 100),
         (0, 40), (63, 3), (1, 9), (500, 4)]


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (9, 3), (8, 2)], ids=["G1", "G3", "G4"])
@pytest.mark.parametrize("window", [None, 48], ids=["causal", "window48"])
def test_mixed_batch_matches_reference(kernel, heads, kv_heads, window):
    check(MIXED, heads=heads, kv_heads=kv_heads, window=window, seed=heads * 7 + (window or 0))


@pytest.mark.parametrize("seed", range(4))
def test_random_batches_match_reference(kernel, seed):
    rng = random.Random(100 + seed)
    specs = []
    for _ in range(rng.randint(1, 12)):
        kind = rng.random()
        if kind < 0.4:
            specs.append((rng.randint(0, 599), 1))  # decode
        elif kind < 0.85:
            specs.append((rng.randint(0, 591), rng.randint(1, 9)))  # verify
        else:
            specs.append((rng.randint(0, 300), rng.randint(17, 120)))  # prefill chunk
    heads, kv_heads = rng.choice([(4, 4), (9, 3), (8, 2)])
    window = rng.choice([None, 1, 17, 200])
    check(specs, heads=heads, kv_heads=kv_heads, window=window, block_size=rng.choice([1, 8, 16, 32]),
          seed=seed, extra_blocks=rng.randint(0, 2))


def test_model_shapes_decode_batch(kernel):
    """This model's shapes: B=32 decodes at context 256, and one 9-token verify."""
    check([(255, 1)] * 32, seed=1)
    check([(247, 9)], seed=2)


def test_long_prefill_chunk(kernel):
    """512 query tokens (split across threads by query chunks) after 100 cached tokens."""
    check([(100, 512), (40, 1)], window=None, seed=3)
    check([(100, 512)], window=128, seed=4)


def test_float64(kernel):
    check(MIXED, heads=8, kv_heads=2, dtype=torch.float64, seed=5)
    check(MIXED, heads=9, kv_heads=3, dtype=torch.float64, window=33, seed=6)


def test_odd_head_dim_and_block_size(kernel):
    """head_dim not a multiple of the vector width (tails of every loop); blocks of 1 and 32 slots."""
    check(MIXED, heads=6, kv_heads=2, head_dim=36, block_size=32, seed=7)
    check([(9, 1), (30, 5), (0, 20)], heads=3, kv_heads=1, head_dim=12, block_size=1, seed=8)
    check(MIXED, heads=8, kv_heads=2, head_dim=80, dtype=torch.float64, window=20, seed=10)


@pytest.mark.parametrize("head_dim,block_size", [(64, 32), (64, 8), (128, 16), (128, 1)])
def test_fast_path_head_sizes(kernel, head_dim, block_size):
    """float with head_dim 64/128 runs the 16-keys-per-pass path: blocks wider than 16 (two
    passes per block), narrower ones (masked lanes), one key per block, and a sliding window."""
    check(MIXED, heads=8, kv_heads=2, head_dim=head_dim, block_size=block_size, seed=20 + block_size)
    check([(0, 40), (70, 3), (200, 1)], heads=4, kv_heads=4, head_dim=head_dim, block_size=block_size,
          window=37, seed=30 + block_size)


def _half(cache: torch.Tensor) -> torch.Tensor:
    """The same cache stored as float16, in the same strided (head-major) layout."""
    return cache.to(torch.float16)


@pytest.mark.parametrize("head_dim,block_size", [(64, 16), (64, 8), (128, 16), (128, 1)])
def test_float16_cache_matches_reference(kernel, head_dim, block_size):
    """A float16 KV cache (half the bytes a decode step reads) with float32 queries: the kernel
    widens each key and value as it loads them, the reference widens the gathered cache; both do
    the same float math on the same values. Mixed batches, a sliding window, GQA 1-4."""
    for heads, kv_heads in ((8, 2), (9, 3), (4, 4)):
        check(MIXED, heads=heads, kv_heads=kv_heads, head_dim=head_dim, block_size=block_size,
              seed=40 + heads + block_size, cache_transform=_half)
    check([(0, 40), (70, 3), (200, 1)], heads=4, kv_heads=4, head_dim=head_dim, block_size=block_size,
          window=37, seed=50 + block_size, cache_transform=_half)


def test_float16_cache_is_read_as_half_not_reinterpreted(kernel):
    """The kernel reads the float16 values themselves: its answer equals the float32 kernel's on
    the widened cache bit for bit (every float16 is a float; only the loads differ), and differs
    from the answer on the unrounded float32 cache (so the rounding did reach the cache)."""
    from specplan.engine.model.attention_cpu import paged_attention_cpu

    batch, num_blocks = make_batch(MIXED, 16, 3)
    q, k_cache, v_cache = make_tensors(batch, num_blocks, 16, 9, 3, 64, torch.float32, 3)
    k16, v16 = k_cache.to(torch.float16), v_cache.to(torch.float16)
    with torch.inference_mode():
        half = paged_attention_cpu(q, k16, v16, batch, 0.125, None)
        widened = paged_attention_cpu(q, k16.float(), v16.float(), batch, 0.125, None)
        full = paged_attention_cpu(q, k_cache, v_cache, batch, 0.125, None)
    assert torch.equal(half, widened)
    assert (half - full).abs().max().item() > 1e-5


def test_float16_cache_refuses_what_it_cannot_read(kernel):
    """A float16 cache at a head size without the fast path, or with float64 queries, is an error
    naming the rule (the engine routes those to the torch reference: ``supports`` says no)."""
    from specplan.engine.model.attention_cpu import paged_attention_cpu, supports

    batch, num_blocks = make_batch([(30, 1)], 16, 4)
    q, k_cache, v_cache = make_tensors(batch, num_blocks, 16, 4, 2, 32, torch.float32, 4)
    assert not supports(batch, torch.float32, "cpu", torch.float16, 32)
    assert supports(batch, torch.float32, "cpu", torch.float16, 64)
    assert not supports(batch, torch.float64, "cpu", torch.float16, 64)
    with pytest.raises(RuntimeError, match="head_dim 64 or 128"):
        paged_attention_cpu(q, k_cache.half(), v_cache.half(), batch, 0.125, None)
    with pytest.raises(RuntimeError, match="float16 with float32 q"):
        paged_attention_cpu(q.double(), k_cache.half(), v_cache.half(), batch, 0.125, None)


def test_strided_cache_view(kernel):
    """A cache whose head_dim is contiguous but whose other strides are not the dense ones."""

    def padded(cache: torch.Tensor) -> torch.Tensor:
        big = torch.randn(*cache.shape[:-1], cache.shape[-1] + 8, dtype=cache.dtype)
        big[..., :cache.shape[-1]] = cache
        return big[..., :cache.shape[-1]]

    check(MIXED, heads=9, kv_heads=3, window=48, seed=9, cache_transform=padded)


def test_token_major_cache(kernel):
    """The other storage order (the heads of one slot side by side) reads the same."""
    check(MIXED, heads=9, kv_heads=3, window=48, seed=10, cache_transform=lambda c: c.contiguous())
    check(MIXED, heads=8, kv_heads=2, head_dim=32, seed=12, cache_transform=lambda c: c.contiguous())


def test_engine_cache_layout_write_and_move():
    """allocate_kv_cache: logical [L, 2, blocks, block_size, KVH, D] over head-major storage (one
    block's slots of one head are one contiguous run); write_kv puts slot s at (s // bs, s % bs)
    and ModelRunner.copy_slots moves slots in every layer, both through the strided view."""
    from specplan.engine.model.attention import write_kv
    from types import SimpleNamespace

    from specplan.engine.model_runner import ModelRunner, allocate_kv_cache

    config = SimpleNamespace(num_layers=2, num_kv_heads=2, head_dim=4)  # all allocate_kv_cache reads
    bs, blocks = 4, 5
    kv = allocate_kv_cache(config, blocks, bs, torch.float32, torch.device("cpu"))
    assert kv.shape == (2, 2, blocks, bs, 2, 4)
    assert kv.stride(4) == bs * 4 and kv.stride(3) == 4  # head-major: slot stride D, head stride bs * D
    g = torch.Generator().manual_seed(0)
    slots = torch.tensor([0, 5, 19, 7])  # blocks 0, 1, 4, 1
    k, v = torch.randn(4, 2, 4, generator=g), torch.randn(4, 2, 4, generator=g)
    write_kv(k, v, kv[1, 0], kv[1, 1], slots)
    for i, s in enumerate(slots.tolist()):
        assert torch.equal(kv[1, 0, s // bs, s % bs], k[i]) and torch.equal(kv[1, 1, s // bs, s % bs], v[i])
    assert kv[0].abs().sum() == 0  # the other layer untouched
    kv[0].copy_(torch.randn(kv[0].shape, generator=g))
    before = kv.clone()
    ModelRunner(None, kv, bs).copy_slots([5, 19], [8, 9])  # slots 8, 9: block 2, offsets 0, 1
    for src, dst in ((5, 8), (19, 9)):
        assert torch.equal(kv[:, :, dst // bs, dst % bs], before[:, :, src // bs, src % bs])
    untouched = [s for s in range(blocks * bs) if s not in (8, 9)]
    assert all(torch.equal(kv[:, :, s // bs, s % bs], before[:, :, s // bs, s % bs]) for s in untouched)


def test_threads_agree_with_single_thread(kernel):
    """Dynamic scheduling over threads changes nothing: every row is computed by one thread."""
    from specplan.engine.model.attention_cpu import paged_attention_cpu

    batch, num_blocks = make_batch(MIXED, 16, 11)
    q, k_cache, v_cache = make_tensors(batch, num_blocks, 16, 9, 3, 64, torch.float32, 11)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = paged_attention_cpu(q, k_cache, v_cache, batch, 0.125, None)
        torch.set_num_threads(max(2, before))
        many = paged_attention_cpu(q, k_cache, v_cache, batch, 0.125, None)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, many)


@pytest.mark.parametrize("specs", [[(255, 1)], [(2000, 1)], [(120, 9)], [(600, 1), (40, 1)], [(0, 1)], [(70, 1)]],
                         ids=["decode256", "decode2000", "verify9", "two-decodes", "first-token", "short"])
@pytest.mark.parametrize("head_dim,dtype", [(64, torch.float32), (32, torch.float32), (64, torch.float64)],
                         ids=["fast-path", "generic-float", "double"])
def test_few_requests_on_two_threads(kernel, specs, head_dim, dtype):
    """One or two requests on two threads: too few (request, KV head) items to share, so the kernel
    gives each thread fewer query rows per item."""
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        check(specs, head_dim=head_dim, dtype=dtype, seed=len(specs) + head_dim)
    finally:
        torch.set_num_threads(before)


def _alone(batch: TokenBatch, row: int) -> TokenBatch:
    """Row ``row`` of a one-request batch as a decode of its own: the same cache and block table,
    the keys up to its position."""
    seen = int(batch.positions[row]) + 1
    return TokenBatch(input_ids=batch.input_ids[row:row + 1], positions=batch.positions[row:row + 1],
                      query_start_loc=torch.tensor([0, 1], dtype=torch.int32),
                      seq_lens=torch.tensor([seen], dtype=torch.int32), slot_mapping=batch.slot_mapping[row:row + 1],
                      block_tables=batch.block_tables, logits_indices=torch.arange(1), query_lens_host=[1],
                      seq_lens_host=[seen], tree_masks=None)


@pytest.mark.parametrize("head_dim,kv_dtype", [(64, torch.float32), (32, torch.float32), (64, torch.float16)],
                         ids=["fast-path", "generic-float", "float16-cache"])
def test_a_row_is_the_same_bits_alone_or_in_a_verify_step(kernel, head_dim, kv_dtype):
    """Batch invariance, which greedy speculation needs exactly: the row a verify step computes for
    position p equals bit for bit the decode step at p (B = 1, two threads). Contexts cross block
    boundaries and run past 8 blocks, where the kernel once split a lone decode's keys."""
    from specplan.engine.model.attention_cpu import paged_attention_cpu

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        for ctx in range(120, 300, 13):
            for T in (2, 5):
                batch, num_blocks = make_batch([(ctx, T)], 16, ctx)
                q, k_cache, v_cache = make_tensors(batch, num_blocks, 16, 9, 3, head_dim, torch.float32, ctx)
                k_cache, v_cache = k_cache.to(kv_dtype), v_cache.to(kv_dtype)
                verify = paged_attention_cpu(q, k_cache, v_cache, batch, 0.125, None)
                for row in range(T):
                    alone = paged_attention_cpu(q[row:row + 1].contiguous(), k_cache, v_cache, _alone(batch, row),
                                                0.125, None)
                    assert torch.equal(alone[0], verify[row]), (ctx, T, row)
    finally:
        torch.set_num_threads(before)


def test_a_tree_verify_on_two_threads(kernel):
    """A single request verifying a draft tree on two threads."""
    from specplan.engine.model.attention_cpu import paged_attention_cpu

    tree = random_tree(random.Random(3), 9)
    batch, num_blocks = tree_batch([(300, 9)], {0: tree}, 16, 31)
    q, k_cache, v_cache = make_tensors(batch, num_blocks, 16, 9, 3, 64, torch.float32, 31)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        with torch.inference_mode():
            ref = reference(q, k_cache, v_cache, batch, None)
            out = paged_attention_cpu(q, k_cache, v_cache, batch, 0.125, None)
    finally:
        torch.set_num_threads(before)
    assert (out - ref).abs().max().item() <= TOL


def random_tree(rng: random.Random, nodes: int) -> DraftTree:
    return DraftTree(tokens=tuple(range(nodes)), parents=(-1,) + tuple(rng.randrange(t) for t in range(1, nodes)))


def test_ancestor_bits_are_the_mask_rows():
    rng = random.Random(5)
    for nodes in (1, 2, 9, 40, 63):
        tree = random_tree(rng, nodes)
        mask = _ancestor_mask(tree)
        assert _ancestor_bits(tree) == [sum(1 << u for u in range(nodes) if mask[t, u]) for t in range(nodes)]


def tree_batch(specs, trees: dict[int, DraftTree], block_size: int, seed: int):
    """make_batch with requests ``trees`` turned into draft trees (masks and bits as the runner builds them)."""
    masks = {i: _ancestor_mask(t) for i, t in trees.items()}
    batch, num_blocks = make_batch(specs, block_size, seed, tree=masks)
    bits = [0] * batch.num_tokens
    starts = batch.query_start_loc.tolist()
    for i, t in trees.items():
        assert len(t.tokens) == specs[i][1]
        bits[starts[i]:starts[i + 1]] = _ancestor_bits(t)
    batch.tree_bits = torch.tensor(bits, dtype=torch.int64)
    return batch, num_blocks


@pytest.mark.parametrize("head_dim,dtype,kv_dtype", [(64, torch.float32, None), (32, torch.float32, None),
                                                    (64, torch.float64, None), (64, torch.float32, torch.float16)],
                         ids=["fast-path", "generic-float", "double", "float16-cache"])
@pytest.mark.parametrize("window", [None, 24], ids=["causal", "window24"])
def test_tree_batches_match_reference(kernel, head_dim, dtype, kv_dtype, window):
    """Draft trees (9 nodes, wide and deep, some straddling a block edge; one of 40 nodes, more than
    a 16-key pass) beside decodes, linear verifies and a prefill chunk, in one batch."""
    from specplan.engine.model.attention_cpu import paged_attention_cpu, supports

    rng = random.Random(head_dim + (window or 0))
    specs = [(20, 9), (5, 1), (27, 9), (0, 9), (100, 40), (63, 4), (150, 30), (9, 9)]
    trees = {0: random_tree(rng, 9), 2: random_tree(rng, 9), 3: random_tree(rng, 9), 4: random_tree(rng, 40),
             7: DraftTree(tokens=tuple(range(9)), parents=(-1,) + (0,) * 8)}  # 8 siblings: each sees the root only
    batch, num_blocks = tree_batch(specs, trees, 16, 21)
    q, k_cache, v_cache = make_tensors(batch, num_blocks, 16, 9, 3, head_dim, dtype, 21)
    if kv_dtype is not None:
        k_cache, v_cache = k_cache.to(kv_dtype), v_cache.to(kv_dtype)
    assert supports(batch, q.dtype, q.device, k_cache.dtype, head_dim)
    with torch.inference_mode():
        ref = reference(q, k_cache, v_cache, batch, window)
        out = paged_attention_cpu(q, k_cache, v_cache, batch, head_dim ** -0.5, window)
    err = (out - ref).abs().max().item()
    assert err <= TOL, f"max abs error {err:.3g} > {TOL}"
    # the bits matter: seeing every node (a chain's causal rule) gives another answer
    batch.tree_bits = torch.where(batch.tree_bits != 0, (1 << 40) - 1, 0)
    with torch.inference_mode():
        wrong = paged_attention_cpu(q, k_cache, v_cache, batch, head_dim ** -0.5, window)
    assert (wrong - ref).abs().max().item() > 1e-3


def test_tree_batch_without_bits_is_refused(kernel):
    from specplan.engine.model.attention_cpu import paged_attention_cpu, supports

    tree = {0: torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)}
    batch, num_blocks = make_batch([(20, 3), (5, 1)], 16, 12, tree=tree)
    q, k_cache, v_cache = make_tensors(batch, num_blocks, 16, 4, 2, 32, torch.float32, 12)
    assert not supports(batch, q.dtype, q.device)
    with pytest.raises(ValueError, match="tree"):
        paged_attention_cpu(q, k_cache, v_cache, batch, 0.2, None)
    batch.tree_masks = None
    assert supports(batch, q.dtype, q.device)


def test_bad_block_id_is_an_error_not_a_crash(kernel):
    from specplan.engine.model.attention_cpu import paged_attention_cpu

    batch, num_blocks = make_batch([(20, 1), (40, 2)], 16, 13)
    q, k_cache, v_cache = make_tensors(batch, num_blocks, 16, 4, 2, 32, torch.float32, 13)
    batch.block_tables[1, 2] = num_blocks  # one past the end of the pool
    with pytest.raises(RuntimeError, match="out of range"):
        paged_attention_cpu(q, k_cache, v_cache, batch, 0.2, None)
