"""Admin access: the bearer token check, where a token comes from, and when one is required.

Rules:
    1. With a token configured, an admin endpoint wants ``Authorization: Bearer <token>``
       (compared in constant time); without one it is open.
    2. Open admin endpoints are only acceptable when nobody else can reach the port: a server
       bound to anything but a loopback address refuses to start without a token, unless the
       operator says ``--insecure-no-auth`` (:func:`check_bind`). Anyone who reaches an open
       router can register a worker of their own and receive every prompt.
    3. A token can be read from a file, so that it does not show in ``ps`` (a flag) or in the
       process environment of a child.
    4. No app serves a description of itself (FastAPI's ``/openapi.json``, ``/docs``,
       ``/redoc``): it would list the admin endpoints to anyone, token or not. The reference
       is docs/ (:data:`NO_API_DOCS`, passed to ``FastAPI``).
"""

from __future__ import annotations

import hmac
import ipaddress
from pathlib import Path
from typing import Any

from openai_request.bodies import ApiError

__all__ = ["MIN_TRANSFER_SECRET_BYTES", "NO_API_DOCS", "BindError", "check_bearer", "check_bind",
           "check_token", "is_loopback", "read_secret_file", "transfer_secret"]

#: Rule 4: the ``FastAPI`` arguments that serve no API description.
NO_API_DOCS: dict[str, Any] = {"openapi_url": None, "docs_url": None, "redoc_url": None}


class BindError(ValueError):
    """The bind address and the admin settings together would expose open admin endpoints."""


def check_bearer(authorization: str | None, token: str | None) -> None:
    """Refuse a request whose ``Authorization`` header does not carry ``token`` (rule 1).

    Raises:
        ApiError: 401 when a token is configured and the header does not match it.
    """
    if token is None:
        return
    given = (authorization or "").encode()
    if not hmac.compare_digest(given, f"Bearer {token}".encode()):
        raise ApiError(401, "this endpoint needs 'Authorization: Bearer <token>'",
                       "authentication_error")


def check_token(token: str | None, setting: str) -> None:
    """Refuse a configured token no client can send: blank, or with white space around it
    (HTTP strips a header value's surrounding white space, so such a token never matches and
    the admin endpoints would be unreachable).

    Raises:
        ValueError: the token is blank or padded; the message names ``setting``.
    """
    if token is None:
        return
    if not token.strip():
        raise ValueError(f"{setting} is blank: give a token, or none to leave admin open on "
                         "loopback")
    if token != token.strip():
        raise ValueError(f"{setting} has white space around it, which no Authorization header "
                         "can carry")


def is_loopback(host: str) -> bool:
    """Whether ``host`` names only this machine (``localhost`` or a loopback address)."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:  # a host name other than localhost may resolve anywhere
        return False


def check_bind(host: str, token: str | None, insecure_no_auth: bool, what: str) -> None:
    """Refuse to serve open admin endpoints beyond this machine (rule 2).

    Args:
        host: the bind address.
        token: the admin token, if any.
        insecure_no_auth: the operator accepts open admin endpoints on a public address.
        what: the server's name for the message (``router``, ``worker``).

    Raises:
        BindError: ``host`` is not loopback, no token is set and ``insecure_no_auth`` is off.
    """
    if token or insecure_no_auth or is_loopback(host):
        return
    raise BindError(
        f"the {what} would listen on {host} with no admin token: anyone who reaches the port "
        "could use the admin endpoints (a router would let them add a worker of their own and "
        "receive every request). Set an admin token (--admin-token-file, or the environment), "
        "bind 127.0.0.1, or pass --insecure-no-auth to accept the risk")


def read_secret_file(path: str, setting: str) -> str:
    """Return the secret (an admin token, a salt secret) held in ``path``, surrounding
    whitespace removed; ``setting`` names the setting that gave the path, for errors.

    Raises:
        ValueError: the file cannot be read or holds nothing.
    """
    try:
        secret = Path(path).read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"{setting} {path}: {exc}") from None
    if not secret:
        raise ValueError(f"{setting} {path} is empty")
    return secret


#: The fewest bytes the KV transfer secret may have, surrounding white space not counted.
MIN_TRANSFER_SECRET_BYTES = 16


def transfer_secret(value: str | None, path: str | None) -> str | None:
    """The KV transfer secret the router and its workers share (``--kv-transfer-secret-file``
    or the value itself): read from ``path`` when one is given (the file wins), surrounding
    white space removed; None when neither is set.

    Raises:
        ValueError: the file cannot be read or is empty, or the secret is shorter than
            :data:`MIN_TRANSFER_SECRET_BYTES`.
    """
    if path is not None:
        value = read_secret_file(path, "kv_transfer_secret_file")
    if value is None:
        return None
    secret = value.strip()
    if len(secret.encode()) < MIN_TRANSFER_SECRET_BYTES:
        raise ValueError(f"the KV transfer secret must be at least {MIN_TRANSFER_SECRET_BYTES} "
                         f"bytes (surrounding white space not counted), got "
                         f"{len(secret.encode())}")
    return secret
