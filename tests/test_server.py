"""The OpenAI-compatible server: a real uvicorn server on loopback, driven by the official client.

The model is a tiny random-weight Llama with a tiny byte-level BPE tokenizer (and a chat
template) built here, so the whole file runs in seconds on a 2-core CPU.
"""

from __future__ import annotations

import dataclasses
import json
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from conftest import chat_tokenizer, loaded_from_hf, tiny_hf_model

openai = pytest.importorskip("openai")

NAME = "tiny-chat"
MAX_MODEL_LEN = 512
CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "hello world, speculative decoding drafts tokens and the target model verifies them",
    "a small model proposes; a large model disposes. 0123456789 !?",
    "servers stream tokens to clients over server-sent events",
]


def make_tokenizer():
    return chat_tokenizer(CORPUS, vocab_size=320)


@pytest.fixture(scope="module")
def loaded():
    tok = make_tokenizer()
    model = tiny_hf_model("llama", vocab_size=len(tok), max_position_embeddings=MAX_MODEL_LEN, seed=3)
    return dataclasses.replace(loaded_from_hf(model, name=NAME), tokenizer=tok)


def make_engine(loaded, **overrides):
    from specplan.engine.server import build_engine

    kwargs = dict(loaded=loaded, proposer="ngram", spec_k=2, max_k=6, dtype=torch.float64, block_size=4,
                  kv_cache_bytes=8 * 1024**2, max_model_len=MAX_MODEL_LEN, max_num_seqs=16,
                  max_num_batched_tokens=256)
    kwargs.update(overrides)
    return build_engine(**kwargs)


class ServerThread:
    """uvicorn on 127.0.0.1 with a free port, in a background thread."""

    def __init__(self, app):
        import uvicorn

        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self):
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            assert time.monotonic() < deadline, "server did not start"
            time.sleep(0.01)
        return self

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(20)
        self.sock.close()


@pytest.fixture(scope="module")
def server(loaded):
    from specplan.engine.server import create_app

    with ServerThread(create_app(make_engine(loaded), NAME, max_queued=64)) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=60)


def metrics(server) -> dict[str, float]:
    """Every sample of /metrics as {name{labels}: value}, parsed by the Prometheus text parser."""
    text = httpx.get(server.url + "/metrics").text
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


def wait_pool_full(server, timeout: float = 10.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        state = httpx.get(server.url + "/debug/engine").json()
        if (state["free_blocks"] == state["total_blocks"] and state["active_jobs"] == 0
                and state["running"] == 0 and state["waiting"] == 0):
            return state
        assert time.monotonic() < deadline, f"KV blocks not returned: {state}"
        time.sleep(0.02)


def greedy(client, prompt, max_tokens=16, **kw):
    return client.completions.create(model=NAME, prompt=prompt, max_tokens=max_tokens, temperature=0, **kw)


# ---- basic endpoints ------------------------------------------------------------------------------
def test_models_and_health(server, client):
    assert [m.id for m in client.models.list().data] == [NAME]
    assert client.models.retrieve(NAME).id == NAME
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}


def test_completion_matches_offline_engine(client, loaded):
    from specplan.engine import LLM, SamplingParams

    r = greedy(client, "the quick brown fox", max_tokens=12)
    assert r.object == "text_completion" and r.model == NAME
    (choice,) = r.choices
    assert choice.finish_reason == "length" and choice.index == 0
    assert r.usage.completion_tokens == 12 and r.usage.prompt_tokens > 0
    offline = LLM(loaded=loaded, dtype=torch.float64, block_size=4, kv_cache_bytes=8 * 1024**2,
                  max_model_len=MAX_MODEL_LEN)
    expected = offline.generate("the quick brown fox", SamplingParams(temperature=0.0, max_tokens=12))[0]
    assert choice.text == expected.text
    assert r.usage.prompt_tokens == len(expected.prompt_token_ids)
    # Token-id prompts work too and give the same continuation.
    assert greedy(client, expected.prompt_token_ids, max_tokens=12).choices[0].text == expected.text


def test_chat(client, loaded):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello world"}]
    r = client.chat.completions.create(model=NAME, messages=messages, max_completion_tokens=10, temperature=0)
    assert r.object == "chat.completion"
    msg = r.choices[0].message
    assert msg.role == "assistant" and isinstance(msg.content, str) and msg.content
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 10
    templated = loaded.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert r.usage.prompt_tokens == len(loaded.tokenizer.encode(templated, add_special_tokens=False))
    # Without a limit a chat runs to the end of the context.
    r = client.chat.completions.create(model=NAME, messages=messages, temperature=0)
    assert r.usage.prompt_tokens + r.usage.completion_tokens == MAX_MODEL_LEN


def test_streaming_equals_non_streamed(client):
    full = greedy(client, "hello world", max_tokens=24)
    chunks = list(greedy(client, "hello world", max_tokens=24, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 24 and not chunks[-1].choices

    messages = [{"role": "user", "content": "the lazy dog"}]
    chat = client.chat.completions.create(model=NAME, messages=messages, max_tokens=20, temperature=0)
    stream = client.chat.completions.create(model=NAME, messages=messages, max_tokens=20, temperature=0, stream=True)
    parts = list(stream)
    assert parts[0].choices[0].delta.role == "assistant"
    assert "".join(p.choices[0].delta.content or "" for p in parts) == chat.choices[0].message.content
    assert parts[-1].choices[0].finish_reason == "length"


def test_sampled_streams_equal_non_streamed(client):
    # Random tokens from a byte-level vocabulary often split UTF-8 characters: the incremental
    # detokenizer must still add up to the final text.
    for seed in range(4):
        kw = dict(model=NAME, prompt="hello", max_tokens=40, temperature=1.5, seed=seed)
        full = client.completions.create(**kw).choices[0].text
        assert "".join(c.choices[0].text for c in client.completions.create(stream=True, **kw)) == full


def test_incremental_detokenization_matches_full_decode(loaded):
    import random

    from specplan.engine import SamplingParams
    from specplan.engine.server.loop import _final_delta, _running_delta, _Track

    tok = loaded.tokenizer
    rng = random.Random(0)
    for trial in range(200):
        ids = [rng.randrange(len(tok)) for _ in range(rng.randint(1, 30))]
        stop = ("ab",) if trial % 3 == 0 else ()
        params = SamplingParams(stop=stop)
        track, sent = _Track(), ""
        for end in range(1, len(ids) + 1):
            sent += _running_delta(track, tok, ids[:end], params)
        track.text = tok.decode(ids, skip_special_tokens=True)
        sent += _final_delta(track)
        assert sent == track.text, (ids, sent, track.text)


def test_seed_reproducible(client):
    def sample(seed):
        return client.completions.create(model=NAME, prompt="a small model", max_tokens=20, temperature=1.0,
                                         seed=seed).choices[0].text

    assert sample(1234) == sample(1234)
    assert sample(1234) != sample(99)


def test_stop_strings(client):
    text = greedy(client, "servers stream", max_tokens=40).choices[0].text
    # A stop string taken from the middle of the greedy output: the text ends just before it.
    candidates = [text[i:i + 2] for i in range(4, len(text) - 2)
                  if text[i:i + 2].isascii() and text[i:i + 2].strip() and text.find(text[i:i + 2]) >= 4]
    assert candidates, text
    stop = candidates[0]
    r = greedy(client, "servers stream", max_tokens=40, stop=[stop, "\x00never"])
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].text == text[:text.find(stop)]
    streamed = "".join(c.choices[0].text for c in greedy(client, "servers stream", max_tokens=40, stop=stop,
                                                         stream=True))
    assert streamed == r.choices[0].text


def test_n_choices(client):
    r = client.completions.create(model=NAME, prompt="hello", max_tokens=16, temperature=1.0, n=3, seed=7)
    assert sorted(c.index for c in r.choices) == [0, 1, 2]
    assert len({c.text for c in r.choices}) > 1  # independent samples
    assert r.usage.completion_tokens == 48
    r = client.completions.create(model=NAME, prompt="hello", max_tokens=8, temperature=0, n=2)
    assert r.choices[0].text == r.choices[1].text
    # Streaming with n > 1: each choice's deltas add up to its text.
    streamed = {0: "", 1: "", 2: ""}
    for c in client.completions.create(model=NAME, prompt="hello", max_tokens=16, temperature=1.0, n=3, seed=7,
                                       stream=True):
        for ch in c.choices:
            streamed[ch.index] += ch.text
    r = client.completions.create(model=NAME, prompt="hello", max_tokens=16, temperature=1.0, n=3, seed=7)
    assert streamed == {c.index: c.text for c in r.choices}


def test_several_prompts_in_one_request(client):
    prompts = ["hello world", "the lazy dog", "a small model"]
    r = client.completions.create(model=NAME, prompt=prompts, max_tokens=6, temperature=0, n=2)
    assert sorted(c.index for c in r.choices) == list(range(6))
    by_index = {c.index: c.text for c in r.choices}
    for i, p in enumerate(prompts):
        alone = greedy(client, p, max_tokens=6).choices[0].text
        assert by_index[2 * i] == by_index[2 * i + 1] == alone


def test_concurrent_clients_equal_sequential(client, server):
    requests = [(f"{CORPUS[i % 4]} {i}", 10 + 7 * i) for i in range(8)]
    alone = [greedy(client, p, m).choices[0].text for p, m in requests]
    steps_before = metrics(server)["specplan:step_num_seqs_count"]
    batched_before = metrics(server)["specplan:step_num_seqs_sum"]
    with ThreadPoolExecutor(8) as pool:
        together = list(pool.map(lambda pm: greedy(client, *pm).choices[0].text, requests))
    assert together == alone
    m = metrics(server)
    # The requests shared steps: more than one sequence per step on average.
    assert (m["specplan:step_num_seqs_sum"] - batched_before) / (m["specplan:step_num_seqs_count"] - steps_before) > 1.5
    wait_pool_full(server)


def test_forced_spec_k_moves_spec_counters(client, server):
    prompt = "the quick brown fox the quick brown fox the quick brown fox the quick"
    before = metrics(server)
    spec = greedy(client, prompt, max_tokens=40, extra_body={"spec": {"k": 4}})
    after = metrics(server)
    plain = greedy(client, prompt, max_tokens=40, extra_body={"spec": {"k": 0}})
    assert spec.choices[0].text == plain.choices[0].text  # greedy verification is lossless
    for name in ("specplan:spec_decode_num_drafts_total", "specplan:spec_decode_num_draft_tokens_total",
                 "specplan:spec_decode_num_accepted_tokens_total"):
        assert after[name] > before[name], name
    assert after["specplan:spec_decode_chosen_k_bucket{le=4.0}"] > before["specplan:spec_decode_chosen_k_bucket{le=4.0}"]
    assert after["specplan:spec_decode_num_draft_tokens_per_pos_total{position=3}"] > \
        before["specplan:spec_decode_num_draft_tokens_per_pos_total{position=3}"]


def test_metrics_parse(server, client):
    greedy(client, "hello", max_tokens=4)
    m = metrics(server)
    for name in ("specplan:time_to_first_token_seconds_count", "specplan:inter_token_latency_seconds_count",
                 "specplan:e2e_request_latency_seconds_count", "specplan:prompt_tokens_total",
                 "specplan:generation_tokens_total", "specplan:step_time_seconds_count",
                 "specplan:step_time_measured_seconds", "specplan:num_requests_running",
                 "specplan:num_requests_waiting"):
        assert m[name] > 0 or name.startswith("specplan:num_requests"), name
    assert m["specplan:step_time_predicted_seconds"] == 0.0  # no planner: no prediction
    assert m["specplan:kv_blocks_total"] > 0
    assert m["specplan:http_responses_total{endpoint=/v1/completions,status=200}"] >= 1
    assert m["specplan:request_success_total{finished_reason=length}"] >= 1


# ---- errors -------------------------------------------------------------------------------------
BAD_REQUESTS = [
    ("/v1/completions", b'{"model": "tiny-chat", "prompt": "hi", ', 400, None),  # malformed JSON
    ("/v1/completions", b"", 400, None),
    ("/v1/completions", b"[1, 2]", 400, None),
    ("/v1/completions", {"prompt": "hi", "max_tokens": "ten"}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "temperature": "hot"}, 400, "temperature"),
    ("/v1/completions", {"prompt": 5}, 400, "prompt"),
    ("/v1/completions", {"prompt": [1, "a"]}, 400, "prompt"),
    ("/v1/completions", {"prompt": "hi", "stop": 3}, 400, "stop"),
    ("/v1/completions", {"prompt": "hi", "n": 0}, 400, "n"),
    ("/v1/completions", {"prompt": "hi", "n": 100}, 400, "n"),  # more than the server could ever admit
    ("/v1/completions", {"prompt": "hi", "stream": "yes"}, 400, "stream"),
    ("/v1/completions", {"max_tokens": 3}, 400, "prompt"),
    ("/v1/completions", {"prompt": ""}, 400, None),
    ("/v1/completions", {"prompt": []}, 400, "prompt"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": -1}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "top_p": 0}, 400, "top_p"),
    ("/v1/completions", {"prompt": "hi", "stop": [""]}, 400, None),
    ("/v1/completions", {"prompt": [10**6]}, 400, None),  # token id outside the vocabulary
    ("/v1/completions", {"prompt": list(range(5, 5 + 40)) * 15}, 400, None),  # 600 tokens > context 512
    ("/v1/completions", {"prompt": "the quick brown fox " * 400}, 400, None),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 600}, 400, None),  # prompt + max_tokens > context
    ("/v1/completions", {"prompt": "hi", "spec": {"k": -1}}, 400, "spec"),
    ("/v1/completions", {"prompt": "hi", "spec": {"k": 99}}, 400, "spec"),
    ("/v1/completions", {"prompt": "hi", "spec": {"kk": 1}}, 400, "spec"),
    ("/v1/completions", {"prompt": "hi", "logprobs": 21}, 400, "logprobs"),  # 0..20 are served (test_logprobs.py)
    ("/v1/completions", {"prompt": "hi", "stream_options": {"include_usage": True}}, 400, "stream_options"),
    ("/v1/completions", {"model": "gpt-4", "prompt": "hi"}, 404, "model"),
    ("/v1/chat/completions", {"messages": "hi"}, 400, "messages"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 3}]}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0}, 400,
     "max_completion_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}, 400,
     "tools"),
    ("/v1/chat/completions", {"model": "nope", "messages": [{"role": "user", "content": "x"}]}, 404, "model"),
    ("/v1/nothing", {"prompt": "hi"}, 404, None),
]


def test_bad_requests_get_4xx_and_server_keeps_serving(server, client):
    before = greedy(client, "hello world", max_tokens=8).choices[0].text
    with httpx.Client(base_url=server.url, timeout=30) as http:
        for path, body, status, param in BAD_REQUESTS:
            content = body if isinstance(body, bytes) else json.dumps(body).encode()
            r = http.post(path, content=content, headers={"content-type": "application/json"})
            assert r.status_code == status, (body, r.status_code, r.text)
            err = r.json()["error"]
            assert err["message"] and set(err) == {"message", "type", "param", "code"}, r.text
            if param is not None:
                assert err["param"] == param, (body, err)
        # Stream requests that fail validation get a plain 4xx JSON error, not a broken stream.
        r = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": -3, "stream": True})
        assert r.status_code == 400 and "max_tokens" in r.json()["error"]["message"]
    m = metrics(server)
    assert not any(k.startswith("specplan:http_responses_total") and "status=5" in k for k in m)
    assert greedy(client, "hello world", max_tokens=8).choices[0].text == before
    wait_pool_full(server)


def test_openai_client_sees_errors(client):
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="other", prompt="hi", max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="context"):
        client.completions.create(model=NAME, prompt=[7] * 600, max_tokens=2)


# ---- cancellation and admission ----------------------------------------------------------------------
def test_cancelled_stream_frees_kv_blocks(server):
    aborted = metrics(server).get("specplan:request_success_total{finished_reason=abort}", 0.0)
    with httpx.Client(base_url=server.url, timeout=30) as http:
        body = {"model": NAME, "prompt": "hello world", "max_tokens": 500, "temperature": 0, "stream": True}
        with http.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: "):
                    break
        busy = http.get("/debug/engine").json()
    assert busy["total_blocks"] > 0
    wait_pool_full(server)
    assert metrics(server)["specplan:request_success_total{finished_reason=abort}"] == aborted + 1


def test_disconnected_non_streaming_request_is_cancelled(server):
    aborted = metrics(server).get("specplan:request_success_total{finished_reason=abort}", 0.0)
    body = {"model": NAME, "prompt": "hello world", "max_tokens": 500, "temperature": 0, "n": 4}  # ~3 s of work
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", json=body, timeout=0.3)
    wait_pool_full(server)
    assert metrics(server)["specplan:request_success_total{finished_reason=abort}"] == aborted + 4


def test_full_queue_answers_429_with_retry_after(loaded):
    from specplan.engine.server import create_app

    app = create_app(make_engine(loaded, max_num_seqs=1), NAME, max_queued=1)
    with ServerThread(app) as s:
        body = {"model": NAME, "prompt": "hello", "max_tokens": 150, "temperature": 0}
        with ThreadPoolExecutor(6) as pool:
            responses = list(pool.map(lambda _: httpx.post(s.url + "/v1/completions", json=body, timeout=60),
                                      range(6)))
        codes = sorted(r.status_code for r in responses)
        assert codes.count(200) >= 2 and 429 in codes and set(codes) <= {200, 429}, codes
        for r in responses:
            if r.status_code == 429:
                assert r.headers["retry-after"] == "1" and r.json()["error"]["code"] == "rate_limit_exceeded"
        texts = {r.json()["choices"][0]["text"] for r in responses if r.status_code == 200}
        assert len(texts) == 1
        # Once the backlog drains, requests are admitted again.
        assert httpx.post(s.url + "/v1/completions", json=body, timeout=60).status_code == 200
        wait_pool_full(s)


# ---- CLI --------------------------------------------------------------------------------------------
def test_cli_serve_bad_arguments_get_one_line(tmp_path):
    from typer.testing import CliRunner

    from specplan.cli import app

    runner = CliRunner()
    r = runner.invoke(app, ["serve", "--policy", "goodput"])
    assert r.exit_code == 2 and "only apply with --adaptive" in r.output
    bad = tmp_path / "broken.json"
    bad.write_text('{"version": 1, "fingerprint": {')
    r = runner.invoke(app, ["serve", "--adaptive", "--profile", str(bad)])
    assert r.exit_code == 2 and "corrupted" in r.output and "specplan profile" in r.output
    r = runner.invoke(app, ["serve", "--model", "/nonexistent/model"])
    assert r.exit_code == 2 and "does not exist" in r.output
    assert len([line for line in r.output.splitlines() if line.strip()]) == 1


def test_startup_heap_is_frozen_while_serving_and_thawed_after(loaded):
    """What is alive when the server starts stays out of the garbage collector's walks while it
    serves (gc.freeze), and is handed back when it stops (a sweep builds and stops one server per
    policy in one process: their engines must still be collectable)."""
    import gc

    from specplan.engine.server import create_app

    gc.unfreeze()  # whatever an earlier test's server left: this one's own freeze is measured
    app = create_app(make_engine(loaded), NAME, max_queued=8)
    with ServerThread(app) as s:
        assert gc.get_freeze_count() > 0
        assert httpx.get(s.url + "/health").json() == {"status": "ok"}
    assert gc.get_freeze_count() == 0
