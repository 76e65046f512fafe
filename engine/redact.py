"""What of a request may reach a log line: bounded prefixes, never whole bodies or keys.

Logs are read by operators, shipped to aggregators and kept for long; a prompt, a request body
or a header value can hold another tenant's secrets. Rules for every log call in ``cluster/``,
``actors/`` and ``engine/``:

* request data (prompts, bodies, header values, template texts, error messages that may quote
  them) is logged only through ``redact``: at most ``PREFIX_CHARS`` characters, then the total
  length, so a log line never holds more than a bounded prefix;
* API keys are never logged, not even redacted: log the tenant name instead;
* request ids, worker ids, tenant names, counts and exception *types* may be logged as they are.
"""

from __future__ import annotations

PREFIX_CHARS = 32


def redact(value: object, limit: int = PREFIX_CHARS) -> str:
    """``value`` as text cut to ``limit`` characters, with the full length when it was cut
    (``'abc…[+1234 chars]'``). Non-string values are formatted with ``repr`` first."""
    text = value if isinstance(value, str) else repr(value)
    if len(text) <= limit:
        return text
    return f"{text[:limit]}…[+{len(text) - limit} chars]"
