"""The fused per-layer CPU kernels (engine/csrc/fused_ops.cpp) against the torch reference
(engine/layer_ops.py TorchLayerOps), which follows Hugging Face's Llama op for op."""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from specplan.engine.model.layer_ops import CpuKernelOps, TorchLayerOps, layer_ops_for


@pytest.fixture(scope="module", autouse=True)
def kernels():
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        pytest.skip("no C++ compiler on PATH: the engine uses the torch reference")
    assert layer_ops_for(torch.device("cpu"), torch.float32) is CpuKernelOps


@pytest.mark.parametrize("n,e", [(1, 64), (5, 576), (40, 100), (32, 576), (2, 13)])
@pytest.mark.parametrize("with_delta", [False, True])
def test_add_rms_norm(n, e, with_delta):
    g = torch.Generator().manual_seed(n + e)
    h = torch.randn(n, e, generator=g) * 3
    delta = torch.randn(n, e, generator=g) if with_delta else None
    w = torch.randn(e, generator=g)
    h_ref, h_ker = h.clone(), h.clone()
    ref = TorchLayerOps.add_rms_norm_(h_ref, delta, w, 1e-5)
    out = CpuKernelOps.add_rms_norm_(h_ker, delta, w, 1e-5)
    assert torch.allclose(h_ker, h_ref, atol=1e-6)  # the residual stream is updated in place, the same way
    assert torch.allclose(out, ref, atol=1e-5, rtol=1e-5)
    if with_delta:
        assert not torch.equal(h_ker, h)


def _caches(blocks, block_size, kvh, d, head_major=False, dtype=torch.float32):
    """K and V caches [blocks, block_size, KVH, D]; head_major: over [blocks, KVH, block_size, D]
    storage, as the engine allocates them."""
    if head_major:
        return tuple(torch.zeros(blocks, kvh, block_size, d, dtype=dtype).transpose(1, 2) for _ in "kv")
    return tuple(torch.zeros(blocks, block_size, kvh, d, dtype=dtype) for _ in "kv")


@pytest.mark.parametrize("n,heads,kvh,d", [(1, 9, 3, 64), (7, 4, 2, 8), (33, 2, 2, 16)])
@pytest.mark.parametrize("head_major", [False, True], ids=["token-major", "head-major"])
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16], ids=["fp32-cache", "fp16-cache"])
def test_rope_write_kv(n, heads, kvh, d, head_major, kv_dtype):
    g = torch.Generator().manual_seed(n)
    qkv = torch.randn(n, (heads + 2 * kvh) * d, generator=g)
    max_pos, blocks, block_size = 128, 20, 4
    angles = torch.rand(max_pos, d // 2, generator=g) * 6
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    positions = torch.randperm(max_pos, generator=g)[:n]
    slots = torch.randperm(blocks * block_size, generator=g)[:n]  # scattered slots
    k_ref, v_ref = _caches(blocks, block_size, kvh, d, dtype=kv_dtype)
    k_ker, v_ker = _caches(blocks, block_size, kvh, d, head_major, dtype=kv_dtype)
    q_ref = TorchLayerOps.rope_write_kv(qkv, positions, cos, sin, k_ref, v_ref, slots, heads, kvh)
    q_ker = CpuKernelOps.rope_write_kv(qkv, positions, cos, sin, k_ker, v_ker, slots, heads, kvh)
    assert q_ker.shape == (n, heads, d)
    assert torch.allclose(q_ker, q_ref, atol=1e-5)
    # A float16 cache: both round to nearest even (values bit for bit; a rotated key may sit on the
    # other side of a rounding edge after its float32 rotation's last bit).
    tol = 1e-5 if kv_dtype == torch.float32 else 2e-3
    assert torch.allclose(k_ker.float(), k_ref.float(), atol=tol, rtol=tol) and torch.equal(v_ker, v_ref)
    assert k_ker.abs().sum() > 0


def test_rope_write_kv_rejects_bad_slots():
    qkv = torch.randn(1, 3 * 8)
    cos = sin = torch.ones(4, 8)
    k, v = _caches(2, 2, 1, 8)
    with pytest.raises(RuntimeError, match="outside the KV cache"):
        CpuKernelOps.rope_write_kv(qkv, torch.tensor([0]), cos, sin, k, v, torch.tensor([4]), 1, 1)
    with pytest.raises(RuntimeError, match="outside the RoPE table"):
        CpuKernelOps.rope_write_kv(qkv, torch.tensor([4]), cos, sin, k, v, torch.tensor([0]), 1, 1)


@pytest.mark.parametrize("n,i", [(1, 1536), (3, 13), (17, 64), (32, 1536), (2, 40)])
def test_silu_mul(n, i):
    g = torch.Generator().manual_seed(i)
    gate_up = torch.randn(n, 2 * i, generator=g) * 8  # large |gate| too: exp must not overflow
    gate_up[0, 0], gate_up[0, 1] = 100.0, -100.0
    ref = TorchLayerOps.silu_mul(gate_up)
    out = CpuKernelOps.silu_mul(gate_up)
    assert torch.allclose(out, ref, atol=1e-5, rtol=1e-5)


def test_other_dtypes_use_the_reference():
    assert layer_ops_for(torch.device("cpu"), torch.float64) is TorchLayerOps


@pytest.mark.parametrize("rows,vocab", [(1, 5), (3, 17), (8, 49152), (33, 1000)])
def test_greedy_tokens_match_torch_argmax(rows, vocab):
    from specplan.engine.sampling import greedy_tokens

    g = torch.Generator().manual_seed(rows * vocab)
    logits = torch.randn(rows, vocab, generator=g)
    assert torch.equal(greedy_tokens(logits), logits.argmax(dim=-1))
    ties = torch.randint(0, 3, (rows, vocab), generator=g).float()  # many equal maxima per row
    assert torch.equal(greedy_tokens(ties), ties.argmax(dim=-1))  # the lowest id wins, as in torch


def test_greedy_tokens_edge_rows():
    from specplan.engine.sampling import greedy_tokens

    x = torch.zeros(4, 100)
    x[0, 99] = 1.0  # maximum in the scalar tail
    x[1] = float("-inf")  # every token masked: token 0
    x[2, 40] = float("nan")  # NaN wins, as in torch
    x[3, 17] = x[3, 18] = 5.0
    assert greedy_tokens(x).tolist() == x.argmax(dim=-1).tolist() == [99, 0, 40, 17]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("tree", [False, True], ids=["causal", "tree"])
def test_decoder_layers_in_one_call_equal_the_per_op_loop(arch, tree):
    """engine/csrc/decoder_layers.cpp runs the loop of Model.forward from C++: same kernels, same
    order, so the same bits, in the hidden states and in every K/V written."""
    from conftest import loaded_from_hf, tiny_hf_model
    from specplan.engine.batch import TokenBatch
    from specplan.engine.model.transformer import Model
    from specplan.engine.model_runner import allocate_kv_cache, layer_caches

    loaded = loaded_from_hf(tiny_hf_model(arch, dtype=torch.float32, num_hidden_layers=3))
    model = Model(loaded.config, loaded.weights, "cpu", torch.float32)
    assert model.kernel_stack is not None and model.truncated(2).kernel_stack is not None
    # batch.py's worked example (block_size 4): r0 prefills positions 0..2, r1 decodes position 9,
    # r2 verifies 3 tokens from position 5 (as a tree root -> {x, y} when `tree`).
    tables = [[0, 0, 0], [1, 2, 3], [4, 5, 0]]
    positions = [0, 1, 2, 9, 5, 6, 7]
    slots = [tables[r][p // 4] * 4 + p % 4 for r, p in zip([0, 0, 0, 1, 2, 2, 2], positions)]
    tree_bits = None
    if tree:
        positions[-1] = 6  # node y sits in slot 7 but is rotated at depth 1
        tree_bits = torch.tensor([0, 0, 0, 0, 0b001, 0b011, 0b101])

    def batch() -> TokenBatch:
        return TokenBatch(input_ids=torch.tensor([5, 7, 11, 13, 17, 19, 23]), positions=torch.tensor(positions),
                          query_start_loc=torch.tensor([0, 3, 4, 7], dtype=torch.int32),
                          seq_lens=torch.tensor([3, 10, 8], dtype=torch.int32), slot_mapping=torch.tensor(slots),
                          block_tables=torch.tensor(tables, dtype=torch.int32),
                          logits_indices=torch.tensor([2, 3, 4, 5, 6]), query_lens_host=[3, 1, 3],
                          seq_lens_host=[3, 10, 8], tree_masks={2: torch.ones(3, 3, dtype=torch.bool)} if tree else None,
                          tree_bits=tree_bits)

    cache = allocate_kv_cache(loaded.config, 6, 4, torch.float32, torch.device("cpu"))
    cache.copy_(torch.randn(cache.shape, generator=torch.Generator().manual_seed(0)))  # earlier context
    caches = {"stack": cache.clone(), "loop": cache.clone()}
    hidden = {"stack": model.forward(batch(), layer_caches(caches["stack"]), 4)}
    model.kernel_stack = None
    hidden["loop"] = model.forward(batch(), layer_caches(caches["loop"]), 4)
    assert torch.equal(hidden["stack"], hidden["loop"]) and hidden["stack"].abs().sum() > 0
    assert torch.equal(caches["stack"], caches["loop"]) and not torch.equal(caches["stack"], cache)


def _team_model(scheme: str):
    """A model whose products and attention are large enough to be split across threads (products
    of >= 32 KB, attention over >= 256 row-keys), in float32 or quantised."""
    from conftest import loaded_from_hf, tiny_hf_model
    from specplan.engine.model.loader import quantize_model
    from specplan.engine.model.transformer import Model

    loaded = loaded_from_hf(tiny_hf_model("llama", dtype=torch.float32, num_hidden_layers=2, hidden_size=256,
                                          intermediate_size=768, num_attention_heads=4, num_key_value_heads=2))
    if scheme != "none":
        loaded = quantize_model(loaded, scheme)
    return loaded, Model(loaded.config, loaded.weights, "cpu", torch.float32)


def _decode_batch(context: list[int], block_size: int, blocks_per_seq: int):
    """One query token per sequence at position context[i] - 1, sequence i in its own blocks."""
    from specplan.engine.batch import TokenBatch

    n = len(context)
    tables = [[i * blocks_per_seq + j for j in range(blocks_per_seq)] for i in range(n)]
    positions = [c - 1 for c in context]
    slots = [tables[i][p // block_size] * block_size + p % block_size for i, p in enumerate(positions)]
    return TokenBatch(input_ids=torch.arange(3, 3 + n), positions=torch.tensor(positions),
                      query_start_loc=torch.arange(n + 1, dtype=torch.int32),
                      seq_lens=torch.tensor(context, dtype=torch.int32), slot_mapping=torch.tensor(slots),
                      block_tables=torch.tensor(tables, dtype=torch.int32), logits_indices=torch.arange(n),
                      query_lens_host=[1] * n, seq_lens_host=list(context))


@pytest.mark.parametrize("scheme", ["none", "q4"])
@pytest.mark.parametrize("context", [[300], [200, 17, 260, 5]], ids=["b1", "b4"])
def test_decoder_team_equals_forking_per_kernel(monkeypatch, scheme, context):
    """decoder_layers keeps its threads for the whole call (csrc/team.h) and hands each kernel's
    chunks to them, instead of forking per kernel: the same split, so the same bits, in the hidden
    states and in every K/V written (SPECPLAN_DECODER_TEAM=0 forks per kernel)."""
    from specplan.engine.model_runner import allocate_kv_cache, layer_caches

    if torch.get_num_threads() < 2:
        pytest.skip("one thread: there is no team to form")
    loaded, model = _team_model(scheme)
    block_size, per_seq = 16, 20
    cache = allocate_kv_cache(loaded.config, per_seq * len(context), block_size, torch.float32, torch.device("cpu"))
    cache.copy_(torch.randn(cache.shape, generator=torch.Generator().manual_seed(1)))  # the earlier context
    out = {}
    for team in ("1", "0"):
        monkeypatch.setenv("SPECPLAN_DECODER_TEAM", team)
        kv = cache.clone()
        out[team] = (model.forward(_decode_batch(context, block_size, per_seq), layer_caches(kv), block_size), kv)
    assert torch.equal(out["1"][0], out["0"][0]) and out["1"][0].abs().sum() > 0
    assert torch.equal(out["1"][1], out["0"][1]) and not torch.equal(out["1"][1], cache)


def test_decoder_team_passes_an_error_on_and_serves_the_next_call(monkeypatch):
    """A check that fails inside the team (here attention's, on a block id past the cache) raises on
    the calling thread as it would without a team, and the threads are released: the next call runs."""
    from specplan.engine.model_runner import allocate_kv_cache, layer_caches

    monkeypatch.setenv("SPECPLAN_DECODER_TEAM", "1")
    loaded, model = _team_model("q4")
    cache = allocate_kv_cache(loaded.config, 20, 16, torch.float32, torch.device("cpu"))
    bad = _decode_batch([300], 16, 20)
    bad.block_tables[0, 3] = 99  # no such block
    with pytest.raises(RuntimeError, match="out of range"):
        model.forward(bad, layer_caches(cache), 16)
    good = model.forward(_decode_batch([300], 16, 20), layer_caches(cache), 16)
    assert torch.isfinite(good).all()


def test_every_kernel_file_feeds_the_build_id():
    """Profiles are keyed by cpu_kernels.build_id(): a kernel source or header left out of its hash
    would let a profile timed on other code be reused."""
    from pathlib import Path

    from specplan.engine.model import cpu_kernels

    csrc = Path(cpu_kernels.__file__).parent / "csrc"
    hashed = {p.name for p in cpu_kernels._SOURCES + cpu_kernels._HEADERS}
    assert {p.name for p in csrc.iterdir() if p.suffix in (".cpp", ".h")} == hashed
