"""Client API keys and their prompt-token quotas on ``/v1/*``; off unless keys are configured.

Two checks, at two points of a request's path:

1. :class:`KeyCheck` wraps each forwarding route: a request that presents no key, or one no
   entry of the key ring matches (:mod:`httpapi.api_keys`), is answered 401 before its body
   is read. ``/v1/models`` calls :meth:`ClientAccess.identify` itself.
2. :meth:`ClientAccess.charge`, once the request is decided (its prompt tokenized, under
   ``--tokenize match`` with the unmatched rest estimated from its bytes), takes the prompt's
   tokens from the key's :class:`~router.routing.token_bucket.TokenBucket` (its ``tpm``, or
   the router's default; 0: no limit). A bucket short of them answers 429 with ``Retry-After``
   (whole seconds until it holds them, rounded up) and an OpenAI-style body; a prompt larger
   than a minute's quota answers 429 without one: waiting cannot help. Tokens taken stay
   taken whatever the answer: a quota counts what was asked of the fleet. A request is
   charged once: a body decided early whose decision was refused is decided again at its
   end (:mod:`router.http.request_path`), and a charge that passed the first time is not
   taken again (:class:`KeyCheck` keeps, per request, what it charged).

Metrics are labelled by the key's name in the keys file, ``other`` for a key without one:
bounded by the file, and never the key.
"""

from __future__ import annotations

import contextvars
import math
import time
from collections.abc import Callable, Mapping

from prometheus_client import CollectorRegistry
from starlette.types import ASGIApp, Receive, Scope, Send

from httpapi.api_keys import ApiKey, KeyRing, presented_key
from openai_request.bodies import ApiError
from router.http.tallies import CountFamily
from router.routing.token_bucket import TokenBucket

__all__ = ["ClientAccess", "KeyCheck", "RateLimited", "Unauthorized"]


#: The key charged for the request being handled (set empty by :class:`KeyCheck`).
_CHARGED: contextvars.ContextVar[list[ApiKey] | None] = contextvars.ContextVar(
    "kvroute_charged", default=None)


class RateLimited(ApiError):
    """A 429 for a key past its tokens per minute, with the headers to send."""

    def __init__(self, message: str, headers: dict[str, str]) -> None:
        super().__init__(429, message, "tokens", None, "rate_limit_exceeded")
        self.headers = headers


class Unauthorized(ApiError):
    """A 401 for a request without a known key, asking for a bearer token."""

    def __init__(self, message: str) -> None:
        super().__init__(401, message, "invalid_request_error", None, "invalid_api_key")
        self.headers = {"www-authenticate": "Bearer"}


class ClientAccess:
    """The key ring, each key's bucket, and the metrics (module docstring).

    Args:
        ring: the configured keys.
        default_tpm: prompt tokens per minute of a key whose line sets none (0: no limit).
        registry: where the metrics go.
        clock: monotonic seconds.
    """

    def __init__(self, ring: KeyRing, default_tpm: int, registry: CollectorRegistry,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if default_tpm < 0:
            raise ValueError("default_tpm must be >= 0")
        self.ring = ring
        self.default_tpm = default_tpm
        self._clock = clock
        self._buckets: dict[ApiKey, TokenBucket] = {}
        self.requests = CountFamily(
            "kvroute_api_key_requests",
            "Requests by API key name (other: a key without one) and outcome: admitted, "
            "rate_limited (Retry-After given), too_large (more than a minute's quota)",
            ["key", "outcome"], registry=registry)
        self.tokens = CountFamily("kvroute_api_key_prompt_tokens",
                                  "Prompt tokens charged to each API key's quota",
                                  ["key"], registry=registry)
        self.unauthorized = CountFamily(
            "kvroute_api_key_unauthorized",
            "Requests refused 401, by reason: missing (no key presented), unknown",
            ["reason"], registry=registry)

    def identify(self, headers: Mapping[str, str]) -> ApiKey:
        """The key ``headers`` present (names in lower case).

        Raises:
            Unauthorized: 401, no key or an unknown one.
        """
        key = presented_key(headers)
        if key is None:
            self.unauthorized.labels("missing").inc()
            raise Unauthorized("no API key: send 'Authorization: Bearer KEY'")
        entry = self.ring.identify(key)
        if entry is None:
            self.unauthorized.labels("unknown").inc()
            raise Unauthorized("the API key is not valid")
        return entry

    def tokens_per_minute(self, entry: ApiKey) -> int:
        """``entry``'s quota (0: no limit)."""
        return self.default_tpm if entry.tokens_per_minute is None else entry.tokens_per_minute

    def charge(self, headers: Mapping[str, str], tokens: int) -> ApiKey:
        """Take ``tokens`` from the quota of the key ``headers`` present.

        Raises:
            Unauthorized: 401, no key or an unknown one.
            RateLimited: 429, the key's bucket does not hold ``tokens`` now.
        """
        charged = _CHARGED.get()
        if charged:  # this request's tokens were taken already
            return charged[0]
        entry = self.identify(headers)
        label = entry.label
        limit = self.tokens_per_minute(entry)
        if limit:
            now = self._clock()
            bucket = self._buckets.get(entry)
            if bucket is None:
                bucket = self._buckets[entry] = TokenBucket.per_minute(limit, now)
            wait = bucket.take(tokens, now)
            if wait:
                remaining = int(bucket.remaining(now))
                headers_out = {"x-ratelimit-limit-tokens": str(limit),
                               "x-ratelimit-remaining-tokens": str(remaining)}
                if math.isinf(wait):
                    self.requests.labels(label, "too_large").inc()
                    raise RateLimited(
                        f"Request too large for key {label!r} on tokens per min (TPM): "
                        f"Limit {limit}, Requested {tokens}.", headers_out)
                seconds = max(1, math.ceil(wait))
                self.requests.labels(label, "rate_limited").inc()
                raise RateLimited(
                    f"Rate limit reached for key {label!r} on tokens per min (TPM): Limit "
                    f"{limit}, Remaining {remaining}, Requested {tokens}. Please try again "
                    f"in {seconds}s.",
                    {**headers_out, "retry-after": str(seconds),
                     "x-ratelimit-reset-tokens": f"{seconds}s"})
        self.requests.labels(label, "admitted").inc()
        self.tokens.labels(label).inc(tokens)
        if charged is not None:
            charged.append(entry)
        return entry


class KeyCheck:
    """A raw route (:mod:`httpapi.app` rule 5) behind the key check: 401 before the body."""

    __slots__ = ("access", "app")

    def __init__(self, app: ASGIApp, access: Callable[[], ClientAccess]) -> None:
        self.app = app
        self.access = access

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]
                   if k in (b"authorization", b"x-api-key")}
        self.access().identify(headers)
        token = _CHARGED.set([])
        try:
            await self.app(scope, receive, send)
        finally:
            _CHARGED.reset(token)
