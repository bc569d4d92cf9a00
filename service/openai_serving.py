"""One skeleton for the OpenAI endpoints: wire request → generation jobs → response body or events.

Every OpenAI route (``/v1/chat/completions``, ``/v1/completions``, ``/v1/responses``) is an
``Endpoint`` adapter with three parts that differ, and ``serve`` runs the part that does not:

1. ``prepare``: check the wire request and turn it into an ``OpenAIJob`` (the prompts, one
   ``SamplingParams`` per run, the ``Constraint`` and the field that holds it), inside the
   endpoint's field names (``named_as``) so that every error names the field as sent;
2. ``serve``: log the caller's labels, admit every run before any starts (``start_all``: a
   refusal is a status code, not a broken stream), collect the relaxed keywords for the
   ``X-Stencil-Warnings`` header;
3. ``events`` (``"stream": true``) or ``body``: the endpoint's own answer from the streams, or
   from the finished results (``run_all``: a client that hangs up aborts them all).

The shape follows vLLM's ``OpenAIServing`` (one base, one subclass per endpoint); the sampling
parameters of every endpoint come from ``sampling_params``, and the prompt of a chat-shaped
request (messages and tools) from ``chat_prompt``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Protocol

from litestar import Request, Response
from litestar.background_tasks import BackgroundTask
from litestar.response import Stream

from stencil.engine.request import ReasoningParams, SamplingParams
from stencil.schemas.openai import ChatMessage, FunctionDefinition
from stencil.service import generation as gen
from stencil.service import inputs
from stencil.service.errors import InputError, named_as
from stencil.service.openai_common import (SSE_HEADERS, Constraint, openai_temperature, relaxed, run_all, start_all,
                                   warnings_header)
from stencil.service.state import ServiceState
from stencil.service.tools import (
    ToolPlan, plan_tools, template_messages, template_renders_calls, template_supports_tools,
)

log = logging.getLogger("stencil.openai")


@dataclass(slots=True, kw_only=True)
class OpenAIJob:
    """A checked request, ready to run (an endpoint's job type may add its own fields).

    Attributes:
        rid: the response's id; a run's engine request id is ``rid`` (one run) or ``{rid}-{k}``.
        model: the model id the answer names.
        constraint: what every run's answer must be.
        format_field: the request field that holds the constraint, for the errors of compiling it.
        runs: ``(prompt token ids, sampling parameters)`` of each run, in the answer's order.
        created: Unix time (s) at which the job was prepared.
        notes: warnings of the request itself (a ``reasoning_effort`` the model cannot take),
            sent with the relaxed keywords.
    """

    rid: str
    model: str
    constraint: Constraint
    format_field: str
    runs: list[tuple[list[int], SamplingParams]]
    created: float = 0.0
    notes: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.created:
            self.created = time.time()


class Endpoint(Protocol):
    """An OpenAI route's adapter (see the module docstring)."""

    def names(self, data: Any) -> dict[str, str]:
        """The request's names of the generation core's fields (``named_as``)."""

    async def prepare(self, service: ServiceState, data: Any) -> OpenAIJob:
        """Check ``data`` and build its job. Raises the errors of ``stencil.service.generation``."""

    def events(self, service: ServiceState, job: OpenAIJob, streams: list[gen.GenerationStream],
               warnings: list[str]) -> AsyncIterator[bytes]:
        """The server-sent events of a streamed answer (errors after the first byte in-band)."""

    def body(self, service: ServiceState, job: OpenAIJob, results: list[gen.GenerationResult],
             warnings: list[str]) -> Any:
        """The whole answer (a msgspec Struct)."""


def log_labels(rid: str, data: Any) -> None:
    """``user`` / ``safety_identifier`` / ``metadata`` / ``prompt_cache_key`` are the caller's
    labels: logged with the id."""
    labels = {k: getattr(data, k, None) for k in ("user", "safety_identifier", "metadata", "prompt_cache_key")}
    labels = {k: v for k, v in labels.items() if v is not None}
    if labels:
        log.info("request labels", extra={"request_id": rid, **labels})


async def serve(endpoint: Endpoint, data: Any, service: ServiceState, request: Request) -> Response | Stream:
    """Answer ``data`` (a decoded wire request with a ``stream`` field) through ``endpoint``.

    Raises (before any byte is sent; answered in OpenAI's error shape): the errors of
    ``endpoint.prepare`` and of admission (``start_all``: 400 naming the field, 429, 503).
    """
    with named_as(endpoint.names(data)):
        job = await endpoint.prepare(service, data)
        log_labels(job.rid, data)
        streams = await start_all(service, job.runs, job.constraint.spec, job.rid, job.format_field,
                                  receive=request.receive)
    warnings = job.notes + relaxed(job.constraint, streams[0])
    headers = warnings_header(warnings)
    if data.stream:
        return Stream(endpoint.events(service, job, streams, warnings), media_type="text/event-stream",
                      headers={**SSE_HEADERS, **headers}, background=BackgroundTask(gen.close_streams, streams))
    results = await run_all(streams, job.rid, request.receive)
    return Response(endpoint.body(service, job, results, warnings), headers=headers)


def sampling_params(service: ServiceState, data: Any, *, max_tokens: int | None, seed: int | None,
                    logprobs: bool, top_logprobs: int, logit_bias: dict[int, float] | None = None,
                    reasoning: ReasoningParams | None = None) -> SamplingParams:
    """``SamplingParams`` of one run from an OpenAI request's fields named as ``SamplingParams``
    names them (``top_p``, ``top_k``, ``stop``, the penalties, ``close_on_budget``,
    ``soft_limits``: ``stencil.service.inputs.sampling_fields``; one the request lacks takes its
    neutral value), OpenAI's ``temperature`` and the ones each endpoint names its own way;
    ``reasoning``: the region before the answer (``stencil.service.reasoning.ReasoningPlan.params``).

    Raises:
        stencil.service.errors.InputError: a value out of range (``stencil.service.inputs.sampling_params``).
    """
    fields = {**inputs.sampling_fields(data), "max_tokens": max_tokens, "seed": seed, "logprobs": logprobs,
              "temperature": openai_temperature(data.temperature), "top_logprobs": top_logprobs,
              "logit_bias": logit_bias, "reasoning": reasoning}
    return inputs.sampling_params(service.config, **fields)


async def chat_prompt(service: ServiceState, messages: list[ChatMessage], functions: list[FunctionDefinition],
                      choice: Any, named: str | None, parallel: bool | None,
                      max_calls: int | None = None,
                      template_kwargs: dict[str, Any] | None = None) -> tuple[ToolPlan, list[int]]:
    """The tool plan and the prompt token ids of a chat-shaped request (messages and tools).

    The tools go to the chat template natively when it takes them, else into a system message
    (``stencil.service.tools.template_messages``); content stays data (``stencil.service.inputs.tokenize``).
    ``template_kwargs``: the template's extra keywords (``chat_template_kwargs``, the reasoning
    switch: ``stencil.service.reasoning``).

    Raises:
        stencil.service.tools.ToolError: tools and ``tool_choice`` that do not fit (``plan_tools``).
        stencil.service.errors.InputError: no messages (with tools too: OpenAI answers 400), the prompt over
            the limits.
    """
    if not messages:  # before the tools' system message could make it look like a conversation
        raise InputError("messages is empty", field="messages", lead=True)
    fmt = service.tool_format  # the family's call syntax (stencil.service.tool_formats)
    plan = plan_tools(functions, choice, named, parallel, max_calls, syntax=fmt.syntax)
    template = getattr(service.engine.tokenizer, "chat_template", None)
    native = template_supports_tools(template)
    templated, tools_arg = template_messages(messages, plan, native, fmt,
                                             native_calls=native or template_renders_calls(template))
    return plan, await inputs.tokenize(service, messages=templated, tools=tools_arg, template_kwargs=template_kwargs)
