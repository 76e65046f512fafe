"""Structured output with xgrammar: compiled grammars (LRU per spec), one matcher per choice, and
the token bitmask of a step's grammar rows, applied inside the batched sampler.

The vocabulary is the model's config vocab (the logits' width): ids the tokenizer does not
define (padding) are never allowed. The byte tokenizer of the tiny test model gets a RAW
byte vocabulary (id 3 + b = byte b; pad/bos and ids past 258 are special, eos stops).

Invariants: a matcher only ever accepts the tokens its mask allowed; a choice whose matcher has
terminated is finished (``stop``); a spec xgrammar cannot compile raises InvalidRequest.

Cost bounds (a schema is client input). Compiling is not bounded by the schema's size: with the
default model's 49k vocabulary an enum of 5,000 values took 0.11 CPU-s and 0.9 MB of token
masks, one of 20,000 4.6 s and 100 MB, and 2,000 optional string properties (98 KB) 204 s. So:
a schema longer than ``max_schema_chars`` is refused before compiling; a schema is compiled here
only once a child process compiled it within ``compile_cpu_s`` CPU-seconds (the kernel ends the
child past them: engine/grammar_compile.py; 0 compiles here at once, unbounded), and a schema
refused for that is refused again at once (the last ``MAX_TOO_COSTLY``, by digest); compiled
grammars are kept within ``max_bytes`` (their ``memory_size_bytes``) and ``max_entries``, and one
larger than ``max_bytes`` alone is refused.
The async engine waits for a compile on a thread of its own, so a compile never holds up the
engine's steps for other requests; the cache is safe to use from both threads.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
from collections import OrderedDict

import torch

from engine.sequence import GrammarSpec, InvalidRequest

JSON_OBJECT_SCHEMA = '{"type": "object"}'
_SOURCE_PREFIX = re.compile(r"^\[[0-9:.]+\]\s+\S+:\d+:\s*")  # "[13:16:36] /project/cpp/x.cc:5082: "


def _tokenizer_info(tokenizer, vocab_size: int, eos_ids: set[int]):
    import xgrammar as xgr

    from engine.tokenizer import ByteTokenizer

    stops = sorted(t for t in eos_ids if t < vocab_size)
    if isinstance(tokenizer, ByteTokenizer):
        off = ByteTokenizer._offset
        vocab = [b""] * vocab_size
        for b in range(256):
            if off + b < vocab_size:
                vocab[off + b] = bytes([b])
        return xgr.TokenizerInfo(vocab, xgr.VocabType.RAW, vocab_size=vocab_size, stop_token_ids=stops)
    try:
        return xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=stops or None)
    except Exception as e:  # noqa: BLE001 - a tokenizer xgrammar does not understand
        raise InvalidRequest(f"structured output is not supported for this model's tokenizer: {e}") from None


MAX_SCHEMA_CHARS = 128 * 1024  # OpenAI bounds schemas too (properties, enum values, name lengths)
MAX_GRAMMAR_BYTES = 256 << 20  # compiled grammars kept per engine (their token masks)
COMPILE_CPU_S = 10.0  # CPU-seconds one schema may take to compile (engine/grammar_compile.py)
MAX_TOO_COSTLY = 1024  # schemas remembered as past that budget (refused again without a compile)


class GrammarCache:
    """Compiles grammar specs for one model (LRU of ``max_entries`` and ``max_bytes``) and makes
    matchers. Thread-safe: compiles run outside the lock."""

    def __init__(self, tokenizer, vocab_size: int, eos_ids: set[int], max_entries: int = 64,
                 max_bytes: int = MAX_GRAMMAR_BYTES, max_schema_chars: int = MAX_SCHEMA_CHARS,
                 compile_cpu_s: float = COMPILE_CPU_S):
        self.tokenizer, self.vocab_size, self.eos_ids = tokenizer, vocab_size, eos_ids
        self.max_entries, self.max_bytes, self.max_schema_chars = max_entries, max_bytes, max_schema_chars
        self.compile_cpu_s = compile_cpu_s  # > 0: compiles run in a child process with this CPU budget
        self._info = None
        self._compiler = None
        self._child = None
        self._lock = threading.Lock()
        self._compiled: OrderedDict[GrammarSpec, tuple[object, int]] = OrderedDict()  # spec -> (grammar, bytes)
        self.bytes = 0
        # digests of schemas refused for their compile's cost: refused again at once, not recompiled
        self._too_costly: OrderedDict[bytes, str] = OrderedDict()
        self.stats = {"compiled": 0, "hits": 0, "refused": 0}

    def _get_info(self):
        with self._lock:
            if self._info is None:
                self._info = _tokenizer_info(self.tokenizer, self.vocab_size, self.eos_ids)
            return self._info

    def _compile_here(self, schema: str):
        """Compile in this process, unbounded: ("ok", grammar) or ("error", message)."""
        import xgrammar as xgr

        info = self._get_info()
        with self._lock:
            if self._compiler is None:
                self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
            compiler = self._compiler
        try:
            # compact JSON (no free whitespace): a small model cannot loop on blanks
            return "ok", compiler.compile_json_schema(schema, any_whitespace=False)
        except Exception as e:  # noqa: BLE001 - xgrammar raises RuntimeError with the reason
            return "error", str(e).strip() or repr(e)

    def _compile_checked(self, schema: str):
        """Compile here once a child process compiled ``schema`` within ``compile_cpu_s``:
        ("ok", grammar), ("error", message) or ("too_big", bytes); InvalidRequest past the budget."""
        from engine.grammar_compile import CompileProcess

        info = self._get_info()  # outside the lock (it takes it)
        with self._lock:
            if self._child is None:
                self._child = CompileProcess(info.serialize_json(), self.compile_cpu_s)
            child = self._child
        kind, val = child.compile(schema, self.max_bytes)
        return self._compile_here(schema) if kind == "ok" else (kind, val)

    def close(self) -> None:
        """End the compile child, if one runs."""
        with self._lock:
            child, self._child = self._child, None
        if child is not None:
            child.close()

    def cached(self, spec: GrammarSpec):
        """The compiled grammar of ``spec`` if kept (now the most recently used), else None."""
        with self._lock:
            hit = self._compiled.get(spec)
            if hit is None:
                return None
            self._compiled.move_to_end(spec)
            self.stats["hits"] += 1
            return hit[0]

    def keep(self, spec: GrammarSpec, compiled) -> None:
        """Keep ``compiled`` as ``spec``'s grammar (most recently used), evicting the least recently
        used ones past ``max_entries`` / ``max_bytes`` (never the one just kept)."""
        size = int(getattr(compiled, "memory_size_bytes", 0) or 0)
        with self._lock:
            old = self._compiled.pop(spec, None)
            if old is not None:
                self.bytes -= old[1]
            self._compiled[spec] = (compiled, size)
            self.bytes += size
            while len(self._compiled) > 1 and (len(self._compiled) > self.max_entries or self.bytes > self.max_bytes):
                _, (_, b) = self._compiled.popitem(last=False)
                self.bytes -= b

    def _refuse(self, msg: str):
        with self._lock:
            self.stats["refused"] += 1
        return InvalidRequest(msg, param="response_format")

    def compile(self, spec: GrammarSpec):
        """The compiled grammar of ``spec`` (cached); InvalidRequest if it cannot compile or is
        past the cost bounds."""
        hit = self.cached(spec)
        if hit is not None:
            return hit
        schema = JSON_OBJECT_SCHEMA if spec.kind == "json_object" else spec.schema
        if len(schema) > self.max_schema_chars:
            raise self._refuse(f"the JSON schema has {len(schema)} characters; this server compiles schemas of "
                               f"at most {self.max_schema_chars}")
        try:
            json.loads(schema)
        except ValueError as e:
            raise self._refuse(f"the JSON schema is not valid JSON: {e}") from None
        digest = hashlib.sha256(schema.encode("utf-8", "surrogatepass")).digest()
        with self._lock:
            known = self._too_costly.get(digest)
        if known is not None:
            raise self._refuse(known)
        try:
            kind, compiled = self._compile_checked(schema) if self.compile_cpu_s > 0 else self._compile_here(schema)
        except InvalidRequest as e:
            with self._lock:
                self.stats["refused"] += 1
                if getattr(e, "over_cpu", False):
                    self._too_costly[digest] = str(e)
                    while len(self._too_costly) > MAX_TOO_COSTLY:
                        self._too_costly.popitem(last=False)
            raise
        if kind == "error":
            msg = _SOURCE_PREFIX.sub("", compiled.splitlines()[-1])  # xgrammar's "[hh:mm:ss] /src.cc:123: "
            raise self._refuse(f"the JSON schema cannot be compiled: {msg}")
        size = compiled if kind == "too_big" else int(getattr(compiled, "memory_size_bytes", 0) or 0)
        if size > self.max_bytes:
            raise self._refuse(f"the JSON schema compiles to {size >> 20} MiB of token masks; this server keeps "
                               f"at most {self.max_bytes >> 20} MiB of them")
        with self._lock:
            self.stats["compiled"] += 1
        self.keep(spec, compiled)
        return compiled

    def matcher(self, spec: GrammarSpec):
        import xgrammar as xgr

        return xgr.GrammarMatcher(self.compile(spec))

    def mask_fn(self, matchers: list[tuple[int, object]], device):
        """A function masking logits rows in place: ``matchers`` = (row, matcher) of the grammar
        rows; other rows are left as they are. Filling the bitmask happens now (on the CPU)."""
        import xgrammar as xgr

        if not matchers:
            return None
        bitmask = xgr.allocate_token_bitmask(len(matchers), self.vocab_size)
        for j, (_, m) in enumerate(matchers):
            m.fill_next_token_bitmask(bitmask, j)
        rows = [r for r, _ in matchers]

        def apply(x: torch.Tensor) -> None:
            sub = x[rows]  # [G, V]; padding ids past the vocab are masked by the bitmask width
            xgr.apply_token_bitmask_inplace(sub, bitmask.to(sub.device), vocab_size=self.vocab_size)
            x[rows] = sub

        return apply
