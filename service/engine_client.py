"""The service's one door to an engine: ``EngineClient``.

The HTTP layer (``stencil.service.app``, ``stencil.service.generation``, the OpenAI routes, ``stencil.service.metrics``)
uses an engine only through these members. Two classes implement them:

* ``stencil.engine.async_engine.AsyncEngine``: the engine in this process, its loop on a thread of its own;
* ``stencil.service.cluster.cluster_engine.ClusterEngine``: the Ray Serve ingress's client of the engine
  replicas, which admit, compile and check each request themselves (its ``check_request`` and
  ``check_budget`` accept everything: the replica's refusal arrives at admission, before any byte).

The protocol is structural (``typing.Protocol``): neither class imports this module, so
``engine/`` keeps importing nothing of ``service/``. Compare vLLM's ``EngineClient``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, Protocol, runtime_checkable

from stencil.engine.outputs import RequestOutput
from stencil.engine.request import SamplingParams
from stencil.grammar.base import GrammarSpec


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

    # -- admission and requests --------------------------------------------------------------------
    def check_request(self, prompt_token_ids: list[int], params: SamplingParams, *, admission: bool = True) -> None:
        """Refuse a request that cannot run (``stencil.engine.llm_engine.EngineError``, naming the field;
        ``EngineOverloaded`` with ``admission`` when the waiting queue is full)."""

    def check_budget(self, grammar: Any, params: SamplingParams) -> None:
        """Refuse a ``max_tokens`` below the grammar's shortest answer (``EngineError``)."""

    async def compile_grammar(self, spec: GrammarSpec, backend: str | None = None, client: str | None = None) -> Any:
        """The compiled grammar of ``spec`` (``stencil.grammar.base.GrammarError`` when it cannot be)."""

    def generate(self, prompt_token_ids: list[int], params: SamplingParams, grammar: Any = None,
                 request_id: str | None = None, *, admitted: bool = False) -> AsyncIterator[RequestOutput]:
        """A request's outputs until it finishes; closing the iterator aborts it."""

    # -- observation -------------------------------------------------------------------------------
    def stats(self) -> dict:
        """``LLMEngine.stats()`` (on a cluster: summed over the replicas)."""

    @property
    def kernels(self) -> dict[str, str]:
        """Which kernel serves each role (attention, linear layers), for ``/health``."""

    @property
    def grammar_stats(self) -> Any:
        """The grammar compiler's counters (``stencil.grammar.base.CompileStats``), or None where grammars
        are compiled elsewhere (a cluster's replicas)."""
