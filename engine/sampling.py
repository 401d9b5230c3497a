"""Sampling parameters and the sampler: greedy, temperature, top-k, top-p, per-request seeds; and
the target's log-probabilities of chosen tokens (``logprobs``)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .model import cpu_kernels


MAX_LOGPROBS = 20  # most alternatives a request may ask for per token (OpenAI's top_logprobs cap)


@dataclass(frozen=True)
class TokenLogprob:
    """The target's log-probability of one token at its position, and the ``top`` alternatives
    asked for: (token id, logprob) pairs, most likely first."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class SamplingParams:
    """Per-request decoding options (vLLM's names and defaults, except ``max_tokens``)."""

    n: int = 1
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1 = no limit
    seed: int | None = None
    max_tokens: int = 16
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    # Force this request's number of speculative tokens per step (0 = never speculate); None lets
    # the engine's decider choose. specplan's extension (the server's {"spec": {"k": ...}}).
    num_speculative_tokens: int | None = None
    # Log-probabilities (vLLM's names). None: none. N >= 0: per output token, the chosen token's
    # logprob plus the N most likely tokens'; prompt_logprobs the same per prompt token (the first
    # has none). They are the target model's RAW log-softmax of its logits at that position (vLLM's
    # default "raw_logprobs"): before temperature, top-k and top-p, so they do not depend on the
    # sampling settings, and with speculation they equal those of the same request without it
    # (each token is scored at the position where it was accepted, draft, bonus or recovered).
    logprobs: int | None = None
    prompt_logprobs: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        else:
            object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        if not isinstance(self.n, int) or self.n < 1:
            raise ValueError(f"n must be an integer >= 1, got {self.n!r}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or not 0 <= value <= MAX_LOGPROBS):
                raise ValueError(f"{name} must be None or an integer in [0, {MAX_LOGPROBS}], got {value!r}")
        # max_tokens=0 scores a prompt without generating (echo with prompt logprobs).
        least = 0 if self.prompt_logprobs is not None else 1
        if not isinstance(self.max_tokens, int) or self.max_tokens < least:
            raise ValueError(f"max_tokens must be an integer >= 1 (0 only with prompt_logprobs), "
                             f"got {self.max_tokens!r}")
        if not (self.temperature >= 0.0):
            raise ValueError(f"temperature must be >= 0, got {self.temperature!r}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise ValueError(f"top_k must be -1, 0 (no limit) or a positive integer, got {self.top_k!r}")
        if self.num_speculative_tokens is not None and (
                not isinstance(self.num_speculative_tokens, int) or self.num_speculative_tokens < 0):
            raise ValueError(f"num_speculative_tokens must be an integer >= 0, got {self.num_speculative_tokens!r}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def probabilities(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                  top_p: torch.Tensor) -> torch.Tensor:
    """The distribution a sampled request draws from: softmax(logits / T) restricted to top-k/top-p.

    logits [R, V]; temperature [R] (> 0); top_k [R] int (<= 0: no limit); top_p [R] -> probs [R, V].
    Used by the sampler and by speculative verification, so both see the same distribution.
    """
    logits = logits.float() / temperature[:, None]
    needs_filter = bool(((top_k > 0) | (top_p < 1.0)).any())
    if needs_filter:
        sorted_logits, order = logits.sort(dim=-1, descending=True)  # [R, V]
        rank = torch.arange(logits.shape[-1], device=logits.device)  # [V]
        k = torch.where(top_k > 0, top_k, logits.shape[-1])  # [R]
        drop = rank[None, :] >= k[:, None]  # [R, V] beyond top-k
        sorted_probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
        # Keep the smallest prefix whose mass reaches top_p (always at least the first token).
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs  # [R, V]
        drop |= mass_before >= top_p[:, None]
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.empty_like(logits).scatter_(-1, order, sorted_logits)
    return logits.softmax(dim=-1)


def sample_from(probs: torch.Tensor, generators: list[torch.Generator | None],
                default_generator: torch.Generator) -> torch.Tensor:
    """One token per row of probs [R, V] with each row's own generator -> [R] int64.

    Exponential race (argmax p / E, E ~ Exp(1)) is exact sampling and needs one random vector per
    row, drawn on the CPU from that row's generator so a seeded request gives the same tokens
    whatever else is in the batch, on any device.
    """
    noise = torch.empty(probs.shape, dtype=torch.float32)
    for row, gen in enumerate(generators):
        noise[row].exponential_(generator=gen or default_generator)
    return (probs / noise.to(probs.device)).argmax(dim=-1)


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None],
           default_generator: torch.Generator) -> torch.Tensor:
    """logits [R, V] -> token ids [R] int64; greedy rows take the argmax."""
    tokens = greedy_tokens(logits)
    sampled_rows = [i for i, p in enumerate(params) if not p.greedy]
    if sampled_rows:
        device = logits.device
        rows = torch.tensor(sampled_rows, device=device)
        sel = [params[i] for i in sampled_rows]
        probs = probabilities(
            logits[rows],
            torch.tensor([p.temperature for p in sel], device=device),
            torch.tensor([p.top_k for p in sel], device=device),
            torch.tensor([p.top_p for p in sel], device=device),
        )
        tokens[rows] = sample_from(probs, [generators[i] for i in sampled_rows], default_generator)
    return tokens


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """logits [R, V] -> argmax of each row [R] int64 (ties: lowest id). On CPU in float32 the
    engine's kernel: several times faster than torch.argmax over a vocabulary-wide row."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.dim() == 2 and cpu_kernels.load():
        return torch.ops.specplan_ops.argmax_rows(logits.contiguous())
    return logits.argmax(dim=-1)


def token_logprobs(logits: torch.Tensor, token_ids: list[int], num_top: list[int]) -> list[TokenLogprob]:
    """Row r of logits [R, V] scores token_ids[r]: its raw log-softmax value and the num_top[r] most
    likely (id, logprob) pairs. One log_softmax and one topk over all R rows, on logits' device."""
    if not token_ids:
        return []
    lp = torch.log_softmax(logits.float(), dim=-1)  # [R, V]
    ids = torch.tensor(token_ids, dtype=torch.int64, device=lp.device)  # [R]
    chosen = lp.gather(1, ids[:, None])[:, 0].tolist()  # [R]
    n = max(num_top)
    top_lp, top_ids = lp.topk(n, dim=-1) if n else (lp[:, :0], lp[:, :0].long())  # [R, n] each
    top_lp, top_ids = top_lp.tolist(), top_ids.tolist()
    return [TokenLogprob(t, c, tuple(zip(top_ids[r][:k], top_lp[r][:k])))
            for r, (t, c, k) in enumerate(zip(token_ids, chosen, num_top))]
