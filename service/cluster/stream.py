"""One request on the replicas: admission, outputs, and failover with replay.

``ReplicaStream`` is what ``ClusterEngine.submit`` returns, a ``stencil.service.engine_client.RequestStream``
as ``stencil.engine.async_engine.EngineStream`` is: an async iterator of ``stencil.engine.outputs.RequestOutput``
with an ``admit()`` that ``stencil.service.generation.start`` awaits before the first byte.

Failover: when the replica dies (Ray's ``ActorDiedError``, a ``Refusal`` of kind
"unavailable", an "abort" it did not ask for, a stream that ends early), the request is sent
again, same id, to another replica, and replayed: the tokens already delivered are recomputed
there, compared and withheld, and delivery resumes after them. A replay that differs, or a
last attempt that fails, is a 503 (``stencil.service.errors.Unavailable``) naming the replica.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from typing import TYPE_CHECKING

from stencil.engine.llm_engine import EngineOverloaded
from stencil.engine.outputs import RequestOutput
from stencil.service.cluster.messages import Admitted, Refusal, ReplicaRequest
from stencil.service.errors import Unavailable

if TYPE_CHECKING:
    from stencil.service.cluster.cluster_engine import ClusterEngine, ReplicaCall

log = logging.getLogger("stencil.cluster")


class ReplicaStream:
    """One request on the replicas: admission, then outputs, with retries and replay on failure.

    An async iterator of ``RequestOutput`` (the same items ``AsyncEngine.generate`` yields).
    ``aclose()`` cancels the replica call (the replica aborts the request and frees its blocks).

    Attributes:
        request_id: the request's id (every attempt's).
        started: set at the first admission: the replica queues the request itself, and the
            ingress does not wait for its scheduling.
        grammar: None: the grammar was compiled on the replica (its Lark answers are not replayed
            here).
        warnings: the grammar's notes, from the latest ``Admitted``.
        grammar_ms: the first admitting replica's time for the grammar (ms; 0 without one).
    """

    grammar = None

    def __init__(self, cluster: "ClusterEngine", request: ReplicaRequest):
        self._cluster = cluster
        self.request = request
        self.request_id = request.request_id
        self.started = asyncio.Event()
        self.warnings: list[str] = []
        self.grammar_ms = 0.0
        self._call: ReplicaCall | None = None
        self.admitted: Admitted | None = None
        self.replicas: list[str] = []  # replicas that admitted it, in order
        self._done = False
        # What the client has been given, and the replay of it after a failover.
        self._tokens: list[int] = []
        self._text = ""
        self._replaying = False
        self._replay_tokens: list[int] = []
        self._replay_text = ""
        self._replay_logprobs: list[float] = []

    async def admit(self) -> None:
        """Wait until a replica admits the request (a no-op once one has); a refused request's call
        is cancelled.

        Raises:
            GrammarError, EngineError (400), EngineOverloaded (429): the replica refused it.
            stencil.service.errors.Unavailable (503): no replica admitted it within the admission
                timeout, or every attempt found its replica gone.
        """
        if self.admitted is not None:
            return
        settings = self._cluster.settings
        last: str = "no replica answered"
        while self.request.attempt < settings.max_attempts:
            call = self._cluster._call(self.request)
            self._call = call
            try:
                first = await asyncio.wait_for(anext(call), settings.admission_timeout_s)
            except asyncio.TimeoutError:
                call.cancel()
                raise Unavailable(f"no replica admitted request {self.request.request_id} within "
                                  f"{settings.admission_timeout_s:g} s") from None
            except self._cluster.overload_on as e:
                call.cancel()
                raise EngineOverloaded(f"every replica's queue is full: {e}") from None
            except (StopAsyncIteration, *self._cluster.retry_on) as e:
                call.cancel()
                last = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
                self._next_attempt(last)
                continue
            if isinstance(first, Refusal):
                if first.retryable:
                    last = f"replica {first.replica_id}: {first.message}"
                    self._next_attempt(last)
                    continue
                raise first.to_exception()
            if not isinstance(first, Admitted):
                call.cancel()
                raise TypeError(f"replica sent {type(first).__name__} before admitting the request")
            self.admitted = first
            self.replicas.append(first.replica_id)
            self.warnings = list(first.warnings)
            if not self.started.is_set():  # the first admission (not a failover's)
                self.grammar_ms = first.grammar_ms
                self.started.set()
            return
        raise Unavailable(f"request {self.request.request_id} failed on {settings.max_attempts} "
                          f"attempts; last: {last}")

    @property
    def replica(self) -> str | None:
        """The replica that admitted the latest attempt (``X-Stencil-Replica``), if any."""
        return self.replicas[-1] if self.replicas else None

    def _next_attempt(self, why: str) -> None:
        self.request.attempt += 1
        self._cluster.retries += 1
        log.warning("request %s: replica failed (%s); attempt %d of %d", self.request.request_id, why,
                    self.request.attempt + 1, self._cluster.settings.max_attempts)

    def __aiter__(self) -> "ReplicaStream":
        return self

    async def __anext__(self) -> RequestOutput:
        if self._done:
            raise StopAsyncIteration
        if self.admitted is None:
            await self.admit()
        while True:
            try:
                item = await anext(self._call)
            except StopAsyncIteration:
                await self._failover("the replica's stream ended before the request finished")
                continue
            except self._cluster.retry_on as e:
                await self._failover(f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
                continue
            if isinstance(item, Refusal):  # its engine stopped mid-request
                await self._failover(f"replica {item.replica_id}: {item.message}")
                continue
            if item.finished and item.finish_reason == "abort":  # the replica is shutting down
                await self._failover(f"replica {self.replicas[-1]} aborted the request")
                continue
            out = self._deliverable(item)
            if out is None:
                continue
            if out.finished:
                self._done = True
            return out

    async def _failover(self, why: str) -> None:
        """Re-send the request elsewhere; later outputs replay what was delivered, then go on.

        Raises:
            Unavailable: the last attempt failed too (503, naming the replica).
        """
        if self._call is not None:
            self._call.cancel()
        failed = self.replicas[-1] if self.replicas else "?"
        if self.request.attempt + 1 >= self._cluster.settings.max_attempts:
            raise Unavailable(f"replica {failed} failed while serving request {self.request.request_id} "
                              f"({why}); no attempt left")
        self._next_attempt(f"{failed}: {why}")
        if self._tokens or self._text:
            self._cluster.replays += 1
        self.admitted = None
        self._replaying = True
        self._replay_tokens, self._replay_text, self._replay_logprobs = [], "", []
        await self.admit()

    def _deliverable(self, out: RequestOutput) -> RequestOutput | None:
        """``out`` as the client should see it: new tokens only; ``None`` while still replaying.

        Raises:
            Unavailable: the replay differs from what was delivered (503).
        """
        if not self._replaying:
            self._tokens.extend(out.new_token_ids)
            self._text += out.new_text
            return out
        self._replay_tokens.extend(out.new_token_ids)
        self._replay_text += out.new_text
        self._replay_logprobs.extend(out.new_logprobs)
        n, done = len(self._tokens), self._replay_tokens
        if done[:n] != self._tokens[:len(done)]:
            raise Unavailable(f"request {self.request.request_id}: its replica failed after {n} tokens and "
                              f"the retry on replica {self.replicas[-1]} produced different ones")
        caught_up = len(done) > n or (out.finished and len(done) == n)
        if not caught_up or not self._replay_text.startswith(self._text):
            if out.finished:  # ended without covering what was delivered, or its text differs
                raise Unavailable(f"request {self.request.request_id}: the retry on replica "
                                  f"{self.replicas[-1]} ended differently from the failed attempt")
            return None
        new_tokens = done[n:]
        new_text = self._replay_text[len(self._text):]
        logprobs = self._replay_logprobs[n:] if out.new_logprobs or self._replay_logprobs else []
        self._replaying = False
        self._tokens = list(done)
        self._text = self._replay_text
        # Everything else as the replica said (the finish, counters, budget and error fields).
        return dataclasses.replace(out, new_token_ids=new_tokens, new_text=new_text, new_logprobs=logprobs,
                                   new_top_logprobs=[])

    async def aclose(self) -> None:
        """Cancel the replica call if the request is not finished (the replica aborts it); idempotent."""
        if self._call is not None and not self._done:
            self._call.cancel()
        self._done = True
