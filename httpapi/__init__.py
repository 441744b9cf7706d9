"""The OpenAI-style HTTP boundary shared by router and worker.

What both apps do the same way at the socket's edge, and nothing about routing or engines:
the FastAPI preamble around an app's typed state (:mod:`httpapi.app`), reading a request body
within a byte limit (:mod:`httpapi.body`), the admin bearer token and the rule that a
non-loopback bind needs one (:mod:`httpapi.auth`), and the uvicorn server with connection limits
and header timeouts (:mod:`httpapi.server`). The request schema and the error shape are
protocol, in :mod:`openai_request.bodies`. Neither app's package is imported here.
"""

from httpapi.auth import BindError, check_bearer, check_bind, is_loopback, read_secret_file
from httpapi.body import ClientGone, read_body, read_json, wait_for_disconnect

__all__ = ["BindError", "ClientGone", "check_bearer", "check_bind", "is_loopback",
           "read_body", "read_json", "read_secret_file", "wait_for_disconnect"]
