"""A sequence: one prompt and the tokens generated for it, plus its place in the KV cache."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import Enum, auto

import torch

from .detokenizer import IncrementalDetokenizer
from .metrics import SpecCounters
from .sampling import SamplingParams, TokenLogprob


class SequenceStatus(Enum):
    WAITING = auto()  # not in the KV cache (new, or preempted and waiting to be recomputed)
    RUNNING = auto()
    FINISHED = auto()


@dataclass
class Sequence:
    seq_id: int
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    generator: torch.Generator | None = None  # per-request RNG for sampling (seeded => reproducible)
    token_ids: list[int] = field(default_factory=list)  # prompt + output
    # Tokens whose K/V are in the cache. The tokens [num_computed_tokens, num_tokens) are fed in
    # the next forward: the whole prompt in chunks at first, then one token per decode step.
    num_computed_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: str | int | None = None  # the stop string or stop token that ended it
    num_preemptions: int = 0
    arrival_time: float = field(default_factory=time.perf_counter)
    first_token_time: float | None = None
    finish_time: float | None = None
    text: str = ""  # detokenized output, truncated at a stop string (set when it finishes)
    detok: IncrementalDetokenizer = field(default_factory=IncrementalDetokenizer)  # for stop strings
    spec: SpecCounters = field(default_factory=SpecCounters)  # this request's speculation counters
    # When asked for (params.logprobs / params.prompt_logprobs), else None: one entry per output
    # token; one per prompt token scored so far (the first prompt token has none: None).
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)
        if self.logprobs is None and self.params.logprobs is not None:
            self.logprobs = []
        if self.prompt_logprobs is None and self.params.prompt_logprobs is not None:
            self.prompt_logprobs = [None]

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return self.num_tokens - self.num_prompt_tokens

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED
