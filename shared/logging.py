"""structlog set-up: JSON lines in production, coloured console for people.

structlog's configuration is process-wide by design; each service calls
`configure_logging` once at start and binds `service` (and, per request,
`request_id` and `trace_id`) with contextvars.
"""

from __future__ import annotations

import logging
import sys

import structlog

from shared import redact
from shared.config import LoggingSettings


def configure_logging(settings: LoggingSettings, service: str) -> None:
    level = getattr(logging, settings.level.upper())
    renderer: structlog.typing.Processor
    if settings.format == "json":
        renderer = structlog.processors.JSONRenderer()
    else:
        renderer = structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty())
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            # No secret reaches a log line (API keys, bearer tokens, URL passwords), tracebacks included.
            redact.structlog_processor,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(level),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )
    structlog.contextvars.bind_contextvars(service=service)
    # Libraries that log through the standard library end up on stderr too.
    logging.basicConfig(level=max(level, logging.WARNING), stream=sys.stderr)
    for handler in logging.getLogger().handlers:
        handler.addFilter(redact.RedactingFilter())
