#!/usr/bin/env python
"""Bounded soak test of `specplan serve` on loopback.

1. Starts a server (`specplan serve` in a subprocess; or uses --url, loopback only).
2. Measures the sustainable rate briefly: a closed loop of --concurrency clients.
3. Drives --rate-mult (2x) that rate as open-loop Poisson arrivals for --duration-s seconds (or
   --max-requests arrivals, whichever comes first). --cancel-frac (20%) of the clients stream and
   hang up after a few chunks; the rest run to completion (half streaming, half not; half chat).
4. Waits (bounded) for everything in flight, then checks that every KV block is back in the pool
   and nothing is left running or waiting on the server.

Reports total requests, outcomes (ok / cancelled / 429 / other 4xx / 5xx / transport errors),
lost requests (a 200 that never finished: no [DONE] or no finish_reason), stuck requests (no
answer within --request-timeout-s, or still active on the server at the end), latency
percentiles, and the server's own counters. Exit code 0 only if there were zero 5xx, zero lost,
zero stuck and the pool is full at the end.

    python -m specplan.bench.soak --tiny --duration-s 60          # quick check on a tiny random model
    python -m specplan.bench.soak --duration-s 300                 # the embedded default model
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from urllib.parse import urlparse

import httpx

LOOPBACK = {"127.0.0.1", "localhost", "::1"}
PROMPTS = [
    "Write a short poem about the sea.",
    "Explain what a hash table is in two sentences.",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "List three rivers in Europe and one fact about each.",
    "Summarize: The quick brown fox jumps over the lazy dog. The dog does not react. The fox runs away.",
    "What is 17 times 23? Show your steps.",
    "Translate to French: Good morning, how are you today?",
    "import numpy as np\n\ndef normalize(x):\n",
]


@dataclass
class Result:
    kind: str  # chat | completion
    mode: str  # plain | stream | cancel
    outcome: str = "pending"  # ok | cancelled | rejected_429 | client_4xx | server_5xx | transport_error | stuck | lost
    status: int | None = None
    ttft_s: float | None = None
    e2e_s: float | None = None
    tokens: int = 0  # completion tokens (non-streamed requests)
    detail: str = ""


@dataclass
class Phase:
    results: list[Result] = field(default_factory=list)
    elapsed_s: float = 0.0
    tokens_per_s: float = 0.0  # calibration: server-side generated tokens per second at saturation
    mean_tokens: float = 0.0  # calibration: mean completion tokens per request


# ---- server process ---------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def build_tiny_model(root: Path) -> Path:
    """A random-weight Llama plus a tiny byte-level BPE tokenizer with a chat template, on disk."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=512, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    backend.train_from_iterator(PROMPTS * 4, trainer=trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<|endoftext|>", eos_token="<|im_end|>")
    tok.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                         "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                      initializer_range=0.1, eos_token_id=2, bos_token_id=1, architectures=["LlamaForCausalLM"])
    torch.manual_seed(0)
    path = root / "tiny-soak"
    LlamaForCausalLM(cfg).save_pretrained(path, safe_serialization=True)
    tok.save_pretrained(path)
    return path


def start_server(args, port: int, model: str | None, log_path: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "specplan.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
           "--max-queued", str(args.max_queued), "--max-num-seqs", str(args.max_num_seqs), "--log-level", "warning"]
    if model:
        cmd += ["--model", model]
    if args.proposer != "none":
        cmd += ["--proposer", args.proposer, "--spec-k", str(args.spec_k)]
    log = open(log_path, "w")
    print(f"[soak] starting: {' '.join(cmd[1:])}  (log: {log_path})", flush=True)
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)


async def wait_healthy(http: httpx.AsyncClient, proc: subprocess.Popen | None, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise SystemExit(f"[soak] the server exited with code {proc.returncode}; see its log")
        try:
            if (await http.get("/health", timeout=2)).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        await asyncio.sleep(0.5)
    raise SystemExit("[soak] the server did not become healthy in time")


# ---- one client request -----------------------------------------------------------------------------------
def request_body(rng: random.Random, model: str, kind: str, stream: bool, max_tokens: int) -> dict:
    prompt = rng.choice(PROMPTS)
    body: dict = {"model": model, "max_tokens": rng.randint(max(4, max_tokens // 4), max_tokens)}
    if rng.random() < 0.7:
        body["temperature"] = 0.0
    else:
        body.update(temperature=0.8, top_p=0.95, seed=rng.randrange(1 << 30))
    if kind == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    if stream:
        body["stream"] = True
    return body


async def run_one(http: httpx.AsyncClient, rng: random.Random, model: str, kind: str, mode: str,
                  max_tokens: int, timeout_s: float) -> Result:
    res = Result(kind, mode)
    path = "/v1/chat/completions" if kind == "chat" else "/v1/completions"
    body = request_body(rng, model, kind, mode != "plain", max_tokens)
    cancel_after = rng.randint(1, 6) if mode == "cancel" else None
    t0 = time.perf_counter()

    async def attempt() -> Result:
        if mode == "plain":
            r = await http.post(path, json=body)
            res.status = r.status_code
            res.e2e_s = time.perf_counter() - t0
            if r.status_code == 200:
                data = r.json()
                choices = data.get("choices") or []
                if choices and all(c.get("finish_reason") for c in choices):
                    res.outcome, res.tokens = "ok", data["usage"]["completion_tokens"]
                else:
                    res.outcome, res.detail = "lost", "200 without finished choices"
            else:
                classify_error(res, r.status_code, r.text)
            return res
        async with http.stream("POST", path, json=body) as r:
            res.status = r.status_code
            if r.status_code != 200:
                classify_error(res, r.status_code, (await r.aread()).decode(errors="replace"))
                return res
            chunks, finished, done = 0, False, False
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                payload = line[6:]
                if payload == "[DONE]":
                    done = True
                    break
                data = json.loads(payload)
                if "error" in data:
                    res.detail = str(data["error"])[:200]
                    kind_ = data["error"].get("type")
                    res.outcome = "server_5xx" if kind_ in ("internal_error", "service_unavailable") else "client_4xx"
                    return res
                if res.ttft_s is None:
                    res.ttft_s = time.perf_counter() - t0
                for c in data.get("choices") or []:
                    finished |= c.get("finish_reason") is not None
                chunks += 1
                if cancel_after is not None and chunks >= cancel_after:
                    res.outcome = "cancelled"
                    return res  # leaving the block closes the connection mid-stream
            res.e2e_s = time.perf_counter() - t0
            if done and finished:
                res.outcome = "ok"
            elif cancel_after is not None and done:
                res.outcome = "ok"  # finished before we hung up
            else:
                res.outcome, res.detail = "lost", f"stream ended early (done={done}, finished={finished})"
            return res

    try:
        return await asyncio.wait_for(attempt(), timeout_s)
    except asyncio.TimeoutError:
        res.outcome, res.detail = "stuck", f"no complete answer within {timeout_s}s"
    except httpx.HTTPError as e:
        res.outcome, res.detail = "transport_error", f"{type(e).__name__}: {e}"[:200]
    return res


def classify_error(res: Result, status: int, text: str) -> None:
    res.detail = text[:200]
    if status == 429:
        res.outcome = "rejected_429"
    elif status >= 500:
        res.outcome = "server_5xx"
    else:
        res.outcome = "client_4xx"


def pick_kind_mode(rng: random.Random, cancel_frac: float) -> tuple[str, str]:
    kind = "chat" if rng.random() < 0.5 else "completion"
    if rng.random() < cancel_frac:
        return kind, "cancel"
    return kind, "stream" if rng.random() < 0.5 else "plain"


# ---- phases -----------------------------------------------------------------------------------------------
async def calibrate(http, model, args, rng) -> tuple[float, Phase]:
    """Closed loop: --concurrency clients back to back for --calibrate-s seconds -> sustainable req/s.

    The server's generated-token rate over the last two thirds of the window (the batch is full by
    then), divided by the mean completion tokens of a request: robust even when few requests
    complete inside the window (a real model on 2 cores takes tens of seconds per batch).
    """
    phase = Phase()
    t0 = time.perf_counter()
    stop_at = t0 + args.calibrate_s

    async def worker(seed: int):
        wrng = random.Random(seed)
        while time.perf_counter() < stop_at:
            kind = "chat" if wrng.random() < 0.5 else "completion"
            phase.results.append(await run_one(http, wrng, model, kind, "plain", args.max_tokens,
                                               args.request_timeout_s))

    async def window() -> float:
        await asyncio.sleep(args.calibrate_s / 3)
        t1, tok1 = time.perf_counter(), (await scrape(http)).get("specplan:generation_tokens_total", 0.0)
        await asyncio.sleep(max(0.0, stop_at - time.perf_counter()))
        t2, tok2 = time.perf_counter(), (await scrape(http)).get("specplan:generation_tokens_total", 0.0)
        return (tok2 - tok1) / (t2 - t1)

    tasks = [asyncio.create_task(worker(rng.randrange(1 << 30))) for _ in range(args.concurrency)]
    tokens_per_s = await window()
    await asyncio.gather(*tasks)  # let the last requests finish before the driven phase
    phase.elapsed_s = time.perf_counter() - t0
    done = [r.tokens for r in phase.results if r.outcome == "ok" and r.tokens]
    mean_tokens = statistics.fmean(done) if done else (args.max_tokens // 4 + args.max_tokens) / 2
    phase.tokens_per_s = tokens_per_s
    phase.mean_tokens = mean_tokens
    return tokens_per_s / mean_tokens, phase


async def drive(http, model, args, rng, rate: float) -> Phase:
    """Open loop: Poisson arrivals at ``rate`` for --duration-s or --max-requests, then drain."""
    phase = Phase()
    tasks: list[asyncio.Task] = []
    t0 = time.perf_counter()
    end = t0 + args.duration_s
    next_report = t0 + 10
    while time.perf_counter() < end and len(tasks) < args.max_requests:
        kind, mode = pick_kind_mode(rng, args.cancel_frac)
        tasks.append(asyncio.create_task(run_one(http, random.Random(rng.randrange(1 << 30)), model, kind, mode,
                                                 args.max_tokens, args.request_timeout_s)))
        await asyncio.sleep(rng.expovariate(rate))
        if time.perf_counter() >= next_report:
            done = [t.result() for t in tasks if t.done()]
            c = Counter(r.outcome for r in done)
            print(f"[soak] t={time.perf_counter() - t0:5.0f}s sent={len(tasks)} in-flight={len(tasks) - len(done)} "
                  + " ".join(f"{k}={v}" for k, v in sorted(c.items())), flush=True)
            next_report += 10
    sent_s = time.perf_counter() - t0
    print(f"[soak] sent {len(tasks)} requests in {sent_s:.0f}s; draining...", flush=True)
    phase.results = list(await asyncio.gather(*tasks))
    phase.elapsed_s = time.perf_counter() - t0
    return phase


async def wait_pool_full(http, timeout: float) -> dict:
    deadline = time.monotonic() + timeout
    state: dict = {}
    while time.monotonic() < deadline:
        state = (await http.get("/debug/engine")).json()
        if (state["free_blocks"] == state["total_blocks"] and state["active_jobs"] == 0 and state["running"] == 0
                and state["waiting"] == 0 and state["pending"] == 0):
            state["pool_full"] = True
            return state
        await asyncio.sleep(0.2)
    state["pool_full"] = False
    return state


async def scrape(http) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for fam in text_string_to_metric_families((await http.get("/metrics")).text):
        for s in fam.samples:
            if s.name.endswith("_created"):
                continue
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


def pct(values: list[float]) -> dict:
    if not values:
        return {}
    v = sorted(values)

    def q(p):
        return round(v[min(len(v) - 1, int(p * (len(v) - 1) + 0.5))], 4)

    return {"n": len(v), "p50": q(0.50), "p90": q(0.90), "p99": q(0.99), "max": round(v[-1], 4),
            "mean": round(statistics.fmean(v), 4)}


def server_delta(before: dict, after: dict, prefix: str) -> dict:
    return {k[len("specplan:"):]: round(after[k] - before.get(k, 0.0), 3) for k in after
            if k.startswith(prefix) and after[k] - before.get(k, 0.0)}


# ---- main -------------------------------------------------------------------------------------------------
async def main_async(args) -> int:
    tmp = tempfile.TemporaryDirectory(prefix="specplan-soak-")
    proc = None
    url = args.url
    if url is None:
        port = free_port()
        model = args.model
        if args.tiny:
            model = str(build_tiny_model(Path(tmp.name)))
        log = Path(args.log) if args.log else Path(tempfile.gettempdir()) / f"specplan-soak-server-{port}.log"
        proc = start_server(args, port, model, log)
        url = f"http://127.0.0.1:{port}"
    host = urlparse(url).hostname
    if host not in LOOPBACK:
        raise SystemExit(f"[soak] loopback only: refusing {url}")
    limits = httpx.Limits(max_connections=2000, max_keepalive_connections=64)
    report: dict = {"url": url, "args": vars(args)}
    try:
        async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(args.request_timeout_s, connect=10),
                                     limits=limits) as http:
            await wait_healthy(http, proc, args.startup_timeout_s)
            model_id = (await http.get("/v1/models")).json()["data"][0]["id"]
            rng = random.Random(args.seed)
            print(f"[soak] server up ({model_id}); calibrating for {args.calibrate_s:.0f}s with "
                  f"{args.concurrency} closed-loop clients...", flush=True)
            rate, cal = await calibrate(http, model_id, args, rng)
            if rate <= 0:
                raise SystemExit("[soak] calibration completed no request")
            target = args.rate_mult * rate
            print(f"[soak] sustainable ~{rate:.2f} req/s; driving {target:.2f} req/s for {args.duration_s:.0f}s "
                  f"with {args.cancel_frac:.0%} cancelling...", flush=True)
            before = await scrape(http)
            run = await drive(http, model_id, args, rng, target)
            pool = await wait_pool_full(http, args.drain_timeout_s)
            after = await scrape(http)
    finally:
        if proc is not None:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
        tmp.cleanup()

    res = run.results
    outcomes = Counter(r.outcome for r in res)
    admitted = sum(1 for r in res if r.outcome in ("ok", "cancelled", "lost", "stuck"))
    finished_server = sum(v for k, v in server_delta(before, after, "specplan:request_success_total").items())
    lost = outcomes.get("lost", 0)
    stuck = outcomes.get("stuck", 0) + (pool.get("active_jobs", 0) or 0)
    ok = [r for r in res if r.outcome == "ok"]
    generated = after.get("specplan:generation_tokens_total", 0.0) - before.get("specplan:generation_tokens_total", 0.0)
    report.update({
        "calibration": {"sustainable_req_per_s": round(rate, 3), "tokens_per_s": round(cal.tokens_per_s, 1),
                        "mean_completion_tokens": round(cal.mean_tokens, 1), "requests": len(cal.results),
                        "seconds": round(cal.elapsed_s, 1),
                        "outcomes": dict(Counter(r.outcome for r in cal.results))},
        "drive": {"target_req_per_s": round(target, 3), "seconds": round(run.elapsed_s, 1),
                  "total_requests": len(res), "outcomes": dict(outcomes),
                  "modes": dict(Counter(r.mode for r in res)),
                  "completed_req_per_s": round(len(ok) / run.elapsed_s, 3),
                  "generated_tokens_per_s": round(generated / run.elapsed_s, 1)},
        "server_5xx": outcomes.get("server_5xx", 0),
        "lost": lost,
        "stuck": stuck,
        "admitted_vs_server_finished": [admitted, finished_server],
        "latency_s": {"e2e_ok": pct([r.e2e_s for r in ok if r.e2e_s is not None]),
                      "ttft_stream": pct([r.ttft_s for r in res if r.ttft_s is not None])},
        "kv_pool_at_end": pool,
        "server": {
            "http": server_delta(before, after, "specplan:http_responses_total"),
            "finished": server_delta(before, after, "specplan:request_success_total"),
            "spec_decode": {k: v for k, v in server_delta(before, after, "specplan:spec_decode_num").items()
                            if "per_pos" not in k},
        },
        "samples_of_failures": [asdict(r) for r in res if r.outcome in ("server_5xx", "lost", "stuck",
                                                                          "transport_error", "client_4xx")][:10],
    })
    passed = (report["server_5xx"] == 0 and lost == 0 and stuck == 0 and pool["pool_full"]
              and outcomes.get("transport_error", 0) == 0 and admitted == finished_server)
    report["passed"] = passed
    text = json.dumps(report, indent=2, default=str)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")
    print(text)
    d = report["drive"]
    print(f"[soak] {'PASS' if passed else 'FAIL'}: {d['total_requests']} requests in {d['seconds']}s at "
          f"{d['target_req_per_s']} req/s (2x of {report['calibration']['sustainable_req_per_s']}): "
          f"{dict(outcomes)}; 5xx={report['server_5xx']} lost={lost} stuck={stuck} "
          f"kv_pool_full={pool['pool_full']} ({pool.get('free_blocks')}/{pool.get('total_blocks')})", flush=True)
    return 0 if passed else 1


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--duration-s", type=float, default=300.0, help="length of the driven phase")
    p.add_argument("--max-requests", type=int, default=20000, help="stop sending after this many requests")
    p.add_argument("--calibrate-s", type=float, default=None, help="calibration length (default: 30s, 10s with --tiny)")
    p.add_argument("--concurrency", type=int, default=None, help="closed-loop clients while calibrating "
                   "(default: --max-num-seqs)")
    p.add_argument("--rate-mult", type=float, default=2.0, help="driven rate as a multiple of the sustainable one")
    p.add_argument("--cancel-frac", type=float, default=0.2, help="fraction of clients hanging up mid-stream")
    p.add_argument("--max-tokens", type=int, default=64, help="max_tokens per request is drawn from [max/4, max]")
    p.add_argument("--model", default=None, help="model for the server (default: the embedded model)")
    p.add_argument("--tiny", action="store_true", help="serve a tiny random model (quick check)")
    p.add_argument("--url", default=None, help="use a running server instead of starting one (loopback only)")
    p.add_argument("--proposer", default="ngram", help="server proposer: ngram | suffix | layer-skip | draft | none")
    p.add_argument("--spec-k", type=int, default=4)
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--max-queued", type=int, default=32, help="server backlog before it answers 429")
    p.add_argument("--request-timeout-s", type=float, default=180.0, help="a request not done by then is stuck")
    p.add_argument("--drain-timeout-s", type=float, default=60.0, help="wait this long for the pool to refill")
    p.add_argument("--startup-timeout-s", type=float, default=300.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="also write the JSON report here (e.g. reports/soak.json)")
    p.add_argument("--log", default=None, help="server log file (default: specplan-soak-server-PORT.log in the temp dir)")
    args = p.parse_args(argv)
    if args.calibrate_s is None:
        args.calibrate_s = 10.0 if args.tiny else 30.0
    if args.concurrency is None:
        args.concurrency = args.max_num_seqs
    if args.tiny and args.model:
        p.error("--tiny and --model exclude each other")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    return asyncio.run(main_async(args))


if __name__ == "__main__":
    sys.exit(main())
