"""Prometheus metrics of one server instance (its own CollectorRegistry; no module-level state).

Names follow vLLM's with a ``specplan:`` prefix: ``specplan:spec_decode_num_drafts_total``,
``specplan:spec_decode_num_accepted_tokens_per_pos_total{position="0"}``, ... Engine-side values
are written by the engine thread (prometheus_client metrics are thread-safe); HTTP counts by the
ASGI middleware.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from ..decider import StepRecord

PREFIX = "specplan:"

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5,
                    0.75, 1.0, 2.5, 5.0)
_TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
_E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0, 600.0)
_TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048)


class ServerMetrics:
    def __init__(self, max_k: int = 8, registry: CollectorRegistry | None = None):
        self.registry = registry if registry is not None else CollectorRegistry()
        r, p = self.registry, PREFIX
        # Server-level.
        self.info = Gauge(p + "server_info", "Constant 1; labels describe the served model and speculation",
                          ["model", "proposer", "k", "decider"], registry=r)
        self.http_responses = Counter(p + "http_responses", "HTTP responses by endpoint and status code",
                                      ["endpoint", "status"], registry=r)
        self.request_success = Counter(p + "request_success", "Finished sequences (choices) by finish reason",
                                       ["finished_reason"], registry=r)
        self.prompt_tokens = Counter(p + "prompt_tokens", "Prompt tokens of admitted requests", registry=r)
        self.generation_tokens = Counter(p + "generation_tokens", "Generated tokens", registry=r)
        self.ttft = Histogram(p + "time_to_first_token_seconds", "Arrival to first generated token",
                              buckets=_TTFT_BUCKETS, registry=r)
        self.itl = Histogram(p + "inter_token_latency_seconds",
                             "Time between two emitted tokens of one sequence (a step emitting m tokens "
                             "counts m observations of its interval / m)", buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram(p + "e2e_request_latency_seconds", "Arrival to last token of a request",
                             buckets=_E2E_BUCKETS, registry=r)
        self.num_requests_running = Gauge(p + "num_requests_running", "Sequences in the running batch", registry=r)
        self.num_requests_waiting = Gauge(p + "num_requests_waiting",
                                          "Sequences waiting for the batch (engine queue plus hand-over)",
                                          registry=r)
        self.kv_blocks_free = Gauge(p + "kv_blocks_free", "Free KV cache blocks", registry=r)
        self.kv_blocks_total = Gauge(p + "kv_blocks_total", "KV cache blocks in the pool", registry=r)
        self.kv_cache_usage = Gauge(p + "kv_cache_usage_perc", "Fraction of KV blocks in use (0..1)", registry=r)
        # Steps.
        self.steps = Counter(p + "engine_steps", "Engine steps run", registry=r)
        self.step_time = Histogram(p + "step_time_seconds", "Measured engine step time", buckets=_LATENCY_BUCKETS,
                                   registry=r)
        self.step_time_measured = Gauge(p + "step_time_measured_seconds", "Measured time of the last step",
                                        registry=r)
        self.step_time_predicted = Gauge(p + "step_time_predicted_seconds",
                                         "Step time the decider predicted for the last step (0: no prediction)",
                                         registry=r)
        self.step_tokens = Histogram(p + "step_num_tokens", "Query tokens per step", buckets=_TOKEN_BUCKETS,
                                     registry=r)
        self.step_seqs = Histogram(p + "step_num_seqs", "Sequences per step", buckets=_TOKEN_BUCKETS, registry=r)
        # Speculative decoding (vLLM's spec_decode_* names).
        self.spec_num_drafts = Counter(p + "spec_decode_num_drafts", "Verification events with at least one draft",
                                       registry=r)
        self.spec_num_draft_tokens = Counter(p + "spec_decode_num_draft_tokens", "Draft tokens proposed", registry=r)
        self.spec_num_accepted_tokens = Counter(p + "spec_decode_num_accepted_tokens", "Draft tokens accepted",
                                                registry=r)
        self.spec_num_emitted_tokens = Counter(p + "spec_decode_num_emitted_tokens",
                                               "Tokens emitted by decode steps (accepted plus bonus/recovered)",
                                               registry=r)
        self.spec_accepted_per_pos = Counter(p + "spec_decode_num_accepted_tokens_per_pos",
                                             "Draft tokens accepted at each draft position", ["position"], registry=r)
        self.spec_drafted_per_pos = Counter(p + "spec_decode_num_draft_tokens_per_pos",
                                            "Draft tokens proposed at each draft position", ["position"], registry=r)
        self.spec_chosen_k = Histogram(p + "spec_decode_chosen_k", "k chosen per decode request per step",
                                       buckets=tuple(float(k) for k in range(max_k + 1)), registry=r)
        for j in range(max_k):  # show every position from the start, at zero
            self.spec_accepted_per_pos.labels(position=str(j))
            self.spec_drafted_per_pos.labels(position=str(j))

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def observe_step(self, record: StepRecord, predicted_s: float | None = None) -> None:
        """Called by the engine thread after each step that ran."""
        self.steps.inc()
        self.step_time.observe(record.total_s)
        self.step_time_measured.set(record.total_s)
        if predicted_s is not None:
            self.step_time_predicted.set(predicted_s)
        self.step_tokens.observe(record.num_tokens)
        self.step_seqs.observe(record.num_seqs)
        for r in record.requests:
            self.spec_chosen_k.observe(r.k)
            self.spec_num_emitted_tokens.inc(r.num_emitted)
            if r.num_proposed == 0:
                continue
            self.spec_num_drafts.inc()
            self.spec_num_draft_tokens.inc(r.num_proposed)
            self.spec_num_accepted_tokens.inc(r.num_accepted)
            for j in range(r.num_proposed):
                self.spec_drafted_per_pos.labels(position=str(j)).inc()
                if j < r.num_accepted:
                    self.spec_accepted_per_pos.labels(position=str(j)).inc()

    def set_engine_state(self, free_blocks: int, total_blocks: int, running: int, waiting: int) -> None:
        self.kv_blocks_free.set(free_blocks)
        self.kv_blocks_total.set(total_blocks)
        self.kv_cache_usage.set(1.0 - free_blocks / total_blocks if total_blocks else 0.0)
        self.num_requests_running.set(running)
        self.num_requests_waiting.set(waiting)
