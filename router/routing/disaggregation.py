"""Selective disaggregation: when a decode worker prefills a request itself.

Under disaggregated serving a request's prompt is prefilled on a prefill worker and its KV
moved to the decode worker, so that decode workers' steps never share a forward pass with a
long prefill. When the decode worker already holds most of the prompt (a follow-up turn whose
history it cached), the part left to compute is short: computing it there costs its decode
steps little, while a remote prefill adds a round trip, a transfer and a prefill worker's
queue. The router then skips the remote prefill (llm-d does the same). The threshold is the
router's ``--pd-local-prefill-tokens``; the benchmark that set its default is in
``docs/benchmarks.md`` ("Disaggregated against aggregated workers").

A request prefilled remotely has its first token after three things in a row
(:func:`remote_prefill_ttft`): the prefill worker's queue and prefill, the transfer, and the
decode worker's wait for its first step. That sum, not the decode worker's own price, is
what the router predicts and books for it.
"""

from __future__ import annotations

from router.routing.scheduler import WorkerCost

__all__ = ["prefills_locally", "remote_prefill_ttft", "transfer_seconds"]


def prefills_locally(prompt_tokens: int, held_blocks: int, block_size: int,
                     local_tokens: int) -> bool:
    """Whether the decode worker computes the prompt itself: at most ``local_tokens`` of its
    ``prompt_tokens`` lie past the ``held_blocks`` blocks it holds (``local_tokens`` 0: only a
    prompt whose every block it holds)."""
    return prompt_tokens - held_blocks * block_size <= local_tokens


def remote_prefill_ttft(prefill: WorkerCost, decode: WorkerCost, decode_first_s: float,
                        transfer_s: float) -> float:
    """The predicted time to first token of a request prefilled on another worker: the
    prefill worker's own time to its one token (``prefill.cost``: its wait, the prompt's
    prefill there, its first step), the transfer of the KV to the decode worker
    (``transfer_s``, :func:`transfer_seconds`), then the decode worker's wait for its first
    step (``decode.wait_s``: its queued prefill and decodes) and that step
    (``decode_first_s``)."""
    return prefill.cost + transfer_s + decode.wait_s + decode_first_s


def transfer_seconds(blocks: int, block_size: int, kv_bytes_per_token: int,
                     bandwidth: float) -> float:
    """Seconds to move ``blocks`` blocks of KV over a link of ``bandwidth`` bytes a second."""
    return blocks * block_size * kv_bytes_per_token / bandwidth
