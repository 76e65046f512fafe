"""Cache-capacity-aware placement: where a prompt's prefix should live in the cluster.

Pure policy (no Ray). The TTFT cost model (``policies.routing``) ranks one request at a time; on
its own it sends a miss, or a tie, to whichever worker sorts first, and that worker evicts the
prefixes it will need next (measured: 23 of 24 shared-prefix requests on one of two workers,
517 evictions, 42% of the oracle's hits). Placement adds what a per-request TTFT cannot see:

  * **in-flight prefixes.** ``ShadowCache`` is the router's model of one worker's prefix cache:
    an LRU of the block hashes routed to it, with the worker's capacity. A prefix routed to a
    worker counts as held there at once, before the worker has computed and indexed it, so a
    burst of one group does not scatter over workers (each computing it) or miss the holder.
    It is reconciled with the global index: an entry older than ``index_lag_s`` that the index
    does not show is gone (evicted, or its request failed).
  * **new prefixes go where they cost the least.** A prompt with no significant match (under
    ``min_match_fraction`` of its blocks anywhere) is placed, among the workers whose expected
    TTFT is within ``place_slack`` x its own prefill of the fastest (load-based spill-over), on
    the one with the least expected TTFT plus the expected recompute of the warm blocks its
    cache would evict to take it: ``evict_weight`` x p(reuse) x warm blocks x the prompt's prefill
    per block. Near ties go by headroom (below); a rendezvous hash of the prompt's leading blocks
    breaks the remaining ties (so ties spread prompts over workers instead of piling them on the
    first).
  * **a warm block is one a later prompt may ask for.** Used within ``warm_s``, not private (a
    request's unshared tail and output: nobody asks for it) and, with
    ``discount_held_elsewhere``, held by no other worker's shadow (a copy there is pulled back,
    a transfer, not a recompute: at 1 Gbit/s ~1/15 of a 0.4-core prefill per block).
  * **p(reuse) is 1 by default, and measured** (``Placer.reuse``, a ``ReuseEstimate``): the
    share of blocks a shadow dropped while warm that a later prompt asked for before they would
    have gone cold (the router's "ghosts"), a Beta(``reuse_prior``) posterior mean over about the
    last ``reuse_window`` blocks; ``reuse_prob=None`` charges evictions at it. Not the default:
    on the cluster bench's workload (``bench/placement_openloop.py``, cluster/README "Placement
    trade-off, session 7") it measured 0.3-0.6 and charging at it lost hits (0.92 of the oracle
    against 0.96) and throughput; under load a recompute delays every request queued behind it,
    so one eviction costs more than its own prefill, and p = 1 prices that better.
  * **matches stay with their holder unless it is clearly slower.** With holders, the best
    holder wins unless another option (a pull to, or a recompute on, a less loaded worker) is
    faster by ``spill_ratio`` and ``spill_abs_s``, its TTFT charged with the warm blocks it would
    evict (each at p(reuse) x the prompt's prefill time per block: what recomputing them later
    is expected to cost): a copy takes cache space that other groups may need. A recompute copy is
    also charged the prefill it repeats (the blocks the holder would reuse, ``compute_weight``):
    compute spent twice is compute another request waits for, so under load a busy holder is
    relieved by a pull (no compute) before a recompute. A pull is charged ``spill_pull_charge``
    (half) of its transfer: the copy serves the group's later requests locally, the transfer is
    paid once. A hot group spills to a second worker under load (the cost
    model then chooses between pulling and recomputing there); a near tie never moves a group.
    Only a holder's **dominant group** spills: the prompt's group made at least
    ``spill_group_share`` of the requests routed to the holder recently (counts that decay with
    time constant ``group_tau_s``: a share of the holder's recent traffic, not of its last N
    requests, so that the requests of groups that stopped coming fade, and so that three equal
    groups do not read as one dominant one by chance: a window of the last 8 requests did, about
    one check in ten, and each such spill evicted a warm group). A copy of one of
    several groups does not relieve their holder (the others keep it busy); it takes cache space
    elsewhere, and where the groups' prefixes fill most of the cluster (the cluster bench's
    ``--sweep steady``) such copies evicted warm groups: 2.7x the evictions, 0.92 of the oracle's
    hits (``bench/placement_openloop.py --workload steady``). A hot group is its holder's
    dominant one and spills as before. Dominance on the holder is not enough either: with 3
    groups per worker at ~0.5 req/s each, one of them makes 60% of its holder's last requests by
    chance, and its copy then put a 4th prefix on a worker whose pool holds 4 with nothing left
    for the requests' own blocks (the cluster bench, session 16: that worker evicted and recomputed,
    p99 TTFT 19-24 s against affinity's 2-7 s). So a group also needs its holders' worth of the
    *cluster's* recent traffic (``spill_share_margin``): its share x workers, taken at the share's
    lower confidence bound over the requests it is measured on (``spill_share_z``), at least its
    holders. One of twelve equal groups never qualifies; a hot group gets every worker. A group
    short of it (minor) leaves only a swamped holder: slower than the spill margin by four
    prefills of the prompt more (``minor_spill_prefills``). ``PlacementConfig(spill_ratio=0, spill_abs_s=0,
    evict_weight=0)`` is the plain per-request TTFT choice (``TTFT_ONLY``).
  * **an overloaded holder lets any group go** (opt-in, ``balance_ratio`` > 0; off by default:
    replayed over 30 paired seeds it cost 1-4% on steady groups and gained nothing on hot or
    fresh ones, the copies it made evicting warm groups). Groups are sticky, so the split of groups over
    workers that their first requests made is the split of the load for as long as they live;
    a worker given one group too many queues while another idles (the cluster bench, session 10:
    engines 63% and 96% busy at the same offered load). Each worker's queue wait (the cost
    model's) is averaged over ``balance_tau_s`` (``Placer.observe_wait``): a burst hardly moves
    it, a worker that carries more than its share keeps it high. A holder whose average exceeds
    ``balance_ratio`` x the least-waiting worker's plus ``balance_abs_s`` is *overloaded*: any of
    its groups spills, and without the spill margin (a persistent queue pays back a copy many
    times; a pull costs a transfer); such a decision counts as ``balance``. The copy then holds the group too, and the match rule sends
    the group's requests to whichever holder is faster.
  * **a hot group takes idle workers** (``idle_slack``; "idle"). The spill rule compares this
    request's TTFT; a worker behind a slow link (a pull ~2 s there, more than a busy holder's
    queue) then never gets a copy of a hot prefix, and its compute idles while the holders batch
    ever more decodes (the cluster bench, session 13: a hot prefix at 1.3 req/s served by 3 of 4
    workers, 0.93 req/s against power-of-two choices' 1.30). A group that brings at least
    ``holders + 0.5`` workers' share of the traffic lately (``Placer.cluster_share`` x workers:
    one of twelve equal groups never does) and whose best holder is busy (``idle_busy_running``
    sequences decoding or prompts queued: until session 28 the queued prompts counted one together,
    and a chat's holder computing its first 288-token prompt at 0.2 core with four more queued
    behind it, 15 s of work, was not busy) goes to an idle worker (nothing queued, nothing
    decoding) that has room for the copy (no warm block evicted) if that costs this request at
    most ``idle_slack`` x its own prefill more than the holder; the match rule then shares the
    group's requests among its holders. Compute an idle worker spends is lost to nobody.
  * **a busy holder is relieved where decoding contends less** (``contention_weight``,
    ``relief_copy_weight``; "relieve"). A request decodes in every step with the sequences in flight
    on its worker, each step longer for each of them, and makes theirs longer: a holder with four
    requests in flight serves a 16-token answer seconds later than an idle worker that pulls the
    prefix, though its TTFT is lower. The per-request TTFT never sees it: on the cluster bench's
    trace and chat workloads kvmesh kept requests on holders while one or two of four workers idled
    and lost seconds per output token and throughput to power of two choices in all fourteen
    default runs of sessions 24-31. A match goes to a worker with fewer requests in flight that
    evicts no warm block and has room for the copy (``prefix_fill``) when its effective TTFT (the
    spill rule's) plus what its requests in flight cost this request's decoding and this request
    theirs (2 x ``row_s``, learned from ended requests' seconds per output token against the mean
    sequences beside them, x the request's expected output tokens, per request in flight) plus the
    copy's room (each block it adds charged ``relief_copy_weight`` x a warm eviction) beats the
    holder's. The target keeps room for one more prefix of the copy's size (``relief_room``): a
    second holder must not take the room of a group still to come. The room charge and the room
    left keep long prefixes home: copies of the steady sweep's 34-block groups
    made in its warm-up filled the pools (replayed: hits 0.93 against 0.98) while a trace's or a
    chat's few blocks move (``bench/placement_openloop.py --workload trace``: 2.19 against 2.01
    req/s at 2.4 offered, latency p90 6.2 against 12.8 s; power of two choices 2.16 and 7.4).
  * **decoding sequences move groups, they do not place them.** The cost model's decode term
    (``Candidate.decode_wait_s``, learned per worker when ``CostConfig.learn_decode``) is how much
    longer a busy worker's steps make a new request wait. It counts in the holder rules above: a
    hot holder whose cost is decode rows, not queued prompts, looked idle without it, and its
    group never left it (the cluster bench, session 12: 69 of 75 hot requests on one worker while
    another idled). A new prefix is placed on TTFTs without it (``place_counts_decode`` counts
    it): where a group lands is its home for as long as it lives, and the sequences decoding now
    finish in seconds; counted, the term scattered new groups by the moment's decode load and cost
    4-7% of the throughput at the highest replayed rates (0.04-0.06 req/s; cluster/README,
    Placement, session 13).
  * **a pool is not filled with prefixes** (``prefix_fill``, ``fill_slack``). A new prefix (or a
    spill's copy) goes only to workers whose prefixes (``ShadowCache.prefix_blocks``: blocks a
    second prompt asked for, or that a new group's first prompt brought, for ``prefix_seed_s`` unless
    a second prompt asks for them: a one-off prompt is no prefix; not the questions asked once)
    stay within 90% of the pool after it, when one of them is within 4 of the prompt's
    prefills of the fastest. A worker whose pool its groups' prefixes fill evicts their tails for
    its own requests' blocks, for as long as those groups live (the cluster bench, session 24: a
    worker given a 4th 512-token group in a 2,048-token pool served 96-304 of 512 prefix tokens
    from cache; such runs read kvmesh / affinity 0.46-0.84). The prefixes of a domain (a tenant's
    prompts) that sent nothing for ``domain_idle_gaps`` x its mean interval between requests do
    not count (``DomainActivity``): a tenant that stopped sending reserves no room, or its worker
    would be barred from new work for as long as nothing evicts them.
  * ties within ``tie_ratio``/``tie_abs_s`` of the best TTFT (for a new prefix, also within
    ``place_tie`` x its own prefill: where a group lands decides where its later requests go, so
    a host 10% faster now is worth less than balance) are broken by headroom: fewest warm
    evictions, not overloaded, fewest prefix blocks held (private and free blocks are both room;
    this spreads groups evenly over caches they fill), not behind a slow link (``remote_ratio``:
    a group's copies are pulled from where it was placed), least loaded now, coldest victims,
    then the rendezvous order, not worker order.
  * **a match goes to the holder with the fewest requests in flight among near ties**
    (``match_tie``): holders that would reuse as many blocks as the chosen one, with a TTFT within
    half again of the fastest holder's, are ties decided by requests decoding or waiting there,
    as power of two choices decides. The TTFTs compared carry each worker's own prefill fit, and
    fits of identical hosts differ by ~10%: a hot prefix held by every worker went to the holder
    fitted fastest whenever its queue allowed (the cluster bench, session 28: 14 of 21 requests on
    one of three holders, TTFT p90 0.80 s against pow2's 0.66 s; the replay of its hot-after-steady
    series, ``bench/placement_openloop.py --workload steady_hot``: 0.83 against pow2's 0.92 req/s
    at 1.3 offered, 0.89 with the rule).

Invariants: a ``ShadowCache`` never holds more than its capacity; ``choose`` returns one of the
given views; with no views it raises ``ValueError``; a measured p(reuse) lies in (0, 1); with
p(reuse) 1 and no held-elsewhere discount every warm eviction is charged a full recompute.
"""

from __future__ import annotations

import hashlib
import itertools
import math
from collections import Counter, OrderedDict, deque
from dataclasses import dataclass, replace
from typing import Callable, Collection, Hashable, Literal, Mapping, Sequence

from policies.routing import Candidate, WorkerId

PlacementKind = Literal["match", "spill", "balance", "relieve", "idle", "place"]
PROXY_TOKEN_S = 1e-3  # without estimates: a token of queue or prefill ~ 1 ms (only compared, never reported)
DECISION_LOG = 64  # the placement decisions other than "match" a ``Placer`` keeps (``Placer.log``)
# and, apart, the last matches that kept a request on a holder slower than another candidate by
# more than the spill margin (``Placer.held``): why a busy holder was not relieved
DECISION_CANDIDATES = 8  # per logged decision, the candidates kept: the fastest, and the one chosen


@dataclass(frozen=True)
class PlacementConfig:
    min_match_fraction: float = 0.1  # a holder must hold this share of the prompt's reusable blocks
    min_match_blocks: int = 1
    spill_ratio: float = 0.5  # leave a holder only for an option this much faster ...
    spill_abs_s: float = 0.05  # ... plus this
    evict_weight: float = 1.0  # warm evictions are charged this x p(reuse) x their recompute time
    compute_weight: float = 1.0  # a spill's extra prefill (blocks the holder reuses and it computes), at this x
    tie_ratio: float = 0.05  # TTFTs this close to the best are ties ...
    tie_abs_s: float = 0.005  # ... or this close
    # holders that would reuse as much as the chosen one and whose TTFT is within this share of the
    # best holder's are ties decided by the fewest requests in flight there (decoding or without a
    # first token), as power of two choices decides: per-worker prefill fits differ by ~10% on
    # identical hosts, and a hot prefix held by every worker went to the one fitted fastest
    # (0: off, holders within ``tie_ratio`` only, by headroom)
    match_tie: float = 0.5
    place_slack: float = 1.0  # new prefix: workers within this x the prompt's own prefill of the fastest
    place_abs_s: float = 0.05
    # a new prefix's options this close (x its own prefill) to the cheapest are ties, decided by
    # headroom: a group brings its later requests, and where it lives decides the cluster's
    # balance for as long as it lives; a faster option now (a host 10% quicker) is worth less
    place_tie: float = 0.25
    warm_s: float = 30.0  # a block used this recently is warm: evicting it may cost a future hit
    reuse_prob: float | None = 1.0  # p(an evicted warm block is asked for again); None: measured (ghosts)
    reuse_prior: tuple[float, float] = (16.0, 16.0)  # Beta prior of the measured p, in blocks (mean 0.5)
    reuse_window: float = 1024.0  # the measured p forgets: counts are kept to about this many blocks
    discount_held_elsewhere: bool = True  # a warm victim another worker holds is not charged (pulled back)
    index_lag_s: float = 30.0  # the index shows a routed prefix within this long (queue + prefill + publish)
    key_blocks: int = 4  # leading blocks that key the rendezvous tie-break (and a prompt's group)
    # a holder is left only for its dominant group: the prompt's group made at least this share of
    # the requests routed to the holder, counted with weights that decay with ``group_tau_s``
    # (0: any group may spill)
    spill_group_share: float = 0.6
    group_tau_s: float = 30.0
    # ... or the holder is overloaded: its queue wait, averaged over ``balance_tau_s``, exceeds
    # ``balance_ratio`` x the least-waiting worker's average plus ``balance_abs_s`` (ratio 0: never)
    # (ratio 0, the default: replayed over 30 paired seeds the rule cost 1-4% of throughput at equal
    # p99 on steady groups and gained nothing on hot or fresh ones; cluster/README, session 12)
    balance_tau_s: float = 30.0
    balance_ratio: float = 0.0
    balance_abs_s: float = 2.0
    # a new prefix is placed on TTFTs without the cost model's decode term (``Candidate.decode_wait_s``):
    # that term prices how much longer a busy worker's steps are, which decides which holder serves a
    # hit and whether a dominant group leaves a busy holder; a new group's home is chosen for the
    # long run (its cache room, its share of the load), not for the sequences decoding right now
    place_counts_decode: bool = False
    # a spill by pull is charged this share of its transfer: the copy it makes serves the group's
    # later requests locally, so the transfer is paid once (1: a hot group never reached a worker
    # behind a slow link, where a pull takes ~2 s; cluster/README, Placement, session 13)
    spill_pull_charge: float = 0.5
    # a busy holder's dominant group spills to an idle worker (nothing queued, nothing decoding) that
    # has room for the copy (no warm block evicted) when that costs this request at most ``idle_slack``
    # x its own prefill more than the holder: idle compute is lost for good, and once the copy is
    # there the match rule shares the group's load. Without it a worker behind a slow link (a pull
    # ~2 s) never took part in a hot prefix (0 requests of 78; the cluster bench, session 13). 0: off
    idle_slack: float = 1.0
    idle_busy_running: int = 2  # a holder is busy with this many sequences decoding or prompts queued
    idle_counts_queued: bool = True  # False: a holder's queued prompts count one together (before session 28)
    # a group has its holders' worth of the traffic when its share of the requests routed lately to
    # the whole cluster (``Placer.cluster_share``) x workers >= holders + a margin. The spill rule
    # needs ``spill_share_margin`` (None: any dominant group spills, the rule before session 17) on
    # the share's lower confidence bound (Wilson, ``spill_share_z`` standard errors, over the
    # recent requests' decayed count): a copy of one of many groups relieves no holder for long and
    # takes room the resident groups' requests need (the cluster bench, session 16: a spill copy of
    # one of 12 groups left a worker with 4 prefixes in a pool sized for 4, which then evicted and
    # recomputed), and at low rates one of 12 groups makes a quarter of the last 15 requests by
    # chance. The idle rule needs ``idle_share_margin`` on the share itself.
    spill_share_margin: float | None = 0.0
    spill_share_z: float = 1.0
    idle_share_margin: float = 0.5
    # a group short of that share (a minor group) still spills from a holder slower than the spill
    # margin by this many of the prompt's own prefills more (a swamped holder; None: never). Until
    # session 29 the prompt's prefill read 2-7x too long wherever the prefix could be pulled
    # (``full_prefill_s``), and 1 never fired in the replays; with the estimate corrected, 1 spilled
    # minor groups in the steady sweep's slow warm-up (``bench/placement_openloop.py --workload
    # steady``, 40 seeds: a worker with 4 groups in 32, hits 0.947 against 0.980), while 4 and never
    # read identical to the rule as it was measured
    minor_spill_prefills: float | None = 4.0
    # a new prefix, or a spill's copy, stays off a worker whose prefix blocks
    # (``ShadowCache.prefix_blocks``) would then exceed this share of its pool while another worker
    # has room: the rest of the pool is its requests' own blocks (prompt tails, outputs), which
    # otherwise evict the tails of its prefixes. The cluster bench (pools of four 512-token
    # prefixes, 12 groups on 4 workers): the runs that left one worker with four groups (7, sessions
    # 16-24) had kvmesh / affinity 0.46-0.84 at equal p99, the runs with 3/3/3/3 0.44-1.94 (median
    # 1.07), and that worker's requests found 96-304 of 512 prefix tokens cached. A worker with room
    # is taken when its TTFT is within ``fill_slack`` x the prompt's prefill of the fastest: the
    # wait is paid once, an overfull pool for as long as its groups live. ``prefix_fill`` >= 1: off
    prefix_fill: float = 0.9
    fill_slack: float = 4.0
    # near ties between workers go to one whose copies out are quick: a worker is *remote* when
    # sending the prompt's prefix from it to the others (``WorkerView.copy_out_s``, the median over
    # them) takes more than ``remote_ratio`` x the quickest worker's plus ``remote_abs_s``; 0: off
    remote_ratio: float = 2.0
    remote_abs_s: float = 0.05
    # a new group's first prompt counts as a prefix this long before a second prompt asks for it
    # (then for good): a prompt nobody repeats is a one-off, and a worker that took many is not full
    # of prefixes. Longer than ``warm_s``: a group's second request may come minutes after its
    # first at low rates (the cluster bench's warm-up: 12 groups in 52-70 s, ~2 requests each)
    prefix_seed_s: float = 120.0
    # ... and the prefixes of a domain (a tenant's prompts) that no prompt could read for this
    # many times its mean interval between such prompts (its own tenant's and those it granted
    # reads to; an average over its last few; at least ``domain_idle_min`` seen) do not count: a
    # tenant that stopped sending, and whose grantees stopped too, reserves no room. Its prefixes
    # stay cached, and count again with its next request. The cluster bench's trace comes seconds
    # after its multi-tenant mix, whose 28 prefixes (most asked for once or twice) filled one
    # worker past the fill line (116-120 blocks of 128, session 32): that worker got none of the
    # trace while three decoded 5-9 sequences each. 0: off
    domain_idle_gaps: float = 4.0
    domain_idle_min: int = 4
    # a request's decoding shares every step with the other sequences in flight on its worker: each
    # makes its steps longer and it makes theirs longer, so a busy holder costs more than its TTFT
    # says (measured on the cluster bench's trace and chat workloads, sessions 24-31: kvmesh kept
    # requests on their holders while one or two of four workers idled, and lost seconds per output
    # token and throughput to power of two choices in all fourteen default runs). A match goes to
    # another worker ("relieve") when that worker evicts no warm block for it, has room for the copy
    # (``prefix_fill``), has fewer requests in flight, and its effective TTFT (as the spill rule's)
    # plus the decode contention there is lower than the holder's by the spill rule's absolute
    # margin or ``tie_ratio``. The contention of one sequence in flight is ``contention_weight`` x 2
    # (its slowdown and theirs) x the seconds one more sequence adds to an output token (learned:
    # ``Placer.decide``'s ``row_s``) x the request's expected output tokens. 0: off
    contention_weight: float = 1.0
    # ... and the copy pays for the room it takes: each block the target adds for it is charged as a
    # warm eviction (``evict_weight`` x p(reuse) x the prompt's prefill per block) x this. A copy that
    # evicts nothing now displaces a prefix later: without the charge, copies of the steady sweep's
    # 34-block groups made in its warm-up filled the pools (``bench/placement_openloop.py --workload
    # steady``: hits 0.93 against 0.98). A short shared prefix (a chat's system prompt, a trace's
    # few blocks) costs little room and moves; a long one only off a much busier holder
    relief_copy_weight: float = 2.0
    relief_fill: bool = True  # ... and the target's prefixes stay within ``prefix_fill`` after it
    # ... with room left for ``relief_room`` - 1 more prefixes of the copy's size: a relief copy is
    # a second holder, and a second holder that takes a pool's last room leaves a group still to come
    # none. With a one-row decode step 0.19 s and 0.078 s per more row (the cluster's hosts, session
    # 38; the contention term is then ~2.5 s per request in flight), reliefs of the steady sweep's
    # 34-block groups during its warm-up left a fourth group on one worker in 5 of 12 replayed seeds,
    # its evictions cascading (TTFT p99 28-37 s at 2 req/s in two). 1: room for the copy alone
    relief_room: float = 2.0


TTFT_ONLY = PlacementConfig(spill_ratio=0.0, spill_abs_s=0.0, evict_weight=0.0, compute_weight=0.0)


_PRIVATE = "private"


def _private(key: Hashable) -> bool:
    return type(key) is tuple and len(key) == 2 and key[0] == _PRIVATE


class ShadowCache:
    """The router's model of one worker's prefix cache: block keys in LRU order (oldest first),
    each with the time it was first routed there and last used; at most ``capacity`` keys."""

    _anon = itertools.count()

    def __init__(self, capacity_blocks: int, on_evict: Callable[[Hashable, float, float], None] | None = None,
                 seed_s: float = 120.0, holders: Counter | None = None,
                 heads: dict[Hashable, set] | None = None, owner: Hashable = None):
        if capacity_blocks <= 0:
            raise ValueError("capacity_blocks must be positive")
        self.capacity = capacity_blocks
        # shared by the shadows of one ``Placer``: per shareable key, how many of them hold it (a
        # victim held elsewhere is asked once per candidate worker per request: a count, not a scan
        # of every other shadow, keeps a decision linear in the workers)
        self.holders = holders
        # shared the same way: per chain head (a prompt's first block), the owners (worker ids) of
        # the shadows holding it. A shadow without a chain's head holds nothing of it (its blocks
        # enter together and leave deepest first), so a prompt's holders are found from its heads
        # without visiting every worker's shadow
        self.heads, self.owner = heads, owner
        self._lru: OrderedDict[Hashable, tuple[float, float]] = OrderedDict()  # key -> (inserted, last used)
        self.shared = 0  # keys a later prompt may ask for (not private): the prefixes it holds
        # of those, the keys that are a prefix (``prefix_blocks``): asked for by a second request
        # (``_prefix``), or routed by a prompt that matched nothing here, a new group's first request,
        # for ``seed_s`` after it (``_seeded``: key -> that time; a prompt nobody repeats within it
        # was a one-off, not a prefix); not the new tail blocks of a prompt that matched (a user's
        # question: asked for once, then cold)
        self._prefix: set[Hashable] = set()
        self._seeded: OrderedDict[Hashable, float] = OrderedDict()
        self.seed_s = seed_s
        # the prefix and seeded keys of each domain (a tenant's prompts), for ``prefix_blocks``'s
        # ``idle_domains``: a tenant that stopped sending holds no room
        self._domain: dict[Hashable, str] = {}
        self._by_domain: dict[str, set[Hashable]] = {}
        self.evicted = 0
        self.on_evict = on_evict  # (key, its last use, now) for every key the LRU drops

    def __len__(self) -> int:
        return len(self._lru)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._lru

    def match(self, chain: Sequence[bytes]) -> int:
        """Leading blocks of ``chain`` present."""
        k = 0
        while k < len(chain) and chain[k] in self._lru:
            k += 1
        return k

    def touch(self, chain: Sequence[bytes], private_blocks: int, now: float, domain: str | None = None) -> None:
        """A request of ``domain`` routed here uses ``chain`` and ``private_blocks`` blocks nobody
        shares (its unshared tail, its output). The engine frees tail blocks first, so they become
        older than the shared prefix, whose first block is the most recent."""
        seed = self.match(chain) == 0
        for _ in range(private_blocks):
            self._put((_PRIVATE, next(self._anon)), now)
        for key in reversed(chain):
            if key in self._lru:
                self._prefix.add(key)
                self._seeded.pop(key, None)
                self._set_domain(key, domain)
            elif seed:
                self._seeded[key] = now
                self._set_domain(key, domain)
            self._put(key, now)
        if self.heads is not None and chain and chain[0] in self._lru:
            self.heads.setdefault(chain[0], set()).add(self.owner)

    def _set_domain(self, key: Hashable, domain: str | None) -> None:
        old = self._domain.get(key)
        if old == domain:
            return
        if old is not None:
            self._by_domain[old].discard(key)
        if domain is None:
            self._domain.pop(key, None)
        else:
            self._domain[key] = domain
            self._by_domain.setdefault(domain, set()).add(key)

    def prefix_blocks(self, now: float, idle_domains: Collection[str] = ()) -> int:
        """Blocks of prefixes it holds that prompts share at ``now`` (see ``_prefix``), less those
        of ``idle_domains`` (tenants that stopped sending, ``DomainActivity``): what a new group's
        prefix competes with for room (``WorkerView.fits``)."""
        while self._seeded:
            key, at = next(iter(self._seeded.items()))
            if at >= now - self.seed_s:
                break
            del self._seeded[key]
            if key not in self._prefix:
                self._set_domain(key, None)
        quiet = sum(len(self._by_domain.get(d, ())) for d in idle_domains)
        return len(self._prefix) + len(self._seeded) - quiet

    def resized(self, capacity_blocks: int) -> "ShadowCache":
        """A copy with another capacity: the keys in LRU order, the oldest overflowing as they would."""
        fresh = ShadowCache(capacity_blocks, self.on_evict, self.seed_s)  # uncounted while it fills
        for k, v in self._lru.items():
            fresh._put(k, v[1])
            fresh._lru[k] = v
        for k in self._lru:  # the copy takes this one's place in the count: what overflowed leaves it
            if k not in fresh._lru:
                self._count(k, -1)
        fresh.holders, fresh.heads, fresh.owner = self.holders, self.heads, self.owner
        fresh._prefix = {k for k in self._prefix if k in fresh._lru}
        fresh._seeded = OrderedDict((k, t) for k, t in self._seeded.items() if k in fresh._lru)
        for k, d in self._domain.items():
            if k in fresh._lru:
                fresh._set_domain(k, d)
        return fresh

    def _forget(self, key: Hashable) -> None:
        self._prefix.discard(key)
        self._seeded.pop(key, None)
        self._set_domain(key, None)

    def _count(self, key: Hashable, step: int) -> None:
        """``key`` entered (``step`` 1) or left (-1) this cache: the shared ``holders`` count
        (and, as it leaves, ``heads``)."""
        if self.holders is None or _private(key):
            return
        if step < 0 and self.heads is not None:
            owners = self.heads.get(key)
            if owners is not None:
                owners.discard(self.owner)
                if not owners:
                    del self.heads[key]
        n = self.holders.get(key, 0) + step
        if n > 0:
            self.holders[key] = n
        else:
            self.holders.pop(key, None)

    def release(self) -> None:
        """This cache is dropped (its worker left): its keys leave the shared ``holders`` count."""
        for key in self._lru:
            self._count(key, -1)

    def _put(self, key: Hashable, now: float) -> None:
        old = self._lru.pop(key, None)
        self._lru[key] = (old[0] if old else now, now)
        if old is None and not _private(key):
            self.shared += 1
            self._count(key, 1)
        while len(self._lru) > self.capacity:
            gone, (_, used) = self._lru.popitem(last=False)
            self.shared -= not _private(gone)
            self._count(gone, -1)
            self._forget(gone)
            self.evicted += 1
            if self.on_evict is not None:
                self.on_evict(gone, used, now)

    def reconcile(self, chain: Sequence[bytes], indexed_blocks: int, now: float, lag_s: float) -> None:
        """The index shows ``indexed_blocks`` of ``chain`` here: drop deeper entries it should
        have shown by now (routed here more than ``lag_s`` ago)."""
        for key in chain[indexed_blocks:]:
            ent = self._lru.get(key)
            if ent is not None and ent[0] < now - lag_s:
                del self._lru[key]
                self.shared -= 1
                self._count(key, -1)
                self._forget(key)

    def eviction_cost(self, new_blocks: int, now: float, warm_s: float,
                      held_elsewhere: Callable[[Hashable], bool] | None = None,
                      counted: bool = False) -> tuple[int, int, float]:
        """What taking ``new_blocks`` more blocks costs, smaller is better: ``(0, 0, -free blocks
        left)`` when they fit in free space, else ``(warm blocks evicted, 1, -age of the most
        recently used block evicted)`` (evicting colder blocks is cheaper). A warm block counts
        only if a later prompt could ask for it (private blocks never are) and, given
        ``held_elsewhere``, only if no other worker holds it (a copy there is pulled, not recomputed).
        ``counted``: held elsewhere is read from the shared ``holders`` count (a ``Placer``'s; it
        counts this shadow's own copy too, and no private block): more than 1. The answer of a
        ``held_elsewhere`` asking every other shadow, at one dict probe per victim; ignored for a
        shadow without the count or with ``held_elsewhere`` given."""
        need = len(self._lru) + new_blocks - self.capacity
        if need <= 0:
            return 0, 0, float(need)
        warm, newest, cutoff = 0, float("-inf"), now - warm_s
        victims = itertools.islice(self._lru.items(), min(need, len(self._lru)))
        if counted and self.holders is not None and held_elsewhere is None:
            get = self.holders.get
            for key, (_, used) in victims:
                if used > cutoff and get(key, 0) == 1:
                    warm += 1
                if used > newest:
                    newest = used
        else:
            for key, (_, used) in victims:
                if used > cutoff and not _private(key) and (held_elsewhere is None or not held_elsewhere(key)):
                    warm += 1
                if used > newest:
                    newest = used
        warm += max(0, need - len(self._lru))  # more than the whole cache
        return warm, 1, (newest - now) if newest > float("-inf") else 0.0


class ReuseEstimate:
    """p(reuse): how often a block evicted while warm is asked for again before it would have
    gone cold, measured on the router's own evictions (its "ghosts": keys a ``ShadowCache``
    dropped within ``warm_s`` of their last use). A ghost a later prompt asks for by its
    deadline (last use + ``warm_s``) is a reuse; one that reaches its deadline unasked is not.
    ``p`` is the Beta(``prior``) posterior mean of those outcomes; counts are scaled down to
    about ``window`` blocks so that p follows a changing workload. Invariant: 0 < p < 1; at
    most ``max_ghosts`` keys are remembered (the oldest are resolved as not reused)."""

    def __init__(self, warm_s: float, prior: tuple[float, float] = (16.0, 16.0), window: float = 1024.0,
                 max_ghosts: int = 1 << 16):
        if prior[0] <= 0 or prior[1] <= 0 or window <= 0:
            raise ValueError("the prior's counts and the window must be positive")
        self.warm_s, self.prior, self.window, self.max_ghosts = warm_s, prior, window, max_ghosts
        self._ghosts: OrderedDict[Hashable, float] = OrderedDict()  # key -> deadline, in eviction order
        self.reused = 0.0
        self.unused = 0.0

    def __len__(self) -> int:
        return len(self._ghosts)

    @property
    def p(self) -> float:
        a, b = self.prior
        return (self.reused + a) / (self.reused + self.unused + a + b)

    def evicted(self, key: Hashable, last_used: float, now: float) -> None:
        """A shadow cache dropped ``key`` (last used ``last_used``) at ``now``."""
        deadline = last_used + self.warm_s
        if _private(key) or deadline <= now:
            return  # nobody asks for a private block; a cold one was no loss
        self._ghosts.pop(key, None)
        self._ghosts[key] = deadline
        while len(self._ghosts) > self.max_ghosts:
            self._ghosts.popitem(last=False)
            self._count(0.0, 1.0)

    def asked(self, keys: Sequence[Hashable], now: float) -> None:
        """A prompt asks for ``keys``: ghosts among them are reuses (those past their deadline
        are resolved as not reused first)."""
        self.expire(now)
        hits = sum(self._ghosts.pop(k, None) is not None for k in keys)
        if hits:
            self._count(float(hits), 0.0)

    def expire(self, now: float) -> None:
        """Resolve ghosts past their deadline as not reused. Deadlines are near eviction order
        (the LRU drops its oldest first), so scanning from the oldest stops at the first live one."""
        n = 0
        while self._ghosts:
            key, deadline = next(iter(self._ghosts.items()))
            if deadline > now:
                break
            del self._ghosts[key]
            n += 1
        if n:
            self._count(0.0, float(n))

    def _count(self, reused: float, unused: float) -> None:
        self.reused += reused
        self.unused += unused
        total = self.reused + self.unused
        if total > self.window:
            self.reused *= self.window / total
            self.unused *= self.window / total


@dataclass(frozen=True)
class WorkerView:
    """One worker as placement sees it for one request.

    ``ttft_s``/``candidate``: its best option from the cost model (None in a fallback without
    estimates: ``ttft_s`` is then a load proxy). ``local_blocks``: prompt blocks it holds or is
    computing. ``eviction``: ``ShadowCache.eviction_cost`` of the blocks it would add. ``load``:
    in-flight tokens. ``rank``: its rendezvous order for the prompt (0 = first). ``reused_blocks``:
    prompt blocks its option does not compute (held or pulled; None: ``local_blocks``)."""

    worker: WorkerId
    ttft_s: float
    local_blocks: int
    eviction: tuple[int, int, float]
    load: float = 0.0
    rank: int = 0
    candidate: Candidate | None = None
    reused_blocks: int | None = None
    group_share: float = 1.0  # the prompt's group's share of its recently routed requests
    wait_avg_s: float = 0.0  # its queue wait (the cost model's), averaged over ``balance_tau_s``
    shared_blocks: int = 0  # blocks of prefixes it holds (its shadow cache's, private blocks not counted)
    running: int = 0  # sequences past their first token there (decoding)
    prefix_blocks: int = 0  # of its shared blocks, those of prefixes prompts share (``ShadowCache.prefix_blocks``)
    capacity: int = 0  # its pool in blocks (its shadow cache's); 0: unknown
    queued: int = 0  # prompts routed there without a first token yet (queued or prefilling); 0: unknown

    def fits(self, new_blocks: float, fill: float) -> bool:
        """Whether ``new_blocks`` more prefix blocks keep its prefixes within ``fill`` of its pool
        (``PlacementConfig.prefix_fill``); True when the pool's size is unknown or ``fill`` >= 1."""
        return fill >= 1.0 or self.capacity <= 0 or self.prefix_blocks + max(0, new_blocks) <= fill * self.capacity

    @property
    def reused(self) -> int:
        return self.local_blocks if self.reused_blocks is None else self.reused_blocks

    @property
    def decode_s(self) -> float:
        """The part of ``ttft_s`` charged for sequences decoding there."""
        return self.candidate.decode_wait_s if self.candidate is not None else 0.0

    @property
    def copy_out_s(self) -> float:
        """How long a copy of this prompt's prefix takes from here to another worker (the
        candidate's ``copy_out_s``; 0 without estimates)."""
        return self.candidate.copy_out_s if self.candidate is not None else 0.0

    @property
    def pull_s(self) -> float:
        """The part of ``ttft_s`` its transfer adds when its option is a pull (not the part
        overlapping the wait in the queue)."""
        return self.candidate.exposed_pull_s if self.candidate is not None else 0.0


@dataclass(frozen=True)
class Placement:
    worker: WorkerId
    kind: PlacementKind
    view: WorkerView

    @property
    def candidate(self) -> Candidate | None:
        return self.view.candidate


def rendezvous_order(key: bytes, workers: Sequence[WorkerId]) -> dict[WorkerId, int]:
    """Highest-random-weight order of ``workers`` for ``key`` (stable, uniform over keys)."""
    score = {w: hashlib.blake2b(key + w.encode(), digest_size=8).digest() for w in workers}
    return {w: i for i, w in enumerate(sorted(workers, key=lambda w: score[w], reverse=True))}


def shortlist(workers: Sequence[WorkerId], held: Mapping[WorkerId, int], in_flight: Mapping[WorkerId, int],
              key: bytes, size: int, holder_share: float = 0.75) -> list[WorkerId]:
    """At most ``size`` of ``workers`` for one request's ranking and placement (all of them when
    they are no more): the workers holding most of its prompt (``held``: blocks, by the index or
    the router's own record; the fewest requests in flight first among equals), at most
    ``holder_share`` of ``size``, then the others with the fewest requests in flight (ties in the
    rendezvous order of the prompt's ``key``: idle workers are drawn per group, not the same few
    for every group). Ranking and placement weigh every candidate per request (its TTFT, what it
    would evict, its pulls): on a large cluster a short list keeps a decision's work bounded."""
    if size <= 0 or len(workers) <= size:
        return list(workers)
    holders = sorted((w for w in workers if held.get(w, 0) > 0), key=lambda w: (-held[w], in_flight.get(w, 0), w))
    holders = holders[:max(1, int(holder_share * size))]
    taken = set(holders)
    order = rendezvous_order(key, workers)
    rest = sorted((w for w in workers if w not in taken), key=lambda w: (in_flight.get(w, 0), order[w]))
    return holders + rest[:size - len(holders)]


def _headroom(over: set[WorkerId], remote: set[WorkerId] = frozenset()) -> Callable[[WorkerView], tuple]:
    """The key that breaks near ties: fewest warm evictions; then not overloaded (its average
    queue wait within ``balance_ratio`` x the least-waiting worker's plus ``balance_abs_s``); then
    the fewest prefix blocks held (the most room for prefixes: private and free blocks are room
    alike, evicting them costs nothing); then not behind a slow link (``remote``); then the least
    loaded now; then the coldest victims. Prefixes held is what spreads new groups evenly over a
    cluster whose caches they fill (a worker given one more group than the rest evicts the others'
    prefixes while another's room lies unused; measured: 4/4/2/2 groups where 3/3/3/3 fit, session
    11). ``over``: the overloaded workers (``_overloaded``)."""
    return lambda v: (v.eviction[0], v.worker in over, v.shared_blocks, v.worker in remote, v.load,
                      v.eviction[1:], v.rank, v.worker)


def _remote(views: Sequence[WorkerView], c: PlacementConfig) -> set[WorkerId]:
    """Workers behind a slow link: a copy of the prompt's prefix from there takes more than
    ``remote_ratio`` x the quickest worker's plus ``remote_abs_s``. A group placed on one is pulled
    from there when it outgrows it (a hot prefix, a chat's shared system prompt), and each copy
    then takes seconds (the cluster bench, session 28: a chat whose first turn landed on the
    100 Mbit/s worker, pulls of 288 tokens from it 2.5-5 s, against ~0.2 s over 1 Gbit/s). A
    tie-break only: such a worker still takes new groups when it holds fewer prefixes."""
    if c.remote_ratio <= 0:
        return set()
    quickest = min(v.copy_out_s for v in views)
    limit = c.remote_ratio * quickest + c.remote_abs_s
    return {v.worker for v in views if v.copy_out_s > limit}


def _overloaded(views: Sequence[WorkerView], c: PlacementConfig) -> set[WorkerId]:
    if c.balance_ratio <= 0:
        return set()
    limit = c.balance_ratio * min(v.wait_avg_s for v in views) + c.balance_abs_s
    return {v.worker for v in views if v.wait_avg_s > limit}


def _idle_target(views: Sequence[WorkerView], best_h: WorkerView, best_h_s: float, prompt_prefill_s: float,
                 c: PlacementConfig) -> WorkerView | None:
    """The worker a busy holder's dominant group spills to because it is idle (``idle_slack``):
    nothing queued or decoding there, room for the copy without evicting a warm block, and its
    TTFT within ``idle_slack`` x the prompt's prefill of the holder's. The fastest such worker."""
    if c.idle_slack <= 0 or _in_flight(best_h, c.idle_counts_queued) < c.idle_busy_running:
        return None
    limit = best_h_s + c.idle_slack * prompt_prefill_s
    idle = [v for v in views if v.load <= 0 and v.running == 0 and v.eviction[0] == 0
            and v.local_blocks < best_h.local_blocks and v.ttft_s <= limit + 1e-12]
    return min(idle, key=lambda v: (v.ttft_s, v.rank, v.worker)) if idle else None


def _relief_target(views: Sequence[WorkerView], best_h: WorkerView, eff: Mapping[WorkerId, float],
                   contention_s: float, usable_blocks: int, block_charge: float,
                   c: PlacementConfig) -> WorkerView | None:
    """The worker a match goes to instead of its busy holder ``best_h`` because decoding there
    contends with fewer sequences (``PlacementConfig.contention_weight``): it evicts no warm block,
    has room for the copy and ``relief_room`` - 1 more like it, has fewer requests in flight, and
    its effective TTFT (``eff``: the spill rule's, with its eviction, repeated-prefill and pull
    terms) plus ``contention_s`` per request in flight, and ``block_charge`` x ``relief_copy_weight``
    per block the copy adds there, beats the holder's by ``spill_abs_s`` or ``tie_ratio``. The best
    such worker, or None."""
    if contention_s <= 0 or c.contention_weight <= 0:
        return None

    def total(v: WorkerView) -> float:
        copy = c.relief_copy_weight * block_charge * max(0, usable_blocks - v.local_blocks) if v is not best_h else 0.0
        return eff[v.worker] + contention_s * _in_flight(v) + copy

    busy = _in_flight(best_h)
    targets = [v for v in views if v.worker != best_h.worker and v.eviction[0] == 0 and _in_flight(v) < busy
               and (not c.relief_fill or v.fits(c.relief_room * (usable_blocks - v.local_blocks), c.prefix_fill))]
    if not targets:
        return None
    v = min(targets, key=lambda v: (total(v), v.rank, v.worker))
    held = total(best_h)
    return v if total(v) + max(c.spill_abs_s, c.tie_ratio * held) < held else None


def _in_flight(v: WorkerView, counts_queued: bool = True) -> int:
    """Requests in flight on ``v``: decoding, and the prompts queued or prefilling (their number
    unknown, or not ``counts_queued``: one if any)."""
    return v.running + max(v.queued if counts_queued else 0, int(v.load > 0))


def _match(holders: Sequence[WorkerView], best_h_s: float, headroom: Callable[[WorkerView], tuple],
           c: PlacementConfig) -> WorkerView:
    """The holder a match goes to: among those within ``tie_ratio`` of the fastest, by headroom;
    then, among the holders reusing as much as that one within ``match_tie`` of the fastest, the
    one with the fewest requests in flight (see ``PlacementConfig.match_tie``)."""
    best = min(_within(holders, best_h_s, c.tie_ratio, c.tie_abs_s), key=headroom)
    if c.match_tie <= 0:
        return best
    ties = [v for v in _within(holders, best_h_s, c.match_tie, c.tie_abs_s) if v.reused >= best.reused]
    return min(ties, key=lambda v: (v.eviction[0], _in_flight(v), v.load, headroom(v)))


def _within(views: Sequence[WorkerView], best_s: float, ratio: float, abs_s: float) -> list[WorkerView]:
    limit = best_s + max(abs_s, ratio * best_s)
    return [v for v in views if v.ttft_s <= limit + 1e-12]


def choose(views: Sequence[WorkerView], usable_blocks: int, prompt_prefill_s: float,
           config: PlacementConfig = PlacementConfig(), reuse_p: float | None = None,
           cluster_share: float | None = None, cluster_weight: float | None = None,
           contention_s: float = 0.0) -> Placement:
    """The worker for one request (see the module docstring for the rules). ``reuse_p``: the
    probability that an evicted warm block is needed again (None: ``config.reuse_prob``, or 1).
    ``cluster_share``: the prompt's group's share of the requests routed lately to all workers
    together (``Placer.cluster_share``; None: unknown, no idle spill); ``cluster_weight``: how many
    requests that share is of (``Placer.cluster_weight``, decayed; None: the share is taken as exact).
    ``contention_s``: what each request in flight on a worker adds to this request's decoding and
    this request to theirs, together (0: unknown, no relief; ``PlacementConfig.contention_weight``)."""
    if not views:
        raise ValueError("no workers to choose from")
    c = config
    p = reuse_p if reuse_p is not None else (c.reuse_prob if c.reuse_prob is not None else 1.0)
    block_s = prompt_prefill_s / max(1, usable_blocks)
    charge = c.evict_weight * p * block_s  # expected recompute, per warm block evicted
    threshold = max(c.min_match_blocks, c.min_match_fraction * usable_blocks)
    holders = [v for v in views if v.local_blocks >= threshold and v.local_blocks > 0]
    over = _overloaded(views, c)
    headroom = _headroom(over, _remote(views, c))
    if holders:
        best_h_s = min(v.ttft_s for v in holders)
        best_h = _match(holders, best_h_s, headroom, c)
        # a copy on a second worker takes cache space other groups may need (now or when they
        # arrive): only for an option faster by the spill margin, counting the warm blocks it
        # evicts at what recomputing them later costs (the prompt's prefill per block)
        # and the prefill it adds: blocks the holder reuses that this option computes again.
        # Under load that compute is taken from other requests (on shared or busy hardware it
        # is their delay), so a recompute copy must win by its own prefill too; a pull computes
        # nothing and pays only its transfer (in its TTFT).
        eff = {v.worker: v.ttft_s + charge * v.eviction[0]
               + c.compute_weight * max(0, best_h.reused - v.reused) * block_s
               - (1.0 - c.spill_pull_charge) * v.pull_s for v in views}
        best_eff = min(eff.values())
        dominant = best_h.group_share >= c.spill_group_share
        # its share of the cluster's recent traffic, in workers (None: nothing routed lately); for a
        # spill, the share it surely has (a lower bound, given how few requests it is measured on)
        share_w = None if cluster_share is None else cluster_share * len(views)
        sure_w = None if share_w is None else len(views) * share_lower_bound(cluster_share, cluster_weight, c.spill_share_z)
        worth = c.spill_share_margin is None or sure_w is None or sure_w >= len(holders) + c.spill_share_margin
        margin = best_eff * (1 + c.spill_ratio) + c.spill_abs_s
        if not worth:  # a minor group: only from a swamped holder
            margin = None if c.minor_spill_prefills is None else margin + c.minor_spill_prefills * prompt_prefill_s
        spill = dominant and margin is not None and best_h_s > margin
        # an overloaded holder: any group, and no margin ("balance": a spill only overload allows)
        balance = not spill and best_h.worker in over and best_h_s > best_eff + c.tie_abs_s
        if spill or balance:
            limit = best_eff + max(c.tie_abs_s, c.tie_ratio * best_eff)
            # a copy does not fill a worker's pool with prefixes (``prefix_fill``)
            targets = [v for v in views if eff[v.worker] <= limit + 1e-12
                       and (v in holders or v.fits(usable_blocks - v.local_blocks, c.prefix_fill))]
            if targets:
                v = min(targets, key=headroom)
                return Placement(v.worker, "spill" if spill else "balance", v)
        relief = _relief_target(views, best_h, eff, contention_s, usable_blocks, charge, c)
        if relief is not None:
            return Placement(relief.worker, "relieve", relief)
        # a group whose share of the traffic is worth one more holder: as many holders as its share
        # of the workers (a hot group; not one of many whose few requests lately happen to weigh)
        hot = share_w is not None and share_w >= len(holders) + c.idle_share_margin
        idle = _idle_target(views, best_h, best_h_s, prompt_prefill_s, c) if dominant and hot else None
        if idle is not None:
            return Placement(idle.worker, "idle", idle)
        return Placement(best_h.worker, "match", best_h)
    # a new prefix: its own TTFT (without the decode term unless ``place_counts_decode``) plus the
    # expected recompute of the warm blocks it evicts (p(reuse) x their prefill), among the workers
    # within the slack of the fastest; ties (within place_tie x its prefill too) by headroom (warm
    # evictions, overload, prefixes held, load)
    ttft = {v.worker: v.ttft_s - (0.0 if c.place_counts_decode else v.decode_s) for v in views}
    fastest = min(ttft.values())
    # only workers whose pools keep room for their requests' blocks after taking the prefix, when
    # one of them is within ``fill_slack`` prefills of the fastest (``prefix_fill``)
    room = [v for v in views if v.fits(usable_blocks - v.local_blocks, c.prefix_fill)]
    if room and len(room) < len(views):
        best_room = min(ttft[v.worker] for v in room)
        if best_room <= fastest + max(c.place_abs_s, c.fill_slack * prompt_prefill_s) + 1e-12:
            views, fastest = room, best_room
    slack = max(c.place_abs_s, c.place_slack * prompt_prefill_s)
    eligible = [v for v in views if ttft[v.worker] <= fastest + slack + 1e-12]
    cost = {v.worker: ttft[v.worker] + charge * v.eviction[0] for v in eligible}
    best = min(cost.values())
    limit = best + max(c.tie_abs_s, c.tie_ratio * best, c.place_tie * prompt_prefill_s)
    v = min((v for v in eligible if cost[v.worker] <= limit + 1e-12), key=headroom)
    return Placement(v.worker, "place", v)


def _with_unranked(v: WorkerView, tokens: float, prompt_tokens: int) -> WorkerView:
    """``v`` with ``tokens`` more queued than its ranking knew: its TTFT later by their prefill at
    the rate its candidate computes this prompt's uncached tokens."""
    c = v.candidate
    if tokens <= 0 or c is None:
        return v
    return replace(v, ttft_s=v.ttft_s + tokens * c.prefill_s / max(1, prompt_tokens - c.cached_tokens))


def decision_record(kind: str, worker: WorkerId, key: bytes, prompt_tokens: int, usable_blocks: int,
                    prefill_s: float, views: Sequence[WorkerView], now: float) -> dict:
    """One entry of ``Placer.log``: the rule, the chosen worker, the prompt's group (its leading
    key's first 8 hex digits), its size and prefill, and per candidate what the rules compared:
    TTFT, blocks it holds, warm blocks it would evict, prefix blocks of its pool, load, running
    (the ``DECISION_CANDIDATES`` fastest and the chosen one: a log of a large pool stays small)."""
    fastest = sorted(views, key=lambda v: (v.ttft_s, v.worker))[:DECISION_CANDIDATES]
    views = fastest + [v for v in views if v.worker == worker and all(f.worker != worker for f in fastest)]
    return {"t": round(now, 3), "kind": kind, "worker": worker, "group": key.hex()[:8],
            "prompt_tokens": prompt_tokens, "usable_blocks": usable_blocks, "prefill_s": round(prefill_s, 4),
            "candidates": {v.worker: {"ttft_s": round(v.ttft_s, 4), "local": v.local_blocks, "evict": v.eviction[0],
                                      "prefix": v.prefix_blocks, "capacity": v.capacity, "load": v.load,
                                      "running": v.running, "queued": v.queued, "wait_avg_s": round(v.wait_avg_s, 4),
                                      "share": round(v.group_share, 3)} for v in views}}


class DomainActivity:
    """How often each domain (a tenant's prompts) sends, and which stopped: a domain is idle when
    nothing came from it for ``gaps`` x its mean interval between requests (an exponential average
    with weight ``alpha``), once ``min_requests`` were seen. ``gaps`` 0: none is ever idle."""

    def __init__(self, gaps: float = 4.0, min_requests: int = 4, alpha: float = 0.25, max_domains: int = 4096):
        self.gaps, self.min_requests, self.alpha, self.max_domains = gaps, min_requests, alpha, max_domains
        self._seen: OrderedDict[str, tuple[float, float, int]] = OrderedDict()  # domain -> (last, mean gap, requests)

    def observe(self, domain: str, now: float) -> None:
        last, gap, n = self._seen.pop(domain, (now, 0.0, 0))
        if n:
            gap = now - last if n == 1 else gap + self.alpha * (now - last - gap)
        self._seen[domain] = (now, gap, n + 1)
        while len(self._seen) > self.max_domains:
            self._seen.popitem(last=False)

    def idle(self, now: float) -> frozenset[str]:
        if self.gaps <= 0:
            return frozenset()
        return frozenset(d for d, (last, gap, n) in self._seen.items()
                         if n >= self.min_requests and now - last > self.gaps * gap)


class Placer:
    """Placement state of one router: a ``ShadowCache`` per worker (capacity in blocks; a worker
    of unknown capacity gets ``default_capacity``)."""

    def __init__(self, config: PlacementConfig | None = None, default_capacity: int = 1 << 20):
        self.config = config or PlacementConfig()
        self.default_capacity = default_capacity
        self.shadows: dict[WorkerId, ShadowCache] = {}
        self._holders: Counter[Hashable] = Counter()  # per shareable key, the shadows holding it
        self._heads: dict[Hashable, set[WorkerId]] = {}  # per chain head, the workers whose shadows hold it
        self.placements: Counter[str] = Counter()  # decisions by rule (match | spill | balance | idle | place; -fallback)
        # the last ``DECISION_LOG`` decisions that give a group a worker (every rule but "match"),
        # with what each candidate looked like: how a group split over the workers came about
        self.log: deque[dict] = deque(maxlen=DECISION_LOG)
        # the last ``DECISION_LOG`` matches that kept a request on its holder though another
        # candidate's TTFT was lower by the spill margin (``spill_ratio``, ``spill_abs_s``: the rules
        # weighed more than TTFT, e.g. the evictions a copy makes; kind "match", with the
        # inputs of the rules besides the candidates: p(reuse), the group's cluster share, contention)
        self.held: deque[dict] = deque(maxlen=DECISION_LOG)
        c = self.config
        self.reuse = ReuseEstimate(c.warm_s, c.reuse_prior, c.reuse_window)  # fed by every shadow's evictions
        # per worker: group key -> its routed requests, decayed to ``_recent_at[worker]``
        self.recent: dict[WorkerId, dict[bytes, float]] = {}
        self._recent_at: dict[WorkerId, float] = {}
        self._recent_total: dict[WorkerId, float] = {}
        self._wait: dict[WorkerId, tuple[float, float, float]] = {}  # per worker: average, last sample, its time
        self.domains = DomainActivity(c.domain_idle_gaps, c.domain_idle_min)

    @property
    def reuse_p(self) -> float:
        """The p(reuse) decisions use: the configured one, else the measured one."""
        return self.config.reuse_prob if self.config.reuse_prob is not None else self.reuse.p

    def shadow(self, worker: WorkerId, capacity_blocks: int | None = None) -> ShadowCache:
        s = self.shadows.get(worker)
        if s is None or (capacity_blocks and s.capacity != capacity_blocks):
            s = self.shadows[worker] = s.resized(capacity_blocks) if s is not None else ShadowCache(
                capacity_blocks or self.default_capacity, self.reuse.evicted, self.config.prefix_seed_s, self._holders,
                self._heads, worker)
        return s

    def remove(self, worker: WorkerId) -> None:
        s = self.shadows.pop(worker, None)
        if s is not None:
            s.release()
        self._wait.pop(worker, None)
        for d in (self.recent, self._recent_at, self._recent_total):
            d.pop(worker, None)

    def observe_wait(self, worker: WorkerId, wait_s: float, now: float) -> float:
        """Fold a sample of ``worker``'s queue wait into its time average (each sample holds until
        the next; ``balance_tau_s`` time constant) and return the average. A worker's queue at one
        instant is noise (a burst, a long prompt); its average over tens of seconds is the share of
        the traffic its groups bring, which per-request choices never see."""
        prev = self._wait.get(worker)
        if prev is None:
            self._wait[worker] = (wait_s, wait_s, now)
            return wait_s
        avg, last, t = prev
        tau = self.config.balance_tau_s
        avg = last + (avg - last) * math.exp(-max(0.0, now - t) / tau) if tau > 0 else wait_s
        self._wait[worker] = (avg, wait_s, max(t, now))
        return avg

    def pending_tokens(self, chains: Mapping[str, Sequence[bytes]], holdings: Mapping[WorkerId, int] | None,
                       workers: Sequence[WorkerId], prompt_tokens: int, block_size: int,
                       now: float) -> dict[WorkerId, int]:
        """Step 1 of a decision: per worker, prompt tokens it holds by the router's own record
        (for the cost model's ``pending``: they count as the worker's own prefix). ``holdings``
        None: the index did not answer (its record is then kept as it is, not reconciled)."""
        held = None if holdings is None else _held_blocks(holdings, prompt_tokens, block_size)
        return {w: n * block_size for w, n in self.pending(chains, held, workers, now).items()}

    def decide(self, prompt_ids: Sequence[int], max_tokens: int, block_size: int,
               chains: Mapping[str, Sequence[bytes]], own_domain: str, holdings: Mapping[WorkerId, int] | None,
               workers: Sequence[WorkerId], loads: Mapping[WorkerId, float], ranking: Sequence[Candidate] | None,
               now: float, reuse: bool = True, running: Mapping[WorkerId, int] | None = None,
               unranked: Mapping[WorkerId, float] | None = None,
               queued: Mapping[WorkerId, int] | None = None, row_s: float = 0.0,
               decode_tokens: int | None = None) -> Placement | None:
        """Step 2: the placement of one request, and (``reuse``) its record in the chosen
        worker's shadow cache. ``holdings``: the index's prompt tokens per worker; ``chains``:
        the prompt's block hashes per readable domain (own domain ``own_domain``); ``loads``:
        per worker, queued prompt tokens to compute; ``ranking``: the cost model's best
        candidate per worker (None: decide from the loads alone); ``running``: per worker, sequences
        decoding (None: unknown, read as 0); ``queued``: per worker, prompts without a first token
        yet (None: unknown, its queued tokens counting one); ``unranked``: per worker, prompt tokens queued there
        since the ranking's loads were taken (requests routed while it was computed: a burst of
        prompts ranked at once all see the same idle worker), added to its TTFT at its own prefill
        rate for this prompt; ``row_s``: seconds one more sequence in flight adds to a worker's output
        token (learned: ``policies.routing.DecodeModel`` over requests' seconds per output token
        against the sequences beside them; 0: unknown, no contention term); ``decode_tokens``: the
        output tokens the request is expected to produce (None: ``max_tokens``). None when no worker
        fits."""
        prompt = len(prompt_ids)
        usable = max(0, (prompt - 1) // block_size)
        held = None if holdings is None else _held_blocks(holdings, prompt, block_size)
        pending = self.pending(chains, held, workers, now) if chains else {}
        local = {w: max((held or {}).get(w, 0), pending.get(w, 0)) for w in workers}
        own = list(chains.get(own_domain, ()))
        if reuse:
            self.reuse.asked([k for chain in chains.values() for k in chain], now)
            for domain in {own_domain, *chains}:  # a domain is in use while prompts that may read it come
                self.domains.observe(domain, now)
        total = -(-(prompt + max_tokens) // block_size)
        proxy = {w: PROXY_TOKEN_S * (loads.get(w, 0.0) + prompt - local[w] * block_size) for w in workers}
        key = leading_key(own, prompt_ids, self.config.key_blocks)
        groups = {key} | {leading_key(chain, prompt_ids, self.config.key_blocks) for chain in chains.values()}
        views = self.views(ranking or None, workers, local, total, loads, key, now, proxy, block_size, groups, running,
                           queued)
        if not views:
            return None
        if unranked:
            views = [_with_unranked(v, unranked.get(v.worker, 0.0), prompt) for v in views]
        prefill = full_prefill_s(ranking, prompt) if ranking else PROXY_TOKEN_S * prompt
        steps = max(0, (max_tokens if decode_tokens is None else min(max_tokens, decode_tokens)) - 1)
        contention = self.config.contention_weight * 2.0 * max(0.0, row_s) * steps if ranking else 0.0
        share = self.cluster_share(groups, now)
        placed = choose(views, usable, prefill, self.config, self.reuse_p, share, self.cluster_weight(now), contention)
        self.count_routed(placed.worker, key, now)
        kind = placed.kind if ranking else f"{placed.kind}-fallback"
        self.placements[kind] += 1
        if placed.kind != "match":
            self.log.append(decision_record(kind, placed.worker, key, prompt, usable, prefill, views, now))
        elif ranking and placed.view.ttft_s > min(v.ttft_s for v in views) * (1 + self.config.spill_ratio) \
                + self.config.spill_abs_s:  # (without estimates the "TTFTs" are queued tokens)
            self.held.append(dict(decision_record(kind, placed.worker, key, prompt, usable, prefill, views, now),
                                  reuse_p=round(self.reuse_p, 4), contention_s=round(contention, 4),
                                  cluster_share=None if share is None else round(share, 4)))
        if reuse:
            self.commit(placed.worker, own, max(0, total - len(own)), now, own_domain)
        return placed

    def pending(self, chains: Mapping[str, Sequence[bytes]], holdings_blocks: Mapping[WorkerId, int] | None,
                workers: Sequence[WorkerId], now: float) -> dict[WorkerId, int]:
        """Per worker, prompt blocks it holds by the router's own record (routed there, maybe
        not yet indexed), after reconciling with the index's ``holdings_blocks``. None: the
        index did not answer, so nothing is reconciled (a timed-out lookup is not evidence that
        a prefix is gone: treating it as such emptied the record under load)."""
        out: dict[WorkerId, int] = {}
        holding: set[WorkerId] = set()  # only shadows with a chain's head hold any of it
        for chain in chains.values():
            if chain:
                holding.update(self._heads.get(chain[0], ()))
        if not holding:
            return out
        for w in workers:
            if w not in holding:
                continue
            s = self.shadows[w]
            best = 0
            for chain in chains.values():
                # a shadow holds a chain's blocks from its first (a prompt's blocks enter together and
                # leave deepest first): one without the first has nothing of it to reconcile
                if holdings_blocks is not None and chain and chain[0] in s:
                    s.reconcile(chain, holdings_blocks.get(w, 0), now, self.config.index_lag_s)
                best = max(best, s.match(chain))
            if best:
                out[w] = best
        return out

    def views(self, ranking: Sequence[Candidate] | None, workers: Sequence[WorkerId],
              local_blocks: Mapping[WorkerId, int], new_blocks: int, loads: Mapping[WorkerId, float],
              key: bytes, now: float, fallback_ttft: Mapping[WorkerId, float] | None = None,
              block_size: int | None = None, groups: frozenset[bytes] | set[bytes] = frozenset(),
              running: Mapping[WorkerId, int] | None = None,
              queued: Mapping[WorkerId, int] | None = None) -> list[WorkerView]:
        """One ``WorkerView`` per worker from the cost model's ``ranking`` (best candidate per
        worker), or, without one, from ``fallback_ttft``/the loads."""
        order = rendezvous_order(key, workers)
        quiet = self.domains.idle(now)
        by_worker = {c.worker: c for c in ranking or ()}
        out = []
        for w in workers:
            cand = by_worker.get(w)
            if ranking is not None and cand is None:
                continue  # the cost model does not know this worker (yet)
            have = local_blocks.get(w, 0)
            ttft = cand.expected_ttft_s if cand is not None else (fallback_ttft or {}).get(w, loads.get(w, 0.0))
            reused = max(have, cand.cached_tokens // block_size) if cand is not None and block_size else None
            shadow = self.shadow(w)
            cost = shadow.eviction_cost(max(0, new_blocks - have), now, self.config.warm_s,
                                        counted=self.config.discount_held_elsewhere)
            wait = self.observe_wait(w, cand.wait_s, now) if cand is not None else 0.0
            out.append(WorkerView(w, ttft, have, cost, loads.get(w, 0.0), order[w], cand, reused,
                                  self.group_share(w, groups or {key}, now), wait, shadow.shared,
                                  (running or {}).get(w, 0), shadow.prefix_blocks(now, quiet), shadow.capacity,
                                  (queued or {}).get(w, 0)))
        return out

    def count_routed(self, worker: WorkerId, key: bytes, now: float) -> None:
        """A request of group ``key`` was routed to ``worker`` at ``now``. Weights are kept in a
        frame that starts at ``_recent_at[worker]`` (a request at t weighs exp((t - start) /
        group_tau_s)), so that shares need no decay step; the frame moves on (and groups whose
        weight fell under 1% of a request are forgotten) once weights grow past e^10."""
        tau = max(self.config.group_tau_s, 1e-9)
        counts = self.recent.setdefault(worker, {})
        start = self._recent_at.setdefault(worker, now)
        x = (now - start) / tau
        if x > 10.0:
            f = math.exp(-x)
            self.recent[worker] = counts = {k: v * f for k, v in counts.items() if v * f >= 0.01}
            self._recent_total[worker] = sum(counts.values())
            self._recent_at[worker], x = now, 0.0
        w = math.exp(max(x, 0.0))
        counts[key] = counts.get(key, 0.0) + w
        self._recent_total[worker] = self._recent_total.get(worker, 0.0) + w

    def group_share(self, worker: WorkerId, keys: set[bytes] | frozenset[bytes], now: float) -> float:
        """The share of the requests routed to ``worker`` lately (weights decaying with
        ``group_tau_s``) that were of the prompt's group: the best over ``keys``, the prompt's
        ``leading_key`` under each domain it may read (a grantee's prompt is of the owner's group
        where it reads the owner's blocks). 1 when nothing was routed there lately (a holder this
        router never fed, or not for a long time: nothing says it serves other groups)."""
        counts = self.recent.get(worker)
        if not counts:
            return 1.0
        total = self._recent_total[worker]
        tau = max(self.config.group_tau_s, 1e-9)
        if total * math.exp(-(now - self._recent_at[worker]) / tau) < 0.01:
            return 1.0  # nothing routed there for many time constants
        return max(counts.get(k, 0.0) for k in keys) / total

    def cluster_share(self, keys: set[bytes] | frozenset[bytes], now: float) -> float | None:
        """The share of the requests routed lately to all workers together (weights decaying with
        ``group_tau_s``) that were of the prompt's group (the best over ``keys``, as ``group_share``).
        None when nothing was routed lately."""
        total = self.cluster_weight(now)
        if total < 0.01 or not keys:
            return None
        return max(sum(counts.get(k, 0.0) * self._decay(w, now) for w, counts in self.recent.items())
                   for k in keys) / total

    def cluster_weight(self, now: float) -> float:
        """How many requests were routed lately to all workers together (each weighing
        exp(-age / ``group_tau_s``)): the sample behind ``cluster_share``."""
        return sum(self._recent_total[w] * self._decay(w, now) for w in self.recent)

    def _decay(self, worker: WorkerId, now: float) -> float:
        """The factor that brings ``worker``'s stored weights (kept in the frame that starts at
        ``_recent_at[worker]``) to ``now``."""
        return math.exp(-max(0.0, now - self._recent_at[worker]) / max(self.config.group_tau_s, 1e-9))

    def groups_per_worker(self, now: float, min_weight: float = 0.5) -> dict[WorkerId, int]:
        """Per worker, the prefix groups routed there lately: those whose decayed request count
        (``group_tau_s``) is at least ``min_weight`` (0.5: a request within ~0.7 x tau). Groups are
        sticky, so this is the split of the groups, and of their load, over the workers."""
        out: dict[WorkerId, int] = {}
        for w, counts in self.recent.items():
            f = self._decay(w, now)
            out[w] = sum(1 for v in counts.values() if v * f >= min_weight)
        return out

    def commit(self, worker: WorkerId, chain: Sequence[bytes], private_blocks: int, now: float,
               domain: str | None = None) -> None:
        """Record that a request using ``chain`` (its own domain ``domain``'s hashes) went to ``worker``."""
        self.shadow(worker).touch(chain, private_blocks, now, domain)


def share_lower_bound(share: float, weight: float | None, z: float) -> float:
    """The Wilson score lower bound of a share measured on ``weight`` requests, ``z`` standard
    errors below (``weight`` None or ``z`` 0: the share itself). 4 of 15 requests (0.27) is at
    least 0.17 at z = 1; 39 of 39, 0.975."""
    if weight is None or weight <= 0 or z <= 0:
        return share
    p, n, z2 = min(1.0, max(0.0, share)), weight, z * z
    centre = p + z2 / (2 * n)
    spread = z * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n))
    return max(0.0, (centre - spread) / (1 + z2 / n))


def full_prefill_s(ranking: Sequence[Candidate], prompt_tokens: int) -> float:
    """The prompt's prefill time without any cached prefix, from a ranking: the least-cached
    candidate's estimate of it (``Candidate.full_prefill_s``), else (a candidate without one) that
    candidate's prefill scaled to the whole prompt. The scaled figure counts the fixed cost of a
    prefill once per computed token: where every worker holds or can pull the prefix it read 7-24 s
    for a 552-token prompt that takes 3.3 s (the cluster bench's placement log, session 29), and
    every rule priced in prompt prefills (evictions, repeated compute, the idle and minor-spill
    margins, a new prefix's slack) was off by that much."""
    c = min(ranking, key=lambda c: (c.cached_tokens, c.worker))
    if c.full_prefill_s > 0:
        return c.full_prefill_s
    return c.prefill_s * prompt_tokens / max(1, prompt_tokens - c.cached_tokens)


def _held_blocks(holdings: Mapping[WorkerId, int], prompt_tokens: int, block_size: int) -> dict[WorkerId, int]:
    usable = max(0, (prompt_tokens - 1) // block_size)
    return {w: min(t // block_size, usable) for w, t in holdings.items()}


def leading_key(chain: Sequence[bytes], prompt_ids: Sequence[int], key_blocks: int) -> bytes:
    """The rendezvous key of a prompt: its ``key_blocks``-th block hash (or its deepest one), or,
    for a prompt shorter than a block, its tokens."""
    if chain:
        return chain[min(len(chain), key_blocks) - 1]
    return b"".join(int(t).to_bytes(4, "little") for t in prompt_ids[:64])
