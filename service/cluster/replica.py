"""One engine as a Ray Serve deployment: the replica side of ``stencil serve --replicas N``.

A plain class (``stencil.service.cluster.deploy`` makes it a deployment with ``serve.deployment``): it
owns an ``AsyncEngine`` and answers

* ``generate(ReplicaRequest)`` — a stream: one ``Admitted`` or ``Refusal``, then the request's
  ``RequestOutput`` s (``stencil.service.cluster.messages``). Admission here is the engine's own:
  ``AsyncEngine.submit`` (``check_request``: prompt length, parameters, waiting-queue room; the
  grammar compile on the replica's compiler, with its cache, behind the prompt's prefill) and
  ``EngineStream.admit`` (the compile's outcome, the budget check), so the ingress never
  duplicates the engine's rules.
* ``record_routing_stats()`` — what the prefix-affinity router reads (Serve polls it every
  ``request_routing_stats_period_s``): cached block hashes, queue, KV usage.
* ``stats()`` — for the ingress's ``/health`` and ``/metrics`` (``handle.broadcast``).
* ``check_health()`` — Serve's health check: raises once the engine loop is dead, so Serve
  replaces the replica.

Cancelling the stream (the client left, a deadline) cancels ``generate``, whose engine stream
then aborts the request and frees its KV blocks.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import AsyncIterator

from stencil.engine.async_engine import AsyncEngine, EngineDeadError
from stencil.engine.config import EngineConfig
from stencil.engine.llm_engine import EngineError, EngineOverloaded
from stencil.engine.request import SamplingParams
from stencil.grammar.base import GrammarError
from stencil.service.cluster.messages import Admitted, Refusal, ReplicaRequest

log = logging.getLogger("stencil.replica")

#: Most cached block hashes one report carries (16 tokens each: 1M tokens of cached prefixes).
MAX_REPORTED_BLOCKS = 65_536


def _replica_id() -> str:
    """Serve's id of this replica (``ReplicaID.unique_id``), or the pid outside Serve."""
    try:
        from ray import serve

        return serve.get_replica_context().replica_id.unique_id
    except Exception:  # noqa: BLE001 - not inside a Serve replica (tests)
        return f"pid{os.getpid()}"


class EngineReplica:
    """An engine replica (see the module docstring).

    Args:
        config: the engine configuration (the same for every replica).
        max_reported_blocks: cap on the block hashes ``record_routing_stats`` reports.
        replica_id: this replica's id; ``None`` = Serve's (tests run replicas outside Serve).
    """

    def __init__(self, config: EngineConfig, max_reported_blocks: int = MAX_REPORTED_BLOCKS,
                 replica_id: str | None = None):
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        self.replica_id = replica_id or _replica_id()
        self._max_reported = max_reported_blocks
        self._started = time.time()
        self._aeng = AsyncEngine(config)
        # One short generation before Serve routes anything here, so the first user request
        # (also the first after a restart) does not pay for first-call allocations. Shorter
        # than a block: it leaves nothing in the prefix cache.
        self._aeng.engine.generate([self._aeng.tokenizer.encode("Hello")[:8] or [0]],
                                   SamplingParams(max_tokens=2, temperature=0.0))
        self._aeng.start()
        self._seq = 0
        self.admitted = 0
        self.finished = 0
        log.info("replica %s ready (pid %d, %.1f s)", self.replica_id, os.getpid(), time.time() - self._started)

    async def generate(self, request: ReplicaRequest) -> AsyncIterator[object]:
        """Admit, then stream one request (see ``stencil.service.cluster.messages`` for the items)."""
        aeng = self._aeng
        stream = None
        try:
            # Each attempt gets its own engine id: a retry that lands where an earlier attempt
            # was just aborted must not receive that attempt's last outputs.
            stream = aeng.submit(request.prompt_token_ids, request.params, request.grammar,
                                 request_id=f"{request.request_id}~{request.attempt}")
            await stream.admit()
        except (GrammarError, EngineError, EngineOverloaded, EngineDeadError) as e:
            if stream is not None:
                await stream.aclose()
            yield Refusal.of(e, self.replica_id)
            return
        try:
            self.admitted += 1
            yield Admitted(self.replica_id, stream.grammar_ms, list(stream.warnings))
            async for out in stream:
                out.request_id = request.request_id
                yield out
                if out.finished:
                    self.finished += 1
        except EngineDeadError as e:  # the loop died or is stopping: the ingress retries elsewhere
            yield Refusal.of(e, self.replica_id)
        except (EngineError, EngineOverloaded) as e:  # refused on the engine thread (e.g. duplicate id)
            yield Refusal.of(e, self.replica_id)
        finally:
            await stream.aclose()  # cancelled (the client left): the engine aborts it, its blocks freed

    def record_routing_stats(self) -> dict:
        """Routing state for ``stencil.service.cluster.routers`` (keys: ``tracking.ROUTING_STATS_KEYS``)."""
        eng = self._aeng.engine
        s = eng.stats()
        self._seq += 1
        return {"block_hashes": eng.kv.cached_block_hashes(self._max_reported), "running": s["running"],
                "waiting": s["waiting"], "kv_usage": s["kv_usage"], "seq": self._seq}

    def stats(self) -> dict:
        """This replica for ``/health`` and ``/metrics``: status, engine stats, kernels, counts."""
        aeng = self._aeng
        return {"replica": self.replica_id, "status": "ok" if aeng.is_alive else "dead", "pid": os.getpid(),
                "engine": aeng.stats(), "kernels": aeng.kernels,
                "admitted": self.admitted, "finished": self.finished,
                "uptime_s": round(time.time() - self._started, 1),
                "error": repr(aeng.error) if aeng.error is not None else None}

    def check_health(self) -> None:
        """Serve's periodic health check.

        Raises:
            EngineDeadError: the engine loop has died (Serve then replaces this replica).
        """
        if not self._aeng.is_alive:
            raise EngineDeadError(f"engine loop died: {self._aeng.error!r}")

    def close(self) -> None:
        """Stop the engine thread and the grammar workers (never raises: shutdown must finish)."""
        aeng = getattr(self, "_aeng", None)
        if aeng is not None:
            from stencil.service.app import stop_engine

            self._aeng = None
            stop_engine(aeng)

    def __del__(self) -> None:
        # Serve calls this after draining (graceful_shutdown_timeout_s).
        self.close()
