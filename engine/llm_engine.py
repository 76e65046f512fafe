"""The engine loop: the scheduler picks sequences, the runner runs them, outputs are post-processed."""

from __future__ import annotations

import logging
import sys
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from engine.approx import ApproxConfig, ApproxReuse, ShadowJob
from engine.redact import describe_exc
from engine.fault_isolation import forward_isolating
from engine.import_holds import ImportHolds
from engine.block_pool import BlockHash, BlockPool, prompt_chains
from engine.kv_cache import KVBlocks, PagedKVCache, token_slots
from engine.kv_manager import KVManager
from engine.model_loader import LoadedModel, load_model
from engine.fork import fork
from engine.grammar import COMPILE_CPU_S, MAX_GRAMMAR_BYTES, MAX_SCHEMA_CHARS, GrammarCache
from engine.logprobs import reduce_prompt_logprobs
from engine.model_runner import ModelRunner, build_batch
from engine.sampler import SampleResult, SampleRow, sample, sample_isolated
from engine.scheduler import Scheduler, SchedulerConfig
from engine.slot_pool import DonorPayload
from engine.step_interrupt import ArrivalSignal, StepInterrupted
from engine.step_trace import StepTrace
from engine.sequence import (REUSE_MODES, InvalidRequest, Request, RequestOutput, SamplingParams, SeqGroup,
                             Sequence, SequenceStatus, TokenLogprob)
from engine.tokenizer import IncrementalDetokenizer
from policies.eviction import TenantEvictionPolicy, TenantQuota
from policies.prefill_priority import may_interrupt
from policies.tenancy import read_label


CALIBRATION_TENANT = "kvmesh-calibration"  # LLMEngine.calibrate's prompts (never cached, not counted)
CALIBRATION_LENGTHS = (32, 256)  # prompt tokens it times: a short and a long prefill for a 3-term fit
MAX_FAILED_STEPS = 3  # steps in a row failing every request in them: the engine is broken, not a request


class EngineBroken(RuntimeError):
    """Every request failed in several steps in a row: the engine itself is broken."""


@dataclass(frozen=True)
class EngineConfig:
    model: str = "default"
    block_size: int = 16
    num_blocks: int | None = None  # None: from kv_cache_bytes
    kv_cache_bytes: int = 512 * 1024 * 1024
    max_model_len: int | None = None  # None: the model's context, capped by the pool
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    enable_prefix_caching: bool = True
    attention: str = "auto"  # auto | sdpa | flash
    dtype: str = "float32"
    device: str = "cpu"
    num_threads: int | None = None
    tenant_quotas: dict[str, TenantQuota] = field(default_factory=dict)
    # a reused (hit) prefix block released less than this long ago is evicted only after the
    # tenant's blocks never hit (requests' unshared tails and outputs); 0: plain LRU for them
    # (policies/eviction.py, bench/eviction_scan.py)
    cache_protect_s: float = 60.0
    # a new chain's blocks (a prompt whose first block nobody had cached: a new group's first
    # prompt) released less than this long ago are evicted after the tenant's tails too, while its
    # new chains have been reused more than its tails (policies/eviction.py); 0: plain LRU for them
    cache_seed_s: float = 120.0
    low_priority_prefill_tokens: int = 32  # prefill chunk cap of a tenant below a contending priority
    priority_hold_s: float = 2.0  # a priority class contends this long after its last prefill work
    alternate_low_prefill: bool = True  # see engine/scheduler.py: a higher-priority step after a lower one is alone
    # a guarded (latency_guard) class's prefill step carries no lower-class work at all, decodes
    # included, and its first one is alone (engine/scheduler.py; needs alternate_low_prefill)
    guarded_steps_alone: bool = True
    # a waiting request whose next prompt block a running prefill is computing waits for that
    # prefill's blocks instead of computing them again (engine/scheduler.py, in-flight prefix join)
    join_inflight_prefill: bool = True
    # within a priority class the waiting tenant with the fewest tokens computed for it is admitted
    # first (virtual token counters, policies/fair_share.py); False: arrival order across tenants
    fair_share: bool = True
    fair_reserve_seqs: int = 4  # with fair_share: sequence slots no single tenant takes (<= max_num_seqs // 4)
    # with fair_share: a full pool preempts the tenant running the most sequences first, and a
    # tenant short of its share of a full pool may preempt (engine/scheduler.py, SchedulerConfig.fair_preempt)
    fair_preempt: bool = True
    # structured output (engine/grammar.py): a response_format schema longer than this is refused;
    # compiled grammars kept per engine, in bytes of token masks (one larger alone is refused)
    max_schema_chars: int = MAX_SCHEMA_CHARS
    grammar_cache_bytes: int = MAX_GRAMMAR_BYTES
    # CPU-seconds one schema may take to compile, in a child process (0: in this process, unbounded)
    grammar_compile_cpu_s: float = COMPILE_CPU_S
    # a step of lower classes only is abandoned between layers when a guarded request above them
    # arrives, never two in a row (engine/step_interrupt.py)
    interrupt_for_guarded: bool = True
    # niceness added to the engine thread when AsyncEngine starts it (Linux, that thread and the
    # threads it starts); < 0 gives the engine CPU precedence over an HTTP front end on the same
    # cores (needs root / CAP_SYS_NICE: refused -> logged, unchanged). 0: untouched
    thread_nice: int = 0
    approx: ApproxConfig | None = ApproxConfig()  # None: "approximate" requests run exactly (CPU only)
    # pulled KV (and the local prefix it extends) is held for its request until that request is
    # admitted, at most this long (engine/import_holds.py); a serving pull with no room waits for
    # room while requests run, and its request is queued while the KV arrives (actors/worker.py).
    # 0: off (pulled KV evictable as it lands, a pull with no room skipped, the request queued
    # after its pull: before session 21)
    import_hold_s: float = 60.0

    def __post_init__(self):
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ValueError("block_size must be a positive power of two")
        if self.max_num_batched_tokens < 1 or self.max_num_seqs < 1:
            raise ValueError("max_num_batched_tokens and max_num_seqs must be >= 1")


@dataclass
class TenantMetrics:
    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0


class LLMEngine:
    """Single-process engine. Not thread-safe: drive it from one thread (see AsyncEngine)."""

    def __init__(self, config: EngineConfig = EngineConfig(), loaded: LoadedModel | None = None):
        self.config = config
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        dtype = getattr(torch, config.dtype)
        self.loaded = loaded or load_model(config.model, dtype=dtype, device=config.device)
        self.tokenizer = self.loaded.tokenizer
        mcfg = self.loaded.model.config
        head_dim = getattr(mcfg, "head_dim", None) or mcfg.hidden_size // mcfg.num_attention_heads
        num_blocks = config.num_blocks or max(
            1, config.kv_cache_bytes // PagedKVCache.bytes_per_block(
                mcfg.num_hidden_layers, config.block_size, mcfg.num_key_value_heads, head_dim, dtype))
        self.max_model_len = min(config.max_model_len or self.loaded.max_context, self.loaded.max_context,
                                 num_blocks * config.block_size)
        self.cache = PagedKVCache(mcfg.num_hidden_layers, num_blocks, config.block_size,
                                  mcfg.num_key_value_heads, head_dim, dtype, config.device)
        eviction = TenantEvictionPolicy(config.tenant_quotas, protect_s=config.cache_protect_s, seed_s=config.cache_seed_s)
        self.pool = BlockPool(num_blocks, config.block_size, eviction)
        self.kv = KVManager(self.pool, self.loaded.model_id, config.enable_prefix_caching)
        self.holds = ImportHolds(self.pool, config.import_hold_s)  # pulled KV kept for its request
        self.scheduler = Scheduler(SchedulerConfig(
            config.max_num_seqs, config.max_num_batched_tokens,
            low_priority_prefill_tokens=config.low_priority_prefill_tokens,
            priority_hold_s=config.priority_hold_s, alternate_low_prefill=config.alternate_low_prefill,
            guarded_steps_alone=config.guarded_steps_alone,
            join_inflight_prefill=config.join_inflight_prefill, fair_share=config.fair_share,
            fair_reserve_seqs=config.fair_reserve_seqs, fair_preempt=config.fair_preempt), self.kv)
        self.scheduler.paused = self.holds.awaiting  # requests whose pull is landing wait
        self.runner = ModelRunner(self.loaded.model, self.cache, config.attention)
        self.eos_ids = self._eos_ids()
        self.seqs: dict[str, Sequence] = {}
        self.approx = (ApproxReuse(self.loaded.model, self.tokenizer, config.approx)
                       if config.approx is not None and config.device == "cpu" else None)
        self.tenant_metrics: dict[str, TenantMetrics] = {}
        # approximate reuse: prompt tokens served from donors, per (reader tenant, read_label)
        self.approx_reads: dict[tuple[str, str], int] = {}
        self.num_steps = 0
        # guarded requests on their way to add_request (AsyncEngine notes them); a lower-class step
        # is abandoned for them between layers (engine/step_interrupt.py)
        self.arrivals = ArrivalSignal()
        self.num_interrupted_steps = 0
        self._interrupted_last = False
        self.trace = StepTrace()  # off unless KVMESH_STEP_TRACE_DIR is set (engine/step_trace.py)
        self.num_forward_tokens = 0  # tokens run through the model (prefill chunks + decodes)
        self.sample_s = 0.0  # time in the batched sampler (masks, logprobs, appends) over all steps
        self.vocab_size = mcfg.vocab_size
        self.grammars = GrammarCache(self.tokenizer, self.vocab_size, self.eos_ids, max_bytes=config.grammar_cache_bytes,
                                     max_schema_chars=config.max_schema_chars,
                                     compile_cpu_s=config.grammar_compile_cpu_s)
        self._shadow_jobs: deque[ShadowJob] = deque()  # quality-gate checks of finished requests
        self._failed_steps = 0  # consecutive steps in which every request failed
        self.num_failed = 0
        self.optional_failures: dict[str, int] = {}  # donations/approximate builds skipped on an error
        self.export_races = 0  # exports cut short: a block left the cache while it was copied (export_prefix)

    def _eos_ids(self) -> set[int]:
        ids = set()
        gen = getattr(self.loaded.model, "generation_config", None)
        for src in (getattr(gen, "eos_token_id", None), getattr(self.tokenizer, "eos_token_id", None)):
            if isinstance(src, int):
                ids.add(src)
            elif src:
                ids.update(src)
        return ids

    # -- requests --------------------------------------------------------------------------
    def validate(self, request: Request) -> None:
        """Raise InvalidRequest unless the request can be served; allocates nothing."""
        if request.request_id in self.seqs:
            raise InvalidRequest(f"duplicate request id {request.request_id!r}")
        n = len(request.prompt_ids)
        if n == 0:
            raise InvalidRequest("the prompt is empty")
        vocab = self.loaded.model.config.vocab_size
        if any((not isinstance(t, int)) or t < 0 or t >= vocab for t in request.prompt_ids):
            raise InvalidRequest(f"prompt token ids must be integers in [0, {vocab})")
        if n >= self.max_model_len:
            raise InvalidRequest(
                f"the prompt has {n} tokens; this model's context is {self.max_model_len} tokens", param="prompt")
        if n + request.params.max_tokens > self.max_model_len:
            raise InvalidRequest(
                f"prompt ({n} tokens) + max_tokens ({request.params.max_tokens}) exceeds the context of "
                f"{self.max_model_len} tokens", param="max_tokens")
        check_sampling_limits(request.params)
        bs = self.config.block_size
        need, cap = -(-(n + request.params.max_tokens) // bs), self.pool.capacity(request.tenant)
        if need > cap:
            raise InvalidRequest(
                f"prompt ({n} tokens) + max_tokens ({request.params.max_tokens}) needs {need} KV blocks; tenant "
                f"{request.tenant!r} may hold at most {cap} of this worker's {self.pool.num_blocks} (the rest is "
                f"other tenants' guaranteed minimum): at most {cap * bs} tokens in all", param="max_tokens")
        if request.reuse not in REUSE_MODES:
            raise InvalidRequest(f"reuse must be one of {REUSE_MODES}, got {request.reuse!r}")
        check_approx_fields(request)
        p = request.params
        bad = [t for t, _ in p.logit_bias if t >= vocab] + [t for t in p.stop_token_ids if t >= vocab]
        if bad:
            raise InvalidRequest(f"token ids {sorted(set(bad))[:8]} in logit_bias/stop_token_ids are outside the "
                                 f"vocabulary [0, {vocab})",
                                 param="logit_bias" if any(t >= vocab for t, _ in p.logit_bias) else "stop_token_ids")
        if p.grammar is not None:
            self.grammars.compile(p.grammar)  # InvalidRequest if it cannot compile; cached

    def _new_choice(self, request: Request, group: SeqGroup, index: int) -> Sequence:
        p = request.params
        seq = Sequence(request=request, tokens=list(request.prompt_ids), num_prompt=len(request.prompt_ids),
                       index=index, group=group)
        if p.seed is not None:
            seq.generator = torch.Generator().manual_seed((p.seed + index) % SEED_RANGE)
        seq.detok = IncrementalDetokenizer(self.tokenizer)
        if p.grammar is not None:
            seq.matcher = self.grammars.matcher(p.grammar)
        group.choices.append(seq)
        return seq

    def add_request(self, request: Request, arrival: float | None = None) -> None:
        """Queue ``request``. ``arrival``: when it reached this engine (``perf_counter``; default
        now), the start of its ``ttft_s``: a request that waited for the step in progress to be
        added counts that wait as queueing (``AsyncEngine`` passes the time it was handed over)."""
        try:
            self.validate(request)
        except BaseException:
            self.holds.release(request.request_id)  # KV pulled for a request refused here
            raise
        group = SeqGroup(request.params.n)
        seq = self._new_choice(request, group, 0)
        if arrival is not None:
            seq.arrival = arrival
        if request.params.prompt_logprobs is not None:
            seq.prompt_lp = [None] * seq.num_prompt
        self.seqs[request.request_id] = seq
        if self.trace.on:
            self.trace.add(request.request_id, request.tenant, seq.num_prompt, len(self.scheduler.running),
                           len(self.scheduler.waiting))
        self.scheduler.add(seq)

    def abort(self, request_id: str, index: int | None = None) -> RequestOutput | None:
        """Abort a request (every choice), or only its choice ``index``; releases their blocks.
        Returns the aborted choice's last output (``finished`` when no choice is left)."""
        seq = self.seqs.get(request_id)
        if seq is None:
            return None
        group = seq.group
        if index is None:
            return self._end_group(group, "abort")
        if not 0 <= index < group.n:
            return None
        target = next((c for c in group.choices if c.index == index), None)
        if target is None:  # not forked yet: it is created finished and never runs
            target = self._new_choice(seq.request, group, index)
            target.status, target.finish_reason = SequenceStatus.FINISHED, "abort"
            group.num_finished += 1
            if group.done:
                self.seqs.pop(request_id, None)
            return self._output(target, [], "")
        if target.finished:
            return None
        return self._finish_choice(target, "abort", [], None)

    def _end_group(self, group: SeqGroup, reason: str, error: str | None = None) -> RequestOutput:
        """Finish every unfinished choice of a request at once (abort, error); one output."""
        last = None
        for c in group.choices:
            if not c.finished:
                self.scheduler.remove(c)
                c.status, c.finish_reason = SequenceStatus.FINISHED, reason
                last = c
        group.num_finished = group.n
        first = group.choices[0]
        self.seqs.pop(first.request_id, None)
        self.holds.release(first.request_id)  # aborted or failed before admission
        self.trace.forget(first.request_id)
        return self._output(last or first, [], "", error=error)

    def has_unfinished(self) -> bool:
        """Requests in flight, or quality-gate shadow checks still to run (one per step)."""
        return self.scheduler.has_unfinished() or bool(self._shadow_jobs)

    def has_work(self) -> bool:
        """Whether a step could do anything now: ``has_unfinished`` less requests that only
        wait for their pull to land (a loop with nothing else sleeps until a command comes)."""
        return bool(self.scheduler.running or self._shadow_jobs) or self.scheduler.has_admissible()

    # -- the loop --------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        self.pool.evict_expired()
        if self._shadow_jobs:  # at most one per step, after the request's last output was returned
            self._run_shadow(self._shadow_jobs.popleft())
        early = self._admit_approximate() if self.approx is not None else []
        scheduled = self.scheduler.schedule()
        if self.holds:
            self._settle_holds(bool(scheduled))
        if not scheduled:
            return early
        chunks, plp = [], []  # plp: (seq, first position, count, first batch row) of prompt-logprob rows
        row = 0
        for seq, n in scheduled:
            start = seq.num_computed
            want = start + n == len(seq.tokens)
            chunks.append((seq.tokens[start : start + n], start, want, [b.block_id for b in seq.blocks]))
            if seq.prompt_lp is not None and not seq.prompt_lp_sent:
                cnt = min(start + n, seq.num_prompt - 1) - start  # row at position p predicts token p + 1
                if cnt > 0:
                    plp.append((seq, start, cnt, row))
            row += n
        t0, wall0, cpu0 = time.perf_counter(), time.time(), time.thread_time()
        wants = [want for _, _, want, _ in chunks]
        interrupt = self._interrupt_check(scheduled)
        try:
            rows = self._forward(chunks, wants, plp, interrupt)
        except StepInterrupted:
            # nothing of the step was applied: the plan's sequences rerun it later (their grown
            # blocks stay theirs); the guarded arrival is added before the next schedule
            self.num_interrupted_steps += 1
            self._interrupted_last = True
            self._trace_step(scheduled, wall0, time.perf_counter() - t0, True, time.thread_time() - cpu0)
            return early
        self._interrupted_last = False
        dt = time.perf_counter() - t0
        self._trace_step(scheduled, wall0, dt, False, time.thread_time() - cpu0)
        total = sum(n for _, n in scheduled)
        self.num_steps += 1
        self.num_forward_tokens += total
        failed = [(seq, r) for (seq, _), r in zip(scheduled, rows) if isinstance(r, BaseException)]
        errors = [self._fail(seq, "forward", err) for seq, err in failed]
        for seq, n in scheduled:
            if seq.first_token_at is None:
                seq.prefill_s += dt * n / total
        sampled_seqs, wanted = [], []
        for (seq, n), (_, _, want, _), row in zip(scheduled, chunks, rows):
            if isinstance(row, BaseException):
                continue
            seq.num_computed += n
            if not seq.approx_kv:  # approximate KV must never enter the exact prefix cache
                self.kv.commit(seq)
            if want:
                sampled_seqs.append(seq)
                wanted.append(row)
                if seq.num_output == 0 and not seq.approx_kv and self.approx is not None \
                        and seq.request.reuse == "approximate":
                    self._guarded(seq, "donation", self._donate)
        logits = torch.stack(wanted) if wanted else None
        for i, seq in enumerate(sampled_seqs):
            if seq.shadow is not None:  # quality gate: the exact argmax of every output step
                seq.shadow_argmax.append(int(logits[i].argmax()))
                if seq.shadow_first_logits is None:
                    seq.shadow_first_logits = logits[i].float().clone()
        rows = list(range(len(sampled_seqs)))
        for i, seq in enumerate(list(sampled_seqs)):
            if seq.group.n > 1 and not seq.group.forked and seq.num_output == 0:
                for child in self._fork(seq):  # forked choices sample from the parent's row
                    sampled_seqs.append(child)
                    rows.append(i)
        if logits is not None and len(rows) != logits.shape[0]:
            logits = logits[torch.tensor(rows, dtype=torch.long, device=logits.device)]
        t1 = time.perf_counter()
        outs = self._sample_and_append(logits, sampled_seqs) if sampled_seqs else []
        self.sample_s += time.perf_counter() - t1
        n_failed = len(failed) + sum(1 for o in outs if o.error)
        self.num_failed += n_failed - len(failed)
        self._failed_steps = self._failed_steps + 1 if n_failed and n_failed >= len(scheduled) else 0
        if self._failed_steps >= MAX_FAILED_STEPS:
            raise EngineBroken(f"{self._failed_steps} steps in a row failed for every request in them")
        return early + errors + outs

    def _forward(self, chunks: list, wants: list[bool], plp: list, interrupt) -> list:
        """One logits row (or None, or the chunk's own exception) per chunk; raises
        ``StepInterrupted`` when ``interrupt`` said so between layers (nothing applied yet)."""
        kw = {} if interrupt is None else {"interrupt": interrupt}  # (tests wrap forward(batch[, rows]))
        if plp:  # prompt logprobs need the hidden rows too: one batched call (a failure fails the step)
            batch = build_batch(chunks, self.config.block_size, self.config.device)
            hrows = torch.tensor([r + i for _, _, c, r in plp for i in range(c)], dtype=torch.long,
                                 device=batch.input_ids.device)
            logits, hidden = self.runner.forward(batch, hrows, **kw)
            off = 0
            for seq, start, cnt, _ in plp:
                lps = reduce_prompt_logprobs(self.runner.model.lm_head, hidden[off : off + cnt],
                                             seq.tokens[start + 1 : start + 1 + cnt], seq.params.prompt_logprobs)
                seq.prompt_lp[start + 1 : start + 1 + cnt] = lps
                off += cnt
            it = iter(logits)
            rows = [next(it) if w else None for w in wants]
        else:  # a chunk whose forward fails alone fails its request alone (engine/fault_isolation.py)
            rows = forward_isolating(
                lambda cs: self.runner.forward(build_batch(cs, self.config.block_size, self.config.device), **kw),
                chunks, wants)
        return rows

    def _trace_step(self, scheduled: list[tuple[Sequence, int]], wall0: float, dt: float, interrupted: bool,
                    cpu: float) -> None:
        if not self.trace.on:
            return
        tok: dict[str, int] = {}
        rows: dict[str, int] = {}
        for seq, n in scheduled:
            tok[seq.request.tenant] = tok.get(seq.request.tenant, 0) + n
            rows[seq.request.tenant] = rows.get(seq.request.tenant, 0) + 1
        waiting: dict[str, int] = {}
        for seq in self.scheduler.waiting:
            waiting[seq.request.tenant] = waiting.get(seq.request.tenant, 0) + 1
        rec = {"ev": "step", "t": round(wall0, 4), "dt": round(dt, 4), "cpu": round(cpu, 4), "tok": tok, "rows": rows,
               "interrupted": interrupted, "waiting": waiting,
               "preempted": self.scheduler.num_preemptions, "room": self.scheduler.num_room_preemptions}
        if waiting:  # why the waiting ones were not admitted (Scheduler.held_back), and the pool's room
            rec["held"] = self.scheduler.held_back()
            rec["free_blocks"] = self.pool.num_free_blocks()
        self.trace.write(rec)

    def _interrupt_check(self, scheduled: list[tuple[Sequence, int]]):
        """The between-layers check for this step's forward, or None when it may not be interrupted
        (``policies.prefill_priority.may_interrupt``: a guarded class above every sequence in it,
        and the last step ran to its end)."""
        guarded = self.pool.eviction.guarded_priorities() if self.config.interrupt_for_guarded else ()
        if not guarded:  # the usual case: no latency_guard tenant, nothing to scan
            return None
        step_top = max(self.scheduler.priority(seq) for seq, _ in scheduled)
        if not may_interrupt(step_top, guarded, self._interrupted_last):
            return None
        arrivals = self.arrivals
        return lambda: arrivals.above(step_top)

    # -- failures of one request (engine/fault_isolation.py) --------------------------------
    def _fail(self, seq: Sequence, where: str, err: BaseException) -> RequestOutput:
        """End ``seq``'s request with an error of its own (its blocks freed); the step goes on
        for the others. The returned output carries ``error`` (the ingress answers 500)."""
        logging.getLogger(__name__).warning("request %s failed in %s: %s", seq.request_id, where,
                                            describe_exc(err, traceback=True))
        self.num_failed += 1
        return self._end_group(seq.group, "error", f"the request failed in the engine's {where} "
                                                   f"({type(err).__name__}); other requests were not affected")

    def _guarded(self, seq: Sequence, where: str, fn) -> bool:
        """``fn(seq)`` for an optional extra (donation): a failure is logged and skipped."""
        try:
            fn(seq)
            return True
        except Exception as e:  # noqa: BLE001 - an optional extra never fails the request or the step
            self.optional_failures[where] = self.optional_failures.get(where, 0) + 1
            logging.getLogger(__name__).warning("%s for request %s failed: %s", where, seq.request_id, describe_exc(e))
            return False

    def _fork(self, parent: Sequence) -> list[Sequence]:
        """Choices 1..n-1 of ``parent``'s request (see engine/fork.py): the running ones, which
        sample now; those without room wait in the queue over the prompt."""
        group = parent.group
        group.forked = True
        running = []
        made = {c.index for c in group.choices}  # a choice aborted before the fork exists, finished
        for i in (i for i in range(1, group.n) if i not in made):
            child = self._new_choice(parent.request, group, i)
            child.arrival, child.prefill_s = parent.arrival, parent.prefill_s
            if fork(parent, child, self.kv, self.cache, self.scheduler, self.config.max_num_seqs):
                running.append(child)
            else:
                self.scheduler.add(child)
        return running

    def _banned(self, seq: Sequence) -> tuple[int, ...]:
        """Ids ``seq`` may not draw now: EOS and its stop_token_ids until it has min_tokens (vLLM's rule)."""
        p = seq.params
        if seq.num_output >= p.min_tokens:
            return ()
        return tuple(sorted(set(self.eos_ids) | set(p.stop_token_ids)))

    def _sample_and_append(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[RequestOutput]:
        """Sample one token for each of ``seqs`` (row i of ``logits``) in one batched call and
        append it. A row whose sampling fails ends its request with ``error``; others go on."""
        rows = [SampleRow(s.params, s.generator, s.tokens if s.params.penalized else None, s.num_prompt,
                          self._banned(s)) for s in seqs]
        gram = [(i, s.matcher) for i, s in enumerate(seqs) if s.matcher is not None]
        try:
            mask = self.grammars.mask_fn(gram, logits.device)
            res: SampleResult = sample(logits, rows, mask)
        except Exception:  # noqa: BLE001 - isolate the failing row(s); the step goes on
            logging.getLogger(__name__).warning("batched sampling failed (%s); sampling row by row",
                                                describe_exc(sys.exc_info()[1]))

            def mask_row(i):
                m = seqs[i].matcher
                return None if m is None else self.grammars.mask_fn([(0, m)], logits.device)

            res = sample_isolated(logits, rows, mask_row)
        outs = []
        for seq, tok, lp, err in zip(seqs, res.tokens, res.logprobs, res.errors):
            if seq.finished or seq.group.done:  # its request ended earlier in this loop (error)
                continue
            if err is None and seq.matcher is not None and not seq.matcher.accept_token(tok):
                err = f"the grammar rejected token {tok}"
            if err is not None:
                logging.getLogger(__name__).warning("request %s failed: %s", seq.request_id, err)
                outs.append(self._end_group(seq.group, "error", err))
            else:
                outs.append(self._append(seq, tok, lp))
        return outs

    # -- approximate reuse (engine/approx.py) -----------------------------------------------
    def _admit_approximate(self) -> list[RequestOutput]:
        """Admit waiting ``approximate`` requests that have a donor: build their prompt KV by
        remapping (outside the batched forward), write it into their own blocks and sample the
        first token; they then decode in the batch. Leading blocks held by the exact prefix
        cache are shared as usual; the rest is never registered (``Sequence.approx_kv``).
        Each request is tried once; one that finds no donor or no room runs exactly."""
        outs = []
        bs = self.config.block_size
        for seq in [s for s in self.scheduler.waiting if s.request.reuse == "approximate" and not s.approx_tried
                    and s.group.n == 1 and s.prompt_lp is None]:  # those run exactly
            if self.scheduler.tenant_full(seq.request.tenant):
                continue  # its tenant holds all but the reserved slots (fair_share): tried once it does not
            seq.approx_tried = True
            if seq.num_output or len(self.scheduler.running) >= self.config.max_num_seqs:
                continue
            n = seq.num_prompt
            hit = self.kv.find_prefix(seq)
            hit_tokens = len(hit) * bs

            def worth(m, hit_tokens=hit_tokens) -> bool:  # asked before the gate decides
                gain = sum(1 for i in range(hit_tokens, m.suffix_start) if m.plan.src[i] is not None)
                return hit_tokens <= m.plan.exact_prefix and gain >= self.config.approx.min_gain_tokens

            t0 = time.perf_counter()
            try:  # one request's approximate path failing = that request runs exactly
                m = self.approx.match(seq.request, worth)
                if m is None:
                    continue  # no donor, not worth it (the exact prefix cache serves nearly as much), or gated
                if m.shadow:  # the quality gate measures this template: run exactly, check once finished
                    seq.shadow = m
                    continue
                if self.kv.blocks_needed(seq, n, hit) > self.pool.num_free_blocks():
                    continue
                res = self.approx.build(seq.request, m)
            except Exception as e:  # noqa: BLE001
                seq.shadow = None
                self.optional_failures["approximate"] = self.optional_failures.get("approximate", 0) + 1
                logging.getLogger(__name__).warning("approximate reuse for %s failed, running it exactly: %s",
                                                    seq.request_id, describe_exc(e, traceback=True))
                continue
            dt = time.perf_counter() - t0
            self.scheduler.waiting.remove(seq)
            self.kv.admit(seq, hit)
            self.kv.grow(seq, n)
            table = [b.block_id for b in seq.blocks]
            slots = torch.tensor(token_slots(table, bs, hit_tokens, n), dtype=torch.long)
            for layer in range(self.cache.num_layers):
                self.cache.write(layer, slots, res.kv.k[layer, hit_tokens:n].to(self.cache.dtype),
                                 res.kv.v[layer, hit_tokens:n].to(self.cache.dtype))
            seq.num_computed = n
            seq.approx_kv = True
            seq.num_approx = max(0, n - res.computed - hit_tokens)
            seq.num_cached = hit_tokens + seq.num_approx
            key = (seq.request.tenant, read_label(seq.request.domain, m.donor.domain))
            self.approx_reads[key] = self.approx_reads.get(key, 0) + seq.num_approx
            seq.prefill_s = dt
            seq.status = SequenceStatus.RUNNING
            self.scheduler.running.append(seq)
            outs.extend(self._sample_and_append(res.logits[None].float(), [seq]))
        return outs

    def _donate(self, seq: Sequence) -> None:
        """Store an exactly prefilled approximate-mode prompt's KV in the slot pool."""
        bs, n = self.config.block_size, seq.num_prompt
        table = [b.block_id for b in seq.blocks]
        slots = torch.tensor(token_slots(table, bs, 0, n), dtype=torch.long)
        k = torch.stack([self.cache.k[layer].index_select(0, slots) for layer in range(self.cache.num_layers)])
        v = torch.stack([self.cache.v[layer].index_select(0, slots) for layer in range(self.cache.num_layers)])
        self.approx.store(seq.request, k.float(), v.float())

    def _run_shadow(self, job: ShadowJob) -> None:
        """One quality-gate check. The request was already served: a failure here is counted and
        logged, never raised into the loop (the key then simply stays served exactly)."""
        try:
            self.approx.shadow_check(job)
        except Exception:  # noqa: BLE001 - best effort: a bug here must not kill the engine loop
            self.approx.stats["shadow_errors"] += 1
            logging.getLogger(__name__).error("quality-gate shadow check of %s failed: %s", job.request.request_id,
                                              describe_exc(sys.exc_info()[1], traceback=True))

    def _queue_shadow(self, seq: Sequence) -> None:
        """Queue the quality-gate check of a finished shadowed request (bounded: oldest dropped)."""
        if len(self._shadow_jobs) >= self.config.approx.max_shadow_jobs:
            self._shadow_jobs.popleft()
            self.approx.stats["shadow_dropped"] += 1
        self._shadow_jobs.append(ShadowJob(seq.request, seq.shadow, list(seq.output_ids), seq.shadow_argmax,
                                           seq.shadow_first_logits))
        seq.shadow, seq.shadow_argmax, seq.shadow_first_logits = None, [], None

    def register_template(self, domain: str, template_id: str, text: str) -> None:
        """Register a template for ``domain`` (requests may then name it without its text)."""
        if self.approx is None:
            raise InvalidRequest("approximate reuse is disabled on this engine")
        self.approx.register_template(domain, template_id, text)

    def set_tenant_policies(self, quotas: dict[str, TenantQuota], gates: dict | None = None) -> None:
        """Apply a changed tenants file without a restart: eviction quotas from now on (blocks
        already cached keep their owner; a lowered cap or minimum takes effect at the next
        eviction) and, for approximate reuse, the quality gates of keys created from now on."""
        import dataclasses

        for tenant, quota in quotas.items():
            self.pool.eviction.set_quota(tenant, quota)
        self.config = dataclasses.replace(self.config, tenant_quotas=dict(quotas))
        if gates is not None and self.approx is not None:
            self.approx.config = dataclasses.replace(self.approx.config, tenant_gates=dict(gates))

    # -- approximate donors across workers (actors.slot_registry) -----------------------------
    def export_donor(self, slot_id: str) -> DonorPayload | None:
        """A slot-pool donor as plain arrays for another worker; None if not held here."""
        return None if self.approx is None else self.approx.export_donor(slot_id, self.loaded.model_id)

    def import_donor(self, payload: DonorPayload, reader_domains: tuple[str, ...]) -> bool:
        """Store a pulled donor in the slot pool if ``reader_domains`` (the importing request's
        own domain and grants) may read its domain. Raises ValueError (nothing stored) on
        another model, an unreadable domain or malformed KV; False if it cannot fit."""
        if self.approx is None:
            raise ValueError("approximate reuse is disabled on this engine")
        c = self.cache
        return self.approx.import_donor(payload, self.loaded.model_id, (c.num_layers, c.num_kv_heads, c.head_dim),
                                        tuple(reader_domains))

    def needed_slot_class(self, request: Request) -> str | None:
        """The template slot class a pulled donor would give ``request`` (None: needs none)."""
        return None if self.approx is None else self.approx.needed_slot_class(request)

    def _append(self, seq: Sequence, token: int, lp: TokenLogprob | None = None) -> RequestOutput:
        now = time.perf_counter()
        if seq.first_token_at is None:
            seq.first_token_at = now
            if seq.index == 0:
                if self.trace.on:
                    self.trace.first(seq.request_id, seq.num_cached, seq.prefill_s)
                m = self.tenant_metrics.setdefault(seq.request.tenant, TenantMetrics())
                m.requests += 1
                m.prompt_tokens += seq.num_prompt
                m.cached_tokens += seq.num_cached
        seq.tokens.append(token)
        if lp is not None:
            seq.cumulative_logprob += lp.logprob
        p = seq.params
        reason = None
        if (token in self.eos_ids and not p.ignore_eos) or token in p.stop_token_ids:
            reason = "stop"
        else:
            seq.text += seq.detok.add(token)
        if p.stop and seq.num_output < p.min_tokens:
            seq.stop_from = len(seq.text)  # text before min_tokens never stops the choice
        elif reason is None and p.stop:
            reason = self._check_stop(seq)
        if reason is None and seq.matcher is not None and seq.matcher.is_terminated():
            reason = "stop"
        if reason is None and (seq.num_output >= p.max_tokens or len(seq.tokens) >= self.max_model_len):
            reason = "length"
        if reason is not None:
            return self._finish_choice(seq, reason, [token], lp)
        # hold back a tail that could still become a stop string
        hold = self._stop_prefix_len(seq)
        delta = seq.text[seq.emitted_chars : len(seq.text) - hold]
        seq.emitted_chars += len(delta)
        return self._output(seq, [token], delta, lp)

    def _finish_choice(self, seq: Sequence, reason: str, new_ids: list[int], lp: TokenLogprob | None) -> RequestOutput:
        seq.status, seq.finish_reason = SequenceStatus.FINISHED, reason
        self.scheduler.remove(seq)
        group = seq.group
        group.num_finished += 1
        if group.done:
            self.seqs.pop(seq.request_id, None)
        self.tenant_metrics.setdefault(seq.request.tenant, TenantMetrics()).output_tokens += seq.num_output
        delta = seq.text[seq.emitted_chars :]
        seq.emitted_chars += len(delta)
        if seq.shadow is not None:
            self._queue_shadow(seq)
        return self._output(seq, new_ids, delta, lp)

    @staticmethod
    def _check_stop(seq: Sequence) -> str | None:
        window = max(map(len, seq.params.stop)) + 16
        start = max(0, seq.emitted_chars - window)
        for s in seq.params.stop:
            idx = seq.text.find(s, max(start, seq.stop_from - len(s) + 1))
            if idx != -1:
                seq.text = seq.text[: idx + len(s) if seq.params.include_stop_str else idx]
                return "stop"
        return None

    @staticmethod
    def _stop_prefix_len(seq: Sequence) -> int:
        best = 0
        for s in seq.params.stop:
            for k in range(min(len(s) - 1, len(seq.text)), best, -1):
                if seq.text.endswith(s[:k]):
                    best = k
                    break
        return best

    def _output(self, seq: Sequence, new_ids: list[int], delta: str, lp: TokenLogprob | None = None,
                error: str | None = None) -> RequestOutput:
        ttft = seq.first_token_at - seq.arrival if seq.first_token_at else None
        plp = None
        if seq.prompt_lp is not None and not seq.prompt_lp_sent and new_ids:
            plp, seq.prompt_lp_sent = seq.prompt_lp, True
        lps = None
        if seq.params.logprobs is not None:
            lps = [lp] if (new_ids and lp is not None) else []
        return RequestOutput(seq.request_id, new_ids, delta, seq.group.done, seq.finish_reason,
                             seq.num_prompt, seq.num_cached, seq.num_output, ttft,
                             seq.prefill_s if seq.first_token_at else None, num_approx_tokens=seq.num_approx,
                             index=seq.index, choice_finished=seq.finished, logprobs=lps, prompt_logprobs=plp,
                             cumulative_logprob=seq.cumulative_logprob, error=error)

    # -- moving KV between engines (pulls) ---------------------------------------------------
    def _settle_holds(self, moved: bool) -> None:
        """After a schedule: admitted requests' holds go (their hits hold the blocks now), old
        ones expire, and when nothing could be scheduled while admissible requests wait, all go."""
        sched = self.scheduler
        for seq in sched.running:
            self.holds.release(seq.request_id, used=True)
        self.holds.expire()
        if not moved and not sched.running and sched.has_admissible():
            self.holds.release_all()

    def expect_pull(self, request_id: str, chains: dict[str, list[BlockHash]]) -> int:
        """A pull for ``request_id`` is about to extend the prompt blocks cached here: hold those
        blocks, and the request (queued now or later) waits for ``pull_landed`` before its
        admission (engine/import_holds.py). Blocks held (0 if expected already)."""
        if request_id in self.holds.awaiting or request_id in self.holds:
            return 0
        self.holds.expect(request_id)
        blocks = self.kv.held_blocks(chains)
        self.holds.add(request_id, blocks)
        return len(blocks)

    def pull_landed(self, request_id: str) -> bool:
        """``request_id``'s pull ended (whole, partly or failed): it may be admitted now."""
        return self.holds.landed(request_id)

    def release_hold(self, request_id: str) -> bool:
        """Drop what is held for a request that will not be added (aborted during its pull)."""
        return self.holds.release(request_id)

    def prompt_chains(self, request: Request) -> dict[str, list[BlockHash]]:
        """Chain hashes of the request's reusable prompt blocks under each domain it may read
        (own domain first). Empty when the request does not reuse KV."""
        if request.reuse == "none" or not self.config.enable_prefix_caching:
            return {}
        return prompt_chains(request.prompt_ids, self.config.block_size, self.loaded.model_id,
                             (request.domain, *request.read_domains))

    def held_prefix_tokens(self, chains: dict[str, list[BlockHash]]) -> int:
        """Leading prompt tokens this engine holds under any of ``chains``."""
        return len(self.kv.held_blocks(chains)) * self.config.block_size

    def can_import(self, chains: dict[str, list[BlockHash]], start: int, end: int, tenant: str) -> bool:
        """Whether blocks [start, end) of a prompt, minus the leading ones held here, fit in the
        pool for ``tenant`` at once, without evicting the held prefix they extend: a pull that
        cannot land whole would evict its own first chunks (and other cached prefixes) for
        nothing."""
        held = self.kv.held_blocks(chains)
        idle = sum(1 for b in held if b.ref_cnt == 0)  # counted as free, but they must stay
        return self.pool.can_allocate(max(0, end - max(start, len(held))) + idle, tenant)

    def export_prefix(self, chains: dict[str, list[BlockHash]], start: int, end: int) -> KVBlocks | None:
        """KV of prompt blocks [start, end) held here under any of ``chains`` (up to the first
        miss), or None. Only hashes the requester computed from its own tokens can match.

        Safe from any thread, without waiting for the step in progress (a pull's holder is
        usually busy: that is why the prompt goes elsewhere). Lock-free, like a seqlock: each
        block's generation is read before its hash is checked, the blocks are copied, and the
        export ends before the first block whose hash or generation changed meanwhile (it left
        the cache and may have been overwritten; ``BlockPool``'s invariants)."""
        seen: list[tuple[object, int, BlockHash]] = []
        for i in range(start, min(end, min((len(c) for c in chains.values()), default=0))):
            hit = None
            for c in chains.values():
                b = self.pool.get_cached_block(c[i])
                if b is not None:
                    g = b.generation
                    if b.block_hash == c[i]:
                        hit = (b, g, c[i])
                        break
            if hit is None:
                break
            seen.append(hit)
        if not seen:
            return None
        bs = self.config.block_size
        data = self.cache.export_blocks([b.block_id for b, _, _ in seen], [(start + i) * bs for i in range(len(seen))],
                                        self.loaded.model_id, [h for _, _, h in seen])
        intact = next((i for i, (b, g, h) in enumerate(seen) if b.generation != g or b.block_hash != h), len(seen))
        if intact == len(seen):
            return data
        self.export_races += 1
        return data.head(intact) if intact else None

    def import_prefix(self, data: KVBlocks, start: int, chains: dict[str, list[BlockHash]], tenant: str,
                      hold_for: str | None = None) -> int:
        """Verify pulled blocks against ``chains`` and register them in the prefix cache (charged to
        ``tenant``): evictable, or held for request ``hold_for`` until it is admitted. Returns
        tokens imported; raises ValueError on a mismatch."""
        bs = self.config.block_size
        if data.model_id != self.loaded.model_id:
            raise ValueError(f"pulled KV is for model {data.model_id!r}, not {self.loaded.model_id!r}")
        if data.positions != tuple((start + i) * bs for i in range(data.num_blocks)):
            raise ValueError("pulled KV blocks are not at the requested positions")
        placed: list[tuple[int, BlockHash, BlockHash | None, str]] = []
        for i, h in enumerate(data.hashes):
            pos = start + i
            domain = next((d for d, c in chains.items() if pos < len(c) and c[pos] == h), None)
            if domain is None or len(data.hashes) != data.num_blocks:
                raise ValueError(f"pulled block {pos} does not match the prompt's hash chain")
            if self.pool.get_cached_block(h) is None:
                placed.append((i, h, chains[domain][pos - 1] if pos else None, domain))
        if not placed or not self.pool.can_allocate(len(placed), tenant):
            return 0
        blocks = self.pool.allocate(len(placed), tenant)
        idx = [i for i, *_ in placed]
        if len(idx) < data.num_blocks:  # some blocks are cached here already: import the rest
            data = KVBlocks(data.k[:, idx], data.v[:, idx], tuple(data.positions[i] for i in idx),
                            data.model_id, tuple(data.hashes[i] for i in idx), data.dtype)
        self.cache.import_blocks([b.block_id for b in blocks], data)
        for block, (_, h, parent, domain) in zip(blocks, placed):
            self.pool.cache_full_block(block, h, parent, tenant, domain)
        if hold_for is not None and (hold_for in self.holds.awaiting or hold_for in self.holds):
            self.holds.add(hold_for, blocks, referenced=True)
        else:  # evictable (a copy, or its request ended meanwhile)
            self.pool.free(blocks)
        return len(placed) * bs

    # -- conveniences ----------------------------------------------------------------------
    def calibrate(self, lengths: tuple[int, ...] | None = None) -> list[tuple[int, float]]:
        """``(prompt tokens, prefill seconds)`` of synthetic prompts of ``lengths`` tokens (None:
        ``CALIBRATION_LENGTHS``), each run
        alone, after an untimed one of the smallest length that warms the model up (a first forward
        pays one-time costs). For the router's prefill fit before any request: a prior fitted to
        another machine prices a new worker's first requests several times too fast or too slow
        (the cluster bench, session 23: 0.6 s expected for cold prompts that took 2 s on 0.4-core
        hosts). Call while the engine is idle (before it serves). Leaves no trace: the prompts are
        not cached (``reuse`` "none"), their tenant's metrics and the steps are not counted, the step
        trace is paused. A length the pool or context cannot hold is skipped."""
        lengths = CALIBRATION_LENGTHS if lengths is None else tuple(lengths)
        if not lengths:
            return []
        vocab = int(self.loaded.model.config.vocab_size)
        steps, had_metrics = self.num_steps, CALIBRATION_TENANT in self.tenant_metrics
        out: list[tuple[int, float]] = []
        with self.trace.paused():
            for i, n in enumerate((min(lengths), *lengths)):
                n = min(n, self.max_model_len - 2)
                ids = tuple(3 + (k * 7919 + i * 104729) % max(1, vocab - 3) for k in range(n))
                params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
                req = Request(f"kvmesh-calibration-{i}", ids, params, tenant=CALIBRATION_TENANT, reuse="none")
                try:
                    outs = self.generate([req])[req.request_id]
                except InvalidRequest:
                    continue
                first = next((o for o in outs if o.prefill_s is not None), None)
                if i > 0 and first is not None:
                    out.append((n, float(first.prefill_s)))
        self.num_steps = steps
        if not had_metrics:
            self.tenant_metrics.pop(CALIBRATION_TENANT, None)
        return out

    def generate(self, requests: list[Request]) -> dict[str, list[RequestOutput]]:
        """Run requests to completion together (continuous batching); outputs per request."""
        for r in requests:
            self.add_request(r)
        results: dict[str, list[RequestOutput]] = {r.request_id: [] for r in requests}
        while self.has_unfinished():
            for out in self.step():
                results[out.request_id].append(out)
        return results

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def reads(self) -> dict[str, dict[str, dict[str, int]]]:
        """Per reader tenant: ``{"exact"|"approx": {label: prompt tokens reused}}`` with labels
        of ``policies.tenancy.read_label`` ("own", "salt", "tenant:<owner>")."""
        out: dict[str, dict[str, dict[str, int]]] = {}
        for kind, table in (("exact", self.kv.reads), ("approx", self.approx_reads)):
            for (tenant, label), n in table.items():
                out.setdefault(tenant, {"exact": {}, "approx": {}})[kind][label] = n
        return out

    def cross_tenant_reads(self) -> dict[str, int]:
        """``"reader<-owner"``: prompt tokens a tenant reused from another tenant's domain (only
        possible through a grant), and ``"reader<-salt"`` from another domain of its own tenant
        (never possible). The isolation audit: without grants this stays empty."""
        out: dict[str, int] = {}
        for table in (self.kv.reads, self.approx_reads):
            for (tenant, label), n in table.items():
                if label != "own":
                    key = f"{tenant}<-{label.removeprefix('tenant:')}"
                    out[key] = out.get(key, 0) + n
        return out

    def stats(self) -> dict:
        reads = self.reads()
        return {
            "free_blocks": self.pool.num_free_blocks(),
            "num_blocks": self.pool.num_blocks,
            "running": len(self.scheduler.running),
            "waiting": len(self.scheduler.waiting),
            "preemptions": self.scheduler.num_preemptions,
            "room_preemptions": self.scheduler.num_room_preemptions,  # of them, for a tenant short of its share
            "prefill_joins": self.scheduler.num_joined,
            "steps": self.num_steps, "interrupted_steps": self.num_interrupted_steps,
            "failed_requests": self.num_failed, "optional_failures": dict(self.optional_failures),
            "import_holds": {**self.holds.stats, "active": len(self.holds), "blocks": self.holds.num_blocks()},
            "tenants": {
                t: {**vars(m), "blocks_held": self.pool.eviction.held.get(t, 0),
                    "evictions": self.pool.stats.get(t).evictions if t in self.pool.stats else 0,
                    "reads": reads.get(t, {"exact": {}, "approx": {}})}
                for t, m in self.tenant_metrics.items()
            },
            "cross_tenant_reads": self.cross_tenant_reads(),
            **({"approx": {**self.approx.stats, "donors": len(self.approx.pool),
                           "donor_bytes": self.approx.pool.nbytes, "shadow_pending": len(self._shadow_jobs),
                           "gate": self.approx.gate.snapshot()}} if self.approx is not None else {}),
        }



SEED_RANGE = 2 ** 64  # torch.Generator.manual_seed takes [0, 2**64): a seed is taken modulo this
SEED_MIN = -(2 ** 63)  # negative seeds (any int64, as OpenAI and vLLM accept) seed (seed mod 2**64)


def check_sampling_limits(params) -> None:
    """Raise InvalidRequest for sampling values the engine cannot run (a seed outside int64 and
    [0, 2**64))."""
    seed = params.seed
    n = max(1, int(getattr(params, "n", 1) or 1))  # choice i of n seeds its generator with seed + i
    if seed is not None and not (isinstance(seed, int) and SEED_MIN <= seed and seed + n - 1 < SEED_RANGE):
        raise InvalidRequest(f"seed must be an integer in [-2**63, 2**64 - n), got {str(seed)[:40]}", param="seed")


def check_approx_fields(request: Request) -> None:
    """Raise InvalidRequest for malformed approximate-reuse fields (ignored unless approximate)."""
    from policies.remap import REMAP_POLICIES

    if request.remap_policy is not None and request.remap_policy not in REMAP_POLICIES:
        raise InvalidRequest(f"remap_policy must be one of {sorted(REMAP_POLICIES)}, got {request.remap_policy!r}")
    r = request.recompute_ratio
    if r is not None and (isinstance(r, bool) or not isinstance(r, (int, float)) or not 0.0 <= r <= 1.0):
        raise InvalidRequest(f"recompute_ratio must be in [0, 1], got {r!r}")
    if request.template is not None and not isinstance(request.template, str):
        raise InvalidRequest("template must be a string id")
    texts = [request.template, request.template_text, request.share_domain, request.tenant]
    if isinstance(request.template_params, dict):
        texts += [x for kv in request.template_params.items() for x in kv]
    if not all(_utf8(t) for t in texts if isinstance(t, str)):
        raise InvalidRequest("template ids, texts, parameters and domains must be valid Unicode text "
                             "(no lone surrogates)")
    p = request.template_params
    if p is not None and (not isinstance(p, dict) or not all(isinstance(k, str) and isinstance(x, str) for k, x in p.items())):
        raise InvalidRequest("template params must map names to strings")


def _utf8(s: str) -> bool:
    try:
        s.encode("utf-8")
        return True
    except UnicodeEncodeError:
        return False
