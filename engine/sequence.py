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
    """The request cannot be served as given; the message says why. Nothing was allocated."""


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    stop: tuple[str, ...] = ()
    seed: int | None = None
    ignore_eos: bool = False

    def __post_init__(self):
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens <= 0:
            raise InvalidRequest(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if not isinstance(self.temperature, (int, float)) or not (0.0 <= self.temperature <= 2.0) or math.isnan(self.temperature):
            raise InvalidRequest(f"temperature must be in [0, 2], got {self.temperature!r}")
        if not isinstance(self.top_p, (int, float)) or not (0.0 < self.top_p <= 1.0):
            raise InvalidRequest(f"top_p must be in (0, 1], got {self.top_p!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise InvalidRequest(f"top_k must be a non-negative integer, got {self.top_k!r}")
        stop = (self.stop,) if isinstance(self.stop, str) else self.stop
        if not isinstance(stop, (tuple, list)) or len(stop) > 4 or not all(isinstance(s, str) and s for s in stop):
            raise InvalidRequest("stop must be a non-empty string or a list of at most 4 non-empty strings")
        object.__setattr__(self, "stop", tuple(stop))
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise InvalidRequest(f"seed must be an integer, got {self.seed!r}")

    @classmethod
    def from_dict(cls, d: dict) -> "SamplingParams":
        known = {f.name for f in fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise InvalidRequest(f"unknown sampling parameters: {sorted(unknown)}")
        return cls(**d)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


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
    detok: object = None

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


@dataclass
class RequestOutput:
    """Incremental result of one step for one request."""

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
    num_approx_tokens: int = 0  # of num_cached_tokens, those served from approximate (remapped) KV
