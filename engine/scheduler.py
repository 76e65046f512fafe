"""Continuous batching: which sequences run in the next forward, and how many tokens each.

Each step has a token budget. Running sequences go first in arrival order (a decode costs one
token, an unfinished prefill continues with a chunk); waiting sequences are admitted while the
budget, the sequence limit and free blocks allow, taking their cached prefix from the pool.
When blocks run out for a running sequence, the most recently admitted one is preempted: its
blocks are freed and it is recomputed later (its full blocks usually stay cached, so the
recompute is mostly prefix hits).

Fairness (no head-of-line blocking by one long prompt):
  * while requests wait, a running prefill's chunk is at most ``long_prefill_tokens`` (default
    half the budget), so one long prompt never takes a whole step's budget from the queue;
  * a waiting request whose blocks are not free yet is passed over and the requests behind it
    are admitted, but at most ``max_bypass`` times: after that nothing behind it is admitted
    until it is (it cannot starve: ``LLMEngine.validate`` refused every request that could not
    fit this tenant's share of the pool even when idle, so it fits once running ones finish).
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
    long_prefill_tokens: int | None = None  # chunk cap while others wait; None: half the budget
    max_bypass: int = 16  # admissions that may pass a waiting request that does not fit yet

    def prefill_cap(self) -> int:
        return self.long_prefill_tokens or max(1, self.max_num_batched_tokens // 2)


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVManager):
        self.config = config
        self.kv = kv
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.num_bypasses = 0  # admissions of a request past an earlier one that did not fit
        self._bypassed: dict[Sequence, int] = {}  # waiting sequence -> times it was passed over

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
        self._bypassed.pop(seq, None)
        self.kv.release(seq)

    def schedule(self) -> list[tuple[Sequence, int]]:
        budget = self.config.max_num_batched_tokens
        out: list[tuple[Sequence, int]] = []
        scheduled: set[int] = set()
        cap = self.config.prefill_cap() if self.waiting else budget
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_pending, budget, max(1, cap) if seq.num_pending > 1 else 1)
            if not self._reserve(seq, n, scheduled):
                continue  # seq itself was preempted; running[i] is now the next one
            out.append((seq, n))
            scheduled.add(id(seq))
            budget -= n
            i += 1
        passed: list[Sequence] = []  # waiting sequences that did not fit this step
        for seq in list(self.waiting):
            if budget <= 0 or len(self.running) >= self.config.max_num_seqs:
                break
            hit = self.kv.find_prefix(seq)
            n = min(len(seq.tokens) - len(hit) * self.kv.block_size, budget)
            if self.kv.blocks_needed(seq, len(hit) * self.kv.block_size + n, hit) > self.kv.pool.num_free_blocks():
                if self._bypassed.get(seq, 0) >= self.config.max_bypass:
                    break  # passed over often enough: it goes next, nothing behind it goes first
                passed.append(seq)
                continue
            if any(self._bypassed.get(p, 0) >= self.config.max_bypass for p in passed):
                break  # one passed over often enough goes next
            self.waiting.remove(seq)
            self._bypassed.pop(seq, None)
            for p in passed:
                self._bypassed[p] = self._bypassed.get(p, 0) + 1
                self.num_bypasses += 1
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
