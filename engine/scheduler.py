"""Continuous batching: which sequences run in the next forward, and how many tokens each.

Each step has a token budget. Running sequences go first in arrival order (a decode costs one
token, an unfinished prefill continues with a chunk); waiting sequences are admitted while the
budget, the sequence limit and free blocks allow, taking their cached prefix from the pool.
When blocks run out for a running sequence, one is preempted: its blocks are freed and it is
recomputed later (its full blocks usually stay cached, so the recompute is mostly prefix hits).
Which one (``_KeepRank``): the lowest priority class first, then (``fair_preempt``) the tenant
running the most sequences, then the one with the most tokens computed for it, then the most
recently admitted (it has computed the least). Running sequences reserve their blocks in the
opposite order, so a lower class never keeps blocks a higher one needs in the same step. Before
session 42 the most recently admitted went whatever its class or tenant: a light tenant's only
request, admitted last next to a flood, was the one preempted again and again.

Fairness (no head-of-line blocking by one long prompt):
  * while requests wait, a running prefill's chunk is at most ``long_prefill_tokens`` (default
    half the budget), so one long prompt never takes a whole step's budget from the queue;
  * a waiting request whose blocks are not free yet is passed over and the requests behind it
    are admitted, but at most ``max_bypass`` times: after that nothing behind it is admitted
    until it is (it cannot starve: ``LLMEngine.validate`` refused every request that could not
    fit this tenant's share of the pool even when idle, so it fits once running ones finish).

Priority (tenant ``priority`` from ``policies.eviction.TenantQuota``, a guest on a lent worker
below every tenant's own class; see ``policies.prefill_priority``): while a higher priority class contends (has waiting or prefilling
work now or within ``priority_hold_s``, or is configured with ``latency_guard``), the lower
classes' prefill, running or newly admitted, gets at most ``low_priority_prefill_tokens`` tokens
per step **all together** (FIFO among them), so a step carrying lower-priority prefill stays
short: on a CPU a step's time grows with its tokens and a step is not preemptible, so a higher-priority request arriving during one waits it
out. Budget goes to decodes first, then to prefills in priority order, then to admissions in
priority order (FIFO within a class). ``min(pending, low_priority_prefill_tokens)`` of the budget
stays reserved for the lower classes' prefill ahead of higher-priority prefills, so they progress
(no starvation); what running lower-priority prefills leave of it goes to the first
lower-priority admission. A step with higher-priority prefill work carries lower-class prefill
only if the step before carried none (``alternate_low_prefill``, default on): a higher-priority
request arriving during a lower-class step then gets a step of its own next, instead of sharing
it with another lower-class chunk, and the lower classes still progress every other step. With
one priority class live nothing changes.

Fair share among tenants of one priority class (``fair_share``, default on;
``policies/fair_share.py``): the waiting requests of a class are admitted in virtual-token-counter
order, the tenant with the fewest tokens computed for it first (each step charges every scheduled
row's tokens to its tenant), not in arrival order, so a tenant that queued 200 requests does not
put another tenant's next request behind all of them; and no tenant holds more than
``max_num_seqs - min(fair_reserve_seqs, max_num_seqs // 4)`` running sequences (60 of 64 by
default), so a light tenant finds a free slot while another fills the rest. Without the reserve
a flood that took every slot made the others wait for its sequences to finish
(``bench/fair_share.py``).

A full pool is shared by tenant too (``fair_preempt``, default on with ``fair_share``): a waiting
request that does not fit may preempt running sequences of a lower class, or of its class whose
tenant runs at least two more sequences than its own (``_make_room``; never two tenants taking
turns), but only when the victims' own blocks make room. Without it a light tenant whose prompt
needs more blocks than are free waited until one of a flood's sequences ended.

A waiting request whose pulled KV is still arriving (``paused``, set by ``LLMEngine.expect_pull``)
is passed over like a joining one, keeping its place, until its pull ends.

In-flight prefix join (``join_inflight_prefill``, default on): a waiting request whose first
uncached prompt block is being computed right now by a running prefill it may read (same chain
hash under one of its readable domains, a producer of at least its priority, exact KV only) is
not admitted yet: it waits until that prefill has registered the blocks and then takes them as
hits. Without this, a burst of requests with one new system prompt computes the prompt once per
request in parallel: each step carries the same tokens several times, and on a CPU a step's time
grows with its tokens, so every request of the burst gets slower and the pool holds copies. The
producer's blocks are registered block by block after each step, so the waiter's hit grows with
the producer's chunks and it is admitted as soon as its next block is not in flight (where the
prompts diverge, or when the producer finished, was preempted or aborted). Requests behind a
waiter are admitted meanwhile (this is not a bypass: the waiter is not short of blocks).

When the top live class is *guarded* (``latency_guard``) and has prefill work
(``guarded_steps_alone``, default on, with ``alternate_low_prefill``), its steps alternate alone /
shared **starting alone** (so its first prefill step never carries a lower-class chunk, whatever
the step before carried), and an alone step carries no lower-class decode rows either: on a CPU
every row adds to the step the guarded request waits for. The shared steps carry the lower
classes' decodes and capped chunk as above, so they still progress every other step. (The
engine may also abandon a lower-class step in progress for a guarded arrival:
``engine/step_interrupt.py``.)
"""

from __future__ import annotations

import itertools
import time
from collections import Counter, deque
from dataclasses import dataclass
from typing import Callable, Container

from engine.kv_manager import KVManager
from engine.sequence import Sequence, SequenceStatus
from policies.fair_share import FairShare
from policies.prefill_priority import PriorityContention, request_class, throttled


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    long_prefill_tokens: int | None = None  # chunk cap while others wait; None: half the budget
    max_bypass: int = 16  # admissions that may pass a waiting request that does not fit yet
    low_priority_prefill_tokens: int = 32  # chunk cap of a lower-priority prefill under contention
    priority_hold_s: float = 2.0  # a class contends this long after its last waiting/prefilling work
    alternate_low_prefill: bool = True  # lower-class prefill skips a step with higher prefill after one of its own
    # with a guarded top class (latency_guard): its prefill steps alternate alone / shared starting
    # alone, and an alone step carries no lower-class decodes either (needs alternate_low_prefill)
    guarded_steps_alone: bool = True
    # a waiting request whose next prompt block a running prefill is computing waits for it (see above)
    join_inflight_prefill: bool = True
    # within a priority class, admit the waiting tenant with the fewest tokens computed for it
    # first (policies.fair_share), and no tenant takes the last ``fair_reserve_seqs`` sequence
    # slots (at most a quarter of max_num_seqs); False: arrival order, no reserve
    fair_share: bool = True
    fair_reserve_seqs: int = 4
    # with fair_share, a full pool is shared fairly too: growth preempts the tenant running the
    # most sequences first, and a waiting tenant running two fewer than another may preempt that
    # one's latest (_make_room); False: the most recently admitted of the lowest class, no
    # preemption for room
    fair_preempt: bool = True

    def __post_init__(self):
        if self.low_priority_prefill_tokens < 1:
            raise ValueError("low_priority_prefill_tokens must be >= 1")
        if self.priority_hold_s < 0:
            raise ValueError("priority_hold_s must be >= 0")
        if self.fair_reserve_seqs < 0:
            raise ValueError("fair_reserve_seqs must be >= 0")

    def prefill_cap(self) -> int:
        return self.long_prefill_tokens or max(1, self.max_num_batched_tokens // 2)

    def tenant_seq_cap(self) -> int:
        """Running sequences one tenant may hold: the rest of the slots stay for the others."""
        if not self.fair_share:
            return self.max_num_seqs
        return self.max_num_seqs - min(self.fair_reserve_seqs, self.max_num_seqs // 4)


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVManager, clock: Callable[[], float] = time.monotonic):
        self.config = config
        self.kv = kv
        self.clock = clock
        self.contention = PriorityContention(config.priority_hold_s)
        self.fair = FairShare()
        # tenant -> its added sequences not yet removed (fair_share: who has work here; n > 1
        # choices forked from an added one count through it)
        self._live: dict[str, set[Sequence]] = {}
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.num_bypasses = 0  # admissions of a request past an earlier one that did not fit
        self.num_room_preemptions = 0  # of num_preemptions: for a waiting request short of its share (_make_room)
        self.num_joined = 0  # requests that waited for a running prefill's blocks (join_inflight_prefill)
        self._joining: set[Sequence] = set()  # waiting sequences now waiting for a running prefill
        # request ids whose KV is still arriving (a pull, engine/import_holds.py): passed over
        # while waiting, their place in the queue kept
        self.paused: Container[str] = frozenset()
        self._bypassed: dict[Sequence, int] = {}  # waiting sequence -> times it was passed over
        self._no_room: set[Sequence] = set()  # passed over by the last schedule: its blocks were not free
        self._low_ran = False  # the last step carried throttled (lower-class) prefill tokens
        self._alone_last = False  # the last step was a guarded class's alone (guarded_steps_alone)

    def add(self, seq: Sequence) -> None:
        if self.config.fair_share:
            tenant = seq.request.tenant
            if tenant not in self._live:
                self.fair.join(tenant, self._live)
            self._live.setdefault(tenant, set()).add(seq)
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def has_admissible(self) -> bool:
        """Waiting requests that may be admitted now (not ``paused`` for a pull)."""
        return any(s.request.request_id not in self.paused for s in self.waiting)

    def held_back(self) -> dict[str, int]:
        """Waiting requests by why the last schedule did not admit them: ``pull`` (KV landing),
        ``join`` (taking a running prefill's blocks), ``room`` (blocks not free), ``other``
        (budget, sequence limit or priority share spent)."""
        out: dict[str, int] = {}
        for s in self.waiting:
            why = ("pull" if s.request.request_id in self.paused else "join" if s in self._joining
                   else "room" if s in self._no_room else "other")
            out[why] = out.get(why, 0) + 1
        return out

    def tenant_full(self, tenant: str) -> bool:
        """Whether ``tenant`` runs as many sequences as one tenant may (``tenant_seq_cap``)."""
        cap = self.config.tenant_seq_cap()
        return cap < self.config.max_num_seqs and sum(s.request.tenant == tenant for s in self.running) >= cap

    def remove(self, seq: Sequence) -> None:
        """Drop a finished or aborted sequence and release its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self._bypassed.pop(seq, None)
        self._joining.discard(seq)
        live = self._live.get(seq.request.tenant)
        if live is not None:
            live.discard(seq)
            if not live:
                del self._live[seq.request.tenant]
        self.kv.release(seq)

    def priority(self, seq: Sequence) -> int:
        return request_class(self.kv.pool.eviction.quota(seq.request.tenant).priority, seq.request.guest)

    def schedule(self) -> list[tuple[Sequence, int]]:
        cfg = self.config
        budget = cfg.max_num_batched_tokens
        scheduled: set[int] = set()
        cap = cfg.prefill_cap() if self.waiting else budget
        low = cfg.low_priority_prefill_tokens
        self.contention.hold_s = cfg.priority_hold_s
        prio = {id(s): self.priority(s) for s in (*self.running, *self.waiting)}
        prefills = [s for s in self.running if s.num_pending > 1]
        top = self.contention.observe(self.clock(), [prio[id(s)] for s in (*prefills, *self.waiting)],
                                      self.kv.pool.eviction.guarded_priorities())

        # plan: decodes first, then prefills by priority; lower-priority ones are capped, and their
        # capped chunks are reserved so that higher-priority prefills cannot take the whole budget
        plan: dict[int, int] = {}
        higher_prefill = top is not None and any(not throttled(prio[id(s)], top) for s in (*prefills, *self.waiting))
        guarded_alone = (higher_prefill and cfg.alternate_low_prefill and cfg.guarded_steps_alone
                         and top in self.kv.pool.eviction.guarded_priorities())
        # a guarded class's prefill: alone first, then shared, alternating; alone = no lower-class work
        alone = not self._alone_last if guarded_alone else False
        for seq in self.running:
            if seq.num_pending <= 1 and budget > 0:
                if alone and throttled(prio[id(seq)], top):
                    continue  # the guarded step does not pay for lower-class decode rows
                plan[id(seq)] = n = min(seq.num_pending, 1)
                budget -= n
        # the lower classes' prefill tokens of this step, all together; reserved ahead of higher prefills
        low_left = low if top is not None else 0
        if alone or (not guarded_alone and low_left and self._low_ran and cfg.alternate_low_prefill
                     and higher_prefill):
            low_left = 0  # they had the last step: this one is the higher classes' alone
        self._alone_last = alone
        low_share = low_left
        low_pending = sum(s.num_pending for s in prefills if throttled(prio[id(s)], top))
        reserved = min(low_left, low_pending)
        for seq in sorted(prefills, key=lambda s: -prio[id(s)]):
            if budget <= 0:
                break
            if throttled(prio[id(seq)], top):
                n = min(seq.num_pending, budget, low_left, max(1, cap))
                if n <= 0:
                    continue  # the lower classes' share of this step is spent
                low_left -= n
                reserved = max(0, reserved - n)
            else:
                n = min(seq.num_pending, max(1, budget - reserved), max(1, cap))
            plan[id(seq)] = n
            budget -= n
        # reserve blocks, the sequences a full pool keeps first; a preemption takes the one it keeps last
        rank = self._keep_rank(prio)
        for seq in sorted((s for s in self.running if id(s) in plan), key=rank.key):
            n = plan.get(id(seq))
            if n is None:
                continue  # preempted for a sequence reserved before it
            if self._reserve(seq, n, scheduled, plan, rank):
                scheduled.add(id(seq))
        out: list[tuple[Sequence, int]] = [(s, plan[id(s)]) for s in self.running if id(s) in scheduled]
        budget = cfg.max_num_batched_tokens - sum(n for _, n in out)  # preempted plans returned

        passed: list[Sequence] = []  # waiting sequences that did not fit this step
        inflight = self._inflight_blocks(prio) if cfg.join_inflight_prefill else {}
        # what running lower-priority prefills left of their share goes to lower-priority admissions
        reserve = low_left if any(throttled(prio[id(s)], top) for s in self.waiting) else 0
        seq_cap = cfg.tenant_seq_cap()
        capped = seq_cap < cfg.max_num_seqs
        held = running_per_tenant(self.running) if capped else {}
        admitted: set[int] = set()  # sequences admitted by this step (never preempted by it)
        for seq in self._admission_order(prio):
            if budget <= 0 or len(self.running) >= cfg.max_num_seqs:
                break
            if capped and held.get(seq.request.tenant, 0) >= seq_cap:
                continue  # its tenant holds all but the reserved slots: not a bypass
            low_prio = throttled(prio[id(seq)], top)
            if low_prio and low_left <= 0:
                continue  # the lower classes' share of this step is spent: not a bypass
            if seq.request.request_id in self.paused:
                continue  # its pull is landing: admitted now, it would compute what arrives
            hit = self.kv.find_prefix(seq)
            if inflight and self._joins_inflight(seq, len(hit), prio[id(seq)], inflight):
                continue  # its next blocks are being computed: take them as hits once registered
            self._joining.discard(seq)
            n = min(len(seq.tokens) - len(hit) * self.kv.block_size, budget)
            if low_prio:
                n = min(n, low_left)
            else:
                n = min(n, max(1, budget - reserve))
            upto = len(hit) * self.kv.block_size + n
            if self.kv.blocks_needed(seq, upto, hit) > self.kv.pool.num_free_blocks():
                if not (cfg.fair_share and cfg.fair_preempt and self._make_room(seq, upto, hit, prio, out, scheduled,
                                                                                admitted)):
                    passed.append(seq)  # (also for held_back: no room)
                    if self._bypassed.get(seq, 0) >= cfg.max_bypass:
                        break  # passed over often enough: it goes next, nothing behind it goes first
                    continue
                budget = cfg.max_num_batched_tokens - sum(k for _, k in out)  # the preempted rows' tokens return
            if any(self._bypassed.get(p, 0) >= cfg.max_bypass for p in passed):
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
            admitted.add(id(seq))
            if capped:
                held[seq.request.tenant] = held.get(seq.request.tenant, 0) + 1
            out.append((seq, n))
            scheduled.add(id(seq))
            budget -= n
            if low_prio:
                low_left -= n
            if cfg.join_inflight_prefill:
                self._add_inflight(seq, prio[id(seq)], inflight)
        self._low_ran = low_left < low_share
        self._no_room = set(passed)
        if cfg.fair_share:
            for seq, n in out:
                self.fair.charge(seq.request.tenant, n)
        return out

    def _admission_order(self, prio: dict[int, int]) -> list[Sequence]:
        """Waiting sequences by priority class, highest first; within a class by fair share
        (``policies.fair_share``) or, without it, in arrival order."""
        by_class = sorted(self.waiting, key=lambda s: -prio[id(s)])  # stable: arrival order within a class
        if not self.config.fair_share or not by_class:
            return by_class
        out: list[Sequence] = []
        for _, group in itertools.groupby(by_class, key=lambda s: prio[id(s)]):
            out.extend(self.fair.order(list(group), lambda s: s.request.tenant, lambda s: s.num_pending))
        return out

    def _add_inflight(self, seq: Sequence, priority: int, inflight: dict) -> None:
        """Record the prompt blocks ``seq`` still has to compute and register (exact KV, cached)."""
        if seq.approx_kv or seq.prefix_chains is None or not self.kv.enable_prefix_caching \
                or seq.request.reuse == "none":
            return
        chain = seq.prefix_chains[1].get(seq.request.domain) or ()
        for h in chain[seq.num_registered:]:
            if inflight.get(h, priority - 1) < priority:
                inflight[h] = priority

    def _inflight_blocks(self, prio: dict[int, int]) -> dict:
        """Chain hash -> highest priority of a running prefill that will register that block."""
        out: dict = {}
        for seq in self.running:
            if seq.num_computed < seq.num_prompt:
                self._add_inflight(seq, prio[id(seq)], out)
        return out

    def _joins_inflight(self, seq: Sequence, hit_blocks: int, priority: int, inflight: dict) -> bool:
        """Whether ``seq``'s first uncached block is in flight in a prefill it may read, of at
        least its priority (a lower class's throttled prefill would hold it back)."""
        if seq.prefix_chains is None:
            return False
        for chain in seq.prefix_chains[1].values():
            if hit_blocks < len(chain) and inflight.get(chain[hit_blocks], priority - 1) >= priority:
                if seq not in self._joining:
                    self._joining.add(seq)
                    self.num_joined += 1
                return True
        return False

    def _make_room(self, seq: Sequence, num_tokens: int, hit: list, prio: dict[int, int],
                   out: list[tuple[Sequence, int]], scheduled: set[int], admitted: set[int]) -> bool:
        """Fair share of the pool: preempt running sequences so that waiting ``seq`` fits, when its
        tenant is short of it. Victims are running sequences of a lower priority class, or of its
        class whose tenant runs at least two more sequences than ``seq``'s (so after the swap it
        still runs at least as many: two tenants never take turns preempting each other), the
        lowest class, the tenant running the most and the most recently admitted first (it has
        computed the least). Nothing is preempted unless the victims' own blocks would make room.
        Victims leave this step's ``out`` and wait again (their full blocks stay cached)."""
        tenant, mine = seq.request.tenant, prio[id(seq)]
        held = running_per_tenant(self.running)
        pos = {id(s): i for i, s in enumerate(self.running)}
        candidates = [s for s in self.running if id(s) not in admitted and prio[id(s)] <= mine]
        need = self.kv.blocks_needed(seq, num_tokens, hit) - self.kv.pool.num_free_blocks()
        victims: list[Sequence] = []
        while need > 0:
            ok = [s for s in candidates if prio[id(s)] < mine
                  or held[s.request.tenant] >= held.get(tenant, 0) + 2]
            if not ok:
                return False
            v = min(ok, key=lambda s: (prio[id(s)], -held[s.request.tenant],
                                       -self.fair.counters.get(s.request.tenant, 0.0), -pos[id(s)]))
            candidates.remove(v)
            victims.append(v)
            held[v.request.tenant] -= 1
            need -= sum(1 for b in v.blocks if b.ref_cnt == 1)
        for v in victims:
            self._preempt(v)
            self.num_room_preemptions += 1
            if id(v) in scheduled:
                scheduled.discard(id(v))
                out[:] = [(s, n) for s, n in out if s is not v]
        return self.kv.blocks_needed(seq, num_tokens, hit) <= self.kv.pool.num_free_blocks()

    def _keep_rank(self, prio: dict[int, int]) -> "_KeepRank":
        fair = self.config.fair_share and self.config.fair_preempt
        return _KeepRank(self.running, prio, self.fair.counters if fair else None)

    def _reserve(self, seq: Sequence, n: int, scheduled: set[int], plan: dict[int, int], rank: "_KeepRank") -> bool:
        """Grow ``seq``'s blocks for ``n`` more tokens, preempting the running sequences not yet
        reserved this step that a full pool keeps last (``_KeepRank``), ``seq`` itself included;
        a preempted sequence's planned tokens leave ``plan`` (the caller returns them to the budget)."""
        target = seq.num_computed + n
        while self.kv.blocks_needed(seq, target) > self.kv.pool.num_free_blocks():
            victim = max((s for s in self.running if id(s) not in scheduled), key=rank.key)
            rank.left(victim)
            self._preempt(victim)
            plan.pop(id(victim), None)
            if victim is seq:
                return False
        self.kv.grow(seq, target)
        return True

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.kv.release(seq)
        seq.num_computed = 0  # num_cached stays: admission sets it again unless output was sent
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1


def running_per_tenant(running: list[Sequence]) -> Counter:
    return Counter(s.request.tenant for s in running)


class _KeepRank:
    """Which running sequences a full pool keeps: ``key`` sorts the kept-first first. A higher
    priority class first; within a class (with fair share) the tenant running fewer sequences
    first, so a tenant that holds most of the pool loses its own sequences before a light tenant
    loses its only one (which, admitted last, arrival order would take first), and between
    tenants running as many the one with fewer tokens computed for it (its fair-share counter);
    then the earliest admitted (the running list's order: preempting the most recently admitted
    keeps it cheap, it has computed the least). With one tenant of one class this is admission order."""

    def __init__(self, running: list[Sequence], prio: dict[int, int], counters: dict | None):
        self.pos = {id(s): i for i, s in enumerate(running)}
        self.prio = prio
        self.counters = counters or {}
        self.held = running_per_tenant(running) if counters is not None else {}

    def key(self, seq: Sequence) -> tuple:
        t = seq.request.tenant
        return (-self.prio[id(seq)], self.held.get(t, 0), self.counters.get(t, 0.0), self.pos[id(seq)])

    def left(self, seq: Sequence) -> None:
        """``seq`` is preempted: its tenant runs one sequence fewer."""
        if seq.request.tenant in self.held:
            self.held[seq.request.tenant] -= 1
