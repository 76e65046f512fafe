"""Engine outputs → OpenAI choices: text, logprobs (completions and chat shapes), echo, best_of.

Pure formatting (no Ray, no FastAPI). One ``Assembler`` answers one HTTP request, which may hold
several engine requests (one per prompt of a batched completion), each with ``n_engine``
choices. Invariants:

* the returned choice index is ``prompt_index * n + rank`` (``rank`` = the engine's choice index,
  or its rank by cumulative logprob when ``best_of`` > n);
* with ``echo`` a choice's text starts with its prompt's text, and with logprobs its logprobs
  start with the prompt's tokens (the first one ``null``, as OpenAI); ``score_only``
  (``max_tokens: 0`` with echo) drops the one token the engine had to generate;
* usage sums prompt tokens over prompts (once per prompt, whatever n) and completion tokens over
  every generated choice (best_of included: they were computed);
* logprobs are finite in JSON: -inf (masked tokens) is written as -9999.0, as vLLM does.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field

from cluster.protocol import ApiError, usage

LOGPROB_FLOOR = -9999.0


def _lp(x) -> float:
    x = float(x)
    return x if math.isfinite(x) else LOGPROB_FLOOR


class TokenTexts:
    """Token id → its text (``tokenizer.decode([id])``, special tokens kept), memoised."""

    def __init__(self, tokenizer):
        self.tokenizer, self.cache = tokenizer, {}

    def __call__(self, token_id: int) -> str:
        s = self.cache.get(token_id)
        if s is None:
            try:
                s = self.tokenizer.decode([token_id], skip_special_tokens=False)
            except TypeError:
                s = self.tokenizer.decode([token_id])
            self.cache[token_id] = s
        return s


class TokenIds:
    """Token id → ``"token_id:<id>"`` (vLLM's ``return_tokens_as_token_ids``)."""

    def __call__(self, token_id: int) -> str:
        return f"token_id:{token_id}"


@dataclass
class PromptInfo:
    """One prompt of the request: its ids and (for echo) text; ``logprobs`` arrive with the
    first output of choice 0 when the request asked for prompt logprobs."""

    ids: list[int]
    text: str
    logprobs: list | None = None


@dataclass
class _Choice:
    prompt: int
    engine_index: int
    texts: list[str] = field(default_factory=list)
    entries: list = field(default_factory=list)  # (token_id, TokenLogprob | None) returned so far
    finish_reason: str | None = None
    num_output_tokens: int = 0
    cumulative_logprob: float = 0.0
    started: bool = False  # stream: the echo prefix / role went out
    offset: int = 0  # stream: text_offset of the next token


def finish_reason(reason: str | None) -> str | None:
    return {"abort": "stop"}.get(reason, reason) if reason else None


def completion_logprobs(entries, texts: TokenTexts, offset: int, top_k: int) -> tuple[dict, int]:
    """OpenAI completions ``logprobs`` for ``entries`` [(token_id, TokenLogprob | None)], text
    offsets starting at ``offset`` (the running sum of token text lengths)."""
    tokens, token_lps, tops, offsets = [], [], [], []
    for tid, lp in entries:
        s = texts(tid)
        tokens.append(s)
        offsets.append(offset)
        offset += len(s)
        if lp is None:
            token_lps.append(None)
            tops.append(None)
            continue
        token_lps.append(_lp(lp.logprob))
        top: dict = {}
        for t, v in tuple(lp.top)[:top_k]:  # best first: two ids with one text keep the better logprob
            top.setdefault(texts(t), _lp(v))
        top.setdefault(s, _lp(lp.logprob))  # vLLM: the chosen token is always in the dict
        tops.append(top)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}, offset


def _chat_token(s: str, lp: float) -> dict:
    return {"token": s, "logprob": _lp(lp), "bytes": list(s.encode("utf-8"))}


def chat_logprobs(entries, texts: TokenTexts, top_k: int) -> list[dict]:
    out = []
    for tid, lp in entries:
        if lp is None:
            continue
        entry = _chat_token(texts(tid), lp.logprob)
        entry["top_logprobs"] = [_chat_token(texts(t), v) for t, v in tuple(lp.top)[:top_k]]
        out.append(entry)
    return out


class Assembler:
    def __init__(self, chat: bool, prompts: list[PromptInfo], n: int, n_engine: int, texts: TokenTexts,
                 logprobs: int | None = None, echo: bool = False, score_only: bool = False):
        self.chat, self.prompts, self.n, self.n_engine, self.texts = chat, prompts, n, n_engine, texts
        self.logprobs, self.echo, self.score_only = logprobs, echo, score_only
        self.choices = {(p, i): _Choice(p, i) for p in range(len(prompts)) for i in range(n_engine)}
        self.prompt_tokens = [len(p.ids) for p in prompts]
        self.cached_tokens = [0] * len(prompts)
        self.finished = [False] * len(prompts)

    @property
    def num_choices(self) -> int:
        return len(self.prompts) * self.n

    def add(self, p: int, out) -> list[dict]:
        """Take one engine output of prompt ``p``; returns the stream choice deltas it makes
        (empty when nothing is to be sent). Raises ApiError(500, engine_error) on ``out.error``."""
        err = getattr(out, "error", None)
        if err:
            raise ApiError(500, f"the engine failed this request: {err}", type_="server_error", code="engine_error")
        self.cached_tokens[p] = out.num_cached_tokens
        self.prompt_tokens[p] = out.num_prompt_tokens
        if out.finished:
            self.finished[p] = True
        pl = getattr(out, "prompt_logprobs", None)
        if pl is not None:
            self.prompts[p].logprobs = list(pl)
        c = self.choices[(p, getattr(out, "index", 0))]
        done = bool(getattr(out, "choice_finished", False) or out.finished)
        ids = list(out.new_token_ids)
        lps = getattr(out, "logprobs", None)
        text = out.new_text
        if self.score_only:
            ids, lps, text = [], None, ""
        else:
            c.num_output_tokens = out.num_output_tokens
            c.cumulative_logprob = getattr(out, "cumulative_logprob", 0.0)
        entries = list(zip(ids, lps)) if self.logprobs is not None and lps is not None else \
            [(t, None) for t in ids] if self.logprobs is not None else []
        prefix_text, prefix_entries = "", []
        if not c.started:
            c.started = True
            if self.echo:
                prefix_text, prefix_entries = self._echo(p)
        c.texts.append(prefix_text + text)
        new_entries = prefix_entries + entries
        c.entries.extend(new_entries)
        if done:
            c.finish_reason = "length" if self.score_only else out.finish_reason
        if not (prefix_text or text or new_entries or done):
            return []
        return [self._delta(c, prefix_text + text, new_entries, done)]

    def _echo(self, p: int) -> tuple[str, list]:
        info = self.prompts[p]
        if self.logprobs is None:
            return info.text, []
        lps = info.logprobs or [None] * len(info.ids)
        return info.text, list(zip(info.ids, lps))

    def _index(self, c: _Choice) -> int:
        return c.prompt * self.n + c.engine_index

    def _delta(self, c: _Choice, text: str, entries: list, done: bool) -> dict:
        d: dict = {"index": self._index(c), "logprobs": None, "finish_reason": finish_reason(c.finish_reason) if done
                   else None}
        if self.chat:
            d["delta"] = {"content": text} if text else {}
            if self.logprobs is not None:
                d["logprobs"] = {"content": chat_logprobs(entries, self.texts, self.logprobs), "refusal": None}
        else:
            d["text"] = text
            if self.logprobs is not None:
                d["logprobs"], c.offset = completion_logprobs(entries, self.texts, c.offset, self.logprobs)
        return d

    def role_deltas(self) -> list[dict]:
        """Chat streams open every choice with its role."""
        return [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
                for i in range(self.num_choices)]

    def usage(self) -> dict:
        completion = 0 if self.score_only else sum(c.num_output_tokens for c in self.choices.values())
        return usage(sum(self.prompt_tokens), completion, sum(self.cached_tokens))

    def final_choices(self) -> list[dict]:
        """The whole response's choices, in index order (best_of: the n best by cumulative logprob)."""
        out = []
        for p in range(len(self.prompts)):
            group = [self.choices[(p, i)] for i in range(self.n_engine)]
            if self.n_engine > self.n:
                group = sorted(group, key=lambda c: -c.cumulative_logprob)[: self.n]
            for rank, c in enumerate(group):
                out.append(self._final(c, p * self.n + rank))
        return out

    def _final(self, c: _Choice, index: int) -> dict:
        text = "".join(c.texts)
        d: dict = {"index": index, "logprobs": None, "finish_reason": finish_reason(c.finish_reason)}
        if self.chat:
            d["message"] = {"role": "assistant", "content": text}
            if self.logprobs is not None:
                d["logprobs"] = {"content": chat_logprobs(c.entries, self.texts, self.logprobs), "refusal": None}
        else:
            d["text"] = text
            if self.logprobs is not None:
                d["logprobs"], _ = completion_logprobs(c.entries, self.texts, 0, self.logprobs)
        return d


def response(rid: str, model: str, chat: bool, choices: list[dict], use: dict, kvmesh: dict) -> dict:
    return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
            "model": model, "choices": choices, "usage": use, "kvmesh": kvmesh}


def chunk_event(rid: str, model: str, created: int, chat: bool, choices: list[dict], use: dict | None = None,
                kvmesh: dict | None = None) -> str:
    """One SSE event (``data: {...}\\n\\n``)."""
    obj: dict = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion", "created": created,
                 "model": model, "choices": choices}
    if use is not None:
        obj["usage"] = use
    if kvmesh is not None:
        obj["kvmesh"] = kvmesh
    return f"data: {json.dumps(obj)}\n\n"
