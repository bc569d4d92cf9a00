"""What the ingress and the engine replicas send each other (pickled by Ray; no Ray imports here).

The ingress sends one ``ReplicaRequest`` per generation. The replica's stream answers with one
``Admitted`` (or one ``Refusal``, then nothing), then ``stencil.engine.outputs.RequestOutput`` items
until one is ``finished``; a replica whose engine stops mid-request sends a ``Refusal`` of kind
"unavailable" instead of the rest.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from stencil.engine.async_engine import EngineDeadError
from stencil.engine.llm_engine import EngineError, EngineOverloaded
from stencil.engine.request import SamplingParams
from stencil.grammar.base import GrammarError, GrammarSpec, GrammarTimeout


@dataclass(slots=True)
class ReplicaRequest:
    """One generation, as the ingress hands it to a replica (prompt already tokenized).

    Attributes:
        request_id: unique among live requests; a retry keeps it (the replica's engine knows
            the attempt as ``{request_id}~{attempt}``).
        prompt_token_ids: the tokenized prompt (chat template applied by the ingress).
        params: sampling parameters, validated by the ingress, with the seed always set (the
            ingress derives a missing one as an engine would, ``stencil.engine.sampler.default_seed``),
            so every attempt of a sampled request draws the same tokens.
        grammar: the constraint to compile on the replica, or ``None``.
        block_hashes: the prompt's full-block hashes (``stencil.engine.kv_cache_manager
            .prompt_block_hashes``), the prefix-affinity router's input.
        attempt: 0 for the first try, then 1, 2, ... for retries after a replica failed.
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    grammar: GrammarSpec | None = None
    block_hashes: list[int] = field(default_factory=list)
    attempt: int = 0

    @property
    def prompt(self) -> str:
        """The prompt as one character per token id.

        Ray's ``PrefixCacheAffinityRouter`` (used for comparison in ``stencil bench cluster``)
        matches prefixes of a request's ``prompt`` string character by character; one character
        per token makes its match a token-prefix match.
        """
        return "".join(map(chr, self.prompt_token_ids))


@dataclass(slots=True)
class Admitted:
    """First item of a replica's stream: the request is queued in its engine.

    Attributes:
        replica_id: Ray Serve's id of the replica (``ReplicaID.unique_id``).
        grammar_ms: time the replica spent getting the compiled grammar (0 without one).
        warnings: the compiled grammar's warnings (keywords ignored under ``strict: false``).
    """

    replica_id: str
    grammar_ms: float = 0.0
    warnings: list[str] = field(default_factory=list)


@dataclass(slots=True)
class Refusal:
    """A replica refused (before ``Admitted``) or could not finish (after it) a request.

    Attributes:
        kind: "bad_request" (400: the engine refused the prompt or parameters), "grammar" (400:
            the constraint cannot be compiled exactly), "grammar_timeout" (400), "overloaded"
            (429) or "unavailable" (the engine is dead or stopping: the ingress retries
            elsewhere).
        message: the error's text.
        keyword / path / position: a grammar error's location.
        replica_id: the replica that sent it.
        field: the request field at fault (``EngineError.field``, ``GrammarError.field``), if known.
        lead: the message begins with the field's name (``EngineError.lead``).
    """

    kind: str
    message: str
    keyword: str | None = None
    path: str | None = None
    position: int | None = None
    replica_id: str = ""
    field: str | None = None
    lead: bool = False

    @property
    def retryable(self) -> bool:
        """Another replica may succeed: this one's engine is gone, not the request at fault."""
        return self.kind == "unavailable"

    @classmethod
    def of(cls, exc: BaseException, replica_id: str = "") -> "Refusal":
        """The refusal that stands for ``exc`` (one of the errors an engine raises on admission).

        Raises:
            TypeError: ``exc`` is not one of them (a bug: let it surface).
        """
        if isinstance(exc, GrammarError):
            kind = "grammar_timeout" if isinstance(exc, GrammarTimeout) else "grammar"
            return cls(kind, exc.message, exc.keyword, exc.path, exc.position, replica_id, exc.field)
        if isinstance(exc, EngineOverloaded):
            return cls("overloaded", str(exc), replica_id=replica_id)
        if isinstance(exc, EngineError):
            return cls("bad_request", str(exc), replica_id=replica_id, field=exc.field, lead=exc.lead)
        if isinstance(exc, EngineDeadError):
            return cls("unavailable", str(exc), replica_id=replica_id)
        raise TypeError(f"no refusal for {type(exc).__name__}: {exc}")

    def to_exception(self) -> Exception:
        """The engine-side exception again, for the service's error mapping (``to_problem``)."""
        if self.kind == "grammar":
            return GrammarError(self.message, keyword=self.keyword, path=self.path, position=self.position,
                                field=self.field)
        if self.kind == "grammar_timeout":
            return GrammarTimeout(self.message, keyword=self.keyword, path=self.path, position=self.position,
                                  field=self.field)
        if self.kind == "overloaded":
            return EngineOverloaded(self.message)
        if self.kind == "bad_request":
            return EngineError(self.message, field=self.field, lead=self.lead)
        return EngineDeadError(f"replica {self.replica_id or '?'}: {self.message}")
