"""The sweep's load generator: a streaming client for specplan's OpenAI-compatible server.

Requests go to ``POST /v1/completions`` with streaming (``stream_options.include_usage``), the
prompt as token ids. In rate mode request i is sent at its ``send_at``; in concurrency mode
``concurrency`` clients each send the next request when their last one ends. A level runs for
``duration_s`` of arrivals or for ``num_requests`` requests, then waits up to
``drain_timeout_s`` for what is still in flight (requests still running then are cancelled and
count as failed). Each request becomes one row: its timings (``sla.request_timings``) and what
the response said. ``run_load_in_child`` runs the same client in a fresh Python process.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Sequence

from specplan.bench.arrivals import LoadRequest
from specplan.bench.sla import request_timings


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
_CHILD = "import specplan.bench.client as c; c._client_child()"


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


__all__ = ["StreamResult", "parse_sse_line", "ClientOptions", "send_request", "run_load", "run_load_in_child"]
