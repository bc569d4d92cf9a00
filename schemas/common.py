"""Wire types shared by every endpoint: usage counters, timings, problem details.

These msgspec Structs are both what the service encodes and what Litestar publishes in the
OpenAPI schema, so a field added here shows up in ``/schema/openapi.json`` at once.
"""

from __future__ import annotations

import msgspec


class Usage(msgspec.Struct, kw_only=True):
    """Token counts of one request (all in tokens).

    Attributes:
        prompt_tokens: tokens of the rendered, tokenized prompt.
        completion_tokens: output tokens (sampled, forced by the grammar, accepted drafts).
        total_tokens: ``prompt_tokens + completion_tokens``.
        cached_tokens: prompt tokens whose K/V came from the prefix cache.
        draft_tokens: speculative (n-gram) tokens proposed for verification.
        accepted_tokens: proposed draft tokens the model accepted.
        forced_tokens: tokens the grammar allowed alone, appended without sampling.
        reasoning_tokens: of ``completion_tokens``, those of the reasoning (its markers
            included); 0 without reasoning.
    """

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    cached_tokens: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    forced_tokens: int = 0
    reasoning_tokens: int = 0


class Timings(msgspec.Struct, kw_only=True):
    """Latencies of one request in milliseconds, measured in the service.

    Attributes:
        ttft_ms: from the request's arrival in the service (grammar compile included) to its
            first output token; ``None`` when no token was produced.
        total_ms: from arrival to the final output.
        grammar_ms: time spent waiting for the grammar (0 on a cache hit or without a grammar).
    """

    ttft_ms: float | None
    total_ms: float
    grammar_ms: float = 0.0


class Problem(msgspec.Struct, kw_only=True, omit_defaults=True):
    """An error body in the shape of RFC 9457 "Problem Details for HTTP APIs".

    Attributes:
        type: a URI naming the kind of problem (``about:blank`` when only the status matters).
        title: the short, constant description of the kind of problem.
        status: the HTTP status code.
        detail: what went wrong with this request, in words.
        request_id: the id under which the service logged the request.
        field: the request body field at fault (``"response_schema"``, ``"max_tokens"``).
        keyword: the JSON Schema keyword at fault.
        path: JSON pointer into the offending schema (``"#/properties/age"``).
        position: character offset in an offending regex.
        line / column: 1-based place of the fault in an offending Lark grammar.
        errors: individual messages when several things are wrong.
    """

    title: str
    status: int
    detail: str
    type: str = "about:blank"
    request_id: str | None = None
    field: str | None = None
    keyword: str | None = None
    path: str | None = None
    position: int | None = None
    line: int | None = None
    column: int | None = None
    errors: list[str] | None = None
