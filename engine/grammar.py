"""Structured output with xgrammar: compiled grammars (LRU per spec), one matcher per choice, and
the token bitmask of a step's grammar rows, applied inside the batched sampler.

The vocabulary is the model's config vocab (the logits' width): ids the tokenizer does not
define (padding) are never allowed. The byte tokenizer of the tiny test model gets a RAW
byte vocabulary (id 3 + b = byte b; pad/bos and ids past 258 are special, eos stops).

Invariants: a matcher only ever accepts the tokens its mask allowed; a choice whose matcher has
terminated is finished (``stop``); a spec xgrammar cannot compile raises InvalidRequest.
"""

from __future__ import annotations

import json
import re
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


class GrammarCache:
    """Compiles grammar specs for one model (LRU of ``max_entries``) and makes matchers."""

    def __init__(self, tokenizer, vocab_size: int, eos_ids: set[int], max_entries: int = 64):
        self.tokenizer, self.vocab_size, self.eos_ids = tokenizer, vocab_size, eos_ids
        self.max_entries = max_entries
        self._compiler = None
        self._compiled: OrderedDict[GrammarSpec, object] = OrderedDict()
        self.stats = {"compiled": 0, "hits": 0}

    def _get_compiler(self):
        if self._compiler is None:
            import xgrammar as xgr

            info = _tokenizer_info(self.tokenizer, self.vocab_size, self.eos_ids)
            self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        return self._compiler

    def compile(self, spec: GrammarSpec):
        """The compiled grammar of ``spec`` (cached); InvalidRequest if it cannot compile."""
        hit = self._compiled.get(spec)
        if hit is not None:
            self._compiled.move_to_end(spec)
            self.stats["hits"] += 1
            return hit
        compiler = self._get_compiler()
        schema = JSON_OBJECT_SCHEMA if spec.kind == "json_object" else spec.schema
        try:
            json.loads(schema)
        except ValueError as e:
            raise InvalidRequest(f"the JSON schema is not valid JSON: {e}") from None
        try:
            # compact JSON (no free whitespace): a small model cannot loop on blanks
            compiled = compiler.compile_json_schema(schema, any_whitespace=False)
        except Exception as e:  # noqa: BLE001 - xgrammar raises RuntimeError with the reason
            msg = str(e).strip().splitlines()[-1] if str(e).strip() else repr(e)
            msg = _SOURCE_PREFIX.sub("", msg)  # xgrammar's "[hh:mm:ss] /its/source.cc:123: " prefix
            raise InvalidRequest(f"the JSON schema cannot be compiled: {msg}") from None
        self._compiled[spec] = compiled
        self.stats["compiled"] += 1
        while len(self._compiled) > self.max_entries:
            self._compiled.popitem(last=False)
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
