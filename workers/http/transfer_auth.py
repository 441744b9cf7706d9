"""Who may read this worker's KV, and whose fetch instructions it follows.

KV is user data: a block's bytes are a function of a user's prompt. Every endpoint that
sends KV (``POST /kv_transfer/read``, ``GET /kv_transfer/blocks/{lease_id}``) or changes what
is held for a peer (``POST /kv_transfer/release``), and every instruction that makes this
worker connect to a peer (the ``x-kvroute-fetch-*`` headers), passes one rule:

Rules:
    1. With a secret (``kv_transfer_secret_file``), a caller proves itself with it: a peer
       sends ``Authorization: Bearer <secret>``, a router sends
       ``x-kvroute-transfer-token: <secret>``; both compared in constant time. Any peer
       address is accepted then.
    2. Without a secret, only this machine is trusted: the worker must be bound to a loopback
       address and the caller must connect from one; a fetch instruction must also name a
       loopback source.
    3. Bound off loopback with no secret, the worker serves no KV and follows no
       instruction (403, saying why; the worker logs it at start).
    4. The secret goes only where an authenticated request sent this worker: the source of
       an authenticated fetch instruction, or the prefill worker named by the
       ``kv_transfer_params`` of a request that carried the router's token
       (:meth:`TransferAuth.outgoing`). A request anyone could write (its body names any
       host) never makes the worker send it.
"""

from __future__ import annotations

import hmac
from urllib.parse import urlsplit

from fastapi import Request

from httpapi.auth import is_loopback
from openai_request.bodies import ApiError

__all__ = ["TOKEN_HEADER", "TransferAuth"]

#: The request header a router carries the secret in (rule 1).
TOKEN_HEADER = "x-kvroute-transfer-token"


class TransferAuth:
    """The module's rules for one worker.

    Args:
        secret: the KV transfer secret, or None.
        bind_host: the address the worker's HTTP server binds.
    """

    __slots__ = ("_bearer", "_secret", "bind_host")

    def __init__(self, secret: str | None, bind_host: str) -> None:
        self._secret = None if secret is None else secret.encode()
        self._bearer = None if secret is None else f"Bearer {secret}".encode()
        self.bind_host = bind_host

    @property
    def enabled(self) -> bool:
        """Whether KV is served and instructions followed at all (rules 1 to 3)."""
        return self._secret is not None or is_loopback(self.bind_host)

    @property
    def off_reason(self) -> str:
        """Why :attr:`enabled` is false, for the start-up log and 403s."""
        return (f"this worker is bound to {self.bind_host} with no KV transfer secret, so "
                "it serves no KV and follows no fetch instruction: give every worker and "
                "the router the same --kv-transfer-secret-file, or bind 127.0.0.1")

    def check_peer(self, request: Request) -> None:
        """Refuse a caller of a KV transfer endpoint that rules 1 and 2 do not admit.

        Raises:
            ApiError: 403 (rule 2 or 3) or 401 (a missing or wrong bearer, rule 1).
        """
        if not self.enabled:
            raise ApiError(403, self.off_reason, "permission_error", code="kv_transfer_off")
        if self._bearer is not None:
            given = (request.headers.get("authorization") or "").encode()
            if not hmac.compare_digest(given, self._bearer):
                raise ApiError(401, "the KV transfer endpoints need 'Authorization: Bearer "
                               "<kv transfer secret>'", "authentication_error")
            return
        peer = request.client.host if request.client is not None else ""
        if not is_loopback(peer):
            raise ApiError(403, f"with no KV transfer secret this worker serves KV to "
                           f"loopback peers only, not {peer or 'an unknown peer'}",
                           "permission_error", code="kv_transfer_loopback_only")

    def router_token_valid(self, request: Request) -> bool:
        """Whether ``request`` carries the secret in :data:`TOKEN_HEADER` (rule 1)."""
        given = request.headers.get(TOKEN_HEADER)
        return (self._secret is not None and given is not None
                and hmac.compare_digest(given.encode(), self._secret))

    def trusts_instruction(self, request: Request, source_url: str) -> bool:
        """Whether a fetch instruction on ``request`` naming ``source_url`` may be followed:
        the router's token matches (rule 1), or, with no secret, the bind, the caller and
        the source are all loopback (rule 2)."""
        if not self.enabled:
            return False
        if self._secret is not None:
            return self.router_token_valid(request)
        peer = request.client.host if request.client is not None else ""
        host = urlsplit(source_url).hostname or ""
        return is_loopback(peer) and is_loopback(host)

    def outgoing(self, authenticated: bool) -> dict[str, str]:
        """The headers for a call to a peer that an ``authenticated`` request named (rule
        4): the bearer when both hold, else none."""
        if self._secret is None or not authenticated:
            return {}
        return {"authorization": f"Bearer {self._secret.decode()}"}
