"""The router's decision, explained: ``POST /debug/route`` (behind the admin token when one is
set) routes a request body without sending it and answers the choice with every candidate's
cost terms, so an operator can see why a prompt went where it did, and what flow control
would do with it now (go, wait, or be refused, and why: each worker's saturation).
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request

from httpapi.body import read_body
from openai_request.bodies import parse_body
from router.http.client_trust import flow_view
from router.http.flow import ask_of, tenant_of
from router.http.request_path import route_of
from router.http.state import RouterState
from router.service import Route

__all__ = ["add_debug_routes", "explain"]


def add_debug_routes(app: FastAPI, state: RouterState) -> None:
    """Add ``POST /debug/route`` to ``app``, serving from ``state``."""

    @app.post("/debug/route")
    async def debug_route(request: Request) -> dict[str, Any]:
        state.admin(request)
        raw = await read_body(request, state.settings.max_body_bytes)
        body = parse_body(raw, state.settings.max_body_bytes)
        kind = "chat" if "messages" in body else "completions"
        headers = {k.lower(): v for k, v in request.headers.items()}
        route = await route_of(state, body, kind, len(raw))
        answer = explain(state, route)
        client = (request.client.host, request.client.port) if request.client else None
        asked, seen = flow_view(body, headers, state.trusted_clients.trusts(client))
        answer["flow"] = state.flow.explain(route, ask_of(asked, seen), tenant_of(asked, seen))
        return answer


def _url(route: Route, worker: int | None) -> str | None:
    """The URL of a candidate worker (None for none)."""
    entry = route.entries.get(worker) if worker is not None else None
    return entry.url if entry is not None else None


def explain(state: RouterState, route: Route) -> dict[str, Any]:
    """``route``'s decision as ``/debug/route`` answers it."""
    decision, core = route.decision, state.service.core
    return {
        "chosen": route.worker.url, "chosen_id": decision.worker,
        "chosen_rank": route.worker.rank,
        # Disaggregated serving: the worker that prefills for the chosen (decode) one.
        "prefill": route.prefill.url if route.prefill else None,
        "prefill_id": route.prefill.id if route.prefill else None,
        # The predicted time to first token (the rule in seconds only): through the remote
        # prefill when there is one (its queue and prefill, the transfer, the decode wait).
        "predicted_ttft_s": route.predicted_ttft_s if route.predicts_ttft else None,
        "prompt_tokens": len(route.prompt.token_ids), "request_blocks": len(route.hashes),
        "decision_us": round(route.decision_seconds * 1e6, 1),
        "continues_session_on": route.continued.worker if route.continued else None,
        # The peer the chosen worker is told to fetch the prompt's leading blocks from.
        "fetch_source": _url(route, decision.chosen.fetch_source)
        if route.prefill is None else None,
        "workers": [{"id": c.worker, "url": route.entries[c.worker].url,
                     "rank": route.entries[c.worker].rank,
                     "matched_blocks": c.matched_blocks,
                     "device_matched_blocks": c.device_matched_blocks,
                     "prefill_blocks": c.prefill_blocks, "decode_blocks": c.decode_blocks,
                     "pending_prefill_blocks": c.pending_prefill_blocks,
                     "active_requests": c.active_requests,
                     "sessions": core.live_sessions(c.worker),
                     "wait_s": c.wait_s, "prefill_s": c.prefill_s,
                     "rate_factor": core.rate_factor(c.worker),
                     "cost": c.cost, "price": c.price, "within_slo": c.within_slo,
                     # Peer fetch: the chosen option's source (null: it recomputes), the
                     # recompute option's TTFT and price, and the cheapest fetch's (its
                     # source, TTFT, price, transfer); waiting for a holder is its own row.
                     "fetch_source": _url(route, c.fetch_source),
                     "fetch_source_id": c.fetch_source, "fetch_blocks": c.fetch_blocks,
                     "fetch_s": c.fetch_s,
                     "recompute_cost": c.recompute_cost, "recompute_price": c.recompute_price,
                     "best_fetch_source_id": c.best_source, "fetch_cost": c.fetch_cost,
                     "fetch_price": c.fetch_price}
                    for c in decision.costs],
    }
