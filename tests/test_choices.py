"""cluster.choices without Ray: engine outputs (as the issue-12 contract shapes them) → OpenAI
choices, logprobs in both shapes, echo, score-only, best_of ranking, usage sums, engine errors."""

import json
from dataclasses import dataclass
from types import SimpleNamespace

import pytest

from cluster.choices import LOGPROB_FLOOR, Assembler, PromptInfo, TokenTexts, chunk_event
from cluster.protocol import ApiError
from engine.tokenizer import ByteTokenizer


@dataclass(frozen=True)
class TL:  # the contract's TokenLogprob
    token_id: int
    logprob: float
    top: tuple = ()


def out(text, ids, *, index=0, done=False, finished=None, lps=None, plps=None, n_out=None, cum=0.0, reason="length",
        prompt=3, cached=0, error=None):
    finished = done if finished is None else finished
    return SimpleNamespace(request_id="r", new_token_ids=ids, new_text=text, finished=finished,
                           finish_reason=reason if done else None, num_prompt_tokens=prompt, num_cached_tokens=cached,
                           num_output_tokens=n_out if n_out is not None else len(ids), index=index,
                           choice_finished=done, logprobs=lps, prompt_logprobs=plps, cumulative_logprob=cum,
                           error=error)


TOK = ByteTokenizer()
TEXTS = TokenTexts(TOK)


def ids(s):
    return TOK.encode(s)


def test_completion_logprobs_with_echo_prompt_first_entry_null():
    prompt = PromptInfo(ids("ab"), "ab")
    asm = Assembler(False, [prompt], n=1, n_engine=1, texts=TEXTS, logprobs=1, echo=True)
    a, b, c = ids("abc")
    plps = [None, TL(b, -0.5, ((b, -0.5),))]
    asm.add(0, out("c", [c], lps=[TL(c, -1.25, ((ids("d")[0], -0.25),))], plps=plps, done=True, prompt=2))
    [ch] = asm.final_choices()
    assert ch["text"] == "abc" and ch["finish_reason"] == "length"
    lp = ch["logprobs"]
    assert lp["tokens"] == ["a", "b", "c"]
    assert lp["token_logprobs"] == [None, -0.5, -1.25]
    assert lp["top_logprobs"] == [None, {"b": -0.5}, {"d": -0.25, "c": -1.25}]  # the chosen token is always there
    assert lp["text_offset"] == [0, 1, 2]
    assert asm.usage()["completion_tokens"] == 1 and asm.usage()["prompt_tokens"] == 2


def test_score_only_drops_the_generated_token():
    prompt = PromptInfo(ids("xy"), "xy")
    asm = Assembler(False, [prompt], n=1, n_engine=1, texts=TEXTS, logprobs=0, echo=True, score_only=True)
    x, y = ids("xy")
    asm.add(0, out("z", ids("z"), lps=[TL(ids("z")[0], -3.0)], plps=[None, TL(y, -2.0)], done=True, prompt=2))
    [ch] = asm.final_choices()
    assert ch["text"] == "xy" and ch["logprobs"]["token_logprobs"] == [None, -2.0]
    assert ch["finish_reason"] == "length" and asm.usage()["completion_tokens"] == 0


def test_best_of_returns_the_n_best_by_cumulative_logprob_and_hides_logprobs():
    asm = Assembler(False, [PromptInfo(ids("p"), "p")], n=2, n_engine=3, texts=TEXTS, logprobs=None)
    for i, (t, cum) in enumerate([("a", -3.0), ("b", -1.0), ("c", -2.0)]):
        asm.add(0, out(t, ids(t), index=i, done=True, finished=i == 2, cum=cum))
    chs = asm.final_choices()
    assert [(c["index"], c["text"]) for c in chs] == [(0, "b"), (1, "c")]
    assert all(c["logprobs"] is None for c in chs)
    assert asm.usage()["completion_tokens"] == 3  # every generated choice was computed


def test_batched_prompts_times_n_are_indexed_prompt_major_and_usage_sums():
    prompts = [PromptInfo(ids("one"), "one"), PromptInfo(ids("two!"), "two!")]
    asm = Assembler(False, prompts, n=2, n_engine=2, texts=TEXTS)
    deltas = []
    for p in (1, 0):
        for i in range(2):
            deltas += asm.add(p, out(f"{p}{i}", ids(f"{p}{i}"), index=i, done=True, finished=i == 1,
                                     prompt=len(prompts[p].ids), cached=p * 16))
    assert sorted(d["index"] for d in deltas) == [0, 1, 2, 3]
    chs = asm.final_choices()
    assert [c["text"] for c in chs] == ["00", "01", "10", "11"]
    u = asm.usage()
    assert u["prompt_tokens"] == 7 and u["completion_tokens"] == 8 and u["prompt_tokens_details"]["cached_tokens"] == 16


def test_chat_logprobs_shape_and_finite_floor():
    asm = Assembler(True, [PromptInfo(ids("q"), "")], n=1, n_engine=1, texts=TEXTS, logprobs=2)
    h = ids("h")[0]
    d1 = asm.add(0, out("h", [h], lps=[TL(h, float("-inf"), ((h, -0.1), (ids("i")[0], float("-inf"))))]))
    assert d1[0]["delta"] == {"content": "h"} and d1[0]["finish_reason"] is None
    entry = d1[0]["logprobs"]["content"][0]
    assert entry == {"token": "h", "logprob": LOGPROB_FLOOR, "bytes": [104],
                     "top_logprobs": [{"token": "h", "logprob": -0.1, "bytes": [104]},
                                      {"token": "i", "logprob": LOGPROB_FLOOR, "bytes": [105]}]}
    d2 = asm.add(0, out("", [], done=True, reason="stop", n_out=1))
    assert d2[0]["finish_reason"] == "stop"
    [ch] = asm.final_choices()
    assert ch["message"] == {"role": "assistant", "content": "h"} and len(ch["logprobs"]["content"]) == 1
    json.dumps(ch, allow_nan=False)  # no NaN/inf reaches JSON


def test_stream_echo_prefix_goes_out_once_with_text_offsets_running():
    asm = Assembler(False, [PromptInfo(ids("ab"), "ab")], n=1, n_engine=1, texts=TEXTS, logprobs=0, echo=True)
    a, b = ids("ab")
    c, d = ids("cd")
    first = asm.add(0, out("c", [c], lps=[TL(c, -1.0)], plps=[None, TL(b, -2.0)]))
    second = asm.add(0, out("d", [d], lps=[TL(d, -1.5)], done=True, n_out=2))
    assert first[0]["text"] == "abc" and first[0]["logprobs"]["text_offset"] == [0, 1, 2]
    assert second[0]["text"] == "d" and second[0]["logprobs"]["text_offset"] == [3]
    assert second[0]["logprobs"]["token_logprobs"] == [-1.5] and second[0]["finish_reason"] == "length"


def test_engine_error_is_a_500_engine_error():
    asm = Assembler(False, [PromptInfo(ids("p"), "p")], n=1, n_engine=1, texts=TEXTS)
    with pytest.raises(ApiError) as e:
        asm.add(0, out("", [], done=True, error="grammar failed"))
    assert e.value.status == 500 and e.value.code == "engine_error" and "grammar failed" in e.value.message


def test_chunk_event_is_one_sse_data_line():
    ev = chunk_event("id", "m", 1, False, [{"index": 0, "text": "x"}], use={"prompt_tokens": 1})
    assert ev.startswith("data: {") and ev.endswith("\n\n") and json.loads(ev[6:])["usage"] == {"prompt_tokens": 1}
