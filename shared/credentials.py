"""How clients present credentials and TLS to NATS and Redis, from the settings.

`nats_options` is what `nats.connect` takes besides callbacks and timeouts;
`redis_url_and_options` is the URL and keyword arguments of a redis-py
client or pool. Both leave an unsecured configuration exactly as before
(no credentials, no TLS, the default inbox prefix).
"""

from __future__ import annotations

import ssl
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from shared.config import NatsSettings, RedisSettings


def tls_context(ca: str, cert: str = "", key: str = "") -> ssl.SSLContext:
    """A client context that trusts `ca` (or the system's CAs when empty) and shows `cert` where given."""
    context = ssl.create_default_context(cafile=ca or None)
    if cert:
        context.load_cert_chain(cert, key or None)
    return context


def nats_options(settings: NatsSettings) -> dict[str, Any]:
    options: dict[str, Any] = {"servers": settings.servers()}
    if settings.inbox_prefix != "_INBOX":
        options["inbox_prefix"] = settings.inbox_prefix
    if settings.user:
        options["user"] = settings.user
        options["password"] = settings.password
    if settings.nkeys_seed_file:
        options["nkeys_seed"] = settings.nkeys_seed_file
    if settings.credentials_file:
        options["user_credentials"] = settings.credentials_file
    if settings.tls_ca or settings.tls_cert:
        options["tls"] = tls_context(settings.tls_ca, settings.tls_cert, settings.tls_key)
    return options


def redis_url_and_options(settings: RedisSettings) -> tuple[str, dict[str, Any]]:
    """The URL (credentials in it dropped when the settings name their own; `rediss://` with TLS) and client options."""
    parts = urlsplit(settings.url)
    scheme, netloc = parts.scheme, parts.netloc
    options: dict[str, Any] = {}
    if settings.username or settings.password:
        # redis-py lets the URL's credentials win over keyword arguments: the settings' must win.
        netloc = netloc.rpartition("@")[2]
        if settings.username:
            options["username"] = settings.username
        options["password"] = settings.password
    if (settings.tls_ca or settings.tls_cert) and scheme == "redis":
        scheme = "rediss"
    if scheme == "rediss":
        options["ssl_cert_reqs"] = "required"
        if settings.tls_ca:
            options["ssl_ca_certs"] = settings.tls_ca
        if settings.tls_cert:
            options["ssl_certfile"] = settings.tls_cert
            options["ssl_keyfile"] = settings.tls_key or None
    return urlunsplit((scheme, netloc, parts.path, parts.query, parts.fragment)), options
