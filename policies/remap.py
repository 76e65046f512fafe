"""Oneiros parameter remapping: which cached KV a new prompt may reuse, and which tokens to recompute.

Pure policy (no torch, no Ray). The worker mechanism (``engine/remap.py``) executes a ``RemapPlan``.

Vocabulary:
  template   text with named parameter spans ``{name}`` (``{{``/``}}`` escape braces);
  instance   one prompt rendered from a template, tokenised ONCE as a whole; every token is
             mapped to the template piece it lies in by character offsets (tokenising pieces
             separately gives different tokens: ``\\n\\n`` is one token alone, two in context);
  donor      a cached instance whose KV the new prompt reuses;
  plan       per new token: its donor token (or None = computed fresh), plus the recompute set.

Invariants of a ``RemapPlan``:
  * ``src[i] == i`` for every ``i < exact_prefix`` (identical tokens, identical context: exact KV);
  * ``src`` is strictly increasing where not None (alignment is monotone), so Δ = i - src[i];
  * a token outside a template text piece (a parameter token, or one that straddles a piece
    boundary) is reused only when the policy says identical values are reused (Identity);
  * ``recompute`` never contains an exact-prefix token (their KV is exact already) nor a fresh one.
"""

from __future__ import annotations

import hashlib
import math
import re
from collections import OrderedDict
from dataclasses import dataclass, field
from difflib import SequenceMatcher
from typing import Callable, Hashable, Sequence

import numpy as np

TokenId = int

_FIELD = re.compile(r"\{\{|\}\}|\{([A-Za-z_][A-Za-z0-9_]*)\}")


# ---------------------------------------------------------------------------------------------
# templates and instances


@dataclass(frozen=True)
class Piece:
    """A template piece: literal text (``param is None``) or a named parameter span."""

    text: str = ""
    param: str | None = None


@dataclass(frozen=True)
class Template:
    """Text with named parameter spans. A parameter may appear several times (same value)."""

    name: str
    pieces: tuple[Piece, ...]

    @staticmethod
    def parse(name: str, text: str) -> "Template":
        pieces: list[Piece] = []
        lit, pos = [], 0
        for m in _FIELD.finditer(text):
            lit.append(text[pos : m.start()])
            pos = m.end()
            if m.group(1) is None:  # escaped brace
                lit.append(m.group(0)[0])
                continue
            if "".join(lit):
                pieces.append(Piece("".join(lit)))
            lit = []
            pieces.append(Piece(param=m.group(1)))
        lit.append(text[pos:])
        if "".join(lit):
            pieces.append(Piece("".join(lit)))
        return Template(name, tuple(pieces))

    @property
    def params(self) -> tuple[str, ...]:
        seen: dict[str, None] = {}
        for p in self.pieces:
            if p.param is not None:
                seen.setdefault(p.param)
        return tuple(seen)

    def render(self, values: dict[str, str]) -> tuple[str, tuple[tuple[int, int], ...]]:
        """(text, character span of every piece). Missing values raise KeyError."""
        out, spans, n = [], [], 0
        for p in self.pieces:
            s = values[p.param] if p.param is not None else p.text
            out.append(s)
            spans.append((n, n + len(s)))
            n += len(s)
        return "".join(out), tuple(spans)


@dataclass(frozen=True)
class TokenRole:
    """Where a token lies: piece index and its character span relative to that piece.

    ``literal`` is True only for a token entirely inside a template text piece.
    """

    piece: int
    rel_start: int
    rel_end: int
    literal: bool


def segment(piece_spans: Sequence[tuple[int, int]], offsets: Sequence[tuple[int, int]], literal: Sequence[bool]) -> tuple[TokenRole, ...]:
    """Map each token (character ``offsets`` of ONE tokenisation of the whole prompt) to its piece.

    A token that straddles two pieces belongs to the piece of its first character and is not
    literal (its text mixes template and parameter characters).
    """
    roles, p = [], 0
    for start, end in offsets:
        while p + 1 < len(piece_spans) and start >= piece_spans[p][1]:
            p += 1
        ps, pe = piece_spans[p]
        inside = ps <= start and end <= pe
        roles.append(TokenRole(p, start - ps, end - ps, literal[p] and inside))
    return tuple(roles)


def token_param(pieces: Sequence[Piece], role: TokenRole) -> str | None:
    """The parameter a token carries characters of: its piece's, or, for a token that starts in
    a literal piece and straddles into the next piece, that next parameter; None for literals."""
    if role.literal:
        return None
    if pieces[role.piece].param is not None:
        return pieces[role.piece].param
    return pieces[role.piece + 1].param if role.piece + 1 < len(pieces) else None


@dataclass(frozen=True)
class Instance:
    """A prompt rendered from ``template`` with ``values``, tokenised once (``token_ids``)."""

    template: Template
    values: tuple[tuple[str, str], ...]
    token_ids: tuple[TokenId, ...]
    roles: tuple[TokenRole, ...]
    param_tokens: tuple[tuple[str, tuple[TokenId, ...]], ...] = ()  # tokens of each parameter value
    uid: int = 0  # caller's handle (e.g. the cached sequence); not part of the content

    @staticmethod
    def build(template: Template, values: dict[str, str], tokenize: Callable[[str], tuple[list[int], list[tuple[int, int]]]], uid: int = 0) -> "Instance":
        """``tokenize(text) -> (ids, char offsets)``, e.g. a HF fast tokenizer's offsets mapping."""
        text, spans = template.render(values)
        ids, offsets = tokenize(text)
        roles = segment(spans, offsets, [p.param is None for p in template.pieces])
        ptoks: dict[str, list[int]] = {}
        for tok, role in zip(ids, roles):
            name = token_param(template.pieces, role)
            if name is not None:
                ptoks.setdefault(name, []).append(tok)
        vals = tuple((k, values[k]) for k in template.params)
        return Instance(template, vals, tuple(ids), roles, tuple((k, tuple(ptoks.get(k, ()))) for k in template.params), uid)

    @property
    def value_map(self) -> dict[str, str]:
        return dict(self.values)


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


# ---------------------------------------------------------------------------------------------
# plans


@dataclass(frozen=True)
class RemapPlan:
    """What the mechanism does for one new prompt (see the module invariants).

    ``slot_positions``: positions to run the new prompt at (Prompt Cache's fixed slot layout);
    None = contiguous 0..n-1.
    """

    src: tuple[int | None, ...]
    exact_prefix: int
    recompute: frozenset[int] = frozenset()
    slot_positions: tuple[int, ...] | None = None

    @property
    def reused(self) -> int:
        """Tokens whose KV is not computed (exact prefix + approximate reuse - recompute)."""
        return sum(s is not None for s in self.src) - len(self.recompute)

    @property
    def approx(self) -> int:
        return self.reused - self.exact_prefix

    def deltas(self) -> tuple[int | None, ...]:
        return tuple(None if s is None else i - s for i, s in enumerate(self.src))

    def shared_blocks(self, block_size: int) -> int:
        """Blocks of the new prompt that can physically share the donor's block (same index):
        every token reused from the same position (Δ = 0) and none recomputed."""
        n = len(self.src) // block_size
        return sum(
            all(self.src[i] == i and i not in self.recompute for i in range(b * block_size, (b + 1) * block_size))
            for b in range(n)
        )

    def with_recompute(self, rows: Sequence[int]) -> "RemapPlan":
        extra = {i for i in rows if self.src[i] is not None and i >= self.exact_prefix}
        return RemapPlan(self.src, self.exact_prefix, self.recompute | frozenset(extra), self.slot_positions)


def align(new: Instance, donor: Instance, reuse_identical_params: bool = True, reuse_literals: bool = True) -> RemapPlan:
    """Align ``new`` with ``donor`` of the same template.

    Exact prefix first; beyond it a token reuses the donor token with the same key
    (piece, relative character span, token id) when it is literal, or when it lies in a
    parameter whose value equals the donor's (and ``reuse_identical_params``). The result is
    made monotone by dropping matches that would go backwards.
    """
    if new.template != donor.template:
        raise ValueError("align needs two instances of the same template")
    pre = common_prefix(new.token_ids, donor.token_ids)
    same_vals = {k for (k, v), (_, dv) in zip(new.values, donor.values) if v == dv}
    pieces = new.template.pieces
    index = {(r.piece, r.rel_start, r.rel_end, t): j for j, (t, r) in enumerate(zip(donor.token_ids, donor.roles))}
    src: list[int | None] = list(range(pre))
    last = pre - 1
    for i in range(pre, len(new.token_ids)):
        r, t = new.roles[i], new.token_ids[i]
        ok = (r.literal and reuse_literals) or (reuse_identical_params and token_param(pieces, r) in same_vals)
        j = index.get((r.piece, r.rel_start, r.rel_end, t)) if ok else None
        if j is not None and j > last:
            src.append(j)
            last = j
        else:
            src.append(None)
    return RemapPlan(tuple(src), pre)


# ---------------------------------------------------------------------------------------------
# template auto-detection (no registered template): align token sequences except for spans


@dataclass(frozen=True)
class DetectedMatch:
    """A cached prompt that the new prompt aligns with except for gaps (the detected parameters)."""

    donor_index: int
    blocks: tuple[tuple[int, int, int], ...]  # (new start, donor start, length), monotone
    coverage: float  # matched tokens / new prompt tokens
    plan: RemapPlan


def detect_template(new_ids: Sequence[int], cached: Sequence[Sequence[int]], min_run: int = 4, min_coverage: float = 0.5,
                    max_compares: int = 4, max_compare_pairs: int = 1 << 20) -> DetectedMatch | None:
    """Best cached prompt that aligns with ``new_ids`` except for spans (runs < min_run dropped).

    The matched runs act as the template's text, the gaps as its parameters. Returns None when
    no cached prompt covers at least ``min_coverage`` of the new prompt.

    Bounded work (this runs on the engine thread, for any tenant that asks): a linear pass per
    candidate computes an upper bound on its coverage (common prefix + positions inside a
    ``min_run``-gram the candidate also contains: every matched run of ``min_run`` or more
    lies inside such grams); candidates that cannot reach ``min_coverage`` or beat the best so
    far are never aligned, the rest are aligned best bound first, at most ``max_compares`` of
    them. Each alignment (difflib) sees tokens outside shared grams as unique (they cannot be
    in a run of ``min_run``; it would otherwise spend quadratic time on frequent tokens) and
    at most ``max_compare_pairs`` (new x cached tokens after the common prefix): the rest of
    the new prompt counts as unmatched (computed exactly), never as wrongly matched.
    """
    new = list(new_ids)
    n = len(new)
    if n == 0 or not cached:
        return None
    k = max(1, min_run)
    new_keys = _gram_keys(new, k)
    sorted_new = np.unique(new_keys)
    bounds = []
    for d, ids in enumerate(cached):
        pre = common_prefix(new, ids)
        keys = _gram_keys(ids, k)
        covered = _cover(_shared(new_keys, sorted_new, keys), n, k)
        ub = (int(covered[pre:].sum()) + pre) / n
        if ub >= min_coverage:
            bounds.append((-ub, d, pre, keys, covered))
    bounds.sort(key=lambda x: (x[0], x[1]))
    best: DetectedMatch | None = None
    for neg_ub, d, pre, keys, covered in bounds[:max(0, max_compares)]:
        if best is not None and -neg_ub <= best.coverage:
            break  # no later candidate can beat the best one
        ids = list(cached[d])
        a = _masked(new, covered, 0)
        b = _masked(ids, _cover(np.isin(keys, new_keys), len(ids), k), 1)
        lb = max(1, len(b) - pre)
        la = min(n - pre, max(k, max_compare_pairs // lb))
        lb = min(lb, max(k, max_compare_pairs // max(1, la)))
        sm = SequenceMatcher(a=a[pre:pre + la], b=b[pre:pre + lb], autojunk=False)
        blocks = tuple((x + pre, y + pre, m) for x, y, m in sm.get_matching_blocks() if m >= min_run)
        src: list[int | None] = [None] * n
        for x, y, m in blocks:
            for j in range(m):
                src[x + j] = y + j
        for i in range(pre):
            src[i] = i
        cov = sum(s is not None for s in src) / n
        if cov >= min_coverage and (best is None or cov > best.coverage):
            best = DetectedMatch(d, blocks, cov, RemapPlan(tuple(src), pre))
    return best


_GRAM_MULT = np.array([0x9E3779B97F4A7C15, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9, 0x27D4EB2F165667C5],
                      dtype=np.uint64)


def _gram_keys(ids: Sequence[int], k: int) -> np.ndarray:
    """A 64-bit key per ``k``-gram of ``ids`` (a collision only loosens the bound: safe)."""
    a = np.asarray(ids, dtype=np.int64).astype(np.uint64)
    m = len(a) - k + 1
    if m <= 0:
        return np.zeros(0, dtype=np.uint64)
    key = np.zeros(m, dtype=np.uint64)
    with np.errstate(over="ignore"):
        for j in range(k):
            key = (key ^ (a[j:j + m] + np.uint64(j + 1))) * _GRAM_MULT[j % len(_GRAM_MULT)]
    return key


def _shared(keys: np.ndarray, sorted_keys: np.ndarray, other: np.ndarray) -> np.ndarray:
    """``np.isin(keys, other)`` given ``sorted_keys = np.unique(keys)``, fast when few match."""
    if len(sorted_keys) == 0 or len(other) == 0:
        return np.zeros(len(keys), dtype=bool)
    at = np.minimum(np.searchsorted(sorted_keys, other), len(sorted_keys) - 1)
    common = other[sorted_keys[at] == other]
    if len(common) == 0:
        return np.zeros(len(keys), dtype=bool)
    return np.isin(keys, common)


def _cover(hits: np.ndarray, n: int, k: int) -> np.ndarray:
    """Positions (of a sequence of length ``n``) inside some ``k``-gram whose ``hits`` is set."""
    if n == 0 or len(hits) == 0 or not hits.any():
        return np.zeros(n, dtype=bool)
    return np.convolve(hits.astype(np.int32), np.ones(k, dtype=np.int32))[:n] > 0


def _masked(ids: list[int], covered: np.ndarray, side: int) -> list:
    """``ids`` with every position outside a shared gram replaced by a value unique to it (and
    to ``side``), so difflib never pairs it with anything."""
    return [t if c else (side, i) for i, (t, c) in enumerate(zip(ids, covered.tolist()))]


# ---------------------------------------------------------------------------------------------
# recompute-set selection


def top_r_by_deviation(plan: RemapPlan, deviation: Sequence[float], r: float) -> RemapPlan:
    """CacheBlend-style: recompute the ``r`` share of approximately reused tokens (those beyond
    the exact prefix: exact ones score zero and would only waste the budget) with the largest
    KV deviation (measured by the mechanism at an early layer)."""
    cand = [i for i, s in enumerate(plan.src) if s is not None and i >= plan.exact_prefix and i not in plan.recompute]
    k = int(math.ceil(r * len(cand) - 1e-9))
    chosen = sorted(cand, key=lambda i: -deviation[i])[:k]
    return plan.with_recompute(chosen)


def structural_recompute(plan: RemapPlan, new: Instance, after_change: int = 1, piece_tail: int = 0) -> RemapPlan:
    """Template-aware recompute: in every literal piece that follows a parameter whose tokens were
    not reused, recompute its first ``after_change`` tokens (they read the changed value) and its
    last ``piece_tail`` tokens (they summarise what came before, e.g. ``\\nLabel:``)."""
    pieces = new.template.pieces
    changed = False
    by_piece: dict[int, list[int]] = {}
    for i, r in enumerate(new.roles):
        by_piece.setdefault(r.piece, []).append(i)
    rows: list[int] = []
    for p in range(len(pieces)):
        toks = by_piece.get(p, [])
        if pieces[p].param is not None or not all(new.roles[i].literal for i in toks):
            changed |= any(plan.src[i] is None for i in toks)
            continue
        if changed and toks:
            rows += toks[:after_change] + (toks[-piece_tail:] if piece_tail else [])
    return plan.with_recompute(rows)


def priority_recompute(plan: RemapPlan, new: Instance, priority: dict[tuple[int, int], float], r: float) -> RemapPlan:
    """Learned selection: recompute the ``r`` share of approximately reused tokens with the
    highest fitted priority, keyed by (piece, token index within the piece); unknown keys score 0."""
    rank = _piece_rank(new)
    cand = [i for i, s in enumerate(plan.src) if s is not None and i >= plan.exact_prefix]
    k = int(math.ceil(r * len(cand) - 1e-9))
    chosen = sorted(cand, key=lambda i: -priority.get(rank[i], 0.0))[:k]
    return plan.with_recompute(chosen)


def _piece_rank(inst: Instance) -> list[tuple[int, int]]:
    counts: dict[int, int] = {}
    out = []
    for r in inst.roles:
        out.append((r.piece, counts.get(r.piece, 0)))
        counts[r.piece] = counts.get(r.piece, 0) + 1
    return out


def piece_keys(inst: Instance) -> list[tuple[int, int]]:
    """(piece, token index within the piece) for every token: the key of learned priorities."""
    return _piece_rank(inst)


# ---------------------------------------------------------------------------------------------
# slot classes and remap policies


@dataclass(frozen=True)
class SlotClass:
    length_bucket: int
    hash_bucket: int


def slot_class(value_tokens: Sequence[int], length_step: int = 8, hash_buckets: int = 1) -> SlotClass:
    """Length bucket = ceil(len / length_step); hash bucket = stable sha256 of the tokens mod n."""
    lb = (len(value_tokens) + length_step - 1) // length_step
    if hash_buckets <= 1:
        return SlotClass(lb, 0)
    digest = hashlib.sha256(b"".join(int(t).to_bytes(4, "little") for t in value_tokens)).digest()
    return SlotClass(lb, int.from_bytes(digest[:8], "little") % hash_buckets)


class IdentityRemap:
    """Identical tokens reuse KV: the exact prefix, the template text and identical parameter
    values, at their slots (shifted by Δ when an earlier value's length differs). Any cached
    instance of the template may donate; the longest common prefix wins, then most reuse."""

    name = "identity"

    def slot_key(self, inst: Instance) -> Hashable:
        return inst.template.name

    def choose_donor(self, inst: Instance, candidates: Sequence[Instance]) -> Instance | None:
        same = [c for c in candidates if c.template == inst.template and self.slot_key(c) == self.slot_key(inst)]
        if not same:
            return None
        return max(same, key=lambda c: (common_prefix(inst.token_ids, c.token_ids), align(inst, c).reused))

    def plan(self, inst: Instance, donor: Instance) -> RemapPlan:
        return align(inst, donor, reuse_identical_params=True)


@dataclass
class HashRemap(IdentityRemap):
    """Parameter values map to slot classes (length bucket, hash bucket); only a cached instance
    with the same class for every parameter donates. Cost: fewer donors (misses); benefit: the
    donor's values are of similar length (small Δ) and, with hash buckets, partitioned apart."""

    length_step: int = 8
    hash_buckets: int = 1
    name: str = "hash"

    def slot_key(self, inst: Instance) -> Hashable:
        return (inst.template.name,) + tuple(slot_class(t, self.length_step, self.hash_buckets) for _, t in inst.param_tokens)


@dataclass
class LearnableRemap(IdentityRemap):
    """Fitted on calibration prompts (``bench/fit_learnable_remap.py``):

    * ``priority[(piece, k)]``: how much the k-th token of a piece deviates when reused (mean
      deep-layer KV deviation on calibration pairs); the recompute set is the top-r by it, so
      no early-layer pass is needed to choose;
    * ``param_weight[name]``: weight of each parameter's value similarity in donor choice
      (donors agreeing on heavily weighted values are preferred after the exact prefix).
    """

    priority: dict[tuple[int, int], float] = field(default_factory=dict)
    param_weight: dict[str, float] = field(default_factory=dict)
    name: str = "learnable"

    def choose_donor(self, inst: Instance, candidates: Sequence[Instance]) -> Instance | None:
        same = [c for c in candidates if c.template == inst.template]
        if not same:
            return None
        vals = inst.value_map

        def score(c: Instance):
            agree = sum(self.param_weight.get(k, 1.0) * _token_jaccard(inst, c, k) for k in vals)
            return (common_prefix(inst.token_ids, c.token_ids), agree)

        return max(same, key=score)

    def select(self, plan: RemapPlan, inst: Instance, r: float) -> RemapPlan:
        return priority_recompute(plan, inst, self.priority, r)

    def to_json(self) -> dict:
        return {"priority": [[p, k, v] for (p, k), v in sorted(self.priority.items())], "param_weight": self.param_weight}

    @staticmethod
    def from_json(d: dict) -> "LearnableRemap":
        return LearnableRemap({(int(p), int(k)): float(v) for p, k, v in d["priority"]}, dict(d.get("param_weight", {})))


def _token_jaccard(a: Instance, b: Instance, name: str) -> float:
    ta, tb = set(dict(a.param_tokens).get(name, ())), set(dict(b.param_tokens).get(name, ()))
    return len(ta & tb) / max(1, len(ta | tb))


REMAP_POLICIES: dict[str, type] = {"identity": IdentityRemap, "hash": HashRemap, "learnable": LearnableRemap}


def make_policy(name: str, **config) -> IdentityRemap:
    """A remap policy from the table by name; unknown names raise ValueError."""
    try:
        return REMAP_POLICIES[name](**config)
    except KeyError:
        raise ValueError(f"unknown remap policy {name!r}: expected one of {sorted(REMAP_POLICIES)}") from None


# ---------------------------------------------------------------------------------------------
# Prompt Cache's alternative: fixed slot lengths, so template tokens never move (Δ = 0)


def fixed_slot_positions(inst: Instance, slot_len: dict[str, int]) -> tuple[int, ...] | None:
    """Positions that reserve ``slot_len[name]`` positions for each parameter occurrence: the
    template text after a slot starts at the same position whatever the value's length. Unused
    slot positions are skipped (a position gap). None when a value overflows its slot."""
    pieces = inst.template.pieces
    out: list[int] = []
    base = 0  # position where the current piece starts
    cur_piece, used = -1, 0
    for r in inst.roles:
        piece = r.piece
        if not r.literal and pieces[piece].param is None and piece + 1 < len(pieces):
            piece += 1  # a token straddling into the next parameter counts in that slot
        if piece != cur_piece:
            if cur_piece >= 0:
                base += _piece_width(pieces[cur_piece], slot_len, used)
            for skipped in range(cur_piece + 1, piece):  # pieces without tokens
                base += _piece_width(pieces[skipped], slot_len, 0)
            cur_piece, used = piece, 0
        name = pieces[piece].param
        if name is not None and used >= slot_len[name]:
            return None
        out.append(base + used)
        used += 1
    return tuple(out)


def _piece_width(piece: Piece, slot_len: dict[str, int], used: int) -> int:
    return slot_len[piece.param] if piece.param is not None else used


def slot_usage(inst: Instance) -> dict[str, int]:
    """Tokens each parameter occupies in ``inst`` (most over its occurrences), counting a token
    that straddles into a parameter in that parameter's slot, as ``fixed_slot_positions`` does."""
    pieces = inst.template.pieces
    count: dict[int, int] = {}
    for r in inst.roles:
        piece = r.piece
        if not r.literal and pieces[piece].param is None and piece + 1 < len(pieces):
            piece += 1
        count[piece] = count.get(piece, 0) + 1
    out: dict[str, int] = {name: 0 for name in inst.template.params}
    for p, c in count.items():
        name = pieces[p].param
        if name is not None:
            out[name] = max(out[name], c)
    return out


def query_suffix_start(inst: Instance, max_tokens: int = 8) -> int:
    """Start of the query suffix that the mechanism always computes: the last ``max_tokens``
    tokens (the request's closing text, e.g. ``\nLabel:`` and the chat markup), or everything
    after the last parameter token when that is shorter. Always leaves the last token."""
    pieces = inst.template.pieces
    n = len(inst.token_ids)
    last_param = max((i for i, r in enumerate(inst.roles) if pieces[r.piece].param is not None or not r.literal), default=-1)
    return min(max(last_param + 1, n - max_tokens), n - 1)


@dataclass(frozen=True)
class RepairGate:
    """Confidence gate on approximate KV: while decoding the first ``steps`` tokens, a greedy
    choice whose logit margin over the runner-up is below ``min_margin`` is not trusted; the
    mechanism then recomputes the prompt (and tokens so far) exactly and continues from that.
    Cost: a full prefill for the gated requests; benefit: near-ties, the choices that
    approximate KV flips, are decided on exact KV."""

    min_margin: float = 1.0
    steps: int = 8

    def repair(self, step: int, margin: float) -> bool:
        return step < self.steps and margin < self.min_margin


# ---------------------------------------------------------------------------------------------
# quality gate: a measured, per-template choice of the recompute share


class GateState:
    """States of one gate key (plain strings, JSON-friendly)."""

    CALIBRATING = "calibrating"  # served exactly; finished requests are shadow-checked at r
    OPEN = "open"  # served approximately at r; every ``recheck_every``-th request is checked
    CLOSED = "closed"  # no rung passed: served exactly, retried after a back-off


@dataclass(frozen=True)
class GateConfig:
    """A tenant's quality knob for approximate reuse (the tenants file's ``remap:`` block).

    ``min_agreement``: share of the last ``samples`` shadow checks whose greedy continuation
    must equal the exact one (1.0: every check agrees). ``max_kl``: optional bound on their mean
    first-token KL(exact || approximate). ``ladder``: recompute shares tried, in order, after
    the tenant's own r (only those above it). ``recheck_every``: while open, every n-th request
    is served exactly and checked. ``backoff_requests``: a closed key serves this many requests
    exactly before it retries (doubling after each failed retry, up to
    ``max_backoff_requests``). ``max_check_tokens``: output positions a shadow check compares.

    What a window proves: with ``min_agreement`` 1.0 a template whose approximate greedy output
    differs from exact in a share p of requests opens with probability (1 - p) ** samples: with
    16 samples 85% at p = 1%, 44% at 5%, 7% at 15%; with 4 samples already 52% at 15%.
    Calibration costs compute (shadow checks), not quality: those requests are served exactly.
    """

    min_agreement: float = 1.0
    samples: int = 16
    max_kl: float | None = None
    recheck_every: int = 8
    ladder: tuple[float, ...] = (0.5, 0.7)
    backoff_requests: int = 64
    max_backoff_requests: int = 1024
    max_check_tokens: int = 16

    def __post_init__(self):
        def whole(name: str, lo: int) -> int:
            x = getattr(self, name)
            if isinstance(x, bool) or not isinstance(x, int) or x < lo:
                raise ValueError(f"{name} must be an integer >= {lo}, got {x!r}")
            return x

        a = self.min_agreement
        if isinstance(a, bool) or not isinstance(a, (int, float)) or not 0.0 < a <= 1.0:
            raise ValueError(f"min_agreement must be in (0, 1], got {a!r}")
        k = self.max_kl
        if k is not None and (isinstance(k, bool) or not isinstance(k, (int, float)) or not k >= 0):
            raise ValueError(f"max_kl must be a number >= 0 (or null), got {k!r}")
        whole("samples", 1), whole("recheck_every", 1), whole("max_check_tokens", 1)
        if whole("max_backoff_requests", 1) < whole("backoff_requests", 1):
            raise ValueError("max_backoff_requests must be >= backoff_requests")
        ladder = tuple(self.ladder)
        if not all(isinstance(r, (int, float)) and not isinstance(r, bool) and 0.0 <= r <= 1.0 for r in ladder):
            raise ValueError(f"ladder must hold recompute shares in [0, 1], got {self.ladder!r}")
        object.__setattr__(self, "ladder", tuple(float(r) for r in ladder))

    def rungs(self, r0: float) -> tuple[float, ...]:
        """The shares a key tries: its own ``r0`` first, then the ladder's larger ones, ascending."""
        return (float(r0),) + tuple(sorted({r for r in self.ladder if r > r0}))

    def allowed_failures(self) -> int:
        """Disagreeing samples a full window may hold and still pass."""
        return int(math.floor((1.0 - self.min_agreement) * self.samples + 1e-9))


@dataclass(frozen=True)
class ShadowSample:
    """One shadow check: the request was served exactly; its approximate prompt KV (at ``r``)
    was then built and the exact output teacher-forced through it.

    ``agree`` is True iff the approximate argmax equals the exact argmax at every compared
    position; by induction that means the approximate greedy continuation would have been
    identical. ``token_agreement``: share of compared positions that agree; ``first_kl``:
    KL(exact || approximate) of the first output token."""

    agree: bool
    token_agreement: float = 1.0
    first_kl: float = 0.0
    positions: int = 1


@dataclass(frozen=True)
class GateDecision:
    """What to do with one approximate-mode request that has a donor.

    ``approximate``: serve from remapped KV at ``r``. Otherwise serve exactly, and when
    ``shadow`` is set, shadow-check the remap at ``r`` once the request has finished."""

    approximate: bool
    shadow: bool
    r: float | None
    state: str


@dataclass
class _Key:
    config: GateConfig
    rungs: tuple[float, ...]
    rung: int = 0
    state: str = GateState.CALIBRATING
    window: list[ShadowSample] = field(default_factory=list)
    since_check: int = 0  # open: requests since the last recheck
    closed_for: int = 0  # closed: requests served exactly since closing
    backoff: int = 0  # closed: requests to wait before the retry (0 until first closed)
    approx_served: int = 0
    exact_served: int = 0
    checks: int = 0
    failures: int = 0
    escalations: int = 0
    closings: int = 0

    @property
    def r(self) -> float:
        return self.rungs[self.rung]


GateKey = tuple[str, str]  # (share domain, template id or detected-template key)


class QualityGate:
    """Per (share domain, template) state machine that chooses the recompute share from measured
    agreement instead of assuming it.

    A key starts CALIBRATING at the tenant's r (``rungs[0]``): its requests are served exactly and
    shadow-checked. It opens once a full window of ``samples`` checks at the current r passes
    (agreement share >= ``min_agreement`` and, if set, mean first-token KL <= ``max_kl``). A
    window that can no longer pass (too many disagreements during calibration), or an open
    key's sliding window that stops passing after a recheck, escalates to the next rung with a
    fresh window; past the last rung the key CLOSES (approximate disabled) for a back-off of
    ``backoff_requests`` requests, then recalibrates at the last rung (doubling the back-off if
    that fails again).

    Invariants: a key is OPEN only if its window holds ``samples`` checks at its current r that
    pass; samples measured at another r than the key's current one are ignored (stale: taken
    before an escalation); keys never share state; at most ``max_keys`` keys are kept *per
    share domain* (the least recently decided of that domain forgotten first: a forgotten key
    calibrates again, it never opens without checks), so one tenant's many keys never push out
    another tenant's calibration. Pure bookkeeping: no torch, no clock.
    """

    def __init__(self, max_keys: int = 4096) -> None:
        if max_keys < 1:
            raise ValueError("max_keys must be >= 1")
        self.max_keys = max_keys
        self._keys: dict[GateKey, _Key] = {}
        self._lru: dict[str, OrderedDict[GateKey, None]] = {}  # per domain, least recently decided first

    def decide(self, key: GateKey, config: GateConfig, r0: float) -> GateDecision:
        """The next request of ``key`` (which has a donor). ``config`` and ``r0`` (the tenant's
        recompute share) are read when the key is first seen."""
        k = self._keys.get(key)
        lru = self._lru.setdefault(key[0], OrderedDict())
        if k is None:
            k = self._keys[key] = _Key(config, config.rungs(r0))
            lru[key] = None
            while len(lru) > self.max_keys:
                self._keys.pop(lru.popitem(last=False)[0], None)
        lru.move_to_end(key)
        if k.state == GateState.OPEN:
            k.since_check += 1
            if k.since_check >= k.config.recheck_every:
                k.since_check = 0
                k.exact_served += 1
                return GateDecision(False, True, k.r, k.state)
            k.approx_served += 1
            return GateDecision(True, False, k.r, k.state)
        k.exact_served += 1
        if k.state == GateState.CLOSED:
            k.closed_for += 1
            if k.closed_for <= k.backoff:
                return GateDecision(False, False, None, k.state)
            k.state, k.rung, k.window = GateState.CALIBRATING, len(k.rungs) - 1, []
        return GateDecision(False, True, k.r, k.state)

    def wants(self, key: GateKey, r: float) -> bool:
        """Whether a check of ``key`` at ``r`` would still count (run it only then)."""
        k = self._keys.get(key)
        return k is not None and k.state != GateState.CLOSED and k.r == r

    def record(self, key: GateKey, r: float, sample: ShadowSample) -> str | None:
        """Add a shadow check of ``key`` at ``r``; returns the key's state afterwards, or None
        when the sample was stale (unknown key, other r, or closed) and was ignored."""
        if not self.wants(key, r):
            return None
        k = self._keys[key]
        cfg = k.config
        k.checks += 1
        k.failures += not sample.agree
        k.window = (k.window + [sample])[-cfg.samples:]
        if k.state == GateState.CALIBRATING:
            if sum(not s.agree for s in k.window) > cfg.allowed_failures():
                self._escalate(k)
            elif len(k.window) == cfg.samples:
                if self._passes(k):
                    k.state, k.since_check = GateState.OPEN, 0
                else:
                    self._escalate(k)
        elif not self._passes(k):  # open: the sliding window stopped passing
            self._escalate(k)
        return k.state

    def state(self, key: GateKey) -> str | None:
        k = self._keys.get(key)
        return None if k is None else k.state

    def r(self, key: GateKey) -> float | None:
        k = self._keys.get(key)
        return None if k is None or k.state == GateState.CLOSED else k.r

    def snapshot(self) -> dict[str, dict]:
        """Per key (``"domain/template"``): state, r, window size and agreement, counters."""
        out = {}
        for (domain, tid), k in self._keys.items():
            n = len(k.window)
            out[f"{domain}/{tid}"] = {
                "state": k.state, "r": None if k.state == GateState.CLOSED else k.r,
                "samples": n, "agreement": sum(s.agree for s in k.window) / n if n else None,
                "mean_first_kl": sum(s.first_kl for s in k.window) / n if n else None,
                "approx_served": k.approx_served, "exact_served": k.exact_served, "checks": k.checks,
                "failures": k.failures, "escalations": k.escalations, "closings": k.closings,
            }
        return out

    @staticmethod
    def _passes(k: _Key) -> bool:
        cfg, w = k.config, k.window
        if len(w) < cfg.samples or sum(not s.agree for s in w) > cfg.allowed_failures():
            return False
        return cfg.max_kl is None or sum(s.first_kl for s in w) / len(w) <= cfg.max_kl

    @staticmethod
    def _escalate(k: _Key) -> None:
        k.window, k.since_check = [], 0
        if k.rung + 1 < len(k.rungs):
            k.rung += 1
            k.state = GateState.CALIBRATING
            k.escalations += 1
            return
        k.state, k.closed_for, k.closings = GateState.CLOSED, 0, k.closings + 1
        k.backoff = k.config.backoff_requests if k.closings == 1 else min(2 * k.backoff, k.config.max_backoff_requests)


def detected_family_key(token_ids: Sequence[int]) -> str:
    """Gate key of an auto-detected template family, named after its first member's tokens
    (``"auto:"`` + 12 hex digits); later members inherit their donor's family (engine/approx.py)."""
    digest = hashlib.sha256(b"".join(int(t).to_bytes(4, "little") for t in token_ids)).hexdigest()
    return "auto:" + digest[:12]
