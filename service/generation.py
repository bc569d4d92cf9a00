"""The generation core every endpoint shares: a checked request runs, streamed or whole.

``POST /generate`` and the OpenAI-compatible routes differ only in their wire types; both go
through these functions so that limits, errors, validation, metrics and logs are the same:

1-3. ``stencil.service.inputs``: ``tokenize`` → prompt token ids, ``sampling_params`` →
   ``SamplingParams``, ``grammar_spec`` / ``checked_grammar_spec`` → ``GrammarSpec`` or ``None``.
4. ``gen = await start(...)``, then ``await collect(gen)`` → ``GenerationResult``, or
   ``async for item in gen`` for streaming: ``GenerationDelta``
   items, then one ``GenerationResult``.

Errors (all mapped to HTTP by ``stencil.service.errors.to_problem``): ``InputError`` (400),
``stencil.grammar.base.GrammarError`` (400, naming keyword/path/position), ``stencil.engine.llm_engine.EngineError``
(400, e.g. prompt too long), ``EngineOverloaded`` (429), ``Unavailable`` / ``EngineDeadError``
(503), ``GenerationTimeout`` (504), ``GenerationFailed`` (500); a constraint found mid-generation
to need text the vocabulary cannot spell (``stencil.grammar.base.DeadEndError``) is an ``InputError``
naming the constraint's field (in-band for a stream). ``start`` raises all of those
that can be known before the first token, so a streaming handler can still answer with a
status code instead of a broken stream.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec

from stencil.engine.request import SamplingParams
from stencil.grammar.base import GrammarError, GrammarSpec
from stencil.schemas.common import Timings, Usage
from stencil.service.engine_client import RequestStream
from stencil.service.errors import (ClientDisconnected, GenerationFailed, GenerationTimeout, InputError, QueueTimeout,
                            Unavailable)
from stencil.service.state import ServiceState

log = logging.getLogger("stencil.generation")

# Parsing and validating an output of this many characters or more (json + jsonschema, pure
# Python for the schema) moves to a worker thread too.
_THREAD_CHECK_CHARS = 16_384
# The ``/generate`` field each kind of constraint comes from, for a ``GrammarError`` to name.
_SPEC_FIELDS = {"json_schema": "response_schema", "regex": "regex", "choice": "choice", "lark": "grammar"}


# -- results ---------------------------------------------------------------------------------------

@dataclass(slots=True)
class GenerationDelta:
    """Output made final since the previous item of a stream.

    Attributes:
        text: new text (complete UTF-8 characters; may be "" when tokens are held back).
        token_ids: new output token ids.
        logprobs: log-probabilities of ``token_ids`` (natural log), when requested, else None.
        top_logprobs: per token, the most likely ``(token id, logprob)`` at its position, best
            first, when ``top_logprobs`` was requested, else None.
        reasoning: new reasoning text (with ``SamplingParams.reasoning``; ``text`` is then the
            answer's).
    """

    text: str
    token_ids: list[int]
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None
    reasoning: str = ""


class GenerationResult(msgspec.Struct, kw_only=True):
    """The finished answer to one request.

    Attributes:
        id: the request id.
        text: the whole output text (equal to the concatenated stream deltas); with reasoning,
            the answer's alone.
        token_ids: the output token ids (reasoning and answer).
        finish_reason: "stop" (EOS, stop string, grammar complete) or "length" (max_tokens or
            the model's context).
        output: the parsed JSON (schema requests) or the chosen string (choice requests);
            ``None`` otherwise and whenever the output was cut short.
        valid: the constraint admits the output, whatever stopped it (jsonschema with format
            checking for schemas, a full match for regexes).
        usage: token counts, speculative counters included.
        timings: ttft / total / grammar wait in milliseconds.
        warnings: why ``valid`` is False, and keywords ignored under ``strict: false``.
        logprobs: per output token, when requested.
        top_logprobs: per output token, its position's alternatives, when requested.
        closed_by_budget: the budget removed, at least once, a continuation the grammar allowed, so
            that the output ended complete within ``max_tokens``. It says the choices were narrowed,
            not that the model would have chosen a removed token: an answer may equal the unbounded
            one (``stencil bench budget`` reports how often).
        shortened: JSON pointers of the values being written where the budget narrowed the choices
            (``["/tags/3", "/note"]``).
        truncated_value: valid, but stopped at ``max_tokens`` where the constraint allowed more
            (``finish_reason`` "length"): its last value may be cut short (a run of digits the
            budget never steered, an optional part of a regex).
        reasoning: with ``SamplingParams.reasoning``, the reasoning's text (markers excluded;
            "" when the region was empty); ``None`` without reasoning.
        reasoning_cut: the end of the reasoning was forced (to leave the answer room within
            ``max_tokens``, or at the reasoning cap), not written by the model.
    """

    id: str
    text: str
    token_ids: list[int]
    finish_reason: str
    output: Any
    valid: bool
    usage: Usage
    timings: Timings
    warnings: list[str]
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None
    closed_by_budget: bool = False
    shortened: list[str] = msgspec.field(default_factory=list)
    truncated_value: bool = False
    reasoning: str | None = None
    reasoning_cut: bool = False


# -- running ---------------------------------------------------------------------------------------

class GenerationStream:
    """An admitted request: iterate it for ``GenerationDelta`` items, then one ``GenerationResult``.

    Wraps the engine's ``stencil.service.engine_client.RequestStream`` (``start`` makes one). Iterate at
    most once. Leaving the iteration early (client gone, task cancelled) aborts the request in the
    engine, which frees its KV blocks at once.
    """

    def __init__(self, state: ServiceState, stream: RequestStream | None, params: SamplingParams,
                 spec: GrammarSpec | None, request_id: str, arrival: float, queue_timeout_s: float | None = None):
        self.state = state
        # Latest moment the request may still be waiting for a running slot (perf_counter s).
        wait = state.config.queue_wait_s if queue_timeout_s is None else min(
            queue_timeout_s, state.config.request_timeout_s)
        self.queue_deadline = arrival + wait
        self.params = params
        self.spec = spec
        self.request_id = request_id
        self.arrival = arrival
        self.result: GenerationResult | None = None
        self._stream = stream

    async def admit(self) -> None:
        """Wait for the engine to accept the request (``RequestStream.admit``: its grammar compiled, its
        budget checked; on a cluster, a replica's word), so its refusal is still raised before the
        first byte; ``start`` does it. The stream is closed on a refusal."""
        try:
            await self._stream.admit()
        except BaseException:
            await self._stream.aclose()
            raise
        if self.spec is not None:
            self.state.metrics.grammar_wait.observe(self._stream.grammar_ms / 1e3)

    @property
    def warnings(self) -> list[str]:
        """The compiled grammar's notes (keywords relaxed, bounds applied), once admitted."""
        return self._stream.warnings

    async def wait_started(self, receive=None) -> None:
        """Wait until the engine schedules the request (a running slot is its own), before any
        byte of the answer is sent, so that a request that cannot start in time still gets a
        status code.

        Args:
            receive: the ASGI ``receive`` of the HTTP request (its body read); a client that
                hangs up while queued is noticed here. ``None`` = do not watch.

        Raises:
            QueueTimeout (429): still queued at ``queue_deadline``; it was taken off the queue.
            ClientDisconnected: the client left while queued; the request was aborted.
        """
        started = self._stream.started
        if started.is_set():
            return  # at once on a cluster: a replica queues the requests it admitted itself
        st = self.state
        waiter = asyncio.ensure_future(started.wait())
        watch = asyncio.ensure_future(_until_disconnect(receive)) if receive is not None else None
        try:
            done, _ = await asyncio.wait({t for t in (waiter, watch) if t is not None},
                                         timeout=max(0.0, self.queue_deadline - time.perf_counter()),
                                         return_when=asyncio.FIRST_COMPLETED)
        finally:
            for t in (waiter, watch):
                if t is not None and not t.done():
                    t.cancel()
        st.metrics.queue_wait.observe(time.perf_counter() - self.arrival)
        if started.is_set():
            return
        await self._stream.aclose()  # off the queue: its place goes to the next request
        if watch is not None and watch in done:
            raise ClientDisconnected(f"client closed the connection; request {self.request_id} aborted while queued")
        st.metrics.queue_timeouts.inc()
        raise QueueTimeout(f"request {self.request_id} waited {time.perf_counter() - self.arrival:.1f} s for a "
                           "running slot, past its deadline; nothing was generated, retry later",
                           retry_after=st.config.retry_after_s)

    @property
    def replica(self) -> str | None:
        """On a cluster (``stencil.service.cluster``), the replica now serving the request; else None."""
        return self._stream.replica

    async def aclose(self) -> None:
        """Give the request up: abort it in the engine unless it finished (idempotent). For a
        stream never iterated (a sibling request failed to start; a client that hung up before
        the body's first chunk) this is the only cleanup there is."""
        if self._stream is not None:
            await self._stream.aclose()

    def __aiter__(self) -> AsyncIterator[GenerationDelta | GenerationResult]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[GenerationDelta | GenerationResult]:
        st = self.state
        deadline = self.arrival + st.config.request_timeout_s
        agen = self._stream
        parts: list[str] = []
        thoughts: list[str] = []
        token_ids: list[int] = []
        logprobs: list[float] = []
        tops: list[list[tuple[int, float]]] = []
        first_at: float | None = None
        last_at = self.arrival
        final = None
        st.inflight += 1
        try:
            while True:
                remaining = deadline - time.perf_counter()
                try:
                    if remaining <= 0:
                        raise TimeoutError
                    async with asyncio.timeout(remaining):
                        out = await anext(agen)
                except StopAsyncIteration:
                    break
                except TimeoutError:
                    st.metrics.timeouts.inc()
                    raise GenerationTimeout(f"request {self.request_id} ran past its {st.config.request_timeout_s:g} s "
                                            "deadline and was aborted") from None
                if out.finish_reason == "error":
                    if out.constraint_error:  # the constraint cannot be spelled: the client's fault
                        field = _SPEC_FIELDS.get(self.spec.kind) if self.spec is not None else None
                        raise InputError(f"the constraint cannot be met by this model: {out.error}", field=field)
                    raise GenerationFailed(f"request {self.request_id} failed in the engine: {out.error}")
                if out.finish_reason == "abort":
                    raise Unavailable(f"request {self.request_id} was aborted: the server is shutting down")
                if out.new_token_ids:
                    now = time.perf_counter()
                    if first_at is None:
                        first_at = now
                        st.metrics.ttft.observe(now - self.arrival)
                    else:
                        # Tokens of one step (accepted drafts, forced runs) share the step's gap.
                        gap = (now - last_at) / len(out.new_token_ids)
                        for _ in out.new_token_ids:
                            st.metrics.itl.observe(gap)
                    last_at = now
                if out.new_token_ids or out.new_text or out.new_reasoning_text:
                    parts.append(out.new_text)
                    thoughts.append(out.new_reasoning_text)
                    token_ids.extend(out.new_token_ids)
                    lp = list(out.new_logprobs) if self.params.logprobs else None
                    if lp:
                        logprobs.extend(lp)
                    top = list(out.new_top_logprobs) if self.params.top_logprobs else None
                    if top:
                        tops.extend(top)
                    yield GenerationDelta(out.new_text, list(out.new_token_ids), lp, top, out.new_reasoning_text)
                if out.finished:
                    final = out
                    break
        finally:
            st.inflight -= 1
            await agen.aclose()
        if final is None:
            raise GenerationFailed(f"request {self.request_id} ended without a final output")
        text = "".join(parts)
        reasoning = "".join(thoughts) if self.params.reasoning is not None else None
        if len(text) >= _THREAD_CHECK_CHARS:
            self.result = await asyncio.to_thread(self._finish, final, text, token_ids, logprobs, first_at, reasoning)
        else:
            self.result = self._finish(final, text, token_ids, logprobs, first_at, reasoning)
        if self.params.top_logprobs:
            self.result.top_logprobs = tops
        yield self.result

    def _finish(self, out, text: str, token_ids: list[int], logprobs: list[float],
                first_at: float | None, reasoning: str | None = None) -> GenerationResult:
        st = self.state
        now = time.perf_counter()
        # The constraint judges the answer alone: its tokens follow the reasoning's.
        answer_ids = token_ids[out.num_reasoning_tokens:] if reasoning is not None else token_ids
        checked = st.checker.check(self.spec, text, out.finish_reason, answer_ids, self._stream.grammar)
        warnings = list(self._stream.warnings) + checked.warnings
        if out.context_room is not None:
            warnings.append(f"max_tokens was lowered to {out.context_room}: the prompt leaves that many "
                            f"tokens of max_model_len (the model's context, or the KV cache's capacity where smaller)")
        usage = Usage(prompt_tokens=out.num_prompt_tokens, completion_tokens=out.num_output_tokens,
                      total_tokens=out.num_prompt_tokens + out.num_output_tokens,
                      cached_tokens=out.num_cached_tokens, draft_tokens=out.num_draft_tokens,
                      accepted_tokens=out.num_accepted_tokens, forced_tokens=out.num_forced_tokens,
                      reasoning_tokens=out.num_reasoning_tokens)
        if out.reasoning_cut and self.params.reasoning.max_reasoning_tokens != 0:  # (0: asked for none)
            warnings.append(f"the reasoning was ended for the model ({out.num_reasoning_tokens} tokens with its "
                            "markers) to leave the answer room within max_tokens, reasoning_effort or the server's "
                            "reasoning budget")
        shortened: list[str] = []
        if out.closed_by_budget and self.spec is not None and self.spec.kind == "json_schema":
            from stencil.service.json_paths import shortened_paths

            shortened = shortened_paths(text, out.budget_cuts)
        if out.closed_by_budget:
            warnings.append(narrowed_note(shortened))
        if out.budget_unenforced and out.finish_reason == "length":
            warnings.append(f"max_tokens could not be kept by closing the answer in time "
                            f"({out.budget_unenforced}): it was cut; a larger max_tokens lets it end")
        if out.guard_hits:
            from stencil.service.json_paths import shortened_paths

            for what, offset in out.guard_hits:
                where = shortened_paths(text, [offset]) if self.spec is not None else []
                warnings.append(f"run-on guard: {what}" + (f" at {where[0] or 'the root'}" if where else "")
                                + "; it was closed (soft_limits adjusts the bounds)")
        timings = Timings(ttft_ms=round((first_at - self.arrival) * 1e3, 3) if first_at is not None else None,
                          total_ms=round((now - self.arrival) * 1e3, 3), grammar_ms=round(self._stream.grammar_ms, 3))
        st.metrics.record_finished(usage, out.finish_reason, checked.valid if self.spec is not None else None)
        log.info("request finished", extra={
            "request_id": self.request_id, "finish_reason": out.finish_reason, "valid": checked.valid,
            "prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
            "ttft_ms": timings.ttft_ms, "total_ms": timings.total_ms})
        return GenerationResult(id=self.request_id, text=text, token_ids=token_ids,
                                finish_reason=out.finish_reason, output=checked.output, valid=checked.valid,
                                usage=usage, timings=timings, warnings=warnings,
                                logprobs=logprobs if self.params.logprobs else None,
                                closed_by_budget=out.closed_by_budget, shortened=shortened,
                                truncated_value=checked.truncated_value, reasoning=reasoning,
                                reasoning_cut=out.reasoning_cut)


async def close_streams(streams: Sequence[GenerationStream]) -> None:
    """Give up every stream of a streamed response once the response has ended (its background
    task): a no-op for streams that finished. A client that hangs up right after the headers
    makes Litestar cancel the body before it takes its first item, and an async generator never
    started runs no ``finally``: without this its engine request ran on, then was held by flow
    control for ever, its KV blocks and running slot with it (found by a new-user trial)."""
    for stream in streams:
        try:
            await stream.aclose()
        except Exception:  # noqa: BLE001 - one stream's failure must not keep the others running
            log.exception("closing the stream of request %s failed", stream.request_id)


def narrowed_note(paths: list[str]) -> str:
    """The warning of an answer that ``max_tokens`` closed early (``closed_by_budget``): where, as
    the JSON pointers of the values it shortened (``""``: the whole answer), each written as a JSON
    string, since a generated key may hold the commas and spaces that separate them."""
    where = ", ".join(msgspec.json.encode(p).decode() if p else "the root" for p in paths)
    return ("max_tokens narrowed the answer: near the end only continuations that close in time were allowed"
            + (f" (at: {where})" if where else ""))


def client_id(headers, peer) -> str:
    """Who sends a request, for fairness between clients: its API key when it gives one, else
    its address (host and port of the connection)."""
    auth = headers.get("authorization") or headers.get("x-api-key") or ""
    if auth:
        import hashlib

        return "key:" + hashlib.blake2b(auth.encode(), digest_size=8).hexdigest()
    return f"peer:{peer.host}:{peer.port}" if peer is not None else "peer:unknown"


async def start(state: ServiceState, prompt_ids: list[int], params: SamplingParams,
                spec: GrammarSpec | None, request_id: str, arrival: float | None = None,
                grammar_backend: str | None = None, client: str | None = None, *, receive=None,
                queue_timeout_s: float | None = None, wait: bool = True) -> GenerationStream:
    """Admit a request: submit it to the engine (``EngineClient.submit``: checked, its grammar
    compiled behind its prefill), wait for its admission (``RequestStream.admit``), then until it is
    scheduled (``GenerationStream.wait_started``); return its stream.

    Args:
        state: the app's injected state.
        prompt_ids: prompt token ids (see ``tokenize``).
        params: see ``sampling_params``.
        spec: see ``grammar_spec``; ``None`` = unconstrained.
        request_id: unique among live requests; used in logs, metrics and errors.
        arrival: ``time.perf_counter()`` when the request arrived (default: now); timings and the
            deadline count from it.
        grammar_backend: "auto", "eager" or "lazy" for this request (``None``: the server's).
        client: who asks (``client_id``): its grammar compiles share the workers fairly.
        receive: the ASGI ``receive`` of the HTTP request, to notice a client that leaves while
            its request is queued (``None``: not watched).
        queue_timeout_s: most seconds to wait for a running slot (``None``: the server's
            ``max_queue_wait_s``, by default half the request timeout).
        wait: False submits without waiting (the caller awaits ``wait_started`` itself).

    Raises:
        Unavailable: the service is draining or the engine is dead.
        EngineError / EngineOverloaded: the engine refuses the request (too long prompt, full
            waiting queue); ``field`` names the core field (``prompt``, ``max_tokens``, ...).
        GrammarError: the constraint cannot be compiled exactly (or compiling timed out); its
            ``field`` names the ``/generate`` field of the constraint (``regex``, ...).
        QueueTimeout / ClientDisconnected: see ``GenerationStream.wait_started``.
    """
    arrival = time.perf_counter() if arrival is None else arrival
    if state.draining:
        raise Unavailable("the server is shutting down and admits no new requests")
    if not state.engine.is_alive:
        raise Unavailable(f"the engine is not running: {state.engine.error!r}")
    try:
        # The engine checks the request (cheap, before any compile; the 429 is decided here,
        # once), then compiles its grammar while it reads the prompt (compile behind prefill).
        stream = state.engine.submit(prompt_ids, params, spec, request_id=request_id,
                                     grammar_backend=grammar_backend, client=client)
        gen = GenerationStream(state, stream, params, spec, request_id, arrival, queue_timeout_s)
        await gen.admit()  # the compile's and the budget's errors (a replica's refusal) too
    except GrammarError as e:
        if e.field is not None or spec is None:
            raise
        raise e.copy(field=_SPEC_FIELDS.get(spec.kind)) from None
    if wait:
        await gen.wait_started(receive)
    return gen


async def _until_disconnect(receive) -> None:
    """Return once the ASGI ``receive`` channel reports ``http.disconnect``."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def collect(gen: GenerationStream, receive=None) -> GenerationResult:
    """Consume an admitted request to its result, aborting it if the client hangs up.

    Args:
        gen: from ``start``.
        receive: the ASGI ``receive`` callable of the HTTP request whose body has been read
            (Litestar: ``request.receive``); its next message is ``http.disconnect`` when the
            client leaves. ``None`` = do not watch.

    Raises:
        ClientDisconnected: the client left; the engine request was aborted (blocks freed).
        and the errors of iterating ``gen`` (timeout, engine failure).
    """
    async def consume() -> GenerationResult:
        result = None
        async for item in gen:
            result = item
        if not isinstance(result, GenerationResult):
            raise GenerationFailed(f"request {gen.request_id} ended without a result")
        return result

    if receive is None:
        return await consume()
    work = asyncio.ensure_future(consume())
    watch = asyncio.ensure_future(_until_disconnect(receive))
    try:
        await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not work.done():
            work.cancel()  # unwinds the engine stream, whose exit aborts the request
        watch.cancel()
    if work.cancelled() or not work.done():
        await asyncio.gather(work, return_exceptions=True)
        raise ClientDisconnected(f"client closed the connection; request {gen.request_id} aborted")
    return work.result()

