"""Benchmark workloads as data: pure generators, a Mooncake trace reader and the oracle.

No model, no HTTP: each generator returns ``WorkItem``s (token-id prompts, arrival offsets,
tenant, share domain) that a load generator (``bench/loadgen.py``) sends as
``{"prompt": [ids...]}`` completions, and that ``oracle_hits`` scores. Prompts are token ids so
that block-aligned hit counts are exact and the same for every configuration.

  * ``shared_prefix``: groups x users; each group's system prompt, each user's question (the shape
    of inference-perf's ``shared_prefix`` and SGLang's ``generated-shared-prefix``);
  * ``multi_turn``: sessions whose turn ``t`` prompt is the whole conversation so far (previous
    prompts, a synthetic assistant reply of ``output_len`` tokens, the new user turn);
  * ``multi_tenant``: 3+ tenants with Zipf-popular prefixes, Poisson arrivals, one tenant reading
    another's KV by a grant (``multi_tenant_tenants`` is the matching tenants file);
  * ``read_mooncake`` / ``write_mooncake``: Mooncake-format JSONL traces (``timestamp`` ms,
    ``input_length``, ``output_length``, ``hash_ids`` of fixed-size blocks), scaled to this machine
    (tokens per hash block, time, request count); a hash id always expands to the same tokens.

``oracle_hits``: one infinite cache per share domain; a request hits the longest block-aligned
prefix already seen in a domain it may read, never its last token (the engine always computes
it), exactly as kvmesh counts ``cached_tokens``.

Invariants: generators are deterministic in their seed; token ids lie in ``[low, vocab_size)``;
every prompt is non-empty; arrival offsets are non-decreasing.
"""

from __future__ import annotations

import hashlib
import json
import math
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Sequence

MOONCAKE_BLOCK = 512  # tokens per hash id in published Mooncake traces


@dataclass(frozen=True)
class WorkItem:
    """One request. ``at_s``: arrival offset from the start (open loop; closed loop ignores it).
    ``domain``/``read_domains``: the share domains it writes / may also read (the oracle's view of
    the tenant's grants). ``group``/``session``: labels for reports."""

    prompt_ids: tuple[int, ...]
    max_tokens: int
    at_s: float = 0.0
    tenant: str = "default"
    domain: str = "default"
    read_domains: tuple[str, ...] = ()
    group: str = ""
    session: str = ""

    def __post_init__(self):
        if not self.prompt_ids:
            raise ValueError("a work item needs a non-empty prompt")
        if self.max_tokens < 1:
            raise ValueError("max_tokens must be >= 1")


@dataclass(frozen=True)
class Vocab:
    """Token ids drawn from ``[low, vocab_size)`` (``low`` skips special tokens)."""

    vocab_size: int = 49152  # SmolLM2
    low: int = 100

    def __post_init__(self):
        if not 0 <= self.low < self.vocab_size:
            raise ValueError("need 0 <= low < vocab_size")

    def tokens(self, rng: random.Random, n: int) -> tuple[int, ...]:
        return tuple(rng.randrange(self.low, self.vocab_size) for _ in range(n))

    def seeded(self, key: str, n: int) -> tuple[int, ...]:
        """``n`` tokens that depend only on ``key`` (stable across runs and processes)."""
        seed = int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "little")
        return self.tokens(random.Random(seed), n)


TINY_VOCAB = Vocab(vocab_size=259, low=3)  # tiny-llama's byte tokenizer: bytes shifted by 3


def poisson_arrivals(n: int, rate_per_s: float | None, rng: random.Random) -> list[float]:
    """``n`` arrival offsets of a Poisson process (all 0 when ``rate_per_s`` is None: a burst)."""
    if rate_per_s is None:
        return [0.0] * n
    if rate_per_s <= 0:
        raise ValueError("rate_per_s must be > 0")
    t, out = 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate_per_s)
        out.append(t)
    return out


# -- shared prefix ---------------------------------------------------------------------------
def shared_prefix(groups: int = 4, users: int = 6, system_len: int = 600, question_len: int = 40,
                  output_len: int = 16, rate_per_s: float | None = None, shuffle: bool = True, seed: int = 0,
                  vocab: Vocab = Vocab(), tenant: str = "default", domain: str | None = None) -> list[WorkItem]:
    """``groups * users`` requests: group ``g``'s system prompt (``system_len`` tokens) followed by
    one user's question (``question_len``). ``shuffle``: groups interleave in a random order (as
    a load generator drawing users at random sends them); else group by group."""
    if groups < 1 or users < 1 or system_len < 0 or question_len < 1:
        raise ValueError("need groups, users, question_len >= 1 and system_len >= 0")
    rng = random.Random(seed)
    systems = [vocab.tokens(rng, system_len) for _ in range(groups)]
    pairs = [(g, u) for g in range(groups) for u in range(users)]
    if shuffle:
        rng.shuffle(pairs)
    times = poisson_arrivals(len(pairs), rate_per_s, rng)
    return [WorkItem(systems[g] + vocab.tokens(rng, question_len), output_len, t, tenant, domain or tenant,
                     group=f"g{g}", session=f"g{g}u{u}") for (g, u), t in zip(pairs, times)]


# -- multi-turn chat -------------------------------------------------------------------------
def multi_turn(sessions: int = 8, turns: int = 4, system_len: int = 200, user_len: int = 40, output_len: int = 32,
               shared_system: bool = True, rate_per_s: float | None = None, think_s: float = 0.0, seed: int = 0,
               vocab: Vocab = Vocab(), tenant: str = "default") -> list[WorkItem]:
    """Each session's turn ``t`` prompt = system prompt + (user turn, assistant reply) * t + user
    turn ``t``; the assistant replies are synthetic ``output_len``-token stand-ins (so the oracle
    is exact; the served reply differs, as in SGLang's multi-turn bench). Sessions start as a
    Poisson process; a session's next turn arrives ``think_s`` after its previous one. Items are
    sorted by arrival, turns of one session in order."""
    if sessions < 1 or turns < 1:
        raise ValueError("need sessions, turns >= 1")
    rng = random.Random(seed)
    common = vocab.tokens(rng, system_len)
    starts = poisson_arrivals(sessions, rate_per_s, rng)
    items: list[WorkItem] = []
    for s, t0 in enumerate(starts):
        convo = common if shared_system else vocab.tokens(rng, system_len)
        for t in range(turns):
            convo = convo + vocab.tokens(rng, user_len)
            items.append(WorkItem(convo, output_len, t0 + t * think_s, tenant, tenant, group="chat",
                                  session=f"s{s}"))
            convo = convo + vocab.tokens(rng, output_len)  # the reply the next turn carries
    items.sort(key=lambda w: w.at_s)  # stable: a session's turns keep their order at equal times
    return items


# -- multi-tenant mix ------------------------------------------------------------------------
@dataclass(frozen=True)
class TenantMix:
    """One tenant of ``multi_tenant``: its share of the requests, how many prefixes it draws from
    (Zipf with exponent ``zipf_s``), their length, and (``reads_from``) a grantor whose prefixes
    it uses with probability ``borrow_p``."""

    name: str
    weight: float = 1.0
    prefixes: int = 8
    prefix_len: int = 400
    zipf_s: float = 1.1
    reads_from: str | None = None
    borrow_p: float = 0.5


DEFAULT_MIX = (TenantMix("acme", 2.0, prefixes=8), TenantMix("globex", 1.0, prefixes=4, reads_from="acme"),
               TenantMix("initech", 1.0, prefixes=16, prefix_len=300, zipf_s=0.8))


def zipf_weights(n: int, s: float) -> list[float]:
    w = [1.0 / (k + 1) ** s for k in range(n)]
    total = sum(w)
    return [x / total for x in w]


def multi_tenant(requests: int = 96, rate_per_s: float | None = 4.0, tenants: Sequence[TenantMix] = DEFAULT_MIX,
                 question_len: int = 40, output_len: int = 16, seed: int = 0, vocab: Vocab = Vocab()) -> list[WorkItem]:
    """``requests`` Poisson arrivals, each of a tenant drawn by weight; its prompt = one of the
    tenant's prefixes (Zipf popularity; a grantee borrows the grantor's with ``borrow_p``) + a
    fresh question. A tenant's domain is its name; a grantee also reads the grantor's domain."""
    names = {t.name for t in tenants}
    if len(tenants) < 1 or len(names) != len(tenants):
        raise ValueError("tenant names must be unique")
    for t in tenants:
        if t.reads_from is not None and t.reads_from not in names:
            raise ValueError(f"{t.name} reads from unknown tenant {t.reads_from!r}")
    rng = random.Random(seed)
    pools = {t.name: [vocab.tokens(rng, t.prefix_len) for _ in range(t.prefixes)] for t in tenants}
    zipf = {t.name: zipf_weights(t.prefixes, t.zipf_s) for t in tenants}
    by_name = {t.name: t for t in tenants}
    times = poisson_arrivals(requests, rate_per_s, rng)
    items = []
    for t_s in times:
        t = rng.choices(tenants, weights=[x.weight for x in tenants])[0]
        owner = t.reads_from if t.reads_from and rng.random() < t.borrow_p else t.name
        k = rng.choices(range(by_name[owner].prefixes), weights=zipf[owner])[0]
        prompt = pools[owner][k] + vocab.tokens(rng, question_len)
        items.append(WorkItem(prompt, output_len, t_s, t.name, t.name,
                              read_domains=(t.reads_from,) if t.reads_from else (), group=f"{owner}/p{k}"))
    return items


def multi_tenant_tenants(tenants: Sequence[TenantMix] = DEFAULT_MIX) -> dict:
    """The tenants file (``KVMESH_TENANTS``) matching a mix: key ``sk-<name>``; a grantee's
    grantor lists it in ``share_with``."""
    grants: dict[str, list[str]] = {}
    for t in tenants:
        if t.reads_from:
            grants.setdefault(t.reads_from, []).append(t.name)
    return {"tenants": [{"name": t.name, "api_keys": [f"sk-{t.name}"], "share_with": grants.get(t.name, [])}
                        for t in tenants]}


# -- Mooncake traces -------------------------------------------------------------------------
@dataclass(frozen=True)
class TraceScale:
    """How a Mooncake trace maps onto this machine: ``tokens_per_hash`` tokens per hash block
    (published traces use 512), ``time_scale`` multiplies timestamps (0.1: ten times faster),
    ``max_requests``/``max_input_tokens``/``max_output_tokens`` bound the replay."""

    tokens_per_hash: int = 16
    time_scale: float = 1.0
    max_requests: int | None = None
    max_input_tokens: int | None = 1536
    max_output_tokens: int | None = 64
    source_block: int = MOONCAKE_BLOCK


def read_mooncake(path: str | Path, scale: TraceScale = TraceScale(), vocab: Vocab = Vocab(),
                  tenant: str = "default") -> list[WorkItem]:
    """Mooncake JSONL (one ``{"timestamp", "input_length", "output_length", "hash_ids"}`` per line)
    as work items (``mooncake_items``). Bad lines raise ``ValueError`` naming the file and the
    record (its non-blank line) number."""
    def records():
        with open(path) as f:
            for number, line in enumerate((line for line in f if line.strip()), 1):
                try:
                    yield json.loads(line)
                except ValueError as e:
                    raise ValueError(f"{path}:{number}: not a Mooncake record ({e!r})") from None

    return mooncake_items(records(), scale, vocab, tenant, where=str(path))


def mooncake_items(records: Iterable[dict], scale: TraceScale = TraceScale(), vocab: Vocab = Vocab(),
                   tenant: str = "default", where: str = "trace") -> list[WorkItem]:
    """Mooncake records as work items. Hash id ``h`` always expands to the same ``tokens_per_hash``
    tokens, so requests sharing leading hash ids share a token prefix; ``input_length`` scales by
    ``tokens_per_hash / source_block`` (never beyond the hash blocks, at least one token); the
    first timestamp becomes offset 0. A bad record raises ``ValueError`` naming ``where`` and its
    number (1-based)."""
    items: list[WorkItem] = []
    t_first = None
    for lineno, rec in enumerate(records, 1):
        try:
            ts, n_in, n_out = float(rec["timestamp"]), int(rec["input_length"]), int(rec["output_length"])
            hashes = [int(h) for h in rec["hash_ids"]]
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{where}:{lineno}: not a Mooncake record ({e!r})") from None
        if n_in < 1 or n_out < 0 or not hashes:
            raise ValueError(f"{where}:{lineno}: needs input_length >= 1, output_length >= 0 and hash_ids")
        t_first = ts if t_first is None else t_first
        tokens: tuple[int, ...] = ()
        for h in hashes:
            tokens += vocab.seeded(f"mooncake-hash-{h}", scale.tokens_per_hash)
        n = min(len(tokens), max(1, math.ceil(n_in * scale.tokens_per_hash / scale.source_block)))
        if scale.max_input_tokens is not None:
            n = min(n, scale.max_input_tokens)
        out = max(1, n_out if scale.max_output_tokens is None else min(n_out, scale.max_output_tokens))
        items.append(WorkItem(tokens[:n], out, (ts - t_first) / 1000.0 * scale.time_scale, tenant, tenant,
                              group=f"h{hashes[0]}"))
        if scale.max_requests is not None and len(items) >= scale.max_requests:
            break
    items.sort(key=lambda w: w.at_s)
    return items


def generate_mooncake(requests: int = 200, rate_per_s: float = 2.0, system_prompts: int = 6, sessions: int = 40,
                      seed: int = 0) -> list[dict]:
    """A synthetic trace in Mooncake's format with its kinds of sharing: a few popular system
    prompts (Zipf), sessions that grow turn by turn (a turn's hash ids extend its previous turn's),
    and one-off documents. Lengths are in the trace's 512-token units."""
    rng = random.Random(seed)
    next_id = 0

    def fresh(n: int) -> list[int]:
        nonlocal next_id
        ids = list(range(next_id, next_id + n))
        next_id += n
        return ids

    systems = [fresh(rng.randint(2, 6)) for _ in range(system_prompts)]
    weights = zipf_weights(system_prompts, 1.0)
    convo: dict[int, list[int]] = {}
    t_ms, out = 0.0, []
    for _ in range(requests):
        t_ms += rng.expovariate(rate_per_s) * 1000.0
        s = rng.randrange(sessions)
        if s not in convo or len(convo[s]) > 24:
            convo[s] = list(rng.choices(systems, weights=weights)[0])
        if rng.random() < 0.15:  # a one-off document after a system prompt
            hashes = list(rng.choices(systems, weights=weights)[0]) + fresh(rng.randint(1, 8))
        else:
            convo[s] = convo[s] + fresh(rng.randint(1, 3))
            hashes = list(convo[s])
        n_in = (len(hashes) - 1) * MOONCAKE_BLOCK + rng.randint(1, MOONCAKE_BLOCK)
        out.append({"timestamp": int(t_ms), "input_length": n_in, "output_length": rng.randint(8, 400),
                    "hash_ids": hashes})
    return out


def write_mooncake(records: Iterable[dict], path: str | Path) -> None:
    with open(path, "w") as f:
        for r in records:
            f.write(json.dumps(r, separators=(", ", ": ")) + "\n")


# -- oracle ----------------------------------------------------------------------------------
def block_chain(prompt_ids: Sequence[int], block_size: int) -> list[bytes]:
    """Chained digests of the prompt's full blocks (block ``k``'s digest covers blocks 0..k)."""
    out, parent = [], b""
    for k in range(len(prompt_ids) // block_size):
        blk = prompt_ids[k * block_size:(k + 1) * block_size]
        parent = hashlib.blake2b(parent + b"".join(int(t).to_bytes(4, "little") for t in blk), digest_size=16).digest()
        out.append(parent)
    return out


def usable_blocks(prompt_tokens: int, held_blocks: int, block_size: int) -> int:
    """Held full blocks a prompt can reuse: never its last token (as the engine counts)."""
    return max(0, min(held_blocks, (prompt_tokens - 1) // block_size))


@dataclass
class Oracle:
    """One infinite cache per share domain, fed requests in order (``observe``)."""

    block_size: int = 16
    seen: dict[str, set[bytes]] = field(default_factory=dict)

    def hit_tokens(self, item: WorkItem) -> int:
        chain = block_chain(item.prompt_ids, self.block_size)
        best = 0
        for d in (item.domain, *item.read_domains):
            have = self.seen.get(d, set())
            k = 0
            while k < len(chain) and chain[k] in have:
                k += 1
            best = max(best, k)
        return usable_blocks(len(item.prompt_ids), best, self.block_size) * self.block_size

    def observe(self, item: WorkItem) -> int:
        """The item's hit tokens, then its blocks enter its own domain's cache."""
        hit = self.hit_tokens(item)
        self.seen.setdefault(item.domain, set()).update(block_chain(item.prompt_ids, self.block_size))
        return hit


def oracle_hits(items: Iterable[WorkItem], block_size: int = 16) -> list[int]:
    """Per item (in the given order): prompt tokens an infinite cache would have reused."""
    o = Oracle(block_size)
    return [o.observe(w) for w in items]
