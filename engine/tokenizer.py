"""Tokenizer helpers: a byte tokenizer for the tiny test model and incremental detokenisation."""

from __future__ import annotations


class ByteTokenizer:
    """UTF-8 bytes shifted by 3 (0 pad, 1 bos, 2 eos); ids past 258 decode to nothing.

    Enough of the HF tokenizer interface for the engine and the tests that use the tiny model.
    """

    pad_token_id, bos_token_id, eos_token_id = 0, 1, 2
    _offset = 3

    def __init__(self, vocab_size: int = 512):
        if vocab_size < 256 + self._offset:
            raise ValueError("ByteTokenizer needs a vocabulary of at least 259 ids")
        self.vocab_size = vocab_size

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [b + self._offset for b in text.encode("utf-8")]

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        data = bytes(i - self._offset for i in ids if self._offset <= i < 256 + self._offset)
        return data.decode("utf-8", errors="replace")

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=False, **_):
        text = "".join(f"<{m['role']}>{m['content']}\n" for m in messages)
        if add_generation_prompt:
            text += "<assistant>"
        return self.encode(text) if tokenize else text


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas without re-decoding everything.

    Decodes a short window (prefix offset .. end) and emits only text that is stable: a
    trailing U+FFFD means a multi-byte character is still incomplete, so it is held back.
    """

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0
        self.text = ""

    def add(self, token_id: int) -> str:
        self.ids.append(token_id)
        prefix = self.tokenizer.decode(self.ids[self.prefix_offset : self.read_offset], skip_special_tokens=True)
        full = self.tokenizer.decode(self.ids[self.prefix_offset :], skip_special_tokens=True)
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            delta = full[len(prefix) :]
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.ids)
            self.text += delta
            return delta
        return ""
