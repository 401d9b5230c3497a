"""The EAGLE-3 head proposer: the target's captured features, lossless drafting (greedy and sampled),
the training math equal to the engine's, and bad heads refused in one line."""

from __future__ import annotations

import json
import math
import random
import time

import pytest
import torch

from conftest import assert_follows_marginals, loaded_from_hf, tiny_hf_model, tiny_llm
from specplan.engine import SamplingParams
from specplan.engine.config import SpecConfig
from specplan.engine.batch import TokenBatch
from specplan.engine.model.transformer import Model
from specplan.engine.model_runner import allocate_kv_cache, layer_caches
from specplan.engine.proposers.eagle import EagleHead, HeadConfig, HeadError, read_head, target_fingerprint, write_head
from specplan.train_draft import HeadModule

LAYERS = (0, 1, 3)
DRAFT_VOCAB = 64  # of the tiny model's 96


@pytest.fixture(scope="module")
def model():
    return tiny_hf_model("llama", num_hidden_layers=4)


def make_head(model, path, seed: int = 5, draft_vocab: int = DRAFT_VOCAB, fingerprint: bool = True) -> HeadModule:
    """A random head for ``model`` written to ``path`` (fp16 on disk, as shipped)."""
    loaded = loaded_from_hf(model)
    c = loaded.config
    g = torch.Generator().manual_seed(seed)
    draft_ids = torch.randperm(c.vocab_size, generator=g)[:draft_vocab].sort().values
    embed = loaded.weights["model.embed_tokens.weight"].float()
    target = Model(c, loaded.weights, "cpu", torch.float32, packed_linears=False)
    config = HeadConfig.for_target(c, draft_vocab, LAYERS)
    torch.manual_seed(seed)
    head = HeadModule(config, embed, embed[draft_ids].clone(), target.rope_cos, target.rope_sin, train_lm_head=True)
    with torch.no_grad():
        for p in head.parameters():  # random everything, large enough that drafts vary
            p.copy_(torch.randn(p.shape, generator=g) * (0.3 if p.dim() == 2 else 0.2) + (1.0 if p.dim() == 1 else 0.0))
    if fingerprint:
        config = HeadConfig(**{**config.__dict__, "target_fingerprint": target_fingerprint(c, embed)})
    t2d = torch.zeros(c.vocab_size, dtype=torch.bool)
    t2d[draft_ids] = True
    weights = {**head.state_dict(), "d2t": draft_ids - torch.arange(draft_vocab), "t2d": t2d}
    write_head(path, config.to_json(c, {"command": "test"}), weights)
    head.load_state_dict({k: v.half().float() for k, v in head.state_dict().items()}, strict=False)  # as stored
    return head


@pytest.fixture(scope="module")
def head_dir(model, tmp_path_factory):
    path = tmp_path_factory.mktemp("head")
    make_head(model, path)
    return path


def prompts(vocab: int, n: int = 6, seed: int = 3) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(rng.randint(3, 12))] for _ in range(n)]


def one_sequence_batch(ids: list[int]) -> TokenBatch:
    n = len(ids)
    return TokenBatch(input_ids=torch.tensor(ids), positions=torch.arange(n), query_start_loc=torch.tensor([0, n], dtype=torch.int32),
                      seq_lens=torch.tensor([n], dtype=torch.int32), slot_mapping=torch.arange(n),
                      block_tables=torch.arange(n // 4 + 1, dtype=torch.int32)[None], logits_indices=torch.arange(n),
                      query_lens_host=[n], seq_lens_host=[n])


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])  # the Python loop, the C++ layer stack
def test_captured_features_are_hf_hidden_states(model, dtype):
    loaded = loaded_from_hf(model)
    target = Model(loaded.config, loaded.weights, "cpu", dtype)
    ids = prompts(96, 1)[0]
    caches = layer_caches(allocate_kv_cache(loaded.config, 8, 4, dtype, torch.device("cpu")))
    hidden, captured = target.forward_capturing(one_sequence_batch(ids), caches, 4, LAYERS)
    with torch.no_grad():
        hf = model(torch.tensor([ids]), output_hidden_states=True).hidden_states
    want = torch.cat([hf[i][0] for i in LAYERS], dim=-1).to(dtype)  # layer i's input
    tol = 1e-9 if dtype == torch.float64 else 1e-4
    assert torch.allclose(captured, want, atol=tol, rtol=tol)
    plain = target.forward(one_sequence_batch(ids), caches, 4)
    assert torch.equal(hidden, plain)  # capturing changes nothing else
    # index num_layers: the residual leaving the last layer, whose final norm is the hidden state
    L, H = loaded.config.num_layers, loaded.config.hidden_size
    _, with_last = target.forward_capturing(one_sequence_batch(ids), caches, 4, (*LAYERS, L))
    assert torch.equal(with_last[:, :-H], captured)
    r = with_last[:, -H:]
    normed = loaded.weights["model.norm.weight"].to(dtype) * r * torch.rsqrt(r.pow(2).mean(-1, keepdim=True) + loaded.config.rms_norm_eps)
    assert torch.allclose(normed, hidden, atol=1e-4, rtol=1e-4)  # the engine's norm: its own op order


@pytest.mark.parametrize("proposer", ["eagle", "chain"])
@pytest.mark.parametrize("k", [1, 3])
def test_greedy_speculation_with_the_head_is_lossless(model, head_dir, proposer, k):
    ps = prompts(96)
    params = SamplingParams(max_tokens=30, temperature=0.0)
    expected = [o.token_ids for o in tiny_llm(model).generate(ps, params)]
    llm = tiny_llm(model, speculative_config={"proposer": proposer, "k": k, "draft_head": str(head_dir)})
    assert [o.token_ids for o in llm.generate(ps, params)] == expected
    st = llm.engine.stats
    assert st.num_draft_tokens > 0 and st.num_accepted_tokens > 0
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks


def test_mixed_k_with_zero_steps_and_preemption_is_lossless(model, head_dir):
    """k = 0 on some steps (features keep arriving, the head catches up later) and preemption
    (its cache restarts): same tokens as without speculation."""
    class Alternating:  # per request and step: 0, 1, 2 or 3 drafts, changing every step
        def __init__(self):
            self.calls = 0

        def decide(self, view):
            self.calls += 1
            return [(self.calls + r.seq_id) % 4 for r in view.requests]

        def observe(self, record):
            pass

    ps = prompts(96, 8, seed=9)
    params = SamplingParams(max_tokens=40, temperature=0.0)
    expected = [o.token_ids for o in tiny_llm(model).generate(ps, params)]
    from specplan.engine.model_runner import kv_bytes_per_block

    loaded = loaded_from_hf(model)
    per_block = 2 * kv_bytes_per_block(loaded.config, 4, torch.float64)
    llm = tiny_llm(model, speculative_config={"proposer": "eagle", "k": 3, "draft_head": str(head_dir)},
                   decider=Alternating(), kv_cache_bytes=per_block * 40)
    outs = llm.generate(ps, params)
    assert [o.token_ids for o in outs] == expected
    assert sum(o.num_preemptions for o in outs) > 0, "no preemption: the test would not cover it"
    assert llm.engine.stats.num_accepted_tokens > 0


def test_prompts_fed_to_the_head_in_their_prefill_step_draft_as_a_whole_prompt_does(model, head_dir):
    """The head is fed a prompt's positions in the step that computes them (``observe_target``),
    chunk by chunk: after a prefill in chunks of 8 tokens its first drafts are those after a
    one-chunk prefill, and its cache already reaches the prompt's last position but one (the
    first proposal runs a one-position catch-up, not one over the prompt)."""
    prompt = [random.Random(4).randrange(96) for _ in range(37)]
    drafted = []
    for budget in (4096, 8):
        llm = tiny_llm(model, speculative_config={"proposer": "eagle", "k": 3, "draft_head": str(head_dir)},
                       max_num_batched_tokens=budget)
        engine = llm.engine
        engine.add_request("r", prompt, SamplingParams(max_tokens=12, temperature=0.0))
        seq = engine._by_request["r"][0]
        steps = 0
        while seq.num_computed_tokens < len(prompt):
            engine.step()
            steps += 1
        assert steps == (1 if budget > len(prompt) else math.ceil(len(prompt) / budget))
        proposer = engine.speculator.proposer
        assert proposer._fed[seq.seq_id][0] == len(prompt) - 1
        assert engine.block_manager.ensure_capacity(seq, seq.num_computed_tokens + 4)
        d = proposer.propose([seq], [3])
        drafted.append((d.token_ids[0], d.confidence[0]))
    (tokens_whole, conf_whole), (tokens_chunked, conf_chunked) = drafted
    assert tokens_whole == tokens_chunked and len(tokens_whole) == 3
    assert conf_whole == pytest.approx(conf_chunked, rel=1e-9)


def test_drafts_carry_the_heads_confidence(model, head_dir):
    llm = tiny_llm(model, speculative_config={"proposer": "eagle", "k": 3, "draft_head": str(head_dir)})
    engine = llm.engine
    engine.add_request("r", prompts(96, 1)[0], SamplingParams(max_tokens=12, temperature=0.0))
    engine.step()  # prefill
    seq = engine._by_request["r"][0]
    assert engine.block_manager.ensure_capacity(seq, seq.num_computed_tokens + 4)
    d = engine.speculator.proposer.propose([seq], [3])
    assert d.confidence is not None and len(d.confidence[0]) == len(d.token_ids[0]) == 3
    assert all(0 < c <= 1 for c in d.confidence[0])
    assert d.truncated([1]).confidence == [d.confidence[0][:1]]


def test_training_math_is_the_engines_math_for_every_unrolled_step(model, head_dir):
    """HeadModule.unrolled (training-time test) gives the logits the engine's drafting does: step 0
    over target features, and steps 1, 2 chained on the head's own output, when the sequence's
    tokens are the head's own drafts (the teacher-forced tokens then equal the drafted ones)."""
    loaded = loaded_from_hf(model)
    trainer = make_head(model, head_dir.parent / "again")  # the same weights as head_dir (same seed)
    # fp32: the checkpoint's weights as they are (the engine's default on CPU is Q8_0 blocks)
    llm = tiny_llm(model, dtype=torch.float32, speculative_config={"proposer": "eagle", "k": 3, "draft_head": str(head_dir),
                                                                   "draft_head_weights": "fp32"})
    engine = llm.engine
    engine.add_request("r", prompts(96, 1, seed=4)[0], SamplingParams(max_tokens=10, temperature=0.0))
    proposer = engine.speculator.proposer
    captured_rows = []
    observe = proposer.observe_target
    proposer.observe_target = lambda work, cap: (captured_rows.append(cap.clone()), observe(work, cap))
    engine.step()  # prefill: the prompt's features
    seq = engine._by_request["r"][0]
    c = seq.num_computed_tokens
    assert engine.block_manager.ensure_capacity(seq, c + 4)  # the lookahead slots the drafts write
    drafts = proposer.propose([seq], [3])
    d = drafts.token_ids[0]
    tokens = seq.token_ids[:c + 1] + d  # x_0..x_c, then the head's drafts
    captured = torch.cat(captured_rows)[:c]  # [c, 3H] target positions 0..c-1
    T = c + 2  # head positions 0..c+1
    cap = torch.zeros(1, T, captured.shape[1])
    cap[0, :c] = captured
    with torch.no_grad():
        logits = trainer.unrolled(torch.tensor([tokens[1:T + 1]]), cap, 3)
    draft_ids = torch.arange(DRAFT_VOCAB) + read_head(head_dir)[1]["d2t"]
    for j in range(3):
        p = c - 1 + j  # step j's position
        assert int(draft_ids[logits[j][0, p].argmax()]) == d[j]
        assert abs(float(logits[j][0, p].softmax(-1).max()) - drafts.confidence[0][j]) < 1e-4


def test_sampled_speculation_with_the_head_keeps_the_target_distribution(model, head_dir):
    """Sampled tokens 2 and 3 (the first is the prefill's, then one step with a head draft whose
    q enters rejection sampling) follow the target's exact marginals (chi-square)."""
    prompt = prompts(96, 1, seed=11)[0]
    n, V = 3000, 96
    params = SamplingParams(max_tokens=3, temperature=1.0, n=n, seed=123)
    llm = tiny_llm(model, speculative_config={"proposer": "eagle", "k": 2, "draft_head": str(head_dir)},
                   max_num_seqs=n, max_num_batched_tokens=40_000, kv_cache_bytes=64 * 1024**2)
    outs = llm.generate([prompt], params)
    st = llm.engine.stats
    assert st.num_draft_tokens >= n and 0 < st.num_accepted_tokens < st.num_draft_tokens
    with torch.no_grad():  # exact marginals of tokens 2 and 3 from the target (all V^2 contexts at once)
        p0 = model(torch.tensor([prompt])).logits[0, -1].double().softmax(-1)  # [V]
        ctx1 = torch.tensor([prompt + [a] for a in range(V)])
        p1 = model(ctx1).logits[:, -1].double().softmax(-1)  # [V, V]: p(t1 | t0)
        ctx2 = torch.tensor([prompt + [a, b] for a in range(V) for b in range(V)])
        p2 = model(ctx2).logits[:, -1].double().softmax(-1).view(V, V, V)  # p(t2 | t0, t1)
    assert_follows_marginals(outs, p0, p1, p2)


def test_a_head_for_another_model_or_vocabulary_is_refused(model, tmp_path, head_dir):
    other = tiny_hf_model("llama", num_hidden_layers=4, seed=7)  # same shapes, other weights
    llm_loaded = loaded_from_hf(other)
    target = Model(llm_loaded.config, llm_loaded.weights, "cpu", torch.float64)
    with pytest.raises(HeadError, match="another model"):
        EagleHead.load(head_dir, target)
    small = tiny_hf_model("llama", num_hidden_layers=4, vocab_size=80)
    make_head(small, tmp_path / "small", draft_vocab=40)
    mine = loaded_from_hf(model)
    with pytest.raises(HeadError, match="vocabulary of 80"):
        EagleHead.load(tmp_path / "small", Model(mine.config, mine.weights, "cpu", torch.float64))


def test_a_corrupt_head_is_refused_in_one_line(model, tmp_path, head_dir):
    import shutil

    loaded = loaded_from_hf(model)
    target = Model(loaded.config, loaded.weights, "cpu", torch.float64)
    bad = tmp_path / "bad"
    shutil.copytree(head_dir, bad)
    data = (bad / "model.safetensors").read_bytes()
    (bad / "model.safetensors").write_bytes(data[:len(data) // 2])
    with pytest.raises(HeadError, match="corrupt") as e:
        EagleHead.load(bad, target)
    assert "\n" not in str(e.value)
    cfg = json.loads((head_dir / "config.json").read_text())
    shutil.copy(head_dir / "model.safetensors", bad / "model.safetensors")
    (bad / "config.json").write_text(json.dumps({**cfg, "architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(HeadError, match="not an EAGLE-3 head"):
        EagleHead.load(bad, target)
    with pytest.raises(HeadError, match="not a draft head folder"):
        EagleHead.load(tmp_path / "missing", target)


def test_cli_reports_a_bad_head_in_one_line(tmp_path):
    from typer.testing import CliRunner

    from specplan.cli import app

    (tmp_path / "config.json").write_text("{}")
    res = CliRunner().invoke(app, ["generate", "hi", "--proposer", "ngram", "--draft-head", str(tmp_path)])
    assert res.exit_code == 2 and "--draft-head only applies" in res.output


def test_train_draft_stages_write_a_head_the_engine_loads(model, tmp_path):
    """features -> a few training steps -> export, on the tiny model with its own greedy outputs as
    data: the folder loads in the engine (fingerprint, shapes, d2t/t2d) and drafts losslessly."""
    from specplan.train_draft import TrainSettings, draft_vocabulary, export_head, extract_features, train_head

    loaded = loaded_from_hf(model)
    ps = prompts(96, 8, seed=21)
    outs = tiny_llm(model).generate(ps, SamplingParams(max_tokens=24, temperature=0.0))
    records = [{"source": "t", "id": str(i), "split": "heldout" if i < 2 else "train", "prompt_ids": p,
                "response_ids": o.token_ids} for i, (p, o) in enumerate(zip(ps, outs))]
    settings = TrainSettings(out=tmp_path / "head", work_dir=tmp_path, steps=4, batch_tokens=128, max_len=64,
                             checkpoint_every=2, draft_vocab_size=48, command="test")
    feats = extract_features(loaded, settings, records, LAYERS)
    assert feats["captured"].shape == (feats["tokens"].shape[0], 3 * 64)
    draft_ids = draft_vocabulary(records, 96, 48)
    assert len(draft_ids) == 48 and bool((draft_ids[1:] > draft_ids[:-1]).all())
    head, result = train_head(loaded, settings, feats, records, LAYERS, draft_ids)
    assert result["proposals"] > 0 and len(result["per_position"]) == 3
    assert (tmp_path / "train_state.pt").exists()  # resumable
    path = export_head(loaded, settings, head, draft_ids, LAYERS, records, result)
    doc = json.loads((path / "config.json").read_text())
    assert doc["architectures"] == ["LlamaForCausalLMEagle3"] and doc["draft_vocab_size"] == 48
    assert doc["specplan"]["command"] == "test" and doc["specplan"]["data"]["heldout_ids"] == ["0", "1"]
    llm = tiny_llm(model, speculative_config={"proposer": "eagle", "k": 3, "draft_head": str(path)})
    params = SamplingParams(max_tokens=24, temperature=0.0)
    assert [o.token_ids for o in llm.generate(ps, params)] == [o.token_ids for o in outs]


def test_a_training_budget_sizes_the_steps_to_the_time_left(model, tmp_path, monkeypatch):
    """With a deadline, training times its first steps, then plans (and schedules) only the steps
    that fit before it: far fewer than asked for, more than the timed ones, and done in time."""
    import specplan.train_draft as td

    assert td.steps_that_fit(8, 10_000, 4.0, 3600.0, 120.0) == 878  # the docstring's example
    assert td.steps_that_fit(8, 500, 4.0, 3600.0, 120.0) == 500  # never more than asked
    assert td.steps_that_fit(8, 10_000, 4.0, 100.0, 120.0) == 8  # out of time: stop now
    loaded = loaded_from_hf(model)
    ps = prompts(96, 8, seed=22)
    outs = tiny_llm(model).generate(ps, SamplingParams(max_tokens=24, temperature=0.0))
    records = [{"source": "t", "id": str(i), "split": "heldout" if i < 2 else "train", "prompt_ids": p,
                "response_ids": o.token_ids} for i, (p, o) in enumerate(zip(ps, outs))]
    settings = td.TrainSettings(out=tmp_path / "head", work_dir=tmp_path, steps=1_000_000, batch_tokens=128,
                                max_len=64, checkpoint_every=10_000, draft_vocab_size=48, command="test")
    feats = td.extract_features(loaded, settings, records, LAYERS)
    draft_ids = td.draft_vocabulary(records, 96, 48)
    monkeypatch.setattr(td, "EXPORT_MARGIN_S", 0.0)
    t0 = time.perf_counter()
    _, result = td.train_head(loaded, settings, feats, records, LAYERS, draft_ids, deadline=t0 + 4.0)
    assert td.TIMED_STEPS < result["steps"] < 1_000_000
    assert time.perf_counter() - t0 < 4.0 + 1.0
    assert torch.load(tmp_path / "train_state.pt", weights_only=False)["step"] == result["steps"]  # saved at the end


def test_features_recorded_during_generation_equal_a_second_pass(model, tmp_path):
    """train-draft's default data stage keeps the target's features while it generates (a k = 0
    proposer reading them): the same rows a separate forward over prompt + answer captures."""
    import dataclasses

    from specplan.train_draft import TrainSettings, extract_features, generate_responses

    loaded = loaded_from_hf(model)
    loaded = dataclasses.replace(loaded, weights={k: v.float() for k, v in loaded.weights.items()})
    pool = [{"source": "t", "id": f"p{i}", "split": "train", "prompt_ids": p} for i, p in enumerate(prompts(96, 5, seed=8))]
    settings = TrainSettings(out=tmp_path / "head", work_dir=tmp_path / "a", max_tokens=12, target_layers=LAYERS)
    settings.work_dir.mkdir()
    records = generate_responses(loaded, settings, pool)
    assert [len(r["response_ids"]) for r in records] == [12] * 5
    recorded = extract_features(loaded, settings, records, LAYERS)
    second = extract_features(loaded, dataclasses.replace(settings, work_dir=tmp_path), records, LAYERS)
    for r, a in zip(records, recorded["starts"][:-1].tolist()):
        n = len(r["prompt_ids"]) + len(r["response_ids"]) - 1  # every fed position
        assert torch.allclose(recorded["captured"][a:a + n].float(), second["captured"][a:a + n].float(), atol=2e-2)
        # the final hidden state (soft targets) too, rebuilt from the residual leaving the last layer
        assert torch.allclose(recorded["final"][a:a + n].float(), second["final"][a:a + n].float(), atol=2e-2)


def test_generation_keeps_prompts_cut_to_the_context(model, tmp_path):
    """A prompt longer than the context leaves room for the answer: train-draft cuts it from the
    left to what the engine can hold, and the record keeps that cut prompt, so the features
    recorded during generation cover exactly its positions (before: the prompt was cut for a fixed
    2048-token context, the 512-token tiny model refused it, and a cut prompt never matched its
    record's length, so its answer was dropped)."""
    import dataclasses

    from specplan.train_draft import TrainSettings, extract_features, generate_responses

    loaded = loaded_from_hf(model)
    loaded = dataclasses.replace(loaded, weights={k: v.float() for k, v in loaded.weights.items()})
    context = model.config.max_position_embeddings  # 512
    rng = random.Random(4)
    long_prompt = [rng.randrange(96) for _ in range(context + 40)]
    pool = [{"source": "t", "id": "long", "split": "train", "prompt_ids": long_prompt},
            {"source": "t", "id": "short", "split": "train", "prompt_ids": prompts(96, 1, seed=8)[0]}]
    settings = TrainSettings(out=tmp_path / "head", work_dir=tmp_path / "a", max_tokens=12, target_layers=LAYERS)
    settings.work_dir.mkdir()
    records = generate_responses(loaded, settings, pool)
    assert [r["id"] for r in records] == ["long", "short"]
    assert records[0]["prompt_ids"] == long_prompt[-(context - 12):]
    assert [len(r["response_ids"]) for r in records] == [12, 12]
    recorded = extract_features(loaded, settings, records, LAYERS)
    second = extract_features(loaded, dataclasses.replace(settings, work_dir=tmp_path), records, LAYERS)
    n = len(records[0]["prompt_ids"]) + 12 - 1
    assert torch.allclose(recorded["captured"][:n].float(), second["captured"][:n].float(), atol=2e-2)


class _StoppingDecider:
    """k = 6 every step, with a DraftStop (engine/decider.py) of acceptance = confidence."""

    def __init__(self, min_gain: float):
        self.draft_stop = self  # StopsDrafts: this object is also the rule
        self.min_gain = min_gain
        self.records = []

    def accept_probability(self, confidence: float) -> float:
        return confidence

    def decide(self, view):
        return [6] * len(view.requests)

    def observe(self, record):
        self.records.append(record)


@pytest.mark.parametrize("proposer", ["eagle", "chain"])
def test_confidence_stop_is_lossless_and_drafts_where_the_head_is_sure(model, head_dir, proposer):
    """The decider's DraftStop cuts each draft at the first token whose running product of
    confidences falls below min_gain: fewer drafts the higher min_gain, none above 1, the same
    tokens as without speculation throughout; the step records carry each draft's confidence."""
    ps = prompts(96, 6, seed=4)
    params = SamplingParams(max_tokens=30, temperature=0.0)
    expected = [o.token_ids for o in tiny_llm(model).generate(ps, params)]
    drafted = {}
    for min_gain in (0.0, 0.02, 1.01):
        decider = _StoppingDecider(min_gain)
        llm = tiny_llm(model, speculative_config={"proposer": proposer, "k": 6, "draft_head": str(head_dir)},
                       decider=decider)
        assert [o.token_ids for o in llm.generate(ps, params)] == expected
        drafted[min_gain] = llm.engine.stats.num_draft_tokens
        head_rows = [r for rec in decider.records for r in rec.requests if r.num_proposed]
        for r in head_rows:
            assert r.stop_rule and r.confidence is not None and len(r.confidence) == r.num_proposed
            heads = [c for c in r.confidence if c == c]  # nan: a chained lookup token
            if proposer == "eagle":
                # every kept draft's running product is >= min_gain
                assert math.prod(heads) >= min_gain
    assert drafted[0.0] > drafted[0.02] > 0
    if proposer == "eagle":
        assert drafted[1.01] == 0


def test_a_pass_after_the_first_runs_only_while_the_drafts_pay_for_it(model, head_dir):
    """DraftStop.pass_gain: the first pass runs for every request given drafts; a later one only
    while sum_i max(0, product_i - min_gain) >= pass_gain. Free passes draft to k, a pass dearer
    than any draft can pay for stops every request at its first draft; lossless either way."""
    ps = prompts(96, 6, seed=4)
    params = SamplingParams(max_tokens=30, temperature=0.0)
    expected = [o.token_ids for o in tiny_llm(model).generate(ps, params)]
    deepest = {}
    for pass_gain in (0.0, 0.5, 100.0):
        decider = _StoppingDecider(0.0)
        decider.pass_gain = pass_gain
        llm = tiny_llm(model, speculative_config={"proposer": "eagle", "k": 6, "draft_head": str(head_dir)},
                       decider=decider)
        assert [o.token_ids for o in llm.generate(ps, params)] == expected
        deepest[pass_gain] = max(r.num_proposed for rec in decider.records for r in rec.requests)
    assert deepest[0.0] == 6 and deepest[100.0] == 1 and 1 <= deepest[0.5] <= 6


def test_chain_shows_the_decider_which_requests_its_lookup_serves(model, head_dir):
    """Before k is decided the chain's lookup runs: a request with a match of >= min_match tokens
    (lookup drafts) shows them as available (its cap is what exists), the others (head drafts)
    show none known and a match length of 0 (a 1-token match's drafts would be the head's); the
    record's match length is the view's, so the planner learns each source in its own belief."""
    class Recording:
        def __init__(self):
            self.views, self.records = [], []

        def decide(self, view):
            self.views.append(view)
            return [4] * len(view.requests)

        def observe(self, record):
            self.records.append(record)

    rng = random.Random(2)
    motif = [rng.randrange(96) for _ in range(5)]
    ps = [motif * 4 + [rng.randrange(96) for _ in range(3)] for _ in range(3)] + prompts(96, 3, seed=6)
    params = SamplingParams(max_tokens=24, temperature=0.0)
    expected = [o.token_ids for o in tiny_llm(model).generate(ps, params)]
    decider = Recording()
    llm = tiny_llm(model, speculative_config={"proposer": "chain", "k": 4, "draft_head": str(head_dir)}, decider=decider)
    assert [o.token_ids for o in llm.generate(ps, params)] == expected
    decided = [rec for rec in decider.records if rec.requests]
    served = head = 0
    for view, rec in zip(decider.views, decided):
        for rv, rr in zip(view.requests, rec.requests):
            assert rr.match_length == rv.match_length
            if (rv.match_length or 0) >= SpecConfig().chain_min_match and rv.available_drafts:
                served += 1
                assert rv.max_k <= rv.available_drafts and rr.k <= rv.available_drafts
            else:
                head += rv.max_k > 0
                assert rv.available_drafts is None
                assert not rv.match_length  # the head's drafts: its belief, not a short match's
    assert served > 0 and head > 0


def test_q8_0_head_weights_draft_about_what_fp32_ones_do(model, head_dir):
    """The engine's default CPU head (Q8_0 projections) against the checkpoint's fp32 weights:
    the same first-draft distribution up to rounding, and greedy speculation lossless either way."""
    ps = prompts(96, 4, seed=13)
    confidences = {}
    for fmt in ("fp32", "q8_0"):
        llm = tiny_llm(model, dtype=torch.float32, speculative_config={
            "proposer": "eagle", "k": 3, "draft_head": str(head_dir), "draft_head_weights": fmt})
        proposer = llm.engine.speculator.proposer
        assert proposer.head.weight_format == fmt
        engine = llm.engine
        engine.add_request("r", ps[0], SamplingParams(max_tokens=8, temperature=0.0))
        engine.step()  # prefill
        seq = engine._by_request["r"][0]
        assert engine.block_manager.ensure_capacity(seq, seq.num_computed_tokens + 2)
        confidences[fmt] = proposer.propose([seq], [1]).confidence[0][0]
    assert abs(confidences["fp32"] - confidences["q8_0"]) < 0.05
    with pytest.raises(ValueError, match="draft_head_weights"):
        tiny_llm(model, speculative_config={"proposer": "eagle", "draft_head": str(head_dir), "draft_head_weights": "q4"})


def test_the_profiler_times_a_head_pass_per_batch_size(model, head_dir):
    """``measure_head_cost``: the head's pass timed over the running sequences at each B and fitted
    a + b x B (what the planner prices a draft position of eagle and chain with)."""
    from specplan.profiler.run import measure_head_cost

    loaded = loaded_from_hf(model)
    cost = measure_head_cost(loaded, batch_sizes=(1, 4), context=16, repeats=2, head_dir=head_dir)
    assert cost is not None and cost.per_pass_s + cost.per_token_s * 4 > 0
    assert measure_head_cost(loaded, batch_sizes=(1,), context=16, repeats=1) is None  # none ships for it


@pytest.mark.parametrize("proposer", ["eagle", "chain"])
def test_the_clairvoyant_ceiling_with_a_head_drafts_only_what_is_accepted(model, head_dir, proposer):
    """The evaluation's clairvoyant decider for a model-drafted proposer: a run at max_k records
    the accepted lengths (clairvoyant.py ``AcceptanceRecorder``), and the run asking for exactly
    those visits the same positions, so every draft it verifies is accepted and it accepts as
    many as the recording run did, in fewer drafts; the tokens are SD off's throughout."""
    from specplan.bench.evaluate import clairvoyant_for, run_cell
    from specplan.engine import FixedDecider

    llm = tiny_llm(model, speculative_config={"proposer": proposer, "k": 4, "max_k": 4, "draft_head": str(head_dir)})
    engine, ps, n = llm.engine, prompts(96, 6, seed=5), 24
    off = run_cell(engine, ps, FixedDecider(0), n, concurrency=3)
    reference, make_clairvoyant = clairvoyant_for(engine, ps, n, concurrency=3)
    recorded = engine.stats
    assert reference == off["outputs"] and recorded.num_accepted_tokens > 0
    blind_drafts, accepted = recorded.num_draft_tokens, recorded.num_accepted_tokens
    seen = run_cell(engine, ps, make_clairvoyant(), n, concurrency=3)
    assert seen["outputs"] == off["outputs"]
    assert seen["acceptance"] == 1.0 and engine.stats.num_accepted_tokens == accepted
    assert engine.stats.num_draft_tokens == accepted < blind_drafts
