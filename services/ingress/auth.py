"""API keys at the ingress: who is asking (401), what their key allows (403, priority), and its limits (429).

`Completions` calls this for every request, HTTP and NATS alike:
`authenticate` before the body is read, `admit` once the request is
tokenized (its cost in tokens is known), and the `Admission` it returns is
settled when the request ends, however it ends.

Key records come from the keys file (re-read when it changes) and from
Redis, each cached here for `cache_ttl_s`: a key revoked in Redis stops
working within that bound on every ingress, and a key's lookup costs no
round trip while it is cached. Unknown ids are cached too (bounded), so a
flood of made-up keys costs one Redis read per id per `cache_ttl_s`.

Nothing here logs, raises or records the key itself: only its public id.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Callable, Mapping

import msgspec
import structlog
from multidict import CIMultiDictProxy
from redis.exceptions import RedisError

from services.ingress.errors import ApiError
from services.ingress.prompts import PreparedRequest
from shared.api_keys import ApiKeyStore, KeyRecord, bearer_token, key_id_of, load_keys_file
from shared.config import AuthSettings
from services.ingress.key_limits import KeyLimiter
from shared.periodic import Periodic

log = structlog.get_logger("kvlane.ingress")

# Key ids remembered (found or not) at most; the oldest go first.
_CACHE_ENTRIES = 10_000
# As long as a key's tenant may be (`KeyRecord.tenant`).
_TENANT_MAX_LENGTH = 128

_REFUSALS = {
    "concurrency": ("concurrency_limit_exceeded", "Too many concurrent requests for this API key: at most {limit}."),
    "rpm": ("rate_limit_exceeded", "Rate limit reached for requests per minute (RPM): limit {limit}."),
    "tpm": ("rate_limit_exceeded", "Rate limit reached for tokens per minute (TPM): limit {limit}, requested {cost}."),
    "too_large": ("request_too_large",
                  "Request too large for tokens per minute (TPM): limit {limit}, requested {cost} (prompt plus max_tokens)."),
}


class Authenticator:
    def __init__(
        self,
        settings: AuthSettings,
        store: ApiKeyStore | None,
        limiter: KeyLimiter | None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """Raises ValueError when auth is required and the keys file cannot be read."""
        self._settings = settings
        self._store = store
        self._limiter = limiter
        self._clock = clock
        self._cache: dict[str, tuple[KeyRecord | None, float]] = {}
        self._file: dict[str, KeyRecord] = {}
        self._file_stamp: tuple[int, int] | None = None
        self._file_checked = -float("inf")
        # Requests holding a concurrency slot, by key id: their slots are renewed while they run.
        self._running: dict[str, set[str]] = {}
        self._settling: set[asyncio.Task] = set()
        self._renewal = Periodic("key_slots", settings.slot_ttl_s / 3, self._renew)
        if self.required and settings.keys_file:
            self._refresh_file(clock())

    @property
    def required(self) -> bool:
        return self._settings.required

    def start(self) -> None:
        if self.required and self._limiter is not None:
            self._renewal.start()

    async def close(self, timeout_s: float = 5.0) -> None:
        """Stop renewing and let the last settlements reach Redis (call after the last request ended)."""
        await self._renewal.stop()
        if self._settling:
            await asyncio.wait(self._settling, timeout=timeout_s)

    # --- who --------------------------------------------------------------------------------

    async def authenticate(self, headers: Mapping[str, str] | None) -> KeyRecord | None:
        """The caller's key record; None when auth is off. Raises a 401 `ApiError` (503 when keys cannot be read)."""
        if not self.required:
            return None
        token = bearer_token(headers)
        if token is None:
            log.info("auth_failed", reason="missing")
            raise ApiError(401, "Missing API key: send it in an `Authorization: Bearer <key>` header.", code="missing_api_key")
        key_id = key_id_of(token)
        record = None if key_id is None else await self._lookup(key_id)
        if record is None or not record.matches(token):
            # The id of a well-formed key is public (kvlane keys list shows it); the rest never leaves here.
            log.info("auth_failed", reason="malformed" if key_id is None else "unknown_or_wrong", key_id=key_id or "")
            raise ApiError(401, "Incorrect API key provided.", code="invalid_api_key")
        return record

    async def _lookup(self, key_id: str) -> KeyRecord | None:
        now = self._clock()
        if self._settings.keys_file:
            self._refresh_file(now)
            if (record := self._file.get(key_id)) is not None:
                return record
        if self._store is None:
            return None
        cached = self._cache.get(key_id)
        if cached is not None and now - cached[1] < self._settings.cache_ttl_s:
            return cached[0]
        try:
            record = await self._store.get(key_id)
        except msgspec.DecodeError as exc:
            log.warning("bad_api_key_record", key_id=key_id, error=str(exc))
            record = None
        except (RedisError, OSError) as exc:
            raise ApiError(503, "API keys cannot be checked right now", code="auth_unavailable", retry_after_s=1.0) from exc
        self._cache.pop(key_id, None)
        self._cache[key_id] = (record, now)
        while len(self._cache) > _CACHE_ENTRIES:
            self._cache.pop(next(iter(self._cache)))
        return record

    def _refresh_file(self, now: float) -> None:
        """Re-read the keys file if it changed (checked at most once per `cache_ttl_s`); a bad new version is ignored."""
        if now - self._file_checked < self._settings.cache_ttl_s:
            return
        self._file_checked = now
        path = self._settings.keys_file
        try:
            stat = os.stat(path)
            stamp = (stat.st_mtime_ns, stat.st_size)
            if stamp == self._file_stamp:
                return
            self._file = load_keys_file(path)
            self._file_stamp = stamp
            log.info("keys_file_loaded", path=path, keys=len(self._file))
        except (OSError, ValueError) as exc:
            problem = f"cannot read keys file {path}: {exc.strerror}" if isinstance(exc, OSError) else str(exc)
            if self._file_stamp is None:
                raise ValueError(f"ingress.auth.keys_file: {problem}") from exc
            log.error("keys_file_unreadable", path=path, error=problem)

    # --- what it may do -----------------------------------------------------------------------

    @staticmethod
    def check_model(record: KeyRecord | None, model: str) -> None:
        if record is not None and not record.allows_model(model):
            raise ApiError(403, f"This API key may not use the model `{model}`.", code="model_not_allowed", param="model")

    @staticmethod
    def named_tenant(headers: Mapping[str, str] | None, header: str, weights: Mapping[str, float]) -> tuple[str, float] | None:
        """The tenant a request without a key names in `header` (HTTP's in any letter case), with its weight; None
        when it names none. A name longer than a key's tenant may be is refused (400)."""
        if not header or not headers:
            return None
        value = headers.get(header)
        if value is None and not isinstance(headers, CIMultiDictProxy):  # NATS headers keep the sender's case
            lowered = header.lower()
            value = next((v for k, v in headers.items() if k.lower() == lowered), None)
        if not value:
            return None
        if len(value) > _TENANT_MAX_LENGTH:
            raise ApiError(400, f"the {header} header names a tenant of {len(value)} characters, at most {_TENANT_MAX_LENGTH}",
                           code="invalid_tenant")
        return value, weights.get(value, 1.0)

    @staticmethod
    def apply(record: KeyRecord | None, prepared: PreparedRequest) -> PreparedRequest:
        """The request as its key allows it: the tenant named with its weight, the priority at most the key's maximum."""
        if record is None:
            return prepared
        return msgspec.structs.replace(prepared, priority=record.clamp_priority(prepared.priority), tenant=record.tenant,
                                       tenant_weight=record.weight)

    # --- limits -------------------------------------------------------------------------------

    async def admit(self, record: KeyRecord | None, request_id: str, prepared: PreparedRequest) -> Admission | None:
        """Count the request against its key's limits (one Redis round trip), or raise 429 with Retry-After.

        Its cost is the prompt plus max_tokens; the returned `Admission` must be settled when the request ends.
        """
        if record is None or not record.limited or self._limiter is None:
            return None
        cost = len(prepared.prompt_token_ids) + prepared.sampling.max_tokens
        try:
            verdict = await self._limiter.admit(record, request_id, cost, self._settings.slot_ttl_s)
        except (RedisError, OSError) as exc:
            raise ApiError(503, "rate limits cannot be checked right now", code="auth_unavailable", retry_after_s=1.0) from exc
        except asyncio.CancelledError:
            # The caller left while Redis answered: the script may have counted the request; give its slot back.
            Admission(self, record.id, request_id, cost).settle(len(prepared.prompt_token_ids))
            raise
        if not verdict.admitted:
            code, message = _REFUSALS[verdict.reason]
            limit = {"concurrency": record.max_concurrency, "rpm": record.rpm}.get(verdict.reason, record.tpm)
            log.info("rate_limited", key_id=record.id, tenant=record.tenant, limit=verdict.reason)
            raise ApiError(429, message.format(limit=limit, cost=cost), code=code, retry_after_s=verdict.retry_after_s)
        if record.max_concurrency:
            self._running.setdefault(record.id, set()).add(request_id)
        return Admission(self, record.id, request_id, cost)

    def _settle(self, admission: Admission, tokens: int | None) -> None:
        running = self._running.get(admission.key_id)
        if running is not None:
            running.discard(admission.request_id)
            if not running:
                del self._running[admission.key_id]
        # A task of its own: the request's task may be being cancelled (its client hung up).
        task = asyncio.get_running_loop().create_task(self._settle_in_redis(admission, tokens))
        self._settling.add(task)
        task.add_done_callback(self._settling.discard)

    async def _settle_in_redis(self, admission: Admission, tokens: int | None) -> None:
        assert self._limiter is not None
        try:
            await self._limiter.settle(admission.key_id, admission.request_id, tokens)
        except Exception as exc:  # its slot expires by itself (slot_ttl_s); the reserved tokens stay counted
            log.warning("rate_limit_settle_failed", key_id=admission.key_id, error=str(exc))

    async def _renew(self) -> None:
        if self._running and self._limiter is not None:
            running = {key_id: sorted(ids) for key_id, ids in self._running.items()}
            await self._limiter.renew(running, self._settings.slot_ttl_s)


class Admission:
    """One admitted request's hold on its key's limits; `settle` it once, when the request ends."""

    def __init__(self, owner: Authenticator, key_id: str, request_id: str, reserved: int) -> None:
        self._owner = owner
        self.key_id = key_id
        self.request_id = request_id
        self.reserved = reserved
        self.settled = False

    def settle(self, tokens: int | None) -> None:
        """The request ended having used `tokens` (prompt + generated; None: what was reserved). Idempotent."""
        if self.settled:
            return
        self.settled = True
        with contextlib.suppress(RuntimeError):  # no running loop: nothing to tell Redis from here
            self._owner._settle(self, tokens)
