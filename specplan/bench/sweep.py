"""SLA sweeps: a load generator for specplan's OpenAI-compatible server and the runner behind
`specplan sweep` (the report is `specplan.sweep_report`).

Load generator
--------------
Requests go to ``POST /v1/completions`` with streaming (``stream_options.include_usage``), the
prompt as token ids (the workload's prompt rendered with the model's chat template where it has
one). Arrivals are a Poisson process at a given rate (gamma intervals with ``burstiness`` != 1,
``inf``: all at once), or a closed loop of ``concurrency`` clients that each send the next
request when their last one ends. A level runs for ``duration_s`` of arrivals or for
``num_requests`` requests, then waits up to ``drain_timeout_s`` for what is still in flight
(requests still running then are cancelled and count as failed).

Metric definitions (those of vLLM's serving benchmark, ``benchmark_serving.py``):

- A *chunk* is one SSE event that carries ``choices`` (the final usage-only event does not). The
  engine may put several tokens in one chunk when speculation accepts drafts.
- TTFT: first chunk's arrival − the request's send time.
- ITL: the gaps between successive chunks of a request (so with speculation one gap may deliver
  several tokens); level percentiles are over all gaps of all successful requests.
- E2EL: the last chunk's arrival − the send time.
- TPOT: (E2EL − TTFT) / (output_tokens − 1), output tokens from the response's ``usage``; only
  requests with more than one output token enter the TPOT statistics (for goodput a one-token
  request has TPOT 0, as in vLLM).
- Request throughput: successful requests / level duration; output token throughput: their output
  tokens / level duration; the level duration runs from the first send to the last completion
  (or cancellation).
- Goodput (vLLM's ``--goodput``): successful requests meeting every SLA threshold given — TTFT ≤
  ``sla.ttft_ms``, TPOT ≤ ``sla.tpot_ms`` (default: the ITL target), E2EL ≤ ``sla.e2el_ms`` — per
  second of level duration.
- Percentiles use ``numpy.percentile`` (linear interpolation); all latencies are reported in ms.

The chosen k
------------
``run_sweep`` serves the engine in-process and wraps its decider in a ``KRecorder`` that tallies,
per engine request, the k the engine ran each step (the decider's choice after the engine's caps),
the drafts proposed and accepted; rows are joined to it by the response id.
"""

from __future__ import annotations

import asyncio
import gc
import json
import math
import random
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

PERCENTILES = (50, 90, 99)
METRICS = ("ttft", "tpot", "itl", "e2el")


# ---- SLA and metrics (pure functions) ------------------------------------------------------------
@dataclass(frozen=True)
class SLA:
    """Latency targets in milliseconds (None: no target)."""

    ttft_ms: float | None = None
    itl_ms: float | None = None  # per chunk gap: the sweep's "p90 ITL meets the SLA" test
    tpot_ms: float | None = None  # per-request goodput threshold on TPOT; None: itl_ms
    e2el_ms: float | None = None

    def goodput_thresholds(self) -> dict[str, float]:
        """vLLM's ``--goodput`` dictionary: metric -> threshold in ms."""
        out = {}
        tpot = self.tpot_ms if self.tpot_ms is not None else self.itl_ms
        for name, value in (("ttft", self.ttft_ms), ("tpot", tpot), ("e2el", self.e2el_ms)):
            if value is not None:
                out[name] = float(value)
        return out


@dataclass
class StreamResult:
    """What one streamed response told the client."""

    chunk_times: list[float] = field(default_factory=list)  # perf_counter arrival of each choices chunk
    output_tokens: int | None = None  # usage.completion_tokens
    prompt_tokens: int | None = None
    response_id: str | None = None
    error: str | None = None
    done: bool = False  # saw [DONE]


def parse_sse_line(line: str, now: float, into: StreamResult) -> None:
    """Fold one SSE line received at ``now`` into ``into`` (data lines only; comments ignored)."""
    if not line.startswith("data:"):
        return
    data = line[5:].strip()
    if data == "[DONE]":
        into.done = True
        return
    obj = json.loads(data)
    if "error" in obj and "choices" not in obj:
        err = obj["error"]
        into.error = err.get("message", str(err)) if isinstance(err, dict) else str(err)
        return
    if into.response_id is None and obj.get("id"):
        into.response_id = obj["id"]
    if obj.get("choices"):
        into.chunk_times.append(now)
    usage = obj.get("usage")
    if usage:
        into.output_tokens = usage.get("completion_tokens")
        into.prompt_tokens = usage.get("prompt_tokens")


def request_timings(start: float, chunk_times: Sequence[float], output_tokens: int | None) -> dict:
    """TTFT, ITL gaps, E2EL and TPOT in seconds from the send time and the chunks' arrival times."""
    if not chunk_times:
        return {"ttft_s": math.nan, "itl_s": [], "e2el_s": math.nan, "tpot_s": math.nan}
    ttft = chunk_times[0] - start
    e2el = chunk_times[-1] - start
    itl = [b - a for a, b in zip(chunk_times, chunk_times[1:])]
    n = output_tokens or 0
    tpot = (e2el - ttft) / (n - 1) if n > 1 else math.nan
    return {"ttft_s": ttft, "itl_s": itl, "e2el_s": e2el, "tpot_s": tpot}


def is_good(row: dict, sla: SLA) -> bool:
    """vLLM's goodput test for one successful request (a one-token request has TPOT 0)."""
    if not row.get("success"):
        return False
    thresholds = sla.goodput_thresholds()
    values = {"ttft": row["ttft_s"], "e2el": row["e2el_s"],
              "tpot": 0.0 if (row.get("output_tokens") or 0) <= 1 else row["tpot_s"]}
    return all(values[k] * 1000.0 <= v for k, v in thresholds.items())


def _stats(values: Iterable[float], name: str) -> dict:
    import numpy as np

    arr = np.asarray([v for v in values if v is not None and not math.isnan(v)], dtype=float) * 1000.0
    if arr.size == 0:
        arr = np.zeros(1)  # as vLLM: `np.mean(x or 0)` when nothing was measured
    out = {f"mean_{name}_ms": float(arr.mean()), f"median_{name}_ms": float(np.median(arr)),
           f"std_{name}_ms": float(arr.std())}
    for p in PERCENTILES:
        out[f"p{p}_{name}_ms"] = float(np.percentile(arr, p))
    return out


def summarize_level(rows: Sequence[dict], duration_s: float, sla: SLA) -> dict:
    """vLLM's ``calculate_metrics`` over one level's request rows, plus speculation counters."""
    ok = [r for r in rows if r.get("success")]
    outputs = [int(r.get("output_tokens") or 0) for r in ok]
    total_input = sum(int(r.get("prompt_tokens") or 0) for r in ok)
    dur = max(duration_s, 1e-9)
    good = sum(is_good(r, sla) for r in ok)
    out = {
        "num_requests": len(rows), "completed": len(ok), "failed": len(rows) - len(ok),
        "duration_s": duration_s, "total_input": total_input, "total_output": sum(outputs),
        "request_throughput": len(ok) / dur, "request_goodput": good / dur,
        "output_throughput": sum(outputs) / dur, "total_token_throughput": (total_input + sum(outputs)) / dur,
        "good_fraction": good / len(rows) if rows else 0.0,
    }
    out.update(_stats((r["ttft_s"] for r in ok), "ttft"))
    out.update(_stats((r["tpot_s"] for r, n in zip(ok, outputs) if n > 1), "tpot"))
    out.update(_stats((g for r in ok for g in (r.get("itl_s") if r.get("itl_s") is not None else [])), "itl"))
    out.update(_stats((r["e2el_s"] for r in ok), "e2el"))
    steps = sum(int(r.get("spec_steps") or 0) for r in ok)
    k_sum = sum(int(r.get("k_sum") or 0) for r in ok)
    proposed = sum(int(r.get("num_draft_tokens") or 0) for r in ok)
    accepted = sum(int(r.get("num_accepted_tokens") or 0) for r in ok)
    k0 = sum(int(r.get("k0_steps") or 0) for r in ok)
    out.update({"spec_steps": steps, "mean_k": k_sum / steps if steps else math.nan,
                "k0_share": k0 / steps if steps else math.nan, "num_draft_tokens": proposed,
                "num_accepted_tokens": accepted, "acceptance_rate": accepted / proposed if proposed else 0.0})
    return out


def meets_itl_sla(level: dict, sla: SLA) -> bool:
    """A level meets the ITL SLA when its p90 ITL is within the target and no request failed."""
    if sla.itl_ms is None:
        return level.get("failed", 0) == 0
    return level.get("failed", 0) == 0 and level.get("completed", 0) > 0 and level["p90_itl_ms"] <= sla.itl_ms


def max_load_meeting(loads: Sequence[float], passes: Sequence[bool]) -> float | None:
    """The highest load such that it and every lower load pass (None if the lowest fails)."""
    best = None
    for load, ok in sorted(zip(loads, passes), key=lambda x: x[0]):
        if not ok:
            break
        best = load
    return best


# ---- requests ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class LoadRequest:
    index: int
    workload: str
    prompt_id: str
    prompt: tuple[int, ...]  # token ids
    max_tokens: int
    send_at: float = 0.0  # seconds after the level starts (rate mode)


@dataclass(frozen=True)
class RenderedPrompt:
    workload: str
    prompt_id: str
    token_ids: tuple[int, ...]


def render_workload(workload: str | Sequence[Any], tokenizer: Any, *, pool: int, seed: int,
                    max_input_tokens: int | None) -> list[RenderedPrompt]:
    """Prompts of a workload (name, or Prompt objects) as token ids, longer ones than
    ``max_input_tokens`` left out. Names go through ``profiler.workloads.load_workload``."""
    if isinstance(workload, str):
        from specplan.bench.workloads import load_workload

        prompts = load_workload(workload, pool, seed)
    else:
        prompts = list(workload)
    out = []
    for p in prompts:
        ids = p.render(tokenizer)
        if max_input_tokens is not None and len(ids) > max_input_tokens:
            continue
        out.append(RenderedPrompt(p.workload, p.id, tuple(ids)))
    if not out:
        raise ValueError(f"no prompt of the workload fits in {max_input_tokens} input tokens "
                         f"(raise --max-input-tokens or the context length)")
    return out


def arrival_times(rate: float, *, duration_s: float | None = None, num_requests: int | None = None,
                  seed: int = 0, burstiness: float = 1.0) -> list[float]:
    """Send times (s) of a Poisson process (gamma intervals when burstiness != 1), the first at 0,
    for ``duration_s`` seconds or ``num_requests`` requests. rate=inf: all at 0."""
    if (duration_s is None) == (num_requests is None):
        raise ValueError("give exactly one of duration_s and num_requests")
    if not rate > 0:
        raise ValueError(f"request rate must be > 0, got {rate}")
    if burstiness <= 0:
        raise ValueError(f"burstiness must be > 0, got {burstiness}")
    if math.isinf(rate):
        if num_requests is None:
            raise ValueError("an infinite rate needs num_requests (a duration sends nothing more after t=0)")
        return [0.0] * num_requests
    rng = random.Random(seed)
    theta = 1.0 / (rate * burstiness)
    times, t = [], 0.0
    while True:
        if num_requests is not None and len(times) >= num_requests:
            return times
        if duration_s is not None and t >= duration_s:
            return times or [0.0]
        times.append(t)
        t += rng.gammavariate(burstiness, theta)


def make_requests(prompts: Sequence[RenderedPrompt], send_at: Sequence[float], max_tokens: int,
                  offset: int = 0) -> list[LoadRequest]:
    """One request per send time, cycling through the prompts from ``offset``."""
    return [LoadRequest(i, p.workload, p.prompt_id, p.token_ids, max_tokens, t)
            for i, t in enumerate(send_at) for p in [prompts[(offset + i) % len(prompts)]]]


# ---- the client ------------------------------------------------------------------------------------
@dataclass
class ClientOptions:
    mode: str = "rate"  # rate | concurrency
    concurrency: int = 1  # clients in the closed loop (concurrency mode)
    duration_s: float | None = None  # concurrency mode: stop starting requests after this
    drain_timeout_s: float = 60.0  # after the last send, how long in-flight requests may still run
    temperature: float = 0.0
    ignore_eos: bool = False
    model: str | None = None
    timeout_s: float = 600.0  # per request


def _payload(req: LoadRequest, opts: ClientOptions) -> dict:
    body = {"prompt": list(req.prompt), "max_tokens": req.max_tokens, "temperature": opts.temperature,
            "stream": True, "stream_options": {"include_usage": True}}
    if opts.ignore_eos:
        body["ignore_eos"] = True
    if opts.model:
        body["model"] = opts.model
    return body


async def send_request(client: Any, url: str, req: LoadRequest, opts: ClientOptions, level_start: float,
                       row: dict) -> dict:
    """Stream one completion and fill ``row`` (also when cancelled half way: see run_load)."""
    import httpx

    stream = StreamResult()
    row.update(index=req.index, workload=req.workload, prompt_id=req.prompt_id, prompt_tokens=len(req.prompt),
               max_tokens=req.max_tokens, send_at=req.send_at, success=False, error="", output_tokens=0,
               ttft_s=math.nan, tpot_s=math.nan, e2el_s=math.nan, itl_s=[], num_chunks=0, response_id="")
    start = time.perf_counter()
    row["start_s"] = start - level_start
    row["_stream"], row["_start"] = stream, start
    try:
        async with client.stream("POST", url, json=_payload(req, opts), timeout=opts.timeout_s) as resp:
            if resp.status_code != 200:
                body = (await resp.aread()).decode("utf-8", "replace")
                try:
                    body = json.loads(body)["error"]["message"]
                except (ValueError, KeyError, TypeError):
                    pass
                stream.error = f"HTTP {resp.status_code}: {body}"[:500]
            else:
                async for line in resp.aiter_lines():
                    parse_sse_line(line, time.perf_counter(), stream)
    except (httpx.HTTPError, OSError, ValueError) as e:
        stream.error = f"{type(e).__name__}: {e}"[:500]
    _finish_row(row, stream, start)
    return row


def _finish_row(row: dict, stream: StreamResult, start: float, error: str | None = None) -> None:
    row.pop("_stream", None)
    row.pop("_start", None)
    t = request_timings(start, stream.chunk_times, stream.output_tokens)
    row.update(t)
    row["num_chunks"] = len(stream.chunk_times)
    row["response_id"] = stream.response_id or ""
    if stream.output_tokens is not None:
        row["output_tokens"] = int(stream.output_tokens)
    if stream.prompt_tokens is not None:
        row["prompt_tokens"] = int(stream.prompt_tokens)
    row["error"] = error or stream.error or ("" if stream.done and stream.output_tokens is not None
                                             else "the stream ended without usage and [DONE]")
    row["success"] = not row["error"] and bool(stream.chunk_times)
    row["end_s"] = (stream.chunk_times[-1] if stream.chunk_times else time.perf_counter()) - (start - row["start_s"])


async def run_load(base_url: str, requests: Sequence[LoadRequest], opts: ClientOptions,
                   on_done: Callable[[], None] | None = None) -> tuple[list[dict], float]:
    """Run one level against ``base_url`` (e.g. http://127.0.0.1:8000); returns (rows, duration_s).

    Rate mode: request i is sent at ``requests[i].send_at``. Concurrency mode: ``opts.concurrency``
    clients send back to back, cycling through ``requests`` for ``opts.duration_s`` (or through
    the list once when duration_s is None).
    """
    import httpx

    url = base_url.rstrip("/") + "/v1/completions"
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    rows: list[dict] = []
    async with httpx.AsyncClient(limits=limits, trust_env=False, timeout=opts.timeout_s) as client:
        level_start = time.perf_counter()

        async def one(req: LoadRequest) -> None:
            row: dict = {}
            rows.append(row)
            await send_request(client, url, req, opts, level_start, row)
            if on_done is not None:
                on_done()

        tasks: list[asyncio.Task] = []
        if opts.mode == "rate":
            for req in requests:
                delay = level_start + req.send_at - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                tasks.append(asyncio.create_task(one(req)))
        elif opts.mode == "concurrency":
            counter = iter(range(10**9))

            async def worker() -> None:
                while True:
                    i = next(counter)
                    if opts.duration_s is None and i >= len(requests):
                        return
                    if opts.duration_s is not None and time.perf_counter() - level_start >= opts.duration_s:
                        return
                    base = requests[i % len(requests)]
                    await one(LoadRequest(i, base.workload, base.prompt_id, base.prompt, base.max_tokens,
                                          time.perf_counter() - level_start))

            workers = [asyncio.create_task(worker()) for _ in range(opts.concurrency)]
            if opts.duration_s is not None:
                await asyncio.wait(workers, timeout=max(0.0, level_start + opts.duration_s - time.perf_counter()))
            tasks = workers
        else:
            raise ValueError(f"mode must be 'rate' or 'concurrency', got {opts.mode!r}")
        if tasks:
            # Closed loop over a fixed list: no deadline but the per-request timeout.
            unbounded = opts.mode == "concurrency" and opts.duration_s is None
            _, pending = await asyncio.wait(tasks, timeout=None if unbounded else opts.drain_timeout_s)
            for t in pending:
                t.cancel()
            if pending:
                await asyncio.gather(*pending, return_exceptions=True)
        end = time.perf_counter()
    for row in rows:  # cancelled in flight: keep what arrived, mark failed
        if "_stream" in row:
            _finish_row(row, row["_stream"], row["_start"],
                        error=f"timeout: still running {opts.drain_timeout_s:g}s after the last send")
    rows.sort(key=lambda r: r["index"])
    return rows, end - level_start


# During a sweep the client runs in a child process (as vLLM's benchmark client does): its
# timestamps are then not delayed by the engine thread holding the server process's GIL. The
# child is a plain `python -c` (not multiprocessing), so no caller needs a `__main__` guard; it
# reads its job as JSON on stdin, prints "+" per finished request and the result as one JSON line.
_CHILD = "import specplan.bench.sweep as s; s._client_child()"


def _client_child() -> None:
    import sys

    job = json.loads(sys.stdin.read())
    reqs = [LoadRequest(**{**r, "prompt": tuple(r["prompt"])}) for r in job["requests"]]
    opts = ClientOptions(**job["opts"])

    def tick() -> None:
        sys.stdout.write("+\n")
        sys.stdout.flush()

    rows, duration = asyncio.run(run_load(job["url"], reqs, opts, on_done=tick))
    sys.stdout.write("=" + json.dumps({"rows": rows, "duration_s": duration}) + "\n")
    sys.stdout.flush()


def run_load_in_child(base_url: str, requests: Sequence[LoadRequest], opts: ClientOptions,
                      on_done: Callable[[], None] | None = None) -> tuple[list[dict], float]:
    """``run_load`` in a fresh Python process (same interpreter and import path)."""
    import os
    import subprocess
    import sys
    import tempfile

    job = json.dumps({"url": base_url, "requests": [asdict(r) for r in requests], "opts": asdict(opts)})
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    with tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen([sys.executable, "-c", _CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=err, text=True, env=env)
        try:
            proc.stdin.write(job)
            proc.stdin.close()
            result = None
            for line in proc.stdout:
                if line.startswith("+"):
                    if on_done is not None:
                        on_done()
                elif line.startswith("="):
                    result = json.loads(line[1:])
            code = proc.wait()
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        if code != 0 or result is None:
            err.seek(0)
            tail = err.read()[-2000:]
            raise RuntimeError(f"the load generator's process failed (exit {code}):\n{tail}")
    return result["rows"], result["duration_s"]


# ---- the server side: recording the chosen k, uvicorn in a thread ------------------------------------
@dataclass
class _KTally:
    steps: int = 0
    k_sum: int = 0
    k0_steps: int = 0
    proposed: int = 0
    accepted: int = 0
    emitted: int = 0
    hist: dict = field(default_factory=dict)


class KRecorder:
    """A SpecDecider wrapper: passes decisions through and tallies, per engine request id, the k
    the engine ran each step, drafts proposed and accepted; plus step counts for the level."""

    def __init__(self, inner: Any):
        self.inner = inner
        self._lock = threading.Lock()
        self._by_rid: dict[str, _KTally] = {}
        self.reset_steps()

    def reset_steps(self) -> None:
        self.num_steps = 0
        self.decode_seqs = 0
        self.step_s = 0.0

    def decide(self, view: Any) -> list[int]:
        return self.inner.decide(view)

    def observe(self, record: Any) -> None:
        with self._lock:
            self.num_steps += 1
            self.decode_seqs += len(record.requests)
            self.step_s += record.total_s
            for r in record.requests:
                t = self._by_rid.get(r.request_id)
                if t is None:
                    t = self._by_rid[r.request_id] = _KTally()
                t.steps += 1
                t.k_sum += r.k
                t.k0_steps += r.k == 0
                t.proposed += r.num_proposed
                t.accepted += r.num_accepted
                t.emitted += r.num_emitted
                t.hist[r.k] = t.hist.get(r.k, 0) + 1
        self.inner.observe(record)

    def pop(self, request_id: str) -> _KTally | None:
        with self._lock:
            return self._by_rid.pop(request_id, None)

    def clear(self) -> None:
        with self._lock:
            self._by_rid.clear()
        self.reset_steps()

    def __getattr__(self, name: str) -> Any:  # predicted_step_s and anything else the server reads
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)


class ServerThread:
    """A FastAPI app under uvicorn on 127.0.0.1 (a free port), in a background thread."""

    def __init__(self, app: Any):
        import socket

        import uvicorn

        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on",
                                                    timeout_graceful_shutdown=10))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       name="specplan-sweep-server", daemon=True)

    def __enter__(self) -> "ServerThread":
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the sweep's server did not start")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc: Any) -> None:
        self.server.should_exit = True
        self.thread.join(30)
        self.sock.close()


# ---- the sweep ---------------------------------------------------------------------------------------
def make_decider(policy: str, *, proposer: str, profile: Any, sla: SLA, max_k: int) -> tuple[Any, str]:
    """The decider a policy runs with, and a description: off / static:K are fixed deciders (no
    planner in the loop, as serving stacks run them); the rest are the planner with that policy."""
    from specplan.engine.decider import FixedDecider
    from specplan.policies.registry import make_policy

    p = make_policy(policy)  # validates the spec
    name = policy.strip().lower()
    if name == "off":
        return FixedDecider(0), "FixedDecider(k=0)"
    if name.startswith("static:"):
        return FixedDecider(int(name.split(":", 1)[1])), f"FixedDecider(k={int(name.split(':', 1)[1])})"
    sla_s = sla.itl_ms / 1000.0 if sla.itl_ms is not None else None
    if profile is not None:
        from specplan.planner.from_profile import planner_from_profile

        return (planner_from_profile(profile, p, proposer=proposer, sla_itl_s=sla_s, max_k=max_k),
                f"Planner({policy}, profile latency model, sla_itl_s={sla_s})")
    if p.requires:
        raise ValueError(f"policy {policy!r} needs a latency profile (--profile)")
    from specplan.planner.from_profile import planner_from_profile

    return (planner_from_profile(None, p, proposer=proposer, sla_itl_s=sla_s, max_k=max_k),
            f"Planner({policy}, no profile)")


def _needs_profile(policies: Sequence[str]) -> bool:
    from specplan.policies.registry import make_policy

    return any(make_policy(p).requires for p in policies)


def _parquet(rows: list[dict], path: Path) -> None:
    import pandas as pd

    tmp = path.with_suffix(".tmp.parquet")
    pd.DataFrame(rows).to_parquet(tmp, index=False)
    tmp.replace(path)


def _write_json(obj: dict, path: Path) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(obj, indent=1, default=str))
    tmp.replace(path)


def run_sweep(policies: Sequence[str], rates: Sequence[float] | None = None, workload: str | Sequence[Any] = "mix",
              sla_ttft_ms: float | None = None, sla_itl_ms: float | None = None, *,
              duration_s: float | None = None, num_requests: int | None = None, out_dir: str | Path = "reports/sweep",
              model: str | None = None, proposer: str = "ngram", profile: Any = None, seed: int = 0,
              concurrency: Sequence[int] | None = None, max_tokens: int = 128, max_input_tokens: int | None = None,
              sla_tpot_ms: float | None = None, sla_e2el_ms: float | None = None, warmup_requests: int = 2,
              drain_timeout_s: float | None = None, burstiness: float = 1.0, temperature: float = 0.0,
              ignore_eos: bool = False, max_k: int = 8, max_queued: int = 1024, loaded: Any = None,
              engine_kwargs: dict | None = None, client_process: bool = True, progress: bool = True,
              command: str | None = None, render: bool = True) -> Path:
    """Run every policy at every load level and write ``<out>/requests.parquet`` (one row per
    request), ``<out>/levels.parquet`` (one row per policy and level) and ``<out>/sweep.json``.

    Levels: ``rates`` (req/s, Poisson) or ``concurrency`` (closed loop), each for ``duration_s`` of
    arrivals (default 60 s) or ``num_requests`` requests. Per policy the engine is built once (the model is loaded
    once for the whole sweep; pass ``loaded`` to reuse one) and served in-process on loopback; the
    levels then run from the lowest load up, each after ``warmup_requests`` unrecorded requests.
    ``profile``: a Profile, a path, or None (the cached profile for this model and machine, made if
    missing, when a policy needs one). ``client_process``: run the load generator in a child
    process (default; its timestamps do not wait for the server's GIL). Returns the output folder.
    """
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from specplan.engine.server.app import build_engine, create_app

    if (rates is None) == (concurrency is None):
        raise ValueError("give exactly one of rates and concurrency")
    if duration_s is not None and num_requests is not None:
        raise ValueError("give duration_s or num_requests, not both")
    if duration_s is None and num_requests is None:
        duration_s = 60.0
    if not policies:
        raise ValueError("no policies to sweep")
    mode = "rate" if rates is not None else "concurrency"
    loads = sorted(float(x) for x in (rates if rates is not None else concurrency))  # type: ignore[union-attr]
    if any(not x > 0 for x in loads):
        raise ValueError(f"loads must be > 0, got {loads}")
    if mode == "concurrency" and any(x != int(x) or math.isinf(x) for x in loads):
        raise ValueError("concurrency levels must be whole numbers")
    policies = [p.strip() for p in policies]
    static_ks = [int(p.split(":", 1)[1]) for p in policies if p.lower().startswith("static:")]
    max_k = max([max_k, *static_ks])
    sla = SLA(sla_ttft_ms, sla_itl_ms, sla_tpot_ms, sla_e2el_ms)
    drain = drain_timeout_s if drain_timeout_s is not None else max(60.0, duration_s or 0.0)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    t_load = time.perf_counter()
    if loaded is None:
        from specplan.engine.model.loader import load_model

        loaded = load_model(model)
    load_s = time.perf_counter() - t_load
    engine_kwargs = dict(engine_kwargs or {})
    max_model_len = min(engine_kwargs.get("max_model_len", 2048), loaded.config.max_position_embeddings)
    input_cap = max_model_len - max_tokens
    if input_cap < 1:
        raise ValueError(f"max_tokens {max_tokens} leaves no room for a prompt in a {max_model_len}-token context")
    max_input_tokens = min(max_input_tokens, input_cap) if max_input_tokens is not None else input_cap

    prof_obj, prof_desc = None, None
    if profile is not None or _needs_profile(policies):
        from specplan.profiler.profile import Profile

        if isinstance(profile, Profile):
            prof_obj, prof_desc = profile, "given in code"
        else:
            from specplan.adaptive import load_or_make_profile

            prof_obj = load_or_make_profile(loaded, str(profile) if profile is not None else None)
            prof_desc = str(profile) if profile is not None else "cached/fresh for this model and machine"

    # The same requests for every policy (paired comparison): per level, send times from its own seed.
    level_sends = {}
    for i, load in enumerate(loads):
        if mode == "rate":
            level_sends[load] = arrival_times(load, duration_s=duration_s, num_requests=num_requests,
                                              seed=seed * 1000 + i, burstiness=burstiness)
        else:
            level_sends[load] = [0.0] * (num_requests if num_requests is not None else int(load))
    pool = max(64, max(len(s) for s in level_sends.values()) + warmup_requests)
    prompts = render_workload(workload, loaded.tokenizer, pool=pool, seed=seed, max_input_tokens=max_input_tokens)

    config = {
        "version": 1, "command": command, "started": time.strftime("%Y-%m-%d %H:%M:%S"), "status": "running",
        "policies": policies, "mode": mode, "loads": loads, "load_unit": "req/s" if mode == "rate" else "concurrency",
        "workload": workload if isinstance(workload, str) else "custom",
        "sla": asdict(sla), "goodput_thresholds_ms": sla.goodput_thresholds(),
        "duration_s": duration_s, "num_requests": num_requests, "max_tokens": max_tokens,
        "max_input_tokens": max_input_tokens, "warmup_requests": warmup_requests, "drain_timeout_s": drain,
        "burstiness": burstiness, "temperature": temperature, "ignore_eos": ignore_eos, "seed": seed,
        "model": loaded.name, "model_arg": model, "proposer": proposer, "max_k": max_k,
        "profile": prof_desc, "engine_kwargs": {k: str(v) for k, v in engine_kwargs.items()},
        "num_prompts": len(prompts), "client": "subprocess" if client_process else "in-process",
        "machine": _machine(), "model_load_s": round(load_s, 2), "deciders": {}, "level_wall_s": {},
    }
    _write_json(config, out / "sweep.json")

    all_rows: list[dict] = []
    all_levels: list[dict] = []

    def run_client(url: str, reqs: list[LoadRequest], opts: ClientOptions, advance: Callable[[int], None]):
        if client_process:
            return run_load_in_child(url, reqs, opts, on_done=lambda: advance(1))
        return asyncio.run(run_load(url, reqs, opts, on_done=lambda: advance(1)))

    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, disable=not progress) as bar:
        overall = bar.add_task("sweep (policy × level)", total=len(policies) * len(loads))
        for policy in policies:
            decider, desc = make_decider(policy, proposer=proposer, profile=prof_obj, sla=sla, max_k=max_k)
            recorder = KRecorder(decider)
            config["deciders"][policy] = desc
            engine = build_engine(loaded=loaded, proposer=proposer, spec_k=min(4, max_k), max_k=max_k,
                                  decider=recorder, **engine_kwargs)
            app = create_app(engine, loaded.name, max_queued=max_queued)
            with ServerThread(app) as server:
                for li, load in enumerate(loads):
                    t_level = time.perf_counter()
                    sends = level_sends[load]
                    label = f"{policy} @ {load:g} {'req/s' if mode == 'rate' else 'concurrent'}"
                    if warmup_requests > 0:
                        warm = make_requests(prompts, [0.0] * warmup_requests, min(max_tokens, 16),
                                             offset=len(prompts) - warmup_requests)
                        # In this process: the warm-up's timings are not kept.
                        asyncio.run(run_load(server.url, warm, ClientOptions(mode="rate", drain_timeout_s=drain,
                                                                             temperature=temperature)))
                    recorder.clear()
                    reqs = make_requests(prompts, sends, max_tokens)
                    opts = ClientOptions(mode=mode, concurrency=int(load) if mode == "concurrency" else 1,
                                         duration_s=duration_s if mode == "concurrency" else None,
                                         drain_timeout_s=drain, temperature=temperature, ignore_eos=ignore_eos)
                    total = len(reqs) if (mode == "rate" or num_requests is not None) else None
                    task = bar.add_task(label, total=total)
                    rows, dur = run_client(server.url, reqs, opts, lambda n, t=task: bar.advance(t, n))
                    bar.remove_task(task)
                    _wait_idle(server.url)
                    for r in rows:
                        r.update(policy=policy, mode=mode, load=load, level_index=li)
                        _attach_k(r, recorder.pop(r["response_id"] + "-0") if r["response_id"] else None)
                    level = {"policy": policy, "mode": mode, "load": load, "level_index": li}
                    level.update(summarize_level(rows, dur, sla))
                    level.update(engine_steps=recorder.num_steps,
                                 mean_decode_batch=recorder.decode_seqs / recorder.num_steps if recorder.num_steps else 0.0,
                                 mean_step_ms=1000 * recorder.step_s / recorder.num_steps if recorder.num_steps else 0.0,
                                 meets_itl_sla=meets_itl_sla(level, sla))
                    all_rows.extend(rows)
                    all_levels.append(level)
                    _parquet(all_rows, out / "requests.parquet")
                    _parquet(all_levels, out / "levels.parquet")
                    config["level_wall_s"][f"{policy}@{load:g}"] = round(time.perf_counter() - t_level, 2)
                    _write_json(config, out / "sweep.json")
                    bar.advance(overall)
            del engine, app, server, recorder, decider  # free this policy's engine (KV cache) before the next
            gc.collect()
    config["status"] = "complete"
    config["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
    _write_json(config, out / "sweep.json")
    if render:
        from specplan.bench.sweep_report import render_report

        render_report(out)
    return out


def _attach_k(row: dict, tally: _KTally | None) -> None:
    t = tally or _KTally()
    row.update(spec_steps=t.steps, k_sum=t.k_sum, k0_steps=t.k0_steps, num_draft_tokens=t.proposed,
               num_accepted_tokens=t.accepted, num_emitted_tokens=t.emitted,
               mean_k=t.k_sum / t.steps if t.steps else math.nan,
               acceptance_rate=t.accepted / t.proposed if t.proposed else math.nan,
               k_hist=json.dumps({str(k): v for k, v in sorted(t.hist.items())}))


def _wait_idle(base_url: str, timeout: float = 30.0) -> None:
    """Until the engine has nothing running or waiting (cancelled requests are being cleaned up)."""
    import httpx

    deadline = time.monotonic() + timeout
    with httpx.Client(trust_env=False, timeout=10) as client:
        while time.monotonic() < deadline:
            try:
                s = client.get(base_url + "/debug/engine").json()
                if s.get("running", 0) == 0 and s.get("waiting", 0) == 0 and s.get("active_jobs", 0) == 0:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.05)


def _machine() -> dict:
    import os
    import platform

    try:
        import torch

        threads, version = torch.get_num_threads(), torch.__version__
    except ImportError:  # pragma: no cover
        threads, version = None, None
    try:
        load = os.getloadavg()[0]
    except OSError:  # pragma: no cover
        load = None
    return {"cpu_count": os.cpu_count(), "torch_threads": threads, "torch": version,
            "python": platform.python_version(), "load_avg_1m_at_start": load}


__all__ = ["SLA", "StreamResult", "parse_sse_line", "request_timings", "is_good", "summarize_level", "meets_itl_sla",
           "max_load_meeting", "LoadRequest", "RenderedPrompt", "render_workload", "arrival_times", "make_requests",
           "ClientOptions", "send_request", "run_load", "run_load_in_child", "KRecorder", "ServerThread", "make_decider", "run_sweep"]
