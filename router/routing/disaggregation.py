"""Selective disaggregation: when a decode worker prefills a request itself.

Under disaggregated serving a request's prompt is prefilled on a prefill worker and its KV
moved to the decode worker, so that decode workers' steps never share a forward pass with a
long prefill. When the decode worker already holds most of the prompt (a follow-up turn whose
history it cached), the part left to compute is short: computing it there costs its decode
steps little, while a remote prefill adds a round trip, a transfer and a prefill worker's
queue. The router then skips the remote prefill (llm-d does the same). The threshold is the
router's ``--pd-local-prefill-tokens``; the benchmark that set its default is in
``docs/routing.md`` ("Roles and ranks").
"""

from __future__ import annotations

__all__ = ["prefills_locally"]


def prefills_locally(prompt_tokens: int, held_blocks: int, block_size: int,
                     local_tokens: int) -> bool:
    """Whether the decode worker computes the prompt itself: at most ``local_tokens`` of its
    ``prompt_tokens`` lie past the ``held_blocks`` blocks it holds (``local_tokens`` 0: only a
    prompt whose every block it holds)."""
    return prompt_tokens - held_blocks * block_size <= local_tokens
