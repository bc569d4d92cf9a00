"""Wire types of ``POST /generate`` (request, response, stream events).

Unknown fields are refused (``forbid_unknown_fields``): a typo such as ``max_token`` must not be
silently ignored. Ranges that do not depend on the server's configuration are declared here
(they appear in the OpenAPI schema, and a value outside is a 422 like a wrong type); the rest
(``max_tokens`` cap, schema size) are checked by ``stencil.service.inputs`` against ``ServiceConfig``.
A sampling field is passed on by its name (``stencil.service.inputs.sampling_fields``) and its
value's range is checked once, by the engine (``SamplingParams.verify``: a 400 naming it);
``min_p`` declares no range here for that reason.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

from stencil.schemas.common import Problem, Timings, Usage

NonNegInt = Annotated[int, msgspec.Meta(ge=0)]
Seed = Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)]


class Message(msgspec.Struct, forbid_unknown_fields=True):
    """One chat message; the chat template of the model renders the list."""

    role: Literal["system", "user", "assistant"]
    content: str


class GrammarBody(msgspec.Struct, forbid_unknown_fields=True):
    """A context-free grammar constraint.

    Attributes:
        lark: the grammar in Lark syntax (llguidance's dialect).
    """

    lark: str


class GenerateRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Body of ``POST /generate``.

    Give exactly one of ``prompt`` / ``messages``, and at most one of ``response_schema`` /
    ``regex`` / ``choice`` / ``grammar``.

    Attributes:
        prompt: raw text continued by the model (with the model's BOS). Text that spells a
            control token (``<|im_end|>``) is plain text unless ``parse_special_tokens``.
        parse_special_tokens: parse control-token text in ``prompt`` into control tokens (for a
            caller that writes its own chat template); default false. Message content is
            always plain text.
        messages: chat messages, rendered with the model's chat template (assistant turn opened).
        response_schema: a JSON Schema the output must validate against (draft from ``$schema``,
            default 2020-12).
        regex: a regular expression the whole output must match.
        choice: the output is exactly one of these strings.
        grammar: ``{"lark": "..."}``: the output is in the language of this Lark grammar
            (llguidance's dialect: a ``start`` rule, ``/regex/`` and ``"literal"`` lexemes,
            uppercase terminals); a bad grammar gets a 400 naming its line and column.
        grammar_backend: "auto" (server default: a fast lazy matcher at once, an eager index
            once the grammar is reused), "eager" (wait for the index) or "lazy".
        max_tokens: most output tokens (server default when absent; capped by the server).
        temperature: 0 = greedy (the default: extraction wants the most likely answer).
        top_p / top_k: nucleus and top-k filtering (1.0 / 0 = off).
        min_p: keep only tokens at least this fraction as likely as the most likely one the
            constraint allows, in [0, 1] (0 = off; vLLM's and llama.cpp's ``min_p``).
        seed: sampling seed; the same request and seed give the same output.
        stop: strings that end the output early (not included).
        stream: answer with server-sent events.
        strict: refuse schema keywords that cannot be enforced exactly (False: ignore them and
            report a warning).
        whitespace: JSON layout: "flexible" (line breaks and indents, or spaces, between
            the tokens of the JSON, bounded: the pretty-printed JSON models write) or "compact"
            (no free whitespace); absent: the server's ``--json-whitespace`` (flexible).
        additional_properties: where an object of ``response_schema`` declares properties and
            says nothing of ``additionalProperties``: "closed" (no other key, OpenAI's strict
            semantics) or "schema" (JSON Schema's: any other key, with any JSON value nested at
            most 3 containers deep); absent: the server's ``--additional-properties`` (closed).
        speculative: n-gram speculation on/off, or its settings; absent = server default.
        logprobs: return each output token's log-probability.
        close_on_budget: under a constraint, keep the output closable within ``max_tokens`` so it
            ends complete and valid (default); false: cut it at ``max_tokens`` (``"length"``,
            ``output: null``). A ``max_tokens`` below the constraint's shortest output is a 400.
        soft_limits: the run-on guard of JSON outputs: ``{"string_chars": 300, "number_digits":
            40, "array_items": 64}`` (the defaults; raised to what the schema allows); a value past
            a bound may only move toward its end, and a warning says so; false turns it off.
        queue_timeout: most seconds to wait for a running slot (absent: the server's request
            timeout). A request still queued then is answered 429 with ``Retry-After``; nothing
            was generated. Admission is first come, first served.
        chat_template_kwargs: with ``messages``: extra keywords for the chat template (vLLM's:
            ``{"enable_thinking": false}`` turns a Qwen3's thinking off); ``messages``, ``tools``
            and ``add_generation_prompt`` are the server's (400).
        reasoning_effort: with ``messages`` and a reasoning model: none / minimal / low /
            medium / high, a cap on its reasoning tokens (docs/api.md, "Reasoning models").
    """

    prompt: str | None = None
    parse_special_tokens: bool = False
    messages: list[Message] | None = None
    response_schema: dict[str, Any] | bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: "GrammarBody | None" = None
    # stencil.grammar.backends.backend_registry.POLICIES, spelled out for the OpenAPI schema
    # (tests/grammar/test_grammar_backends.py holds the two equal)
    grammar_backend: Literal["auto", "eager", "lazy"] | None = None
    max_tokens: Annotated[int, msgspec.Meta(ge=1)] | None = None
    temperature: Annotated[float, msgspec.Meta(ge=0.0)] = 0.0
    top_p: Annotated[float, msgspec.Meta(gt=0.0, le=1.0)] = 1.0
    top_k: NonNegInt = 0
    min_p: float = 0.0
    seed: Seed | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    strict: bool = True
    whitespace: Literal["compact", "flexible"] | None = None
    additional_properties: Literal["closed", "schema"] | None = None
    speculative: bool | dict[str, Any] | None = None
    logprobs: bool = False
    close_on_budget: bool = True
    soft_limits: dict[str, int] | bool | None = None
    queue_timeout: Annotated[float, msgspec.Meta(gt=0.0)] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high"] | None = None


class GenerateResponse(msgspec.Struct, kw_only=True):
    """Answer of ``POST /generate`` (and the fields of the final stream event).

    Attributes:
        id: request id (also in the ``X-Request-Id`` header and the server log).
        text: the generated text.
        output: the parsed JSON (schema), the chosen string (choice), else null; null when cut
            short before the constraint admits the text.
        valid: the constraint admits the text, whatever stopped it (checked with jsonschema for
            schemas, a full match for regexes).
        finish_reason: what stopped it: "stop" (EOS, stop string, constraint complete) or
            "length" (``max_tokens`` or the model's context).
        truncated_value: valid, but stopped at "length" where the constraint allowed more: the
            last value (a number the budget never steered, an optional part of a regex) may be
            shorter than the model would have written.
        usage: token counts (speculative counters included).
        timings: ttft_ms, total_ms, grammar_ms.
        warnings: why ``valid`` is false; keywords ignored under ``strict: false``.
        logprobs: natural-log probabilities of the output tokens, when asked for.
        closed_by_budget: the output was closed early (budget-aware masks) to fit ``max_tokens``.
        shortened: JSON pointers of the values cut short by that (``["/tags/3", "/note"]``).
        reasoning: a reasoning model's thoughts before the answer (markers excluded), with
            ``messages``; null otherwise. ``text``, ``output`` and ``valid`` are the answer's.
    """

    id: str
    text: str
    output: Any
    valid: bool
    finish_reason: str
    usage: Usage
    timings: Timings
    warnings: list[str]
    logprobs: list[float] | None = None
    closed_by_budget: bool = False
    shortened: list[str] = msgspec.field(default_factory=list)
    truncated_value: bool = False
    reasoning: str | None = None


class StreamDelta(msgspec.Struct, kw_only=True, omit_defaults=True, tag="delta", tag_field="type"):
    """A ``data:`` event with new text (``type: "delta"``); ``reasoning``: new reasoning text
    (a reasoning model's, before the answer's ``text``)."""

    text: str
    logprobs: list[float] | None = None
    reasoning: str | None = None


class StreamFinal(msgspec.Struct, kw_only=True, tag="final", tag_field="type"):
    """The last event before ``data: [DONE]`` (``type: "final"``): everything but the text."""

    id: str
    output: Any
    valid: bool
    finish_reason: str
    usage: Usage
    timings: Timings
    warnings: list[str]
    closed_by_budget: bool = False
    shortened: list[str] = msgspec.field(default_factory=list)
    truncated_value: bool = False


class StreamError(msgspec.Struct, kw_only=True, tag="error", tag_field="type"):
    """Sent instead of ``final`` when the request fails after the stream began (``type: "error"``)."""

    error: Problem


class HealthResponse(msgspec.Struct, kw_only=True):
    """Body of ``GET /health``.

    Attributes:
        status: "ok", "draining" or "dead".
        model: the served model's id.
        inflight: generation requests now being served.
        engine: ``LLMEngine.stats()`` (running, waiting, KV blocks, prefix cache, steps).
        kernels: what computes the model (``LLMEngine.kernels``): attention backend, int4 GEMM
            ("native", "torch" or "none" without int4 weights), KV-cache dtype.
        replicas: on a cluster (``stencil serve --replicas N``), each engine replica's last
            report (``status`` "ok", "dead" or "unreachable", its ``engine`` stats, ``kernels``,
            ``pid``); ``engine`` then sums them. ``None`` for a single engine.
        error: why the engine died, when it did.
    """

    status: Literal["ok", "draining", "dead"]
    model: str
    inflight: int
    engine: dict[str, Any]
    kernels: dict[str, str] = {}
    replicas: list[dict[str, Any]] | None = None
    error: str | None = None
