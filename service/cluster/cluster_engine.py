"""The ingress side of the cluster: an engine-shaped client of the engine replicas.

``ClusterEngine`` implements ``stencil.service.engine_client.EngineClient``, as
``stencil.engine.async_engine.AsyncEngine`` does (tokenizer, ``submit``, ``stats``, ``kernels``,
``replica_health``, ``start`` / ``shutdown``), so the same Litestar app (validation, chat templates,
tokenizing, output checking, errors, metrics) runs as the Ray Serve ingress, and only token ids and
the grammar's spec travel to the replicas, which check the request and compile the grammar themselves
(one copy of the engine's rules).

It knows Ray only through two callables given to it (``call`` starts a streaming request on a
replica chosen by the deployment's router; ``broadcast`` asks every replica) and the exception
types it is told to retry, so it is tested with fake replicas.

Admission before the first byte: ``submit`` returns a ``stencil.service.cluster.stream.ReplicaStream``
(an ``stencil.service.engine_client.RequestStream``) whose ``admit()`` (awaited by
``stencil.service.generation.start``) waits for the replica's ``Admitted`` or ``Refusal``, so a
replica's 400/429 still comes as a status code, not inside a stream.

Faults: when the replica dies (or its engine stops) mid-request, the stream re-sends the request,
with the same id, to another replica and *replays* it: the new replica recomputes the output
from the start (prefix caching makes the prompt cheap if it holds it), the tokens already
delivered are compared with the new ones and withheld, and delivery resumes after them. Greedy
and seeded outputs are the same on every replica (stable seeds, batch-invariant int4 kernels),
so the client sees one uninterrupted answer; if the replay differs (fp32 weights are not
batch-invariant) or every attempt fails, the request fails with a 503 naming the replica.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol

from stencil.engine.config import EngineConfig
from stencil.engine.kv_cache_manager import prompt_block_hashes
from stencil.engine.request import SamplingParams
from stencil.engine.sampler import default_seed
from stencil.grammar.base import GrammarSpec
from stencil.service.cluster.messages import ReplicaRequest
from stencil.service.cluster.stream import ReplicaStream


#: Most leading blocks hashed for routing (4096 tokens at 16 per block): bounds the router's work.
MAX_ROUTED_BLOCKS = 256


class ReplicaCall(Protocol):
    """A streaming call on one replica (Ray Serve's ``DeploymentResponseGenerator``)."""

    def __aiter__(self) -> AsyncIterator[Any]: ...

    async def __anext__(self) -> Any: ...

    def cancel(self) -> None: ...


@dataclass(slots=True)
class ClusterSettings:
    """How the ingress talks to the replicas.

    Attributes:
        max_attempts: tries per request (first one included) when replicas fail.
        admission_timeout_s: longest wait for a replica to admit a request (all replicas dead or
            restarting, or every queue full) before a 503.
        stats_period_s: how often the ingress asks every replica for its stats (/health, /metrics).
        stats_timeout_s: a replica that does not answer within this is reported unreachable.
        block_size: the replicas' KV block size (their ``EngineConfig.block_size``).
    """

    max_attempts: int = 3
    admission_timeout_s: float = 60.0
    stats_period_s: float = 1.0
    stats_timeout_s: float = 5.0
    block_size: int = 16


class _Vocab:
    """The ingress's stand-in for the grammar compiler: only the token → bytes map (exact logprob
    bytes)."""

    def __init__(self, tokenizer, vocab_size: int | None):
        from stencil.grammar.vocab import build_vocabulary

        self.vocab = build_vocabulary(tokenizer, model_vocab_size=vocab_size)


def aggregate_stats(per_replica: list[dict]) -> dict:
    """Sum replica stats; ``prefix_cache_hit_rate`` and ``kv_usage`` are recomputed from sums."""
    keys = ("running", "waiting", "kv_blocks_total", "kv_blocks_free", "prefix_cache_queries",
            "prefix_cache_hits", "num_preemptions", "num_steps")
    out = {k: sum(int(s.get(k, 0)) for s in per_replica) for k in keys}
    for k in ("kv_sliding_blocks_total", "kv_sliding_blocks_free"):  # replicas with a hybrid KV cache
        if any(k in s for s in per_replica):
            out[k] = sum(int(s.get(k, 0)) for s in per_replica)
    total = out["kv_blocks_total"]
    out["kv_usage"] = 1.0 - out["kv_blocks_free"] / total if total else 0.0
    q = out["prefix_cache_queries"]
    out["prefix_cache_hit_rate"] = out["prefix_cache_hits"] / q if q else 0.0
    out["replicas"] = len(per_replica)
    return out


class ClusterEngine:
    """Engine-shaped front of the replicas (see the module docstring).

    Args:
        config: the replicas' engine configuration (its ``model`` gives the tokenizer here).
        call: starts a streaming ``generate`` call with a ``ReplicaRequest`` on the replica the
            deployment's router picks; returns a ``ReplicaCall``.
        broadcast: ``await broadcast("stats")`` → one result per replica (an exception for a
            replica that failed to answer).
        retry_on: exception types meaning "that replica is gone" (Ray's ``RayActorError``, ...).
        overload_on: exception types meaning "every queue is full" (Serve's ``BackPressureError``).
        settings: timeouts and attempts.
        tokenizer: a ready tokenizer (tests); default: loaded from ``config.model``.
    """

    def __init__(self, config: EngineConfig, call: Callable[[ReplicaRequest], ReplicaCall],
                 broadcast: Callable[[str], Awaitable[list]], *,
                 retry_on: tuple[type[BaseException], ...] = (),
                 overload_on: tuple[type[BaseException], ...] = (),
                 settings: ClusterSettings | None = None, tokenizer=None, vocab_size: int | None = None):
        if tokenizer is None:
            from transformers import AutoConfig, AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(str(config.model))
            vocab_size = int(AutoConfig.from_pretrained(str(config.model)).vocab_size)
        self.tokenizer = tokenizer
        self.settings = settings or ClusterSettings(block_size=config.block_size)
        self._call = call
        self._broadcast = broadcast
        self.retry_on = retry_on
        self.overload_on = overload_on
        try:
            grammar = _Vocab(tokenizer, vocab_size)
        except (ValueError, AttributeError, TypeError):  # a tokenizer without a usable vocabulary
            grammar = None
        self.config = config
        self._grammar = grammar
        self.error: BaseException | None = None
        self.on_dead = None  # set by create_app; replicas are restarted by Serve, never "dead" here
        self.retries = 0  # requests re-sent after a replica failed
        self.replays = 0  # of which had already delivered tokens
        self._health: list[dict] = []
        self._health_at = 0.0
        self._poller: asyncio.Task | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    # -- lifecycle (as AsyncEngine) -----------------------------------------------------------
    def start(self) -> "ClusterEngine":
        """Start polling the replicas' stats (call from the event loop, as the app's lifespan does)."""
        if self._poller is None:
            self._loop = asyncio.get_running_loop()
            self._poller = self._loop.create_task(self._poll())
        return self

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop polling (any thread). The replicas belong to Serve: it drains and stops them."""
        if self._poller is not None and self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._poller.cancel)

    @property
    def is_alive(self) -> bool:
        """Always True: a dead replica is Serve's to restart; requests wait for admission."""
        return True

    # -- the model and admission (``stencil.service.engine_client.EngineClient``) ------------------------
    @property
    def vocab(self):
        """Token id → bytes, built here from the tokenizer (None if it has no usable vocabulary)."""
        return self._grammar.vocab if self._grammar is not None else None

    @property
    def vocab_size(self) -> int:
        return self._grammar.vocab.model_vocab_size if self._grammar is not None else len(self.tokenizer)

    @property
    def model_path(self) -> str:
        return str(self.config.model)

    def stats(self) -> dict:
        """The replicas' ``LLMEngine.stats()`` summed (hit rate and KV usage recomputed), plus the
        ingress's ``retries`` and ``replays`` (requests re-sent after a replica failed, and of
        those the ones that had delivered tokens)."""
        out = aggregate_stats([r["engine"] for r in self.replica_health() if r.get("engine")])
        out["retries"], out["replays"] = self.retries, self.replays
        return out

    @property
    def kernels(self) -> dict[str, str]:
        for r in self.replica_health():
            if r.get("kernels"):
                return r["kernels"]
        return {}

    @property
    def grammar_stats(self) -> None:
        """Grammars are compiled on the replicas (their counters are in their own metrics)."""
        return None

    # -- requests -------------------------------------------------------------------------------
    def submit(self, prompt_token_ids: list[int], params: SamplingParams, spec: GrammarSpec | None = None, *,
               request_id: str | None = None, grammar_backend: str | None = None,
               client: str | None = None) -> ReplicaStream:
        """A request's stream (nothing is sent yet): its ``admit()`` sends it to a replica, which checks
        it (``LLMEngine.check_request``, the 429 decided there, once), compiles ``spec`` (its
        vocabulary, its cache, its default backend: ``grammar_backend`` and ``client`` are not sent)
        and checks ``max_tokens`` against it; their errors are raised by ``admit``.
        """
        rid = request_id or "req-" + os.urandom(8).hex()
        if params.seed is None:
            # Pinned here, as one engine would derive it, so every attempt samples alike.
            params = dataclasses.replace(params, seed=default_seed(self.config.seed, rid))
        req = ReplicaRequest(rid, list(prompt_token_ids), params, spec,
                             prompt_block_hashes(prompt_token_ids, self.settings.block_size, MAX_ROUTED_BLOCKS))
        return ReplicaStream(self, req)

    def abort_all(self) -> int:
        """0: the requests run on the replicas, which Serve drains on shutdown (their engines abort
        what still runs, and each stream fails over or ends); the ingress has nothing to abort."""
        return 0

    # -- replicas -------------------------------------------------------------------------------
    def replica_health(self) -> list[dict]:
        """Each replica's last ``EngineReplica.stats()`` (or ``{"status": "unreachable"}``)."""
        return list(self._health)

    async def refresh(self) -> list[dict]:
        """Ask every replica for its stats now; return and keep the answers."""
        try:
            results = await asyncio.wait_for(self._broadcast("stats"), self.settings.stats_timeout_s)
        except Exception as e:  # noqa: BLE001 - no answer at all: report it, keep polling
            results = [e]
        health = []
        for r in results:
            if isinstance(r, BaseException):
                health.append({"status": "unreachable", "error": f"{type(r).__name__}: {str(r)[:200]}"})
            else:
                health.append(r)
        health.sort(key=lambda r: r.get("replica", "~"))
        self._health, self._health_at = health, time.monotonic()
        return health

    async def _poll(self) -> None:
        while True:
            await self.refresh()
            await asyncio.sleep(self.settings.stats_period_s)
