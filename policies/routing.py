"""Network-aware routing: expected time to first token (TTFT) for each way of serving a prompt.

Pure policy (no torch, no Ray). For a prompt of ``P`` tokens and a candidate target worker ``w``:

    local/recompute  TTFT = wait(w) + prefill_w(P - m_w, cached=m_w)
    pulled           TTFT = wait(w) + pull(m_w -> L) + prefill_w(P - L, cached=L)

where ``m_w`` is the prefix ``w`` already holds, ``L`` a deeper prefix held by other workers, and
``pull`` the makespan of fetching blocks ``[m_w, L)`` from the holders in parallel
(per source: RTT + bytes / bandwidth(src node -> dst node)). The minimum over all candidates wins.

Estimates are learned online:
  * ``PrefillModel``: per worker, time = a + b*n + c*n*(n + 2*cached) (linear and quadratic terms in
    tokens; the quadratic feature is the attention work, ``n**2`` without a cached prefix), a
    non-negative least-squares fit over a bounded window, ridge-pulled toward a prior so that it is
    sane before (and shortly after) the first measurements. A worker's own fit is pulled toward
    the pooled fit of all workers (partial pooling), not toward the fixed prior: a new worker
    with a few small prompts measured predicts large ones like its peers, not like the prior.
  * ``LinkModel``: per (src node, dst node), EWMA of log seconds-per-byte (a geometric mean of
    rates: a link that gets 40x faster is believed as quickly as one that gets 40x slower; a
    plain mean of seconds-per-byte lets one slow sample dominate for many transfers) with a
    weight that grows from ``alpha`` for samples within ``noise_factor`` of the estimate to
    ``jump_alpha`` for samples off by ``jump_factor`` or more (a re-shaped link, not noise),
    from real transfers, and EWMA of RTT from small transfers / probes.
  * queue wait: from each worker's published ``WorkerLoad``: its prompts' predicted prefills,
    plus, per sequence decoding there, a wait learned from measured TTFTs (``DecodeModel``); and,
    where it publishes its KV memory, not less than when the request would find room in it
    (``kv_admission_s``): an engine whose pool is full admits nothing until running requests end.

Invariants: predictions are finite and >= 0; prefill predictions never decrease with more new
tokens; a decision never pulls a block that no live holder has, and never more than the prompt
minus its last token (the last token is always computed to produce logits).
"""

from __future__ import annotations

import heapq
import itertools
import math
import random
import statistics
import time
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Container, Iterable, Literal, Mapping, NamedTuple, Sequence

WorkerId = str
NodeId = str
RouteKind = Literal["local", "pulled", "recomputed"]

_SCALE = 1024.0  # tokens; features are expressed in units of 1024 tokens for conditioning
COPY_OUT_NODES = 16  # destinations ``CostModel.copy_out_s`` takes the median over


# ----------------------------------------------------------------------------------------------
# Prefill time
# ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class PrefillPrior:
    """Prior coefficients (seconds): fixed cost, per 1024 new tokens, per 1024**2 attention units."""

    a: float = 0.02
    b: float = 0.5
    c: float = 0.05
    weight: float = 0.5  # ridge strength, in pseudo-samples at 1024 tokens


def _features(new_tokens: int, cached_tokens: int) -> tuple[float, float, float]:
    n = new_tokens / _SCALE
    p = cached_tokens / _SCALE
    return (1.0, n, n * (n + 2.0 * p))


def _solve(m: list[list[float]], v: list[float]) -> list[float] | None:
    """Gaussian elimination with partial pivoting for a small dense system; None if singular."""
    k = len(v)
    a = [row[:] + [v[i]] for i, row in enumerate(m)]
    for col in range(k):
        piv = max(range(col, k), key=lambda r: abs(a[r][col]))
        if abs(a[piv][col]) < 1e-15:
            return None
        a[col], a[piv] = a[piv], a[col]
        for r in range(k):
            if r != col:
                f = a[r][col] / a[col][col]
                for c in range(col, k + 1):
                    a[r][c] -= f * a[col][c]
    return [a[i][k] / a[i][i] for i in range(k)]


class PrefillModel:
    """Online fit of prefill seconds over (new tokens, cached tokens) for one worker.

    Minimises  sum_i (y_i - theta . phi_i)^2 + w * |theta - prior|^2  subject to theta >= 0 over the
    last ``window`` samples (exact non-negative solution by enumerating the 8 active sets), so the
    curve is monotone in new tokens and starts at the prior.
    """

    def __init__(self, prior: PrefillPrior | None = None, window: int = 128):
        self.prior = prior or PrefillPrior()
        self._samples: deque[tuple[tuple[float, float, float], float]] = deque(maxlen=window)
        self._theta: tuple[float, float, float] | None = None

    @property
    def num_samples(self) -> int:
        return len(self._samples)

    def center_on(self, coefficients: tuple[float, float, float]) -> None:
        """Pull the fit toward ``coefficients`` (e.g. the pooled fit) instead of the prior's."""
        a, b, c = coefficients
        if (a, b, c) != (self.prior.a, self.prior.b, self.prior.c):
            self.prior = PrefillPrior(a, b, c, self.prior.weight)
            self._theta = None

    def observe(self, new_tokens: int, seconds: float, cached_tokens: int = 0) -> None:
        if new_tokens <= 0 or not math.isfinite(seconds) or seconds < 0:
            return
        self._samples.append((_features(new_tokens, cached_tokens), float(seconds)))
        self._theta = None

    @property
    def coefficients(self) -> tuple[float, float, float]:
        if self._theta is None:
            self._theta = self._fit()
        return self._theta

    def predict(self, new_tokens: int, cached_tokens: int = 0) -> float:
        if new_tokens <= 0:
            return 0.0
        a, b, c = self.coefficients
        f = _features(new_tokens, cached_tokens)
        return a * f[0] + b * f[1] + c * f[2]

    def _fit(self) -> tuple[float, float, float]:
        prior = (self.prior.a, self.prior.b, self.prior.c)
        if not self._samples:
            return prior
        w = self.prior.weight
        xtx = [[0.0] * 3 for _ in range(3)]
        xty = [0.0] * 3
        yty = 0.0
        for f, y in self._samples:
            for i in range(3):
                xty[i] += f[i] * y
                for j in range(3):
                    xtx[i][j] += f[i] * f[j]
            yty += y * y

        def objective(t: Sequence[float]) -> float:
            quad = sum(t[i] * xtx[i][j] * t[j] for i in range(3) for j in range(3))
            data = yty - 2 * sum(t[i] * xty[i] for i in range(3)) + quad
            return data + w * sum((t[i] - prior[i]) ** 2 for i in range(3))

        best, best_obj = (0.0, 0.0, 0.0), objective((0.0, 0.0, 0.0))
        for r in range(1, 4):
            for free in itertools.combinations(range(3), r):
                m = [[xtx[i][j] + (w if i == j else 0.0) for j in free] for i in free]
                v = [xty[i] + w * prior[i] for i in free]
                sol = _solve(m, v)
                if sol is None or min(sol) < 0:
                    continue
                t = [0.0, 0.0, 0.0]
                for i, s in zip(free, sol):
                    t[i] = s
                obj = objective(t)
                if obj < best_obj:
                    best, best_obj = (t[0], t[1], t[2]), obj
        return best


# the ridge weight of a fit of seconds per output token over the sequences decoding beside a request
# (``cluster.routing.CostAwareRouter.rows``): in squared sequences, 4 is one sequence's difference
# over four requests
ROW_FIT_WEIGHT = 4.0


class DecodeModel:
    """Seconds each sequence decoding on a worker adds to a new request's wait, learned from
    outcomes. A sample is (sequences decoding there when the request was routed, its measured
    TTFT minus the prediction without this term). The estimate is the slope of a least-squares
    line through the last ``window`` samples, with an intercept: an error that does not grow with
    the decoding sequences (a slow ingress, a mispredicted prompt queue) goes into the
    intercept, which is not used, instead of being charged per sequence. The slope is ridge-pulled
    toward a prior by ``weight`` (in units of squared sequence counts), never below 0; residuals
    are capped at ``cap_s`` so that one stalled request cannot swing it.

    Why it exists: a decode row makes every step on that worker longer, and a CPU step is not
    preemptible, so a busy holder answers later than its queue of prompts alone says; without
    this term a hot prefix piles onto its holders while other workers idle.

    The same slope fit serves the placement's decode contention (``cluster.routing.CostAwareRouter.rows``,
    ``ROW_FIT_WEIGHT``): samples of (mean sequences decoding beside an ended request, its seconds per
    output token)."""

    def __init__(self, prior_s: float = 0.0, weight: float = 16.0, window: int = 256, cap_s: float = 30.0):
        self.prior_s, self.weight, self.cap_s = max(0.0, prior_s), weight, cap_s
        self._samples: deque[tuple[float, float]] = deque(maxlen=window)
        self._value: float | None = None

    @property
    def num_samples(self) -> int:
        return len(self._samples)

    def center_on(self, prior_s: float) -> None:
        if max(0.0, prior_s) != self.prior_s:
            self.prior_s, self._value = max(0.0, prior_s), None

    def observe(self, running: float, residual_s: float) -> None:
        """A sample: sequences decoding (a count, or a mean over time) and the seconds to explain."""
        if running < 0 or not math.isfinite(residual_s):
            return
        self._samples.append((running, max(-self.cap_s, min(self.cap_s, residual_s))))
        self._value = None

    @property
    def seconds(self) -> float:
        if self._value is None:
            n = len(self._samples)
            sxx = sxy = 0.0
            if n:
                mx = sum(x for x, _ in self._samples) / n
                my = sum(y for _, y in self._samples) / n
                for x, y in self._samples:
                    sxx += (x - mx) ** 2
                    sxy += (x - mx) * (y - my)
            self._value = max(0.0, (sxy + self.weight * self.prior_s) / (sxx + self.weight))
        return self._value


# ----------------------------------------------------------------------------------------------
# Links
# ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class LinkPrior:
    """Estimates before any measurement. Same-node pulls go through shared memory."""

    bandwidth_Bps: float = 125e6  # 1 Gbit/s between nodes
    rtt_s: float = 1e-3
    local_bandwidth_Bps: float = 4e9
    local_rtt_s: float = 2e-4
    alpha: float = 0.3  # EWMA weight of a new sample
    noise_factor: float = 1.5  # bandwidth samples within this factor of the estimate weigh alpha;
    jump_factor: float = 4.0  # samples this many times off (or more) weigh jump_alpha: the link
    jump_alpha: float = 0.7  # changed (the weight grows linearly in log deviation in between)
    probe_max_bytes: int = 64 * 1024  # transfers up to this size only update the RTT


@dataclass(frozen=True)
class LinkEstimate:
    bandwidth_Bps: float
    rtt_s: float
    samples: int  # bandwidth samples behind the estimate (0 = prior)

    def transfer_s(self, nbytes: int) -> float:
        return self.rtt_s + nbytes / self.bandwidth_Bps


class LinkModel:
    """EWMA bandwidth and RTT per directed node pair.

    A transfer of ``nbytes`` taking ``seconds`` gives a bandwidth sample
    ``nbytes / (seconds - rtt)`` (the RTT part is bounded to half the transfer so a bad RTT estimate
    cannot produce absurd rates). An unmeasured direction borrows the reverse direction's estimate.
    """

    def __init__(self, prior: LinkPrior | None = None):
        self.prior = prior or LinkPrior()
        self._spb: dict[tuple[NodeId, NodeId], tuple[float, int]] = {}  # log seconds per byte, count
        self._rtt: dict[tuple[NodeId, NodeId], tuple[float, int]] = {}

    def _ewma(self, table: dict, key, sample: float) -> None:
        old = table.get(key)
        a = self.prior.alpha
        table[key] = (sample, 1) if old is None else ((1 - a) * old[0] + a * sample, old[1] + 1)

    def observe_rtt(self, src: NodeId, dst: NodeId, rtt_s: float) -> None:
        if math.isfinite(rtt_s) and rtt_s >= 0:
            self._ewma(self._rtt, (src, dst), rtt_s)

    def observe_transfer(self, src: NodeId, dst: NodeId, nbytes: int, seconds: float) -> None:
        if nbytes <= 0 or not math.isfinite(seconds) or seconds <= 0:
            return
        if nbytes <= self.prior.probe_max_bytes:
            self.observe_rtt(src, dst, seconds)
            return
        rtt = self.estimate(src, dst).rtt_s
        log_spb = math.log(max(seconds - rtt, seconds / 2) / nbytes)
        old = self._spb.get((src, dst))
        p = self.prior
        a = p.alpha
        if old is not None:
            lo, hi = math.log(p.noise_factor), math.log(p.jump_factor)
            t = min(1.0, max(0.0, (abs(log_spb - old[0]) - lo) / (hi - lo)))
            a = p.alpha + t * (p.jump_alpha - p.alpha)
        self._spb[(src, dst)] = (log_spb, 1) if old is None else ((1 - a) * old[0] + a * log_spb, old[1] + 1)

    def estimate(self, src: NodeId, dst: NodeId) -> LinkEstimate:
        same = src == dst
        spb = self._spb.get((src, dst)) or self._spb.get((dst, src))
        rtt = self._rtt.get((src, dst)) or self._rtt.get((dst, src))
        p = self.prior
        bw = math.exp(-spb[0]) if spb else (p.local_bandwidth_Bps if same else p.bandwidth_Bps)
        return LinkEstimate(bw, rtt[0] if rtt else (p.local_rtt_s if same else p.rtt_s), spb[1] if spb else 0)

    def snapshot(self) -> dict[str, dict[str, float]]:
        keys = set(self._spb) | set(self._rtt)
        return {f"{s}->{d}": {"bandwidth_Bps": (e := self.estimate(s, d)).bandwidth_Bps, "rtt_s": e.rtt_s,
                              "samples": e.samples} for s, d in sorted(keys)}


# ----------------------------------------------------------------------------------------------
# Load, decisions
# ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class WorkerLoad:
    """What a worker publishes: prompts waiting for prefill (their uncached token counts), how many
    sequences are decoding, and any extra wait it knows of (e.g. a drain, or an artificial load)."""

    waiting_tokens: tuple[int, ...] = ()
    running: int = 0
    extra_wait_s: float = 0.0
    # KV memory, in tokens (``kv_use``): the engine's pool (0: unknown, no memory term); per
    # running request (tokens it holds, seconds until it ends); per waiting one, in routing order
    # (tokens it will hold when admitted, prompt tokens it computes, seconds it decodes after)
    kv_tokens: int = 0
    kv_running: tuple[tuple[int, float], ...] = ()
    kv_waiting: tuple[tuple[int, int, float], ...] = ()


class KvFlight(NamedTuple):
    """A request in flight on a worker, as the memory signal sees it (``kv_use``). A named tuple:
    the controller builds one per request in flight per worker whose signal it retakes."""

    prompt_tokens: int
    cached_tokens: int  # prompt tokens expected reused there (local + pulled): not computed
    blocks: tuple = ()  # its prompt's full blocks' chain hashes (requests sharing a block share its KV)
    output_tokens: int = 0  # output it is expected to produce (max_tokens, capped by what requests there produce)
    running_s: float | None = None  # seconds since its first token; None: waiting for it


def kv_counted(flights: Sequence[KvFlight]) -> tuple[tuple[int, ...], tuple[int, ...], set]:
    """The part of ``kv_use`` that changes only with the requests in flight (which there are,
    their blocks, which have started), not with time: ``(order, shared, held)``, the order they
    are counted in (indices into ``flights``: running ones first, routing order within each),
    each one's leading blocks (in that order) an earlier one holds, and every block hash held. A
    prompt block several requests share is counted once (the same hash is the same KV), for the
    first that holds it. The controller keeps it while its requests there stay the same and
    retakes only ``kv_use``'s times (held_prefix and the set were most of the signal's cost)."""
    order = tuple(sorted(range(len(flights)), key=lambda i: flights[i].running_s is None))  # stable
    shared, held = [], set()
    for i in order:
        blocks = flights[i].blocks
        n = held_prefix(blocks, held)
        held.update(itertools.islice(blocks, n, None))  # its first ``n`` are in already
        shared.append(n)
    return order, tuple(shared), held


def kv_use(flights: Sequence[KvFlight], tpot_s: float, block_size: int,
           counted: tuple[tuple[int, ...], tuple[int, ...], set] | None = None,
           elapsed_s: float = 0.0) -> tuple[tuple, tuple, set]:
    """``(kv_running, kv_waiting, held)`` of ``WorkerLoad`` from the requests in flight on a
    worker (waiting ones in routing order) and ``tpot_s`` there (seconds per output token). A
    prompt block several requests share is counted once, for the first request that holds it:
    running ones first, then waiting ones in order (``kv_counted``; ``counted`` is its answer
    for these flights, taken earlier). A running request holds its prompt and the output
    produced so far (``running_s / tpot_s``) and ends after the rest of its expected output (one
    past that end: a quarter of it more); a waiting one will hold its prompt and one token. Sizes
    are whole blocks, in tokens (a 40-token suffix and 16 output tokens take 4 blocks: 64
    tokens). ``held``: every block hash counted (a new request needs no room for these; the set
    of ``counted`` itself, not a copy: read it, do not change it). ``elapsed_s``: seconds since
    the flights' ``running_s`` were read (the running ones have run that much longer), so that a
    signal is retaken from the same flights as time passes."""
    running, waiting = [], []
    tpot = max(tpot_s, 1e-6)
    order, shares, held = counted if counted is not None else kv_counted(flights)
    for i, shared in zip(order, shares):
        f = flights[i]
        if f.running_s is None:
            own = kv_blocks(f.prompt_tokens + 1, block_size) - shared
            waiting.append((own * block_size, max(0, f.prompt_tokens - f.cached_tokens),
                            round(f.output_tokens * tpot, 2)))
        else:
            running_s = f.running_s + elapsed_s
            produced = min(f.output_tokens, int(max(0.0, running_s) / tpot) + 1)
            own = kv_blocks(f.prompt_tokens + produced, block_size) - shared
            # still running past its expected end: its steps were longer than the worker's recent
            # average (prefills of requests admitted meanwhile share them); it holds its blocks for
            # a quarter of its expected life more (at least a step), not "ends now"
            left = max(f.output_tokens * tpot - running_s, tpot * max(1, f.output_tokens // 4))
            running.append((own * block_size, round(left, 2)))
    return tuple(running), tuple(waiting), held


def held_prefix(blocks: Sequence, held: Container) -> int:
    """How many leading blocks of a prompt's chain hashes ``blocks`` are in ``held``. A chain hash
    is held only together with every block before it (the same hash is the same prefix, and
    ``held`` is made of whole prompts' chains), so this is a binary search: O(log n) lookups
    instead of one per block (``kv_use`` runs per candidate worker per routed request, over every
    request in flight there: at 256 in flight x 100 blocks on 8 workers the per-block count cost
    ~14 ms a route)."""
    lo, hi = 0, len(blocks)
    while lo < hi:
        mid = (lo + hi) // 2
        if blocks[mid] in held:
            lo = mid + 1
        else:
            hi = mid
    return lo


def kv_blocks(tokens: int, block_size: int) -> int:
    """Blocks ``tokens`` tokens of KV take (the pool allocates whole blocks)."""
    return -(-max(0, tokens) // block_size)


def kv_admission_s(capacity: int, running: Sequence[tuple[int, float]], waiting: Sequence[tuple[int, float]],
                   need: int) -> float:
    """Seconds until a new request needing ``need`` tokens of KV is admitted to an engine whose
    pool holds ``capacity`` tokens: ``running`` requests hold (tokens, seconds until they end);
    ``waiting`` ones, first come first served, need (tokens, seconds they run once admitted).
    Each is admitted as soon as what it needs is free, and the new one last. A request larger
    than the pool is admitted alone (the engine refuses what could never fit). 0 with no pool."""
    if capacity <= 0:
        return 0.0
    ends = [(max(0.0, t), n) for n, t in running]
    heapq.heapify(ends)
    used = sum(n for n, _ in running)
    t = 0.0
    for n, life in (*waiting, (need, 0.0)):
        n = min(n, capacity)
        while used + n > capacity and ends:
            end, k = heapq.heappop(ends)
            t, used = max(t, end), used - k
        used += n
        heapq.heappush(ends, (t + max(0.0, life), n))
    return t


@dataclass(frozen=True)
class PullRange:
    """Blocks ``[start_block, end_block)`` of the prompt, fetched from ``holder`` on ``node``."""

    holder: WorkerId
    node: NodeId
    start_block: int
    end_block: int
    nbytes: int
    expected_s: float


@dataclass(frozen=True)
class Candidate:
    """One way to serve the prompt on ``worker``; ``cached_tokens`` = reused prefix (local + pulled).
    A pull's ``expected_ttft_s`` is ``max(wait_s, pull_s) + prefill_s`` (the request waits in the
    queue while its KV arrives; ``CostConfig.pull_overlaps_wait``), else ``wait_s + pull_s +
    prefill_s``; ``exposed_pull_s`` is the part of the TTFT the transfer adds."""

    worker: WorkerId
    kind: RouteKind
    expected_ttft_s: float
    wait_s: float
    prefill_s: float
    pull_s: float
    local_tokens: int
    pulled_tokens: int
    pulls: tuple[PullRange, ...] = ()
    decode_wait_s: float = 0.0  # the part of ``wait_s`` charged for sequences decoding on ``worker``
    # when the request would find room in the worker's KV pool (``kv_admission_s``; 0: room now or
    # unknown); ``wait_s`` is at least this
    kv_wait_s: float = 0.0
    # in a ranking (best per worker): the expected TTFT of this worker's best pull, where a pull
    # was possible but ranked below this option (why a holder in the index was not pulled from)
    pull_option_ttft_s: float | None = None
    # the median time to send the prompt's usable blocks from this worker's node to the other
    # workers' nodes: what a later copy of a prefix placed here takes (0: no other node)
    copy_out_s: float = 0.0
    # this worker's prefill of the whole prompt with nothing cached, and of the prompt after its own
    # prefix (a pull's prefill if its pulls fail); 0: unknown. A prefill has a fixed cost, so
    # ``prefill_s`` scaled by tokens is neither: a 40-token question's 0.5 s x 552 / 40 read 7 s
    # for a 552-token prompt that takes 3.3 s
    full_prefill_s: float = 0.0
    own_prefill_s: float = 0.0

    @property
    def exposed_pull_s(self) -> float:
        return max(0.0, self.expected_ttft_s - self.wait_s - self.prefill_s) if self.kind == "pulled" else 0.0

    @property
    def cached_tokens(self) -> int:
        return self.local_tokens + self.pulled_tokens

    @property
    def memory_bound(self) -> bool:
        """The wait is the KV pool's (room for the request), not the queue's compute."""
        return self.kv_wait_s > 0 and self.kv_wait_s >= self.wait_s


@dataclass(frozen=True)
class RouteDecision:
    """The chosen candidate plus the runners-up (best per worker, ascending TTFT)."""

    chosen: Candidate
    ranking: tuple[Candidate, ...]
    fallback: bool = False  # True when made without estimates (power of two choices)

    @property
    def worker(self) -> WorkerId:
        return self.chosen.worker

    @property
    def kind(self) -> RouteKind:
        return self.chosen.kind


@dataclass(frozen=True)
class CostConfig:
    block_size: int = 16
    bytes_per_token: int = 2 * 30 * 3 * 64 * 4  # K+V, layers, kv heads, head dim, float32
    decode_step_s: float = 0.0  # extra wait per decoding sequence on the target (the prior when learned)
    # learn that wait per worker from measured TTFTs (``DecodeModel``). Off by default: on the
    # cluster bench it lifted a hot prefix ~6% but cost the shared-prefix workload hits and ~10%
    # throughput (cluster/README.md, "Session 8")
    learn_decode: bool = False
    prefill_prior: PrefillPrior = field(default_factory=PrefillPrior)
    link_prior: LinkPrior = field(default_factory=LinkPrior)
    min_samples_own_fit: int = 1  # below this a worker uses the pooled fit of all workers
    window: int = 128
    # a pulled request is queued while its KV arrives (actors/worker.py, engine/import_holds.py):
    # its TTFT is max(wait, transfer) + prefill; False: wait + transfer + prefill (before session 21)
    pull_overlaps_wait: bool = True


# A worker's KV signal gives each running request's seconds until it ends as of when it was taken
# (``kv_use``); the cost model counts them from when it got the signal, once that is this long ago
# (the controller sends a worker's signal again only when its requests change, or every
# ``cluster.routing.LOAD_REFRESH_S``). Younger signals are read as they are: the time between a
# signal and the ranking it rides on is not worth a difference between otherwise equal workers.
LOAD_AGE_MIN_S = 0.05


class CostModel:
    """Shared estimates plus the TTFT arithmetic. One instance lives in the router actor."""

    def __init__(self, config: CostConfig | None = None, clock=time.monotonic):
        self.config = config or CostConfig()
        self.clock = clock
        self._load_at: dict[WorkerId, float] = {}  # when each worker's load came
        self.links = LinkModel(self.config.link_prior)
        self._prefill: dict[WorkerId, PrefillModel] = {}
        self._pooled = PrefillModel(self.config.prefill_prior, window=self.config.window)
        self.nodes: dict[WorkerId, NodeId] = {}
        self.loads: dict[WorkerId, WorkerLoad] = {}
        self._decode: dict[WorkerId, DecodeModel] = {}
        self._decode_pooled = DecodeModel(self.config.decode_step_s)

    # -- learning ---------------------------------------------------------------------------
    def register(self, worker: WorkerId, node: NodeId) -> None:
        self.nodes[worker] = node
        self.loads.setdefault(worker, WorkerLoad())

    def remove(self, worker: WorkerId) -> None:
        for table in (self.nodes, self.loads, self._prefill, self._decode, self._load_at):
            table.pop(worker, None)

    def observe_prefill(self, worker: WorkerId, new_tokens: int, seconds: float, cached_tokens: int = 0) -> None:
        model = self._prefill.get(worker)
        if model is None:
            model = self._prefill[worker] = PrefillModel(self.config.prefill_prior, self.config.window)
        model.observe(new_tokens, seconds, cached_tokens)
        self._pooled.observe(new_tokens, seconds, cached_tokens)

    def observe_load(self, worker: WorkerId, load: WorkerLoad) -> None:
        self.loads[worker] = load
        self._load_at[worker] = self.clock()

    def observe_outcome(self, worker: WorkerId, running: int, predicted_s: float, actual_s: float,
                        decode_wait_s: float = 0.0) -> None:
        """A request routed to ``worker`` while ``running`` sequences decoded there, predicted
        to start after ``predicted_s`` (of which ``decode_wait_s`` for those sequences: the
        chosen ``Candidate``'s), got its first token after ``actual_s``: a sample of the decode
        term (``DecodeModel``), measured against the prediction without it, so that the
        estimate does not feed on itself (requests with nothing decoding are samples too: they
        anchor the intercept). Only for routes without a pull: a pull's error is the link's,
        not the worker's."""
        if not self.config.learn_decode or running < 0 or worker not in self.nodes:
            return
        if not all(math.isfinite(x) for x in (predicted_s, actual_s, decode_wait_s)) or actual_s < 0:
            return
        residual = actual_s - (predicted_s - decode_wait_s)
        model = self._decode.get(worker)
        if model is None:
            model = self._decode[worker] = DecodeModel(self.config.decode_step_s, window=self.config.window)
        model.observe(running, residual)
        self._decode_pooled.observe(running, residual)

    def decode_s(self, worker: WorkerId) -> float:
        """Wait per decoding sequence on ``worker``: its own estimate shrunk toward the pooled
        one (which is shrunk toward ``decode_step_s``); the pooled one until it has samples."""
        if not self.config.learn_decode:
            return self.config.decode_step_s
        own = self._decode.get(worker)
        if own is not None and own.num_samples >= self.config.min_samples_own_fit:
            own.center_on(self._decode_pooled.seconds)
            return own.seconds
        return self._decode_pooled.seconds

    def prefill_model(self, worker: WorkerId) -> PrefillModel:
        """The worker's own fit, shrunk toward the pooled fit; the pooled fit until it has samples."""
        own = self._prefill.get(worker)
        if own is not None and own.num_samples >= self.config.min_samples_own_fit:
            own.center_on(self._pooled.coefficients)
            return own
        return self._pooled

    # -- estimates --------------------------------------------------------------------------
    def prefill_s(self, worker: WorkerId, new_tokens: int, cached_tokens: int = 0) -> float:
        return self.prefill_model(worker).predict(new_tokens, cached_tokens)

    def wait_s(self, worker: WorkerId, kv_need: int | None = None) -> float:
        return self._wait_parts(worker, kv_need)[0]

    def _wait_parts(self, worker: WorkerId, kv_need: int | None = None) -> tuple[float, float, float]:
        """(the worker's expected wait, the part of it charged for its decoding sequences, when a
        request needing ``kv_need`` tokens of KV would find room there). The wait is the queue's
        compute (its prompts' prefills and the decode term), but not less than the room's."""
        load = self.loads.get(worker, WorkerLoad())
        model = self.prefill_model(worker)
        decode = load.running * self.decode_s(worker)
        wait = load.extra_wait_s + sum(model.predict(n) for n in load.waiting_tokens) + decode
        kv = 0.0
        if kv_need is not None and load.kv_tokens > 0:
            queue = [(n, model.predict(p) + d) for n, p, d in load.kv_waiting]
            running = load.kv_running
            age = self.clock() - self._load_at.get(worker, float("inf"))
            if LOAD_AGE_MIN_S <= age < float("inf"):  # its running requests are that much nearer their ends
                running = tuple((n, t - age) for n, t in running)
            kv = kv_admission_s(load.kv_tokens, running, queue, kv_need)
        return max(wait, kv), decode, kv

    def usable_tokens(self, prompt_tokens: int, held: int) -> int:
        """Held prefix usable for a prompt: whole blocks, never the prompt's last token."""
        bs = self.config.block_size
        return max(0, min(held, prompt_tokens - 1) // bs * bs)

    def plan_pull(self, target: WorkerId, start_block: int, end_block: int,
                  holders: Mapping[WorkerId, int]) -> tuple[float, tuple[PullRange, ...]] | None:
        """Split blocks ``[start_block, end_block)`` over holders (``holders[h]`` = blocks held),
        one source per node (workers on one node share its link), minimising the makespan.

        Greedy, deepest blocks first (they have the fewest eligible sources): each block goes to
        the eligible source that would finish it earliest. Consecutive blocks merge into ranges.
        """
        if end_block <= start_block:
            return 0.0, ()
        dst = self.nodes.get(target, target)
        per_node: dict[NodeId, tuple[WorkerId, int]] = {}
        for h, blocks in holders.items():
            if h == target or blocks <= start_block:
                continue
            node = self.nodes.get(h, h)
            cur = per_node.get(node)
            key = (blocks, -self.wait_s(h), h)
            if cur is None or key > (cur[1], -self.wait_s(cur[0]), cur[0]):
                per_node[node] = (h, blocks)
        if not per_node or max(b for _, b in per_node.values()) < end_block:
            return None
        block_bytes = self.config.block_size * self.config.bytes_per_token
        links = {n: self.links.estimate(n, dst) for n in per_node}
        assigned: dict[NodeId, list[int]] = {n: [] for n in per_node}
        finish = {n: 0.0 for n in per_node}
        for blk in range(end_block - 1, start_block - 1, -1):
            eligible = [n for n, (_, held) in per_node.items() if held > blk]
            n = min(eligible, key=lambda x: (links[x].rtt_s + (len(assigned[x]) + 1) * block_bytes
                                             / links[x].bandwidth_Bps, x))
            assigned[n].append(blk)
            finish[n] = links[n].transfer_s(len(assigned[n]) * block_bytes)
        ranges: list[PullRange] = []
        for n, blks in assigned.items():
            blks.sort()
            for _, grp in itertools.groupby(enumerate(blks), key=lambda t: t[1] - t[0]):
                run = [b for _, b in grp]
                nbytes = len(run) * block_bytes
                ranges.append(PullRange(per_node[n][0], n, run[0], run[-1] + 1, nbytes,
                                        links[n].transfer_s(nbytes)))
        ranges.sort(key=lambda r: r.start_block)
        return max(finish.values()), tuple(ranges)

    # -- ranking ----------------------------------------------------------------------------
    def candidates(self, prompt_tokens: int, holdings: Mapping[WorkerId, int],
                   workers: Iterable[WorkerId] | None = None,
                   pending: Mapping[WorkerId, int] | None = None,
                   shared: Mapping[WorkerId, int] | None = None) -> list[Candidate]:
        """Every option on every worker: its own prefix only, or pulls up to each deeper level.
        ``pending``: prefix tokens a worker is computing for a request routed there but not yet
        indexed; they count as its own (local) prefix, never as a pull source. ``shared``: prompt
        tokens that requests in flight on a worker hold already (``kv_use``): the request needs KV
        room for the rest of its prompt (a prefix only cached there is room it takes)."""
        bs = self.config.block_size
        targets = list(workers) if workers is not None else list(self.nodes)
        held_blocks = {h: self.usable_tokens(prompt_tokens, t) // bs for h, t in holdings.items()}
        levels = sorted(set(held_blocks.values()))
        pending, shared = pending or {}, shared or {}
        out: list[Candidate] = []
        copy_bytes = self.usable_tokens(prompt_tokens, prompt_tokens) * self.config.bytes_per_token
        target_nodes = sorted({self.nodes.get(x, x) for x in targets})
        # a pull's plan depends on the target's node and the blocks it lacks, not on the target
        # (a target holds no deeper block than its own prefix): one plan per node and level
        plans: dict[tuple, tuple[float, tuple[PullRange, ...]] | None] = {}
        copies: dict[NodeId, float] = {}  # what a copy out of a node takes: per node, as plans
        for w in targets:
            own = max(held_blocks.get(w, 0), self.usable_tokens(prompt_tokens, pending.get(w, 0)) // bs) * bs
            wait, dec, kv = self._wait_parts(w, kv_blocks(prompt_tokens + 1, bs) * bs - shared.get(w, 0))
            pre = own_pre = self.prefill_s(w, prompt_tokens - own, own)
            full = self.prefill_s(w, prompt_tokens, 0) if own else pre
            node = self.nodes.get(w, w)
            if node not in copies:
                copies[node] = self.copy_out_s(w, target_nodes, copy_bytes)
            copy_out = copies[node]
            out.append(Candidate(w, "local" if own else "recomputed", wait + pre, wait, pre, 0.0, own, 0,
                                 decode_wait_s=dec, kv_wait_s=kv, copy_out_s=copy_out, full_prefill_s=full,
                                 own_prefill_s=own_pre))
            for level in levels:
                if level * bs <= own:
                    continue
                at = (node, own // bs, level)
                if at not in plans:
                    plans[at] = self.plan_pull(w, own // bs, level, held_blocks)
                plan = plans[at]
                if plan is None:
                    continue
                pull_s, ranges = plan
                cached = level * bs
                pre = self.prefill_s(w, prompt_tokens - cached, cached)
                queued = max(wait, pull_s) if self.config.pull_overlaps_wait else wait + pull_s
                out.append(Candidate(w, "pulled", queued + pre, wait, pre, pull_s, own,
                                     cached - own, ranges, dec, kv, copy_out_s=copy_out, full_prefill_s=full,
                                     own_prefill_s=own_pre))
        return out

    def copy_out_s(self, worker: WorkerId, nodes: Sequence[NodeId], nbytes: int) -> float:
        """The median over ``nodes`` other than ``worker``'s of the estimated time to send
        ``nbytes`` from ``worker``'s node there (0: no other node). Where a prefix is placed is
        where its copies are pulled from once its group outgrows one worker: from a node behind a
        slow link each copy takes seconds. At most ``COPY_OUT_NODES`` destinations are asked (the
        first in ``nodes``' order: the ranking stays linear in the workers on a large cluster)."""
        src = self.nodes.get(worker, worker)
        dsts = [n for n in nodes if n != src][:COPY_OUT_NODES]
        if not dsts or nbytes <= 0:
            return 0.0
        return statistics.median(self.links.estimate(src, d).transfer_s(nbytes) for d in dsts)

    def rank(self, prompt_tokens: int, holdings: Mapping[WorkerId, int],
             workers: Iterable[WorkerId] | None = None,
             pending: Mapping[WorkerId, int] | None = None,
             shared: Mapping[WorkerId, int] | None = None) -> list[Candidate]:
        """Best candidate per worker, ascending expected TTFT (ties: fewer pulled tokens, id); one
        that is not a pull carries its worker's best pull's TTFT where there was one."""
        best: dict[WorkerId, Candidate] = {}
        pulls: dict[WorkerId, Candidate] = {}
        for c in self.candidates(prompt_tokens, holdings, workers, pending, shared):
            for top in (best, pulls) if c.kind == "pulled" else (best,):
                cur = top.get(c.worker)
                if cur is None or _order(c) < _order(cur):
                    top[c.worker] = c
        return sorted((c if c.kind == "pulled" or c.worker not in pulls
                       else replace(c, pull_option_ttft_s=pulls[c.worker].expected_ttft_s) for c in best.values()),
                      key=_order)

    def decide(self, prompt_tokens: int, holdings: Mapping[WorkerId, int],
               workers: Iterable[WorkerId] | None = None,
               pending: Mapping[WorkerId, int] | None = None) -> RouteDecision | None:
        ranking = self.rank(prompt_tokens, holdings, workers, pending)
        return RouteDecision(ranking[0], tuple(ranking)) if ranking else None


def _order(c: Candidate) -> tuple:
    return (round(c.expected_ttft_s, 9), c.pulled_tokens, c.worker)


def power_of_two(workers: Sequence[WorkerId], load: Mapping[WorkerId, float],
                 rng: random.Random | None = None) -> WorkerId | None:
    """Fallback without estimates: the less loaded of two random workers (ties: the first)."""
    if not workers:
        return None
    rng = rng or random
    if len(workers) == 1:
        return workers[0]
    a, b = rng.sample(list(workers), 2)
    return b if load.get(b, 0.0) < load.get(a, 0.0) else a


def pull_deadline_s(pull_s: float, recompute_s: float, floor_s: float = 1.0, slack: float = 2.0) -> float:
    """How long a planned pull may take before the worker gives up and recomputes: ``slack`` x
    its expected transfer, but at least as long as recomputing those tokens would take (the
    ski-rental rule: waiting as long as the alternative costs, then switching, never costs more
    than twice the better choice) and at least ``floor_s`` (a holder busy with a step answers
    late). A stalled pull then delays its request by about one recompute, not by a fixed timeout."""
    return max(floor_s, slack * max(0.0, pull_s), max(0.0, recompute_s))
