"""Continuous batching over a paged KV cache (plain Python over sequences).

Each step, running sequences come first (oldest first), each feeding its uncomputed tokens: one
for a decode, the rest of its prompt (in chunks) for a prefill. Waiting sequences join while the
token budget, the sequence limit and free blocks allow, in arrival order. When a running
sequence needs a block and none is free, the newest running sequence is preempted: its blocks
are freed and it goes back to the front of the queue to be recomputed later (vLLM's recompute
preemption), so running out of KV cache slows serving down but never fails a request.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from .block_manager import BlockManager
from .config import SchedulerConfig
from .sequence import Sequence, SequenceStatus


@dataclass
class SchedulerOutput:
    scheduled: list[tuple[Sequence, int]] = field(default_factory=list)  # (sequence, query tokens)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager):
        self.config = config
        self.block_manager = block_manager
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order: oldest first

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        bm = self.block_manager
        for seq in list(self.running):
            if budget == 0:
                break
            if seq.status is not SequenceStatus.RUNNING:  # preempted earlier in this loop
                continue
            n = min(seq.num_uncomputed_tokens, budget)
            while not bm.ensure_capacity(seq, seq.num_computed_tokens + n):
                victim = self.running[-1]
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    break
            if seq.status is SequenceStatus.RUNNING:
                out.scheduled.append((seq, n))
                budget -= n
        # New work joins only when nothing had to be preempted this step (otherwise it would
        # take the blocks just freed and thrash).
        while self.waiting and budget > 0 and not out.preempted and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            n = min(seq.num_uncomputed_tokens, budget)
            if not bm.ensure_capacity(seq, seq.num_computed_tokens + n):
                break
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.scheduled.append((seq, n))
            budget -= n
        return out

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Remove a sequence (done, stopped or cancelled) and return its blocks to the pool."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING and seq in self.waiting:
            self.waiting.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
