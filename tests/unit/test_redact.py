"""Secrets never reach a log line: structlog events and standard-library records alike."""

from __future__ import annotations

import json
import logging

import structlog

from shared import redact
from shared.config import LoggingSettings
from shared.logging import configure_logging

KEY = "kvl_0123456789ab_" + "S" * 43


def test_text_patterns() -> None:
    text = (f"Authorization: Bearer {KEY}, api_key={KEY} and Basic dXNlcjpwYXNz, openai sk-abcdefghijklmnop, "
            "nats://alice:hunter2@nats:4222 redis://:pw0rd@redis:6379/0 http://127.0.0.1:8000/v1")
    out = redact.redact_text(text)
    for secret in ("SSSS", "dXNlcjpwYXNz", "abcdefghijklmnop", "hunter2", "pw0rd"):
        assert secret not in out
    assert "kvl_0123456789ab_" in out  # the key's public id stays: it names the key without revealing it
    assert "nats://alice:[redacted]@nats:4222" in out and "http://127.0.0.1:8000/v1" in out


def test_secret_keys_are_replaced_whole_at_any_depth() -> None:
    event = {"event": "x", "authorization": "opaque", "headers": {"X-Api-Key": "opaque2", "accept": "json"},
             "nats_password": "opaque3", "max_tokens": 5, "items": [{"token": "opaque4"}]}
    out = redact.structlog_processor(None, "info", dict(event))
    assert "opaque" not in json.dumps(out)
    assert out["headers"]["accept"] == "json" and out["max_tokens"] == 5


def test_configured_logging_redacts_structlog_and_stdlib(capsys) -> None:
    root = logging.getLogger()
    saved = root.handlers[:]
    root.handlers.clear()
    try:
        configure_logging(LoggingSettings(format="json", level="info"), "test")
        structlog.get_logger("t").warning("seen", header=f"Bearer {KEY}")
        try:
            raise ValueError(f"bad key {KEY}")
        except ValueError:
            structlog.get_logger("t").exception("failed")
            logging.getLogger("aiohttp.server").exception("Error handling request: %s", f"Bearer {KEY}")
        err = capsys.readouterr().err
    finally:
        for handler in root.handlers[:]:
            root.removeHandler(handler)
        root.handlers.extend(saved)
        structlog.reset_defaults()
        structlog.contextvars.clear_contextvars()
    assert "SSSS" not in err
    # The event, the structlog traceback, the stdlib record and its traceback.
    assert err.count("[redacted]") >= 4 and "bad key kvl_0123456789ab_[redacted]" in err
