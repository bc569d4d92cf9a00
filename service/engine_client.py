"""The service's one door to an engine: ``EngineClient``, and the ``RequestStream`` it hands back.

The HTTP layer (``stencil.service.app``, ``stencil.service.generation``, the OpenAI routes, ``stencil.service.metrics``,
``stencil.service.server``) uses an engine only through these members, and a request only through its
``RequestStream``: no route probes an engine for what it may have. A request goes in whole — prompt token
ids, ``SamplingParams``, ``GrammarSpec`` — through ``EngineClient.submit``; how the engine admits it and
compiles its grammar stays behind the door:

* ``stencil.engine.async_engine.AsyncEngine``: the engine in this process, its loop on a thread of its own.
  ``submit`` checks the request (``LLMEngine.check_request``: the 429 is decided there, once), starts the
  grammar compile and queues the request at once, so the engine reads all but the prompt's last token while
  the grammar compiles ("compile behind prefill"); ``admit`` waits for the compile and the budget check
  (``LLMEngine.check_budget``).
* ``stencil.service.cluster.cluster_engine.ClusterEngine``: the Ray Serve ingress's client of the engine
  replicas, which check the request and compile its grammar themselves; ``admit`` waits for a replica's
  ``Admitted`` or ``Refusal``.

Either way every refusal a request can meet before its first token is raised by ``submit`` or ``admit``, so a
streaming handler still answers it with a status code. A third engine implements these two protocols and
nothing else (``tests/service/test_engine_door.py`` serves ``/generate`` and ``/v1/chat/completions``
through one written from this module alone).

Both protocols are structural (``typing.Protocol``): no engine imports this module, so ``engine/`` keeps
importing nothing of ``service/``. Compare vLLM's ``EngineClient``.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any, Protocol, runtime_checkable

from stencil.engine.outputs import RequestOutput
from stencil.engine.request import SamplingParams
from stencil.grammar.base import GrammarSpec


@runtime_checkable
class RequestStream(Protocol):
    """One submitted request: its admission, then its ``RequestOutput`` s (the last one ``finished``).

    Attributes:
        request_id: the id given to ``submit``.
        started: set once the engine first schedules the request (or it ended, or failed); an engine
            without a queue of its own to wait in (a cluster's replicas queue themselves) sets it at
            admission. The service waits on it, at most the queue wait, before it sends any byte.
        grammar: the compiled grammar (``stencil.grammar.compiled.CompiledGrammar``), once admitted, for
            replaying a Lark answer's tokens through a fresh matcher; None when unconstrained or when the
            grammar was compiled elsewhere (a replica).
        warnings: the compiled grammar's notes (keywords relaxed, bounds applied), once admitted.
        grammar_ms: milliseconds the request waited for its grammar and budget check (0 without one),
            once admitted.
    """

    request_id: str
    started: asyncio.Event
    grammar: Any
    warnings: list[str]
    grammar_ms: float

    @property
    def replica(self) -> str | None:
        """The replica serving the request (``X-Stencil-Replica``); None for an engine in this process."""

    async def admit(self) -> None:
        """Wait until the engine has accepted the request: its grammar compiled and ``max_tokens`` checked
        against it. Iterating admits first when this was not awaited. On a refusal the request is
        closed (its KV blocks freed) before the error is raised.

        Raises:
            stencil.grammar.base.GrammarError (400): the constraint cannot be compiled exactly.
            stencil.engine.llm_engine.EngineError (400): e.g. ``max_tokens`` below the grammar's
                shortest answer; ``EngineOverloaded`` (429): every replica's queue is full.
            stencil.service.errors.Unavailable (503): no replica admitted it.
        """

    def __aiter__(self) -> AsyncIterator[RequestOutput]: ...

    async def __anext__(self) -> RequestOutput:
        """The request's next output. A failure after admission is an output with ``finish_reason``
        "error" (or "abort" at shutdown), or an exception (``EngineDeadError``, ``Unavailable``)."""

    async def aclose(self) -> None:
        """Give the request up: abort it in the engine unless it finished (idempotent)."""


@runtime_checkable
class EngineClient(Protocol):
    """What the service needs of an engine (see the module docstring).

    Attributes:
        tokenizer: the model's Hugging Face tokenizer (chat template, encode, decode).
        error: why the engine loop died, else None.
        on_dead: called with the exception when the engine loop dies (set by ``create_app``).
    """

    tokenizer: Any
    error: BaseException | None
    on_dead: Any

    # -- lifecycle ---------------------------------------------------------------------------------
    def start(self) -> "EngineClient":
        """Start serving (the engine loop, or the replicas' stats poller)."""

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop; in-flight requests end with ``"abort"`` (never raises on the second call)."""

    @property
    def is_alive(self) -> bool:
        """Whether requests can be served."""

    # -- the model ---------------------------------------------------------------------------------
    @property
    def vocab(self) -> Any:
        """``stencil.grammar.vocab.TokenVocabulary`` (token id → bytes, for exact logprob bytes), or None
        when the tokenizer has no usable vocabulary."""

    @property
    def vocab_size(self) -> int:
        """Rows of the model's logits (token ids are below it; may exceed the tokenizer's)."""

    @property
    def model_path(self) -> str:
        """The configured model (a directory, a .gguf file or a hub id), as given."""

    # -- requests ----------------------------------------------------------------------------------
    def submit(self, prompt_token_ids: list[int], params: SamplingParams, spec: GrammarSpec | None = None, *,
               request_id: str, grammar_backend: str | None = None, client: str | None = None) -> RequestStream:
        """Hand a request to the engine (call on the event loop that will read its stream).

        Args:
            prompt_token_ids: the tokenized prompt.
            params: its sampling parameters (the engine may run it with ``max_tokens`` lowered to the
                context's room; its last output's ``context_room`` says so).
            spec: its constraint, None for free text.
            request_id: unique among live requests.
            grammar_backend: "auto", "eager" or "lazy" for this request (None: the engine's policy).
            client: who asks (``stencil.service.generation.client_id``), for a fair share of the
                grammar compiler's workers.

        Raises:
            stencil.engine.llm_engine.EngineError (400, naming the field) / ``EngineOverloaded`` (429):
                refused at once; later refusals come from ``RequestStream.admit``.
            stencil.engine.async_engine.EngineDeadError: the engine loop died.
        """

    def abort_all(self) -> int:
        """Abort every request still running here (each ends with ``"abort"``); return how many. Thread-safe:
        the server calls it when a stop signal's grace period runs out."""

    # -- observation -------------------------------------------------------------------------------
    def stats(self) -> dict:
        """``LLMEngine.stats()`` (on a cluster: summed over the replicas, plus ``retries`` and ``replays``)."""

    @property
    def kernels(self) -> dict[str, str]:
        """Which kernel serves each role (attention, linear layers), for ``/health``."""

    @property
    def grammar_stats(self) -> Any:
        """The grammar compiler's counters (``stencil.grammar.base.CompileStats``), or None where grammars
        are compiled elsewhere (a cluster's replicas)."""

    def replica_health(self) -> list[dict] | None:
        """Each replica's last report (``EngineReplica.stats()``, or ``{"status": "unreachable"}``), for
        ``/health`` and ``/metrics``; None for an engine without replicas (the local one)."""
