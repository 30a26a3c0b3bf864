"""Secrets out of log lines: API keys, bearer tokens, passwords in URLs.

Nothing should log a secret in the first place (no code logs request
headers); this is the net under that rule, applied to every structlog event
and every standard-library record (aiohttp, nats-py...) a service writes.

* A value whose key names a secret (`authorization`, `api_key`,
  `password`...) is replaced whole.
* In any text: `Bearer <token>` / `Basic <credentials>`, kvlane keys
  (`kvl_<id>_<secret>` keeps its public `kvl_<id>`), OpenAI-style `sk-...`
  keys, and the password of a URL's user-info (`nats://user:pw@host`).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping, MutableMapping
from typing import Any

REDACTED = "[redacted]"

_SECRET_KEYS = frozenset({
    "authorization", "proxy_authorization", "api_key", "apikey", "x_api_key", "openai_api_key", "password", "passwd",
    "secret", "client_secret", "token", "access_token", "refresh_token", "auth_token", "bearer", "cookie", "set_cookie",
    "credentials", "nkey_seed", "user_credentials",
})
_SECRET_SUFFIXES = ("_password", "_secret", "_api_key", "_credentials")

_PATTERNS: tuple[tuple[re.Pattern[str], str], ...] = (
    (re.compile(r"\b(Bearer|Basic|Token)(\s+)[A-Za-z0-9._~+/=-]+", re.IGNORECASE), rf"\1\2{REDACTED}"),
    (re.compile(r"\b(kvl_[0-9a-f]{12}_)[A-Za-z0-9_-]+"), rf"\1{REDACTED}"),
    (re.compile(r"\bsk-[A-Za-z0-9_-]{8,}"), f"sk-{REDACTED}"),
    # scheme://user:password@host -> scheme://user:[redacted]@host
    (re.compile(r"([A-Za-z][A-Za-z0-9+.-]*://[^:/@\s]*):[^@/\s]+@"), rf"\1:{REDACTED}@"),
)


def is_secret_key(name: str) -> bool:
    key = name.lower().replace("-", "_")
    return key in _SECRET_KEYS or key.endswith(_SECRET_SUFFIXES)


def redact_text(text: str) -> str:
    for pattern, replacement in _PATTERNS:
        text = pattern.sub(replacement, text)
    return text


def redact(value: Any, depth: int = 0) -> Any:
    """`value` with every secret in it replaced (text, and mappings and lists down to a few levels)."""
    if isinstance(value, str):
        return redact_text(value)
    if isinstance(value, bytes):
        return redact_text(value.decode("utf-8", "backslashreplace"))
    if depth >= 4:
        return value
    if isinstance(value, Mapping):
        return {k: REDACTED if isinstance(k, str) and is_secret_key(k) else redact(v, depth + 1) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(redact(item, depth + 1) for item in value)
    return value


def structlog_processor(logger: Any, method: str, event: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
    """A structlog processor: run it after `format_exc_info`, so tracebacks are covered too."""
    for key, value in event.items():
        if is_secret_key(key):
            event[key] = REDACTED
        elif isinstance(value, (str, bytes, Mapping, list, tuple)):
            event[key] = redact(value)
    return event


class RedactingFilter(logging.Filter):
    """For standard-library handlers: the message, its arguments and any traceback, redacted."""

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:  # a malformed record: leave it to the formatter to report
            return True
        record.msg, record.args = redact_text(message), None
        if record.exc_info and not record.exc_text:
            record.exc_text = logging.Formatter().formatException(record.exc_info)
        if record.exc_text:
            record.exc_text = redact_text(record.exc_text)
        return True
