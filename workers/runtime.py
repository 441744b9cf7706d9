"""Assembles one worker from its settings: tokenizer, cache manager, batcher, executor, event
sink, publisher and engine; and answers what the HTTP layer asks of the worker as a whole.

With ``data_parallel_size`` N > 1 the worker runs N sim engines in one process, each with its
own cache manager, batcher, executor and event sink, behind one HTTP port, as ``vllm serve
--data-parallel-size N`` does: every engine publishes on the one publisher, each batch naming
its rank, so a router sees N caches on one stream. A request goes to the rank its
``X-data-parallel-rank`` header names, else to the rank with the fewest requests (vLLM's
coordinator balances the same way). The load report sums the ranks; a snapshot would have to
restate every rank, so a data-parallel worker offers none (a router clears and relearns).
"""

from __future__ import annotations

import hashlib
import time
import uuid
from typing import Any

from indexer.hashing import SALT_TAG_HMAC, SALT_TAG_SHA256
from openai_request.tokenizer import BYTE_OFFSET, ByteTokenizer, Tokenizer, load_tokenizer
from workers.cache.block_keys import Prompt
from workers.cache.cache_manager import CacheManager
from workers.cache.event_sink import EventSink
from workers.cache.image_hints import ImageHints
from workers.cache.publisher import EventPublisher
from workers.engine.batcher import Batcher, EngineRequest
from workers.engine.executor import Executor, SimExecutor
from workers.engine.loop import Engine, RequestHandle
from workers.engine.timing import TIMING_MODELS
from workers.settings import WorkerSettings

__all__ = ["WorkerRuntime"]


def sim_vocab(tokenizer: Tokenizer) -> range:
    """Token ids the sim engine draws from: printable ASCII for the byte tokenizer (so its
    text reads cleanly), every non-special id for a real tokenizer."""
    if isinstance(tokenizer, ByteTokenizer):
        return range(BYTE_OFFSET + 32, BYTE_OFFSET + 127)
    return range(min(tokenizer.vocab_size - 1, 260), tokenizer.vocab_size)


class WorkerRuntime:
    """One worker's parts, built from settings; started and stopped by the app's lifespan."""

    def __init__(self, settings: WorkerSettings) -> None:
        self.settings = settings
        self.tokenizer = load_tokenizer(settings.tokenizer)
        self.instance_id = uuid.uuid4().hex
        self.started_at = int(time.time())
        self._loras = {name: i + 1 for i, name in enumerate(settings.loras)}
        num_blocks = settings.num_blocks
        iteration_context = None
        if settings.engine == "torch":  # the KV cache is sized from its memory budget
            from workers.torch.engine import memory_plan_for

            plan = memory_plan_for(settings)
            num_blocks, iteration_context = plan.num_blocks, plan.iteration_context
        self.publisher: EventPublisher | None = None
        if settings.events_enabled:
            rank = settings.data_parallel_rank
            host = settings.events_host
            assert settings.events_port is not None, "events_enabled implies a port"
            replay = None
            if settings.replay_port is not None:
                replay = f"tcp://{host}:{_shift(settings.replay_port, rank)}"
            self.publisher = EventPublisher(f"tcp://{host}:{_shift(settings.events_port, rank)}",
                                            replay, topic=settings.topic,
                                            buffer_batches=settings.replay_buffer,
                                            curve=settings.curve_keys)
        #: One engine per data-parallel rank, rank 0 first (module docstring).
        self.engines: list[Engine] = []
        for i in range(settings.data_parallel_size):
            cache = CacheManager(num_blocks, settings.block_size, settings.host_blocks)
            batcher = Batcher(cache, max_num_batched_tokens=settings.max_num_batched_tokens,
                              max_num_seqs=settings.max_num_seqs,
                              short_prefill=settings.short_prefill,
                              short_pass_tokens=settings.short_pass_tokens,
                              max_model_len=settings.max_model_len,
                              max_iteration_context=iteration_context)
            hints = ImageHints(settings.image_hint_capacity) if settings.image_hints else None
            sink = EventSink(max_pending_stored=settings.max_pending_stored, hints=hints,
                             salt_key=settings.salt_key)
            rank = settings.data_parallel_rank if settings.data_parallel_size == 1 else i
            self.engines.append(Engine(cache, batcher, self._executor(cache), sink,
                                       self.publisher, rank=rank))
        #: Rank 0's engine and parts (the whole worker when it has one rank).
        self.engine = self.engines[0]
        self.cache, self.batcher = self.engine.cache, self.engine.batcher
        self.executor, self.sink = self.engine.executor, self.engine.sink

    def _executor(self, cache: CacheManager) -> Executor:
        s = self.settings
        if s.engine == "torch":
            from workers.torch.engine import build_torch_executor

            return build_torch_executor(s, self.tokenizer, cache)
        return SimExecutor(TIMING_MODELS[s.timing], speedup=s.speedup,
                           vocab=sim_vocab(self.tokenizer),
                           block_size=s.block_size)

    async def start(self) -> None:
        """Bind the event sockets and start the engine loop."""
        if self.publisher is not None:
            await self.publisher.start()
        for engine in self.engines:
            await engine.start()

    async def stop(self) -> None:
        """Stop the engine (aborting what runs) and close the sockets."""
        for engine in self.engines:
            await engine.stop()
        if self.publisher is not None:
            await self.publisher.close()

    def lora_scope(self, model: str) -> tuple[int, str] | None:
        """``(lora_id, name)`` when ``model`` names a served LoRA adapter."""
        lora_id = self._loras.get(model)
        return None if lora_id is None else (lora_id, model)

    def scope_salt(self, salt: str | None) -> str | None:
        """The salt the cache keys use; with prefix caching off, a fresh one per request so
        no block is ever reused."""
        if not self.settings.prefix_caching:
            return f"no-reuse:{uuid.uuid4().hex}"
        return salt

    def submit(self, request_id: str, prompt: Prompt, max_tokens: int,
               engine: Engine | None = None) -> RequestHandle:
        """Hand a request to ``engine`` (one of :attr:`engines`; default rank 0's).

        Raises:
            ValueError: the engine refuses it (too long, malformed).
        """
        eos = self.tokenizer.eos_token_id if self.settings.engine == "torch" else None
        return (engine or self.engine).submit(EngineRequest(request_id, prompt, max_tokens,
                                                            eos_token_id=eos))

    def rank_engine(self, rank: int | None) -> Engine:
        """Rank ``rank``'s engine; None: the least busy one (fewest running and waiting).

        Raises:
            ValueError: this worker has no rank ``rank``.
        """
        engines = self.engines
        if rank is None:
            return min(engines, key=lambda e: e.batcher.running + e.batcher.waiting)
        if not 0 <= rank < len(engines):
            raise ValueError(f"data-parallel rank {rank} is not one of this worker's "
                             f"0..{len(engines) - 1}")
        return engines[rank]

    def load(self) -> dict[str, int | float]:
        """``GET /load``: every rank's load together (KV usage over all their blocks)."""
        if len(self.engines) == 1:
            return self.engine.load()
        loads = [e.load() for e in self.engines]
        out = {k: sum(load[k] for load in loads) for k in loads[0]}
        held = sum(load["kv_usage"] * load["num_blocks"] for load in loads)
        out["kv_usage"] = held / out["num_blocks"]
        return out

    async def reset_prefix_cache(self) -> bool:
        """Reset every rank's cache; ``False`` when some rank has running requests (ranks
        idle by then are reset already)."""
        done = [await e.reset_prefix_cache() for e in self.engines]
        return all(done)

    def model_info(self) -> dict[str, Any]:
        """``GET /model_info``: what a router needs to index and route to this worker."""
        s = self.settings
        tokenizer_file = s.tokenizer or ""
        extra: dict[str, Any] = {}
        if s.image_routing_version is not None:
            extra["trtllm_image_routing_version"] = s.image_routing_version
        pub = self.publisher
        return {
            "model": s.model,
            # sglang-router names a worker's model by these (it shows "unknown" without).
            "model_path": s.model,
            "tokenizer_path": tokenizer_file,
            "engine": s.engine,
            "block_size": s.block_size,
            "tokenizer": self.tokenizer.identity,
            "tokenizer_source": hashlib.sha256(tokenizer_file.encode()).hexdigest()[:8]
            if tokenizer_file else "builtin",
            "mm_tokens_per_image": s.mm_tokens_per_image if s.images else 0,
            "instance_id": self.instance_id,
            "events_endpoint": pub.endpoint if pub else None,
            "replay_endpoint": pub.replay_endpoint if pub else None,
            "topic": s.topic,
            "data_parallel_rank": s.data_parallel_rank,
            "data_parallel_size": s.data_parallel_size,
            "capacity": {"num_blocks": self.cache.pool.num_blocks, "host_blocks": s.host_blocks,
                         "max_num_seqs": s.max_num_seqs},
            "max_model_len": s.max_model_len,
            "salt_hashing": SALT_TAG_HMAC if s.salt_key is not None else SALT_TAG_SHA256,
            "kv_snapshot": pub is not None and s.data_parallel_size == 1,
            "lora_adapters": list(s.loras),
            "extra": extra,
        }


def _shift(port: int, rank: int) -> int:
    return port + rank if port else 0
