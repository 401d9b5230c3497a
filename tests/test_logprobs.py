"""Logprobs with speculation: every token's logprob is the target's raw log-softmax at the position
where the token was accepted, so SD on and off give the same logprobs; prompt logprobs match a
transformers forward pass; the server speaks OpenAI's formats (issue 35)."""

from __future__ import annotations

import dataclasses
import itertools
import json

import httpx
import pytest
import torch

from conftest import RidgeLatency, loaded_from_hf, tiny_hf_model, tiny_llm
from specplan.engine import FixedDecider, SamplingParams

# Text that repeats, so lookup proposers find drafts the tiny random model accepts.
PROMPTS = [[5, 6, 7, 8, 9] * 4 + [5, 6], [11, 12, 13, 11, 12, 13, 11, 12], [40, 41, 42, 43] * 3, [3]]


class CyclingDecider:
    """k varies from step to step (0 included): the same request verifies 0..5 drafts."""

    predicted_step_s = None

    def __init__(self):
        self.ks = itertools.cycle([3, 0, 5, 1, 2])

    def decide(self, view):
        k = next(self.ks)
        return [k] * len(view.requests)

    def observe(self, record):
        pass


def goodput_planner():
    from specplan.planner import Planner
    from specplan.policies import make_policy

    return Planner(make_policy("goodput"), RidgeLatency(a=0.03, c=1e-9), proposer="ngram")


@pytest.fixture(scope="module")
def model():
    return tiny_hf_model("llama", seed=4)


def hf_logprobs(model, ids: list[int]) -> torch.Tensor:
    """[len(ids), V]: row i is the log-softmax predicting token i + 1, by transformers."""
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0]
    return torch.log_softmax(logits.double(), dim=-1)


def assert_same_logprobs(a, b, tol=1e-4):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.token_id == y.token_id
        assert abs(x.logprob - y.logprob) < tol
        assert [t for t, _ in x.top] == [t for t, _ in y.top]
        assert all(abs(p - q) < tol for (_, p), (_, q) in zip(x.top, y.top))


# ---- (a) greedy: SD on equals SD off, token for token and logprob for logprob ------------------
@pytest.mark.parametrize("spec,decider", [
    ({"proposer": "ngram", "k": 4}, None),
    ({"proposer": "suffix", "k": 6}, None),
    ({"proposer": "ngram", "k": 4, "max_k": 6}, CyclingDecider),
    ({"proposer": "ngram", "k": 4, "max_k": 6}, goodput_planner),
], ids=["ngram-k4", "suffix-tree", "varying-k", "goodput-planner"])
def test_greedy_logprobs_equal_with_and_without_speculation(model, spec, decider):
    params = SamplingParams(temperature=0.0, max_tokens=40, logprobs=5, prompt_logprobs=3)
    off = tiny_llm(model).generate(PROMPTS, params)
    llm = tiny_llm(model, speculative_config=spec, decider=decider() if decider else None)
    on = llm.generate(PROMPTS, params)
    assert llm.engine.stats.num_accepted_tokens > 0  # drafts were accepted, so rows > 0 were scored
    for a, b in zip(off, on):
        assert a.token_ids == b.token_ids
        assert len(a.logprobs) == len(a.token_ids) and all(len(e.top) == 5 for e in a.logprobs)
        assert_same_logprobs(a.logprobs, b.logprobs)
        assert a.prompt_logprobs[0] is None and b.prompt_logprobs[0] is None
        assert_same_logprobs(a.prompt_logprobs[1:], b.prompt_logprobs[1:])


def test_suffix_trees_score_the_accepted_branch(model, monkeypatch):
    """Branching trees verify in one pass: the rows of their tokens are the accepted path's nodes."""
    import specplan.engine.engine as engine_module

    seen = []
    real = engine_module.verify

    def spy(logits, items, gen):
        verdicts = real(logits, items, gen)
        seen.extend(v.path for w, v in zip(items, verdicts) if w.tree is not None and v.path)
        return verdicts

    # Several continuations of "5 6" so the suffix tree branches.
    prompt = [5, 6, 7, 1, 5, 6, 8, 2, 5, 6, 7, 1, 5, 6, 9, 3, 5, 6]
    params = SamplingParams(temperature=0.0, max_tokens=48, logprobs=2)
    off = tiny_llm(model).generate([prompt], params)[0]
    llm = tiny_llm(model, speculative_config={"proposer": "suffix", "k": 6})
    monkeypatch.setattr(engine_module, "verify", spy)
    on = llm.generate([prompt], params)[0]
    assert on.token_ids == off.token_ids
    assert_same_logprobs(off.logprobs, on.logprobs)
    assert any(p != list(range(1, len(p) + 1)) for p in seen), seen  # some accepted branch was not the first rows


def test_verdict_rows_worked_example():
    from specplan.engine.spec_decode.verifier import Verdict

    assert Verdict([7, 8, 9], 2).rows == [0, 1, 2]
    assert Verdict([4, 6, 1], 2, path=[2, 4]).rows == [0, 2, 4]  # the docstring's tree


def test_stop_truncates_logprobs_alike(model):
    params = SamplingParams(temperature=0.0, max_tokens=40, logprobs=1)
    full = tiny_llm(model).generate(PROMPTS[0], params)[0]
    stop = full.token_ids[9]
    cut_params = dataclasses.replace(params, stop_token_ids=(stop,))
    for spec in (None, {"proposer": "ngram", "k": 4}):
        out = tiny_llm(model, speculative_config=spec).generate(PROMPTS[0], cut_params)[0]
        n = full.token_ids.index(stop) + 1
        assert out.token_ids == full.token_ids[:n] and out.finish_reason == "stop"
        assert_same_logprobs(out.logprobs, full.logprobs[:n])
    short = tiny_llm(model, speculative_config={"proposer": "ngram", "k": 4}).generate(
        PROMPTS[0], dataclasses.replace(params, max_tokens=7))[0]
    assert len(short.token_ids) == len(short.logprobs) == 7


def test_no_logprobs_unless_asked(model):
    out = tiny_llm(model).generate(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=4))[0]
    assert out.logprobs is None and out.prompt_logprobs is None


# ---- (b) sampled: each logprob is the raw log-softmax of a plain forward pass ------------------
@pytest.mark.parametrize("spec", [None, {"proposer": "ngram", "k": 4}, {"proposer": "suffix", "k": 6}])
def test_sampled_logprobs_are_raw_target_logprobs(model, spec):
    params = SamplingParams(temperature=0.7, top_k=20, top_p=0.9, seed=11, max_tokens=32, logprobs=3)
    outs = tiny_llm(model, speculative_config=spec).generate(PROMPTS[:3], params)
    for prompt, out in zip(PROMPTS, outs):
        ref = hf_logprobs(model, prompt + out.token_ids)
        for j, e in enumerate(out.logprobs):
            row = ref[len(prompt) - 1 + j]
            assert e.token_id == out.token_ids[j]
            assert abs(e.logprob - row[e.token_id].item()) < 1e-4
            assert [t for t, _ in e.top] == row.topk(3).indices.tolist()


# ---- (c) prompt logprobs: a transformers forward pass, across prefill chunks ------------------
@pytest.mark.parametrize("chunk", [512, 7])
def test_prompt_logprobs_match_transformers(model, chunk):
    llm = tiny_llm(model, max_num_batched_tokens=chunk)
    prompts = [list(range(10, 60)), [9, 8, 7, 6, 5], [42]]
    outs = llm.generate(prompts, SamplingParams(max_tokens=0, prompt_logprobs=4))
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == [] and out.finish_reason == "length"
        assert len(out.prompt_logprobs) == len(prompt) and out.prompt_logprobs[0] is None
        ref = hf_logprobs(model, prompt)
        for i, e in enumerate(out.prompt_logprobs[1:], start=1):
            assert e.token_id == prompt[i]
            assert abs(e.logprob - ref[i - 1, prompt[i]].item()) < 1e-3
            assert [t for t, _ in e.top] == ref[i - 1].topk(4).indices.tolist()
    assert not llm.engine.has_unfinished and llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks


def test_prompt_logprobs_survive_preemption(model):
    """A preempted request recomputes its prompt but scores no position twice."""
    llm = tiny_llm(model, kv_cache_bytes=64 * 1024, max_num_batched_tokens=16)  # a few blocks: preemptions
    prompts = [list(range(10 + i, 40 + i)) for i in range(6)]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=24, prompt_logprobs=1, logprobs=1))
    assert any(o.num_preemptions for o in outs)
    for prompt, out in zip(prompts, outs):
        assert len(out.prompt_logprobs) == len(prompt) and len(out.logprobs) == len(out.token_ids) == 24
        ref = hf_logprobs(model, prompt + out.token_ids)
        assert all(abs(e.logprob - ref[i - 1, prompt[i]].item()) < 1e-3
                   for i, e in enumerate(out.prompt_logprobs[1:], start=1))


def test_logprob_params_are_validated():
    for bad in (dict(logprobs=-1), dict(logprobs=21), dict(prompt_logprobs=99), dict(max_tokens=0)):
        with pytest.raises(ValueError):
            SamplingParams(**bad)
    assert SamplingParams(max_tokens=0, prompt_logprobs=0).max_tokens == 0


# ---- (d) the server ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def loaded():
    from test_server import MAX_MODEL_LEN, NAME, make_tokenizer

    tok = make_tokenizer()
    m = tiny_hf_model("llama", vocab_size=len(tok), max_position_embeddings=MAX_MODEL_LEN, seed=3)
    return dataclasses.replace(loaded_from_hf(m, name=NAME), tokenizer=tok), m


@pytest.fixture(scope="module")
def servers(loaded):
    from test_server import NAME, ServerThread, make_engine
    from specplan.engine.server import create_app

    on = create_app(make_engine(loaded[0], spec_k=4), NAME)
    off = create_app(make_engine(loaded[0], proposer=None), NAME)
    with ServerThread(on) as s_on, ServerThread(off) as s_off:
        yield s_on, s_off


TEXT = "the quick brown fox jumps over the lazy dog the quick brown fox"


def post(server, path, body) -> dict:
    r = httpx.post(server.url + path, json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def stream(server, path, body) -> list[dict]:
    with httpx.stream("POST", server.url + path, json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200
        lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(x) for x in lines[:-1]]


def close(a, b, tol=1e-4) -> bool:
    return a is None and b is None or abs(a - b) < tol


def assert_chat_equal(a: list[dict], b: list[dict]):
    assert [e["token"] for e in a] == [e["token"] for e in b]
    for x, y in zip(a, b):
        assert close(x["logprob"], y["logprob"]) and x["bytes"] == y["bytes"]
        assert [t["token"] for t in x["top_logprobs"]] == [t["token"] for t in y["top_logprobs"]]


def test_server_chat_logprobs_with_and_without_speculation(servers):
    on, off = servers
    body = {"messages": [{"role": "user", "content": TEXT}], "max_tokens": 24, "temperature": 0,
            "logprobs": True, "top_logprobs": 3}
    results = []
    for server in (on, off):
        full = post(server, "/v1/chat/completions", body)["choices"][0]
        content = full["logprobs"]["content"]
        assert len(content) == 24 and all(len(e["top_logprobs"]) == 3 for e in content)
        assert set(content[0]) == {"token", "logprob", "bytes", "top_logprobs"}
        # A token may hold part of a UTF-8 character: its bytes are exact, its text is not.
        assert bytes(b for e in content for b in e["bytes"]).decode(errors="replace") == full["message"]["content"]
        chunks = stream(server, "/v1/chat/completions", body)
        streamed = [e for c in chunks for ch in c["choices"] if ch["logprobs"] for e in ch["logprobs"]["content"]]
        assert_chat_equal(streamed, content)
        results.append(content)
    assert_chat_equal(*results)
    plain = post(on, "/v1/chat/completions", {**body, "logprobs": False, "top_logprobs": None})
    assert plain["choices"][0]["logprobs"] is None


def test_server_completion_logprobs_with_and_without_speculation(servers):
    on, off = servers
    body = {"prompt": TEXT, "max_tokens": 20, "temperature": 0, "logprobs": 2}
    results = []
    for server in (on, off):
        full = post(server, "/v1/completions", body)["choices"][0]
        lp = full["logprobs"]
        assert set(lp) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
        assert len(lp["tokens"]) == 20
        assert lp["text_offset"][0] == 0 and all(1 <= len(d) <= 3 for d in lp["top_logprobs"])  # strings may collide
        streamed = {"tokens": [], "token_logprobs": [], "text_offset": []}
        for c in stream(server, "/v1/completions", body):
            for ch in c["choices"]:
                for key in streamed:
                    streamed[key] += (ch["logprobs"] or {}).get(key, [])
        assert streamed["tokens"] == lp["tokens"]
        assert all(close(x, y) for x, y in zip(streamed["token_logprobs"], lp["token_logprobs"]))
        results.append(lp)
    assert results[0]["tokens"] == results[1]["tokens"]
    assert all(close(x, y) for x, y in zip(results[0]["token_logprobs"], results[1]["token_logprobs"]))


def test_server_echo_scores_the_prompt(servers, loaded):
    on, off = servers
    tok, model = loaded[0].tokenizer, loaded[1]
    ids = tok.encode(TEXT)
    ref = hf_logprobs(model, ids)
    for server in (on, off):
        body = {"prompt": TEXT, "max_tokens": 0, "echo": True, "logprobs": 1}
        choice = post(server, "/v1/completions", body)["choices"][0]
        lp = choice["logprobs"]
        assert choice["text"] == TEXT and choice["finish_reason"] == "length"
        assert len(lp["tokens"]) == len(ids) and lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        assert all(abs(lp["token_logprobs"][i] - ref[i - 1, ids[i]].item()) < 1e-3 for i in range(1, len(ids)))
        assert "".join(lp["tokens"]) == TEXT and lp["text_offset"][1] == len(lp["tokens"][0])
        (streamed,) = [ch for c in stream(server, "/v1/completions", body) for ch in c["choices"] if ch["text"]]
        assert streamed["text"] == TEXT and streamed["logprobs"]["tokens"] == lp["tokens"]
        # Echo with generated tokens: the prompt's entries, then the output's.
        both = post(server, "/v1/completions", {**body, "max_tokens": 5, "temperature": 0})["choices"][0]
        assert both["text"].startswith(TEXT) and len(both["logprobs"]["tokens"]) == len(ids) + 5
        assert both["logprobs"]["text_offset"][len(ids)] == len(TEXT)
        # Echo without logprobs: the text only.
        assert post(server, "/v1/completions", {"prompt": TEXT, "max_tokens": 0, "echo": True})["choices"][0] == {
            "index": 0, "text": TEXT, "logprobs": None, "finish_reason": "length"}


BAD = [
    ("/v1/chat/completions", {"top_logprobs": 2}, "top_logprobs"),
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": -1}, "top_logprobs"),
    ("/v1/chat/completions", {"logprobs": 3}, "logprobs"),
    ("/v1/completions", {"logprobs": True}, "logprobs"),
    ("/v1/completions", {"logprobs": 21}, "logprobs"),
    ("/v1/completions", {"logprobs": -1}, "logprobs"),
    ("/v1/completions", {"echo": "yes"}, "echo"),
    ("/v1/completions", {"max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"max_tokens": 0, "echo": False, "logprobs": 1}, "max_tokens"),
]


@pytest.mark.parametrize("path,extra,param", BAD)
def test_server_rejects_malformed_logprob_params(servers, path, extra, param):
    base = {"messages": [{"role": "user", "content": "hi"}]} if "chat" in path else {"prompt": "hi"}
    r = httpx.post(servers[0].url + path, json={**base, **extra}, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text


@pytest.mark.slow
def test_default_model_echo_logprobs_match_transformers():
    """The real default model over HTTP: echo logprobs equal a transformers forward pass."""
    from test_server import ServerThread
    from transformers import AutoModelForCausalLM
    from specplan.engine import load_model
    from specplan.engine.server import build_engine, create_app

    loaded = load_model(None)
    hf = AutoModelForCausalLM.from_pretrained(loaded.path, dtype=torch.float32, local_files_only=True).eval()
    text = "The capital of France is Paris. The capital of Italy is Rome."
    ids = loaded.tokenizer.encode(text)
    ref = hf_logprobs(hf, ids)
    with ServerThread(create_app(build_engine(loaded=loaded, proposer="ngram", spec_k=4), "default")) as server:
        lp = post(server, "/v1/completions", {"prompt": text, "max_tokens": 0, "echo": True, "logprobs": 5})
        lp = lp["choices"][0]["logprobs"]
        assert len(lp["tokens"]) == len(ids) and lp["token_logprobs"][0] is None
    assert all(abs(lp["token_logprobs"][i] - ref[i - 1, ids[i]].item()) < 1e-3 for i in range(1, len(ids)))
