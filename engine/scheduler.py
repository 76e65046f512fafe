"""Continuous batching: which sequences run in the next forward, and how many tokens each.

Each step has a token budget. Running sequences go first in arrival order (a decode costs one
token, an unfinished prefill continues with a chunk); waiting sequences are admitted while the
budget, the sequence limit and free blocks allow, taking their cached prefix from the pool.
When blocks run out for a running sequence, the most recently admitted one is preempted: its
blocks are freed and it is recomputed later (its full blocks usually stay cached, so the
recompute is mostly prefix hits).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from engine.kv_manager import KVManager
from engine.sequence import Sequence, SequenceStatus


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVManager):
        self.config = config
        self.kv = kv
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def remove(self, seq: Sequence) -> None:
        """Drop a finished or aborted sequence and release its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.kv.release(seq)

    def schedule(self) -> list[tuple[Sequence, int]]:
        budget = self.config.max_num_batched_tokens
        out: list[tuple[Sequence, int]] = []
        scheduled: set[int] = set()
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_pending, budget)
            if not self._reserve(seq, n, scheduled):
                continue  # seq itself was preempted; running[i] is now the next one
            out.append((seq, n))
            scheduled.add(id(seq))
            budget -= n
            i += 1
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            hit = self.kv.find_prefix(seq)
            n = min(len(seq.tokens) - len(hit) * self.kv.block_size, budget)
            if self.kv.blocks_needed(seq, len(hit) * self.kv.block_size + n, hit) > self.kv.pool.num_free_blocks():
                break
            self.waiting.popleft()
            self.kv.admit(seq, hit)
            self.kv.grow(seq, seq.num_computed + n)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.append((seq, n))
            scheduled.add(id(seq))
            budget -= n
        return out

    def _reserve(self, seq: Sequence, n: int, scheduled: set[int]) -> bool:
        """Grow ``seq``'s blocks for ``n`` more tokens, preempting later sequences if needed."""
        target = seq.num_computed + n
        while self.kv.blocks_needed(seq, target) > self.kv.pool.num_free_blocks():
            victim = self.running[-1]
            self._preempt(victim)
            if victim is seq:
                return False
            assert id(victim) not in scheduled, "preempted a sequence already in this batch"
        self.kv.grow(seq, target)
        return True

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.kv.release(seq)
        seq.num_computed = 0
        seq.num_cached = 0
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1
