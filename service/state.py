"""Service configuration and the typed state every handler receives by dependency injection."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from stencil.engine.config import ConfigError
from stencil.service.engine_client import EngineClient
from stencil.service.metrics import Metrics
from stencil.service.reasoning_formats import ReasoningFormat, check_name
from stencil.service import tool_formats
from stencil.service.tool_formats import ToolFormat
from stencil.service.validation import OutputChecker, SchemaChecks


@dataclass(slots=True)
class ServiceConfig:
    """Limits and options of the HTTP service (the engine has its own ``EngineConfig``).

    Attributes:
        api_key: when set, every route but ``/health`` needs ``Authorization: Bearer <key>``
            (or ``X-API-Key``); ``None`` reads ``STENCIL_API_KEY`` (empty = no key).
        model_name: id reported by ``/v1/models`` and in responses; ``None`` = the model
            directory's name.
        max_body_bytes: largest request body (bytes); larger → 413.
        max_prompt_chars: longest ``prompt`` or sum of message contents (characters).
        max_messages: most chat messages in one request.
        max_schema_bytes: largest ``response_schema`` as compact JSON (bytes).
        max_schema_depth: deepest nesting of objects/arrays in a schema.
        max_regex_chars: longest ``regex``.
        max_grammar_chars: longest Lark ``grammar``.
        max_choices / max_choice_chars: most ``choice`` entries / longest entry.
        max_stop: most stop strings; max_stop_chars: longest one.
        max_tokens_cap: largest ``max_tokens`` a request may ask for.
        default_max_tokens: ``max_tokens`` when a request gives none.
        request_timeout_s: deadline of one request from arrival (seconds); past it → 504.
        max_queue_wait_s: longest wait for a running slot before a 429 with ``Retry-After``
            (seconds); ``None``: half of ``request_timeout_s``. The deadline counts from arrival,
            so a request that queued for all of it would be admitted only to end in a 504 after
            its work began; the other half is left to generate (a request's own
            ``queue_timeout`` may be shorter, never longer than ``request_timeout_s``).
        shutdown_grace_s: how long in-flight requests may run after SIGTERM (seconds).
        retry_after_s: ``Retry-After`` sent with 429 (seconds).
        json_whitespace: the layout JSON Schema answers may take when a request does not say:
            "flexible" (a line break and an indent, or a space, around structural characters:
            the pretty-printed JSON models write; docs/api.md, "Behaviour") or "compact".
        additional_properties: where a JSON Schema object declares properties and says nothing
            of ``additionalProperties``, when a request does not say: "closed" (no other key,
            OpenAI's strict semantics) or "schema" (any other key, as JSON Schema says).
        chat_template: a Jinja chat template used instead of the model's own (vLLM's
            ``--chat-template``): for a model whose file carries none or a wrong one. ``None``: the
            model's. Checked by ``validate`` (a syntax error names its line); installed on the
            engine's tokenizer when the app starts, so every route renders with it.
        reasoning_format: how the model marks its reasoning (``stencil.service.reasoning_formats``):
            "auto" (``None`` too: detected from the chat template), "none" (never split out
            reasoning), or a format's name (``qwen3``, ``deepseek_r1``, ...). An unknown name
            is refused by ``validate``, listing the known ones.
        reasoning_budget: most reasoning tokens of any request (``None``: no cap but
            ``max_tokens``); ``reasoning_effort`` caps it further per request.
        tool_call_format: the syntax the model writes tool calls in
            (``stencil.service.tool_formats``): "auto" (``None`` too: detected from the served
            chat template; Hermes for a template that shows none) or a format's name
            (``hermes``, ``mistral``, ...). An unknown name is refused by ``validate``, listing
            the known ones.
    """

    api_key: str | None = None
    model_name: str | None = None
    max_body_bytes: int = 1 << 20
    max_prompt_chars: int = 200_000
    max_messages: int = 256
    max_schema_bytes: int = 64 << 10
    max_schema_depth: int = 32
    max_regex_chars: int = 4096
    max_grammar_chars: int = 64 << 10
    max_choices: int = 256
    max_choice_chars: int = 1024
    max_stop: int = 8
    max_stop_chars: int = 256
    max_tokens_cap: int = 4096
    default_max_tokens: int = 256
    request_timeout_s: float = 300.0
    max_queue_wait_s: float | None = None
    shutdown_grace_s: float = 30.0
    retry_after_s: int = 1
    json_whitespace: str = "flexible"
    additional_properties: str = "closed"
    chat_template: str | None = None
    reasoning_format: str | None = "auto"
    reasoning_budget: int | None = None
    tool_call_format: str | None = "auto"

    def validate(self) -> "ServiceConfig":
        """Resolve the API key from the environment and check ranges; return self.

        Raises:
            stencil.engine.config.ConfigError: naming the offending field.
        """
        if self.api_key is None:
            self.api_key = os.environ.get("STENCIL_API_KEY") or None
        for name in ("max_body_bytes", "max_prompt_chars", "max_messages", "max_schema_bytes",
                     "max_schema_depth", "max_regex_chars", "max_grammar_chars", "max_choices", "max_choice_chars",
                     "max_stop_chars", "max_tokens_cap", "default_max_tokens", "retry_after_s"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.max_stop < 0:
            raise ConfigError(f"max_stop must be >= 0, got {self.max_stop}")
        if self.default_max_tokens > self.max_tokens_cap:
            raise ConfigError(f"default_max_tokens ({self.default_max_tokens}) exceeds max_tokens_cap "
                              f"({self.max_tokens_cap})")
        if self.json_whitespace not in ("compact", "flexible"):
            raise ConfigError(f"json_whitespace must be compact or flexible, got {self.json_whitespace!r}")
        if self.additional_properties not in ("closed", "schema"):
            raise ConfigError(f"additional_properties must be closed or schema, got {self.additional_properties!r}")
        if self.request_timeout_s <= 0 or self.shutdown_grace_s < 0:
            raise ConfigError("request_timeout_s must be > 0 and shutdown_grace_s >= 0")
        if self.max_queue_wait_s is not None and not 0 < self.max_queue_wait_s <= self.request_timeout_s:
            raise ConfigError(f"max_queue_wait_s must be in (0, request_timeout_s], got {self.max_queue_wait_s}")
        check_name(self.reasoning_format)
        tool_formats.check_name(self.tool_call_format)
        if self.reasoning_budget is not None and self.reasoning_budget < 0:
            raise ConfigError(f"reasoning_budget must be >= 0, got {self.reasoning_budget}")
        if self.chat_template is not None:
            from jinja2 import TemplateSyntaxError
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            try:  # transformers renders templates in this sandbox too
                ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True).parse(self.chat_template)
            except TemplateSyntaxError as e:
                raise ConfigError(f"chat_template does not parse: line {e.lineno}: {e.message}") from None
        return self

    @property
    def queue_wait_s(self) -> float:
        """Seconds a request may wait for a running slot when it does not say (see the fields)."""
        return self.request_timeout_s / 2 if self.max_queue_wait_s is None else self.max_queue_wait_s


@dataclass(slots=True)
class ServiceState:
    """What a handler needs, injected as ``service: ServiceState``.

    Attributes:
        engine: the running engine (owned by the app's lifespan), used only through
            ``stencil.service.engine_client.EngineClient``: an ``AsyncEngine``, or on the Ray Serve
            ingress a ``stencil.service.cluster.cluster_engine.ClusterEngine`` (its requests go to replicas).
        config: the service's limits.
        metrics: this app's Prometheus registry and series.
        checker: cached output validators.
        model_name: the served model's id.
        schemas: request schemas already checked against their meta-schema.
        draining: set on shutdown; new generation requests get 503.
        inflight: generation requests now being served.
        reasoning: the served model's reasoning format (``ServiceConfig.reasoning_format``
            resolved against its chat template when the app starts), or ``None``.
        tool_format: the served model's tool-call format (``ServiceConfig.tool_call_format``
            resolved likewise).
    """

    engine: EngineClient
    config: ServiceConfig
    metrics: Metrics
    checker: OutputChecker
    model_name: str
    schemas: SchemaChecks = field(default_factory=SchemaChecks)
    draining: bool = False
    inflight: int = field(default=0)
    reasoning: ReasoningFormat | None = None
    tool_format: ToolFormat = tool_formats.HERMES_FORMAT


class StateHolder:
    """Where an app's lifespan puts its ``ServiceState`` once the engine is up (one per app, in
    ``app.state[STATE_KEY]``; not global)."""

    __slots__ = ("state",)

    def __init__(self) -> None:
        self.state: ServiceState | None = None


STATE_KEY = "stencil"


def service_state(app) -> ServiceState | None:
    """The running Litestar app's ``ServiceState`` (``None`` before startup); for the routes
    outside ``stencil.service.app``, the CLI, the server runner and tests."""
    return app.state[STATE_KEY].state
