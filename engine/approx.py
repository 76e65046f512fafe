"""Approximate (Oneiros) reuse in the serving path: donors in, remapped prompt KV out.

At admission a request with ``reuse == "approximate"`` looks for a donor in the slot pool
(its own share domain and the domains it may read): an instance of the template the request
names (donor chosen by the remap policy: identity, hash slot classes or learnable), or, when it
names none, a cached prompt it aligns with except for spans (``detect_template``). The prompt's
KV is then built by ``engine.remap.remap_prefill`` (donor KV re-rotated, parameter tokens, the
deviation-selected share ``r`` and the query suffix computed fresh) and written into the
sequence's paged blocks. Requests that found no donor run exactly and, once prefilled, donate.

Safety invariants (the engine enforces the first two, see ``LLMEngine.step``):
  * a sequence with approximate KV (``Sequence.approx_kv``) never registers blocks in the exact
    prefix cache, so ``exact``/``none`` requests never read approximate KV;
  * only sequences prefilled exactly donate, so approximate KV never feeds another remap;
  * leading blocks that the exact prefix cache holds are shared as usual (exact KV); approximate
    KV is written only into the sequence's own new blocks, at positions >= that hit.

Quality gate (``policies.remap.QualityGate``; on when the tenant has a ``GateConfig``): the
recompute share is chosen per (share domain, template) from measurements, not assumed. While a
key calibrates (or at every ``recheck_every``-th request once open) ``match`` returns a
``shadow`` match: the request runs exactly, the engine records the exact argmax at every output
step and, after the request's last output was returned, ``shadow_check`` builds the approximate
prompt KV at the key's r from the same donor and teacher-forces the exact output through it.
Every position's argmax equal to the exact one <=> the approximate greedy continuation would
have been identical (by induction), so the gate measures greedy exact-match itself. Keys of
auto-detected templates are families: a prompt joins the family of the donor it matched.

Defaults (from ``bench/results/remap.json``, SmolLM2-135M, 3 task families): policy ``hash``
with ``r = 0.3`` (deviation at layer 1): 61% of prompt tokens reused at greedy EM 0.861, the best
quality of the calibration-free policies at r > 0. ``learnable`` scored higher (0.715 / 0.889
at r = 0.15) but needs priorities fitted per template offline; runtime-registered templates have
none, so here it only changes donor choice (parameter similarity) and keeps deviation selection.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass, field, replace
from typing import Callable

import numpy as np
import torch

from engine.manual_forward import SeqKV, teacher_force
from engine.remap import RemapResult, remap_prefill
from engine.sequence import Request
from engine.slot_pool import Donor, DonorPayload, SlotPool, slot_class_of
from policies.remap import (
    REMAP_POLICIES, GateConfig, GateKey, GateState, Instance, Piece, QualityGate, RemapPlan, ShadowSample, Template,
    detect_template, detected_family_key, make_policy, query_suffix_start,
)

DEFAULT_POLICY = "hash"
DEFAULT_RECOMPUTE_RATIO = 0.3
# detected-family maps kept per tenant (one per share domain; every cache_salt is a domain): the
# tenant's least recently used domain's map goes first, so salts cannot grow the maps unboundedly
FAMILY_DOMAINS_PER_TENANT = 16


@dataclass(frozen=True)
class ApproxConfig:
    policy: str = DEFAULT_POLICY
    recompute_ratio: float = DEFAULT_RECOMPUTE_RATIO
    bytes_per_domain: int = 64 * 1024 * 1024
    max_donors_per_domain: int = 64
    bytes_per_tenant: int | None = None  # donors of one tenant over all its domains; None: bytes_per_domain
    detect_min_coverage: float = 0.5  # auto-detection: matched share of the new prompt
    detect_max_candidates: int = 32  # most recent donors compared by auto-detection
    suffix_tokens: int = 8  # query suffix always computed when the template does not say
    min_gain_tokens: int = 16  # below this many approximate tokens, run exactly instead
    # Quality gate: ``gate`` for every tenant (None: ungated, r as configured), overridden per
    # tenant by ``tenant_gates`` (a tenant mapped to None is ungated).
    gate: GateConfig | None = None
    tenant_gates: dict[str, GateConfig | None] = field(default_factory=dict)
    max_shadow_jobs: int = 8  # finished requests waiting for their shadow check; oldest dropped

    def __post_init__(self):
        if self.policy not in REMAP_POLICIES:
            raise ValueError(f"unknown remap policy {self.policy!r}")
        if not 0.0 <= self.recompute_ratio <= 1.0:
            raise ValueError("recompute_ratio must be in [0, 1]")
        if self.max_shadow_jobs < 1:
            raise ValueError("max_shadow_jobs must be >= 1")

    def gate_for(self, tenant: str) -> GateConfig | None:
        return self.tenant_gates[tenant] if tenant in self.tenant_gates else self.gate


@dataclass(frozen=True)
class ApproxMatch:
    """A donor and the plan to build the new prompt from it at recompute share ``r``.

    ``shadow``: the gate wants a measurement, not approximate serving: run the request exactly
    and, once it has finished, ``shadow_check`` this match (``gate_key`` names the gate key)."""

    donor: Donor
    plan: RemapPlan
    suffix_start: int
    instance: Instance | None
    r: float = DEFAULT_RECOMPUTE_RATIO
    shadow: bool = False
    gate_key: GateKey | None = None


@dataclass
class ShadowJob:
    """A finished, exactly served request to shadow-check: its exact output ids, the exact argmax
    at each output step (``exact_argmax[i]`` chose output i when greedy) and the exact logits of
    the first output token."""

    request: Request
    match: ApproxMatch
    output_ids: list[int]
    exact_argmax: list[int]
    first_logits: torch.Tensor | None


class ApproxReuse:
    """Slot pool + template registry + the remap call; pure bookkeeping apart from ``build``."""

    def __init__(self, model: torch.nn.Module, tokenizer, config: ApproxConfig = ApproxConfig()):
        self.model, self.tokenizer, self.config = model, tokenizer, config
        self.pool = SlotPool(config.bytes_per_domain, config.max_donors_per_domain,
                             bytes_per_tenant=config.bytes_per_tenant)
        self.templates: dict[tuple[str, str], str] = {}  # (domain, template id) -> text
        self.stats = {"approx_requests": 0, "donors_stored": 0, "donors_imported": 0, "no_donor": 0, "gate_exact": 0,
                      "shadow_checks": 0, "shadow_disagreements": 0, "shadow_skipped": 0, "shadow_dropped": 0,
                      "shadow_errors": 0}
        self.gate = QualityGate()
        # detected-template families per share domain: sha256 of a prompt's ids -> family key,
        # each domain's map LRU-bounded on its own (one tenant cannot push out another's), and at
        # most FAMILY_DOMAINS_PER_TENANT maps per tenant (its least recently used domain dropped)
        self._families: dict[str, OrderedDict[bytes, str]] = {}
        self._family_domains: dict[str, OrderedDict[str, None]] = {}  # tenant -> its domains with a map, LRU

    # -- templates ---------------------------------------------------------------------------
    def register_template(self, domain: str, template_id: str, text: str) -> None:
        Template.parse(template_id, text)  # raises on nothing; parse accepts any text
        self.templates[(domain, template_id)] = text

    def template_text(self, request: Request) -> str | None:
        if request.template is None:
            return None
        if request.template_text is not None:
            return request.template_text
        for d in (request.domain, *request.read_domains):
            if (d, request.template) in self.templates:
                return self.templates[(d, request.template)]
        return None

    def instance(self, request: Request) -> Instance | None:
        """The prompt as an instance of the template it names, segmented by one tokenisation
        of the whole prompt; None when it names none or the prompt does not contain the
        rendered template (e.g. another chat wrapper), or re-tokenising changes the ids."""
        text = self.template_text(request)
        if text is None or request.template_params is None:
            return None
        try:
            tmpl = Template.parse(request.template, text)
            values = {k: str(request.template_params[k]) for k in tmpl.params}
            rendered, _ = tmpl.render(values)
            full = self.tokenizer.decode(list(request.prompt_ids), skip_special_tokens=False)
            at = full.find(rendered)
            if at < 0 or not rendered:
                return None
            wrapped = _wrap(tmpl, full[:at], full[at + len(rendered):])
            return Instance.build(wrapped, values, _tokenize_fn(self.tokenizer, request.prompt_ids))
        except (KeyError, ValueError):
            return None

    # -- donors ------------------------------------------------------------------------------
    def store(self, request: Request, k: torch.Tensor, v: torch.Tensor) -> bool:
        """Keep an exactly prefilled prompt's KV ``[layers, n, kv_heads, head_dim]`` as a donor."""
        inst = self.instance(request)
        policy = make_policy(request.remap_policy or self.config.policy)
        donor = Donor(request.domain, request.tenant, tuple(request.prompt_ids),
                      SeqKV(k, v, torch.arange(k.shape[1])), inst,
                      request.template if inst is not None else None,
                      policy.slot_key(inst) if inst is not None else None)
        ok = self.pool.put(donor)
        self.stats["donors_stored"] += ok
        return ok

    def match(self, request: Request, worth: Callable[[ApproxMatch], bool] | None = None) -> ApproxMatch | None:
        """The donor and plan for an approximate request, or None (run it exactly). With a quality
        gate the match may be a ``shadow`` one (run exactly, then measure); a closed key gives None.
        Requests that are not approximate, find no donor, or whose match ``worth`` rejects (e.g.
        the exact prefix cache serves as much) never reach the gate: they spend no gate turn."""
        if request.reuse != "approximate":
            return None
        cands = self.pool.candidates((request.domain, *request.read_domains))
        ids = list(request.prompt_ids)
        n = len(ids)
        if request.template is not None:
            inst = self.instance(request)
            if inst is None:
                return None
            same = [d for d in cands if d.instance is not None and d.template_id == request.template]
            policy = make_policy(request.remap_policy or self.config.policy)
            chosen = policy.choose_donor(inst, [d.instance for d in same])
            if chosen is None:
                self.stats["no_donor"] += 1
                return None
            donor = next(d for d in same if d.instance is chosen)
            m = ApproxMatch(donor, policy.plan(inst, chosen), query_suffix_start(inst, self.config.suffix_tokens), inst)
            return self._gated(request, m, request.template) if worth is None or worth(m) else None
        pool = [d for d in cands if d.token_ids != tuple(ids)][: self.config.detect_max_candidates]
        found = detect_template(ids, [d.token_ids for d in pool], min_coverage=self.config.detect_min_coverage)
        if found is None:
            self.stats["no_donor"] += 1
            return None
        donor = pool[found.donor_index]
        m = ApproxMatch(donor, found.plan, max(0, n - self.config.suffix_tokens), None)
        return self._gated(request, m, self._family(request, donor)) if worth is None or worth(m) else None

    def _gated(self, request: Request, m: ApproxMatch, template_key: str) -> ApproxMatch | None:
        """``m`` at the request's r when ungated; else as the gate decides: approximate at the
        key's r, a shadow match (run exactly, measure), or None (closed: run exactly)."""
        r0 = self.config.recompute_ratio if request.recompute_ratio is None else float(request.recompute_ratio)
        cfg = self.config.gate_for(request.tenant)
        if cfg is None:
            return replace(m, r=r0)
        key = (request.domain, template_key)
        d = self.gate.decide(key, cfg, r0)
        if not d.approximate:
            self.stats["gate_exact"] += 1
            if not d.shadow:
                return None
        return replace(m, r=d.r, shadow=d.shadow, gate_key=key)

    def _family(self, request: Request, donor: Donor) -> str:
        """Gate key of an auto-detected template: the family of the matched donor (a donor
        without one founds it); the request joins it, so its own donation stays in it."""
        dkey = _ids_digest(donor.token_ids)
        fam = self._families.get(donor.domain, {}).get(dkey) or detected_family_key(donor.token_ids)
        mine = self._families.setdefault(request.domain, OrderedDict())
        doms = self._family_domains.setdefault(request.tenant, OrderedDict())
        doms[request.domain] = None
        doms.move_to_end(request.domain)
        while len(doms) > FAMILY_DOMAINS_PER_TENANT:
            self._families.pop(doms.popitem(last=False)[0], None)
        # only the requester's own domain is written: a donor read through a grant keeps the
        # family its owner's map gives it (or its own, by its digest)
        for k in ((dkey,) if donor.domain == request.domain else ()) + (_ids_digest(request.prompt_ids),):
            mine[k] = fam
            mine.move_to_end(k)
        while len(mine) > 16 * self.config.max_donors_per_domain:
            mine.popitem(last=False)
        return fam

    # -- donors across workers (actors.slot_registry) -----------------------------------------
    def needed_slot_class(self, request: Request) -> str | None:
        """The slot class (``Donor.slot_class``) an approximate request of a named template
        would use, when no readable donor here has it; None when it needs none (not approximate,
        no template, prompt not an instance of it, or a local donor already fits)."""
        if request.reuse != "approximate" or request.template is None:
            return None
        if self.config.gate_for(request.tenant) is not None \
                and self.gate.state((request.domain, request.template)) == GateState.CLOSED:
            return None  # the gate serves this template exactly for now: a donor would sit unused
        inst = self.instance(request)
        if inst is None:
            return None
        want = slot_class_of(make_policy(request.remap_policy or self.config.policy).slot_key(inst), inst)
        held = any(d.template_id == request.template and d.slot_class == want
                   for d in self.pool.candidates((request.domain, *request.read_domains)))
        return None if held else want

    def export_donor(self, slot_id: str, model_id: str) -> DonorPayload | None:
        """The donor ``slot_id`` as plain arrays for another worker, or None if not held."""
        d = self.pool.get(slot_id)
        if d is None:
            return None
        return DonorPayload(d.kv.k.float().contiguous().numpy(), d.kv.v.float().contiguous().numpy(), model_id,
                            d.token_ids, d.domain, d.tenant, d.template_id, d.instance, d.slot_key)

    def import_donor(self, payload: DonorPayload, model_id: str, kv_shape: tuple[int, int, int],
                     reader_domains: tuple[str, ...]) -> bool:
        """Verify a pulled donor and store it under its own domain; False if it does not fit.
        Raises ValueError (pool untouched) for another model, a domain the reader may not
        read, KV of the wrong shape, or a segmentation that is not of these tokens.
        ``kv_shape`` = (layers, kv heads, head dim) of this worker's model."""
        if payload.model_id != model_id:
            raise ValueError(f"donor KV is for model {payload.model_id!r}, not {model_id!r}")
        if payload.domain not in reader_domains:
            raise ValueError(f"donor of domain {payload.domain!r} is not readable by {list(reader_domains)}")
        n = len(payload.token_ids)
        want = (kv_shape[0], n, kv_shape[1], kv_shape[2])
        if n == 0 or tuple(payload.k.shape) != want or tuple(payload.v.shape) != want:
            raise ValueError(f"donor KV has shape {tuple(payload.k.shape)}, expected {want}")
        inst = payload.instance
        if (payload.template_id is None) != (inst is None) or (payload.slot_key is None) != (inst is None):
            raise ValueError("donor template id, segmentation and slot key must come together")
        if inst is not None and (tuple(inst.token_ids) != tuple(payload.token_ids)
                                 or inst.template.name != payload.template_id or len(inst.roles) != n):
            raise ValueError("donor segmentation does not match its tokens or template")
        k = torch.tensor(payload.k, dtype=torch.float32)
        v = torch.tensor(payload.v, dtype=torch.float32)
        donor = Donor(payload.domain, payload.tenant, tuple(int(t) for t in payload.token_ids),
                      SeqKV(k, v, torch.arange(n)), inst, payload.template_id, payload.slot_key)
        ok = self.pool.put(donor)
        self.stats["donors_imported"] += ok
        return ok

    def build(self, request: Request, m: ApproxMatch) -> RemapResult:
        """Run the remap at ``m.r`` (outside the batched forward); the donor becomes most
        recently used."""
        self.pool.touch(m.donor)
        self.stats["approx_requests"] += 1
        return self._remap(request, m)

    def _remap(self, request: Request, m: ApproxMatch) -> RemapResult:
        donor = m.donor.kv
        if donor.k.dtype != torch.float32:
            donor = SeqKV(donor.k.float(), donor.v.float(), donor.positions)
        return remap_prefill(self.model, list(request.prompt_ids), donor, m.plan, r=m.r,
                             select_layer=min(1, self.model.config.num_hidden_layers - 1), suffix_start=m.suffix_start)

    # -- quality gate: shadow checks -----------------------------------------------------------
    def shadow_check(self, job: ShadowJob) -> ShadowSample | None:
        """Measure ``job``'s match and record it in the gate. Skipped (None) when the gate no
        longer wants a sample of that key at that r (it opened or escalated meanwhile), or the
        request produced no output. Compares at most the gate's ``max_check_tokens`` positions."""
        m = job.match
        cfg = self.config.gate_for(job.request.tenant)
        if m.gate_key is None or cfg is None or not self.gate.wants(m.gate_key, m.r) or not job.exact_argmax:
            self.stats["shadow_skipped"] += 1
            return None
        res = self._remap(job.request, m)
        limit = cfg.max_check_tokens
        sample = teacher_forced_agreement(self.model, res.logits, res.kv, job.output_ids[:limit],
                                          job.exact_argmax[:limit], job.first_logits)
        self.stats["shadow_checks"] += 1
        self.stats["shadow_disagreements"] += not sample.agree
        self.gate.record(m.gate_key, m.r, sample)
        return sample


def first_token_kl(exact_logits: torch.Tensor, approx_logits: torch.Tensor) -> float:
    """KL(exact || approximate) of one next-token distribution, in float64."""
    lp, lq = torch.log_softmax(exact_logits.double(), -1), torch.log_softmax(approx_logits.double(), -1)
    return max(0.0, float((lp.exp() * (lp - lq)).sum()))


def teacher_forced_agreement(model: torch.nn.Module, logits: torch.Tensor, kv: SeqKV, output_ids: list[int],
                             exact_argmax: list[int], exact_first_logits: torch.Tensor | None = None) -> ShadowSample:
    """Teacher-force ``output_ids`` (the exactly served output) through approximate prompt KV
    (``logits``: its next-token logits, ``kv``: its KV) and compare the argmax at each position
    with ``exact_argmax`` (the exact argmax after the same tokens). Agreement at every position
    <=> greedy decoding from the approximate KV reproduces the exact greedy output (when the
    output was greedy, ``output_ids == exact_argmax``; for a sampled output it is top-1
    agreement along the sampled path). The outputs after the first are teacher-forced in one
    forward (``teacher_force``), not one decode each."""
    n = min(len(output_ids), len(exact_argmax))
    if n == 0:
        raise ValueError("a shadow check needs at least one output position")
    kl = first_token_kl(exact_first_logits, logits) if exact_first_logits is not None else 0.0
    argmax = [int(logits.argmax())]
    if n > 1:
        argmax += teacher_force(model, kv, list(output_ids[: n - 1])).argmax(-1).tolist()
    agree = sum(a == b for a, b in zip(argmax, exact_argmax[:n]))
    return ShadowSample(agree == n, agree / n, kl, n)


def _ids_digest(ids) -> bytes:
    return hashlib.sha256(np.asarray(ids, dtype=np.int64).tobytes()).digest()


def _wrap(tmpl: Template, before: str, after: str) -> Template:
    """``tmpl`` inside the prompt's surrounding text (chat markup), literal pieces merged."""
    pieces = list(tmpl.pieces)
    if before:
        if pieces and pieces[0].param is None:
            pieces[0] = Piece(before + pieces[0].text)
        else:
            pieces.insert(0, Piece(before))
    if after:
        if pieces and pieces[-1].param is None:
            pieces[-1] = Piece(pieces[-1].text + after)
        else:
            pieces.append(Piece(after))
    return Template(tmpl.name, tuple(pieces))


def _tokenize_fn(tokenizer, prompt_ids):
    """``text -> (ids, char offsets)`` that must reproduce ``prompt_ids`` (ValueError if not):
    a HF fast tokenizer's offsets mapping, else offsets from decoding growing prefixes."""
    want = list(prompt_ids)

    def tokenize(text: str):
        if getattr(tokenizer, "is_fast", False):
            enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
            ids, offsets = list(enc["input_ids"]), [tuple(o) for o in enc["offset_mapping"]]
        else:
            ids = list(tokenizer.encode(text, add_special_tokens=False))
            ends = [len(tokenizer.decode(ids[: i + 1], skip_special_tokens=False)) for i in range(len(ids))]
            offsets = [(ends[i - 1] if i else 0, e) for i, e in enumerate(ends)]
        if ids != want:
            raise ValueError("re-tokenising the prompt text does not give the prompt's ids")
        return ids, offsets

    return tokenize
