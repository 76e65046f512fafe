"""Parsing untrusted JSON request bodies: bounded, strict, and UTF-8-clean.

``loads`` is ``json.loads`` with the holes a hostile client could use closed, each turned into
``BadJson`` (the ingress answers 400; an over-long body is refused before parsing, 413):

* nesting deeper than ``MAX_DEPTH`` (the C parser would raise RecursionError, a 500 before);
* the non-standard literals ``NaN``, ``Infinity``, ``-Infinity`` (Python accepts them) and
  numbers that overflow a float (``1e400`` would become infinity);
* strings (values or keys) that are not valid Unicode text, i.e. hold a lone surrogate such as
  ``"\\udc80"``: they cannot be encoded as UTF-8, which breaks tokenizers and hashing later;
* integers with more digits than Python converts (ValueError) and invalid UTF-8 bytes.

Invariant: ``loads`` returns plain JSON data (dict, list, str, int, float, bool, None) whose
depth is at most ``MAX_DEPTH`` and every string of which encodes as UTF-8, or raises BadJson.
"""

from __future__ import annotations

import json

MAX_DEPTH = 32  # OpenAI bodies nest 4-5 levels (messages -> content parts -> text)


class BadJson(ValueError):
    """The body is not acceptable JSON; the message says why (never echoes the body)."""


def _no_constant(name: str):
    raise BadJson(f"{name} is not valid JSON")


def _finite(text: str) -> float:
    x = float(text)
    if x in (float("inf"), float("-inf")):
        raise BadJson(f"the number {text[:24]} is out of range")
    return x


def loads(raw: bytes | str) -> object:
    try:
        data = json.loads(raw, parse_constant=_no_constant, parse_float=_finite)
    except BadJson:
        raise
    except RecursionError:
        raise BadJson(f"the body nests deeper than {MAX_DEPTH} levels") from None
    except UnicodeDecodeError:
        raise BadJson("the body is not valid UTF-8") from None
    except ValueError as e:  # JSONDecodeError, over-long integers
        raise BadJson(f"the body is not valid JSON: {str(e)[:120]}") from None
    check(data)
    return data


def check(data: object, max_depth: int = MAX_DEPTH) -> None:
    """Raise BadJson unless ``data`` nests at most ``max_depth`` levels and all its strings
    (keys included) encode as UTF-8. Iterative: no recursion on hostile input."""
    stack: list[tuple[object, int]] = [(data, 1)]
    while stack:
        x, depth = stack.pop()
        if isinstance(x, str):
            _utf8(x)
        elif isinstance(x, (dict, list)):
            if depth > max_depth:
                raise BadJson(f"the body nests deeper than {max_depth} levels")
            if isinstance(x, dict):
                for k, v in x.items():
                    _utf8(k)
                    stack.append((v, depth + 1))
            else:
                stack.extend((v, depth + 1) for v in x)


def _utf8(s: str) -> None:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as e:
        raise BadJson(f"a string holds a character that is not valid Unicode text (a lone surrogate "
                      f"at position {e.start}); send UTF-8 text") from None


def utf8_clean(s: str) -> bool:
    """Whether ``s`` encodes as UTF-8 (no lone surrogates)."""
    try:
        s.encode("utf-8")
        return True
    except UnicodeEncodeError:
        return False
