"""Requests as the engine sees them: sampling parameters, validation and per-sequence state."""

from __future__ import annotations

import enum
import math
import time
from dataclasses import dataclass, field, fields

import torch

from engine.block_pool import Block, BlockHash
from policies.tenancy import REUSE_MODES  # noqa: F401 - one definition, re-exported


class InvalidRequest(ValueError):
    """The request cannot be served as given; the message says why, ``param`` (if known) names the
    HTTP field at fault. Nothing was allocated."""

    def __init__(self, message: str = "", param: str | None = None):
        super().__init__(message)
        self.param = param

    def __reduce__(self):  # keep ``param`` across Ray (pickled by args otherwise)
        return type(self), (str(self), self.param)


GREEDY_TEMPERATURE = 1e-5  # below this, sampling is greedy (as vLLM): no overflow, no NaN
MAX_N = 64
MAX_LOGPROBS = 20


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_num(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


@dataclass(frozen=True)
class GrammarSpec:
    """Structured output: ``json_object`` (any JSON object) or ``json_schema`` (``schema`` = the
    schema as JSON text). Compiled once per spec by engine/grammar.py."""

    kind: str
    schema: str | None = None

    def __post_init__(self):
        if self.kind not in ("json_object", "json_schema"):
            raise InvalidRequest(f"grammar kind must be json_object or json_schema, got {self.kind!r}")
        if self.kind == "json_schema" and not isinstance(self.schema, str):
            raise InvalidRequest("a json_schema grammar needs its schema as a JSON string")
        if self.kind == "json_object" and self.schema is not None:
            raise InvalidRequest("a json_object grammar takes no schema")


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one request. Order of the logits processing (engine/sampler.py): repetition
    penalty (prompt + output), frequency/presence penalties (output), logit_bias, grammar mask,
    then temperature, top_k, min_p, top_p. Logprobs are of the raw logits (before all of it)."""

    max_tokens: int = 16
    temperature: float = 1.0  # < GREEDY_TEMPERATURE = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    stop: tuple[str, ...] = ()
    seed: int | None = None  # choice i of n uses seed + i
    ignore_eos: bool = False
    include_stop_str: bool = False  # a matched stop string stays in the text (vLLM include_stop_str_in_output)
    min_tokens: int = 0  # before this many output tokens: EOS and stop_token_ids are masked, stop strings unchecked
    n: int = 1
    logprobs: int | None = None  # top-k alternatives per generated token (0: the chosen only)
    prompt_logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_p: float = 0.0
    stop_token_ids: tuple[int, ...] = ()
    grammar: GrammarSpec | None = None

    def __post_init__(self):
        if not _is_int(self.max_tokens) or self.max_tokens <= 0:
            raise InvalidRequest(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if not _is_num(self.temperature) or not (0.0 <= self.temperature <= 2.0):
            raise InvalidRequest(f"temperature must be in [0, 2], got {self.temperature!r}")
        if not _is_num(self.top_p) or not (0.0 < self.top_p <= 1.0):
            raise InvalidRequest(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise InvalidRequest(f"top_k must be a non-negative integer, got {self.top_k!r}")
        stop = (self.stop,) if isinstance(self.stop, str) else self.stop
        if not isinstance(stop, (tuple, list)) or len(stop) > 4 or not all(isinstance(s, str) and s for s in stop):
            raise InvalidRequest("stop must be a non-empty string or a list of at most 4 non-empty strings")
        object.__setattr__(self, "stop", tuple(stop))
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            raise InvalidRequest(f"min_tokens must be an integer in [0, max_tokens={self.max_tokens}], "
                                 f"got {self.min_tokens!r}")
        if self.seed is not None and not _is_int(self.seed):
            raise InvalidRequest(f"seed must be an integer, got {self.seed!r}")
        if not _is_int(self.n) or not 1 <= self.n <= MAX_N:
            raise InvalidRequest(f"n must be an integer in [1, {MAX_N}], got {self.n!r}")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and (not _is_int(v) or not 0 <= v <= MAX_LOGPROBS):
                raise InvalidRequest(f"{name} must be an integer in [0, {MAX_LOGPROBS}], got {v!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not _is_num(v) or not -2.0 <= v <= 2.0:
                raise InvalidRequest(f"{name} must be in [-2, 2], got {v!r}")
        if not _is_num(self.repetition_penalty) or not 0.0 < self.repetition_penalty <= 2.0:
            raise InvalidRequest(f"repetition_penalty must be in (0, 2], got {self.repetition_penalty!r}")
        if not _is_num(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise InvalidRequest(f"min_p must be in [0, 1], got {self.min_p!r}")
        bias = self.logit_bias.items() if isinstance(self.logit_bias, dict) else self.logit_bias
        try:
            bias = tuple((t, b) for t, b in bias)
        except (TypeError, ValueError):
            raise InvalidRequest("logit_bias must map token ids to biases") from None
        if len(bias) > 1024 or not all(_is_int(t) and t >= 0 and _is_num(b) and -100.0 <= b <= 100.0 for t, b in bias):
            raise InvalidRequest("logit_bias must map at most 1024 non-negative integer token ids to biases in [-100, 100]")
        if len({t for t, _ in bias}) != len(bias):
            raise InvalidRequest("logit_bias names a token id twice")
        object.__setattr__(self, "logit_bias", tuple(sorted((t, float(b)) for t, b in bias)))
        ids = self.stop_token_ids
        if not isinstance(ids, (tuple, list)) or len(ids) > 64 or not all(_is_int(t) and t >= 0 for t in ids):
            raise InvalidRequest("stop_token_ids must be a list of at most 64 non-negative integer token ids")
        object.__setattr__(self, "stop_token_ids", tuple(ids))
        g = self.grammar
        if isinstance(g, dict):
            unknown = set(g) - {"kind", "schema"}
            if unknown:
                raise InvalidRequest(f"unknown grammar fields: {sorted(unknown)}")
            g = GrammarSpec(**g)
            object.__setattr__(self, "grammar", g)
        if g is not None and not isinstance(g, GrammarSpec):
            raise InvalidRequest("grammar must be a GrammarSpec")

    @classmethod
    def from_dict(cls, d: dict) -> "SamplingParams":
        known = {f.name for f in fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise InvalidRequest(f"unknown sampling parameters: {sorted(unknown)}")
        return cls(**d)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def penalized(self) -> bool:
        """Whether the logits need processing beyond temperature/top-k/top-p (the slow path)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
                    or self.logit_bias)


@dataclass(frozen=True)
class Request:
    """One generation request. ``share_domain`` salts block hashes: requests of one domain share
    KV; by default a tenant's domain is the tenant itself (see policies.tenancy)."""

    request_id: str
    prompt_ids: tuple[int, ...]
    params: SamplingParams = SamplingParams()
    tenant: str = "default"
    share_domain: str | None = None
    reuse: str = "exact"
    # Domains this request may read KV from besides its own (grants), tried in order.
    read_domains: tuple[str, ...] = ()
    # Approximate reuse (engine/approx.py), used only when reuse == "approximate": the template
    # the prompt instantiates (id; its text here or registered with the engine) and its values;
    # remap policy and recompute share r (None: the engine's defaults).
    template: str | None = None
    template_text: str | None = field(default=None, compare=False)
    template_params: dict[str, str] | None = field(default=None, compare=False)
    remap_policy: str | None = None
    recompute_ratio: float | None = None
    # Sent to a worker assigned to another tenant, which lent it (cluster.pool.WorkerPool.lendable):
    # scheduled below every class of that worker's own tenants (policies.prefill_priority.request_class).
    guest: bool = False

    @property
    def domain(self) -> str:
        return self.share_domain or self.tenant


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """Mutable engine state of one request.

    ``tokens`` = prompt + generated ids. ``num_computed`` tokens have KV in ``blocks`` (the block
    table); the next forward computes tokens[num_computed : num_computed + chunk].
    ``block_hashes[i]`` is the chain hash of block i once it is full.
    """

    request: Request
    tokens: list[int]
    num_prompt: int
    status: SequenceStatus = SequenceStatus.WAITING
    blocks: list[Block] = field(default_factory=list)
    block_hashes: list[BlockHash] = field(default_factory=list)
    num_computed: int = 0
    num_cached: int = 0  # prompt tokens served from reused KV (exact prefix cache + approximate)
    num_approx: int = 0  # of those, served from approximate (remapped donor) KV
    approx_kv: bool = False  # KV built from a donor: never registered in the exact prefix cache
    approx_tried: bool = False
    # Quality gate (engine/approx.py): a match to shadow-check once this exactly served request
    # has finished; meanwhile the exact argmax at every output step (len == num_output) and the
    # exact logits of the first output token are recorded.
    shadow: object = None  # engine.approx.ApproxMatch
    shadow_argmax: list[int] = field(default_factory=list)
    shadow_first_logits: torch.Tensor | None = None
    num_registered: int = 0  # leading blocks already in the prefix cache
    prefix_chains: tuple[int, dict] | None = None  # (token count, chain hashes per readable domain)
    finish_reason: str | None = None
    arrival: float = field(default_factory=time.perf_counter)
    first_token_at: float | None = None
    prefill_s: float = 0.0  # forward time attributed to this prompt's chunks (by token share)
    generator: torch.Generator | None = None
    text: str = ""  # generated text so far (after stop-string truncation on finish)
    emitted_chars: int = 0
    stop_from: int = 0  # a stop string must end after this many chars of text (those came before min_tokens)
    detok: object = None
    # n > 1 (engine/fork.py): choice ``index`` of ``group``; choice 0 prefills, the others fork
    # from it once its prompt is computed, sharing its full blocks.
    index: int = 0
    group: "SeqGroup | None" = None
    matcher: object = None  # engine.grammar matcher of this choice (params.grammar)
    cumulative_logprob: float = 0.0
    # prompt_logprobs: entry p = logprob of prompt token p given tokens[:p] (entry 0 stays None);
    # filled chunk by chunk while the prompt is computed, sent with the first output.
    prompt_lp: list | None = None
    prompt_lp_sent: bool = False

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def params(self) -> SamplingParams:
        return self.request.params

    @property
    def num_output(self) -> int:
        return len(self.tokens) - self.num_prompt

    @property
    def output_ids(self) -> list[int]:
        return self.tokens[self.num_prompt :]

    @property
    def num_pending(self) -> int:
        """Tokens whose KV still has to be computed before the next sample."""
        return len(self.tokens) - self.num_computed

    @property
    def finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED


@dataclass(eq=False)
class SeqGroup:
    """The n choices of one request. ``choices`` grows when choice 0 forks; the request is done
    when ``num_finished == n`` (its last output then carries ``finished=True``)."""

    n: int
    choices: list[Sequence] = field(default_factory=list)
    forked: bool = False
    num_finished: int = 0

    @property
    def done(self) -> bool:
        return self.num_finished >= self.n


@dataclass(frozen=True)
class TokenLogprob:
    """A token's logprob under the model's raw distribution and the top-k (token_id, logprob)
    alternatives, best first."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass
class RequestOutput:
    """Incremental result of one step for one choice of one request.

    ``finished`` is True on the request's last output (all choices done); ``choice_finished``
    on each choice's last one (its ``finish_reason`` set). For n = 1 they coincide."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_cached_tokens: int
    num_output_tokens: int
    ttft_s: float | None = None
    prefill_s: float | None = None  # forward time spent on this prompt (excludes queueing)
    route: str | None = None  # local | pulled | recomputed, set by the worker on every output
    pulled_tokens: int = 0  # prompt tokens whose KV was pulled from another worker
    pull_outcome: str | None = None  # what its pulls did, comma separated (actors.worker.PULL_OUTCOMES); None: none
    num_approx_tokens: int = 0  # of num_cached_tokens, those served from approximate (remapped) KV
    index: int = 0  # choice 0..n-1
    choice_finished: bool = False
    logprobs: list[TokenLogprob] | None = None  # one per new_token_ids when params.logprobs is not None
    prompt_logprobs: list[TokenLogprob | None] | None = None  # first output of choice 0; entry 0 is None
    cumulative_logprob: float = 0.0  # sum of the choice's chosen-token logprobs (when logprobs is on)
    error: str | None = None  # the request failed alone (sampling/grammar); finished=True
