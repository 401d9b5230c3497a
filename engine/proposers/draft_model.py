"""Draft-model proposer: a small causal LM with the target's vocabulary drafts k tokens.

Its KV cache is indexed by the target's block tables, so it lives in the same paged pool and the
same lookahead reservation covers it. Two kinds:
  * a separate draft model: its own KV tensor, sized into the engine's KV budget;
  * a layer-skip draft: the target's own first N layers (sharing embedding, final norm and LM
    head). Its K/V for committed tokens *is* the target's K/V of those layers, so it shares the
    target's cache and never needs to catch up; the target's verify pass overwrites whatever the
    draft wrote into lookahead slots with identical values for accepted tokens.

Draft KV bookkeeping (separate model): after a step that fed positions c..c+k-1 to the draft and
accepted a drafts, the draft's K/V is valid for positions < min(c + k, c + 1 + a), which is
min(fed, target's num_computed_tokens). The next step first feeds the tokens after that (catch-up,
which for a new request is its whole prompt), then drafts one token per forward.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from ..block_manager import BlockManager
from ..model.transformer import Model
from ..model_runner import ModelRunner, ScheduledSeq
from ..sampling import greedy_tokens, probabilities, sample_from
from ..sequence import Sequence
from ..drafts import DraftTokens


@dataclass(frozen=True)
class DraftModel:
    model: Model
    shares_target_kv: bool  # layer-skip: reads and writes the target's first layers' KV


class DraftModelProposer:
    proposes_prefixes = False  # each pass samples anew; proposing costs a forward per position

    def __init__(self, draft: DraftModel, runner: ModelRunner, block_manager: BlockManager,
                 default_generator: torch.Generator, name: str):
        self.draft = draft
        self.runner = runner
        self.block_manager = block_manager
        self.default_generator = default_generator
        self.name = name
        self._fed: dict[int, tuple[int, int]] = {}  # seq_id -> (positions fed to the draft, preemptions then)

    def _valid_prefix(self, seq: Sequence) -> int:
        """Positions whose draft K/V is valid and may be read."""
        if self.draft.shares_target_kv:
            return seq.num_computed_tokens
        fed, preemptions = self._fed.get(seq.seq_id, (0, seq.num_preemptions))
        if preemptions != seq.num_preemptions:  # blocks were freed and reallocated
            return 0
        return min(fed, seq.num_computed_tokens)

    def propose(self, seqs: list[Sequence], k: list[int]) -> DraftTokens:
        t0 = time.perf_counter()
        drafts: list[list[int]] = [[] for _ in seqs]
        qs: list[list[torch.Tensor]] = [[] for _ in seqs]
        active = [i for i, ki in enumerate(k) if ki > 0]
        items = []
        for i in active:
            seq = seqs[i]
            start = self._valid_prefix(seq)
            items.append(ScheduledSeq(seq, seq.token_ids[start:], start, 1))
        passes = 0
        while items:
            passes += 1
            batch = self.runner.build_batch(items, self.block_manager)
            logits = self.runner.execute(batch)  # [len(active), V]
            tokens, probs = self._pick(logits, [seqs[i] for i in active])
            for row, i in enumerate(active):
                drafts[i].append(tokens[row])
                if probs is not None and not seqs[i].params.greedy:
                    qs[i].append(probs[row])
            active = [i for i in active if len(drafts[i]) < k[i]]
            items = [ScheduledSeq(seqs[i], [drafts[i][-1]], seqs[i].num_tokens - 1 + len(drafts[i]), 1)
                     for i in active]
        for i, seq in enumerate(seqs):
            if k[i] > 0:
                self._fed[seq.seq_id] = (seq.num_tokens - 1 + k[i], seq.num_preemptions)
        draft_probs = None
        if any(qs):
            draft_probs = [torch.stack(q) if q else None for q in qs]  # [k_i, V] each
        return DraftTokens(token_ids=drafts, draft_probs=draft_probs, seconds=time.perf_counter() - t0, passes=passes)

    def _pick(self, logits: torch.Tensor, seqs: list[Sequence]) -> tuple[list[int], torch.Tensor | None]:
        """Greedy rows take the argmax; sampled rows sample from q with the request's own settings."""
        tokens = greedy_tokens(logits)
        sampled = [r for r, s in enumerate(seqs) if not s.params.greedy]
        if not sampled:
            return tokens.tolist(), None
        device = logits.device
        params = [s.params for s in seqs]
        probs = probabilities(logits, torch.tensor([p.temperature or 1.0 for p in params], device=device),
                              torch.tensor([p.top_k for p in params], device=device),
                              torch.tensor([p.top_p for p in params], device=device))  # [R, V]
        rows = torch.tensor(sampled, device=device)
        tokens[rows] = sample_from(probs[rows], [seqs[r].generator for r in sampled], self.default_generator)
        return tokens.tolist(), probs

    def on_finished(self, seq: Sequence) -> None:
        self._fed.pop(seq.seq_id, None)
