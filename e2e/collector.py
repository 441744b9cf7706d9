"""A real OpenTelemetry collector for end-to-end tests: Rotel's agent (the ``rotel`` wheel on
PyPI bundles the binary, a collector written in Rust), with OTLP/gRPC and OTLP/HTTP receivers
on 127.0.0.1 and every span it receives written to its output by its debug log.

Nothing is forwarded anywhere (``--exporter blackhole``): the debug log at ``detailed``
verbosity prints each span as the OpenTelemetry Collector's debug exporter does (ids, name,
kind, status and every attribute with its type), and :func:`parse_spans` reads that text back.
``--disable-batching`` makes the agent print each export as it arrives.
"""

from __future__ import annotations

import importlib.util
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from e2e.harness import Process
from kvroute.up import free_port
from tests.support.eventually import eventually_blocking

__all__ = ["CollectedSpan", "Collector", "agent_path", "parse_spans"]


def agent_path() -> Path | None:
    """The ``rotel-agent`` binary inside the installed ``rotel`` package (None when missing)."""
    spec = importlib.util.find_spec("rotel")
    if spec is None or spec.origin is None:
        return None
    path = Path(spec.origin).parent / "rotel-agent"
    return path if path.is_file() else None


def required_agent() -> Path:
    """:func:`agent_path`, for a test module: missing, the module is skipped, or fails under
    ``CI=true`` (rotel is in the dev extra, so CI must have it)."""
    path = agent_path()
    if path is None:
        if os.environ.get("CI") == "true":
            raise RuntimeError("the rotel package (its rotel-agent binary) is not installed")
        pytest.skip("the rotel package (an OpenTelemetry collector) is not installed",
                    allow_module_level=True)
    return path


@dataclass(repr=False)
class CollectedSpan:
    """One span as the collector printed it; ids are lowercase hex ('' for no parent)."""

    trace_id: str = ""
    parent_id: str = ""
    span_id: str = ""
    name: str = ""
    kind: str = ""
    status: str = ""
    attributes: dict[str, Any] = field(default_factory=dict)
    resource: dict[str, Any] = field(default_factory=dict)

    @property
    def service(self) -> str:
        return str(self.resource.get("service.name", ""))

    def __repr__(self) -> str:  # short: failure messages list many
        return (f"<{self.service}: {self.name!r} trace {self.trace_id} id {self.span_id} "
                f"parent {self.parent_id or '-'}>")


_SPAN_FIELDS = {"Trace ID": "trace_id", "Parent ID": "parent_id", "ID": "span_id",
                "Name": "name", "Kind": "kind", "Status code": "status"}
_FIELD = re.compile(r"\s+(Trace ID|Parent ID|ID|Name|Kind|Status code)\s+: ?(.*)")
_ATTRIBUTE = re.compile(r"\s+-> ([^:]+): (\w+)\((.*)\)")
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def _value(kind: str, text: str) -> Any:
    if kind == "Int":
        return int(text)
    if kind == "Double":
        return float(text)
    if kind == "Bool":
        return text == "true"
    return text


def parse_spans(text: str) -> list[CollectedSpan]:
    """The spans in the collector's debug log ``text``, in the order printed.

    A ``ResourceSpans`` block starts a resource whose ``Resource attributes:`` apply to every
    ``Span #`` after it; a span's ``Attributes:`` are its own. Sections the tests do not read
    (events, links) are skipped, and so are the agent's own log lines.
    """
    spans: list[CollectedSpan] = []
    resource: dict[str, Any] = {}
    span: CollectedSpan | None = None
    into: dict[str, Any] | None = None  # where the next "-> key: Type(value)" lines go
    for line in _ANSI.sub("", text).splitlines():
        if line.startswith("ResourceSpans #"):
            resource, span, into = {}, None, None
        elif line.startswith("Resource attributes:"):
            into = resource
        elif line.startswith("Span #"):
            span = CollectedSpan(resource=resource)
            spans.append(span)
            into = None
        elif line.startswith("Attributes:") and span is not None:
            into = span.attributes
        elif (match := _ATTRIBUTE.match(line)) is not None:
            if into is not None:
                into[match[1]] = _value(match[2], match[3])
        elif span is not None and (match := _FIELD.match(line)) is not None:
            setattr(span, _SPAN_FIELDS[match[1]], match[2].strip())
        elif not line.startswith(" "):  # another section (events, links): not read
            into = None
    return spans


class Collector(Process):
    """Rotel's agent on two free ports of 127.0.0.1: OTLP/gRPC and OTLP/HTTP receivers."""

    def __init__(self, agent: Path, log_dir: Path) -> None:
        self.grpc_port, self.http_port = free_port(), free_port()
        super().__init__("collector", [
            "start", "--otlp-grpc-endpoint", f"127.0.0.1:{self.grpc_port}",
            "--otlp-http-endpoint", f"127.0.0.1:{self.http_port}",
            "--exporter", "blackhole", "--disable-batching",
            "--debug-log", "traces", "--debug-log-verbosity", "detailed",
            "--pid-file", str(log_dir / "collector.pid"),
            "--log-file", str(log_dir / "collector-agent.log")], {}, log_dir)
        self.agent = agent

    def command(self) -> list[str]:
        return [str(self.agent), *self.args]

    @property
    def http_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"http://127.0.0.1:{self.grpc_port}"

    def wait_healthy(self, timeout: float = 30.0) -> None:
        """Until the HTTP receiver accepts an (empty) export."""
        def accepting() -> bool:
            if not self.alive():
                raise AssertionError(f"the collector exited:\n{self.tail()}")
            r = httpx.post(f"{self.http_url}/v1/traces", content=b"",
                           headers={"content-type": "application/x-protobuf"})
            return r.status_code == 200
        eventually_blocking(accepting, "the collector's OTLP/HTTP receiver", timeout,
                            tolerate=(httpx.HTTPError,))

    def spans(self) -> list[CollectedSpan]:
        """Every span received so far."""
        return parse_spans(self.log.read_text(errors="replace")) if self.log.exists() else []

    def wait_for(self, done: Callable[[list[CollectedSpan]], bool], what: str,
                 timeout: float = 30.0) -> list[CollectedSpan]:
        """The spans received, once ``done`` holds of them (AssertionError naming ``what``
        and the spans seen otherwise)."""
        return eventually_blocking(self.spans, what, timeout, until=done, interval=0.1)
