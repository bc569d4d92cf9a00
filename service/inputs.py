"""Input processing: what a request asks for, checked against the service's limits, in the
engine's terms: the prompt's token ids, its ``SamplingParams`` and its ``GrammarSpec``.

Every endpoint (``POST /generate``, the OpenAI-compatible routes, ``stencil generate``) turns its
wire fields into these three with the functions below, then runs them through
``stencil.service.generation``; so a limit, and the field an error names, are the same everywhere.

1. ``tokenize(state, prompt=..., messages=...)`` → prompt token ids (chat template applied to
   ``messages`` with ``add_generation_prompt=True``; content kept as data: ``stencil.service.prompts``).
2. ``sampling_params(state.config, **sampling_fields(body))`` → ``SamplingParams`` (the service's
   caps here; every value's range in ``SamplingParams.verify``, once).
3. ``grammar_spec(state.config, response_schema=..., regex=..., choice=...)`` → ``GrammarSpec``
   or ``None`` (``checked_grammar_spec`` on the event loop).

Errors: ``stencil.service.errors.InputError`` (HTTP 400) naming the offending field.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from stencil.engine.request import EngineError, SamplingParams
from stencil.engine.speculative.spec_config import SpecConfigError
from stencil.grammar.base import GrammarSpec
from stencil.grammar.budget import SoftLimits, SoftLimitsError
from stencil.service.errors import InputError
from stencil.service.prompts import encode_prompt, message_text
from stencil.service.state import ServiceConfig, ServiceState
from stencil.service.validation import SchemaChecks, check_schema

# Tokenizing a few kB takes well under a millisecond; beyond this many characters it moves to a
# worker thread so one huge prompt cannot stall every other request's stream.
_THREAD_TOKENIZE_CHARS = 16_384


# -- prompts ---------------------------------------------------------------------------------------

async def tokenize(state: ServiceState, prompt: str | None = None, messages: list[dict] | None = None,
                   tools: list[dict] | None = None, *, parse_special_tokens: bool = False,
                   template_kwargs: dict[str, Any] | None = None) -> list[int]:
    """``encode_prompt`` with the service's size limits, off the event loop for long inputs.

    Content is data: no text of a message, tool or prompt becomes a control token
    (``stencil.service.prompts``), unless ``parse_special_tokens`` asks for it in a plain prompt.
    ``template_kwargs``: the chat template's extra keywords (``chat_template_kwargs``).

    Raises:
        InputError: over ``max_prompt_chars`` or ``max_messages``; see ``encode_prompt``.
    """
    cfg = state.config
    if messages is not None:
        if len(messages) > cfg.max_messages:
            raise InputError(f"{len(messages)} messages; the limit is {cfg.max_messages}", field="messages")
        size = sum(len(message_text(m.get("content"), i)) for i, m in enumerate(messages))
    else:
        size = len(prompt or "")
    if size > cfg.max_prompt_chars:
        field = "messages" if messages is not None else "prompt"
        raise InputError(f"{field} has {size} characters; the limit is {cfg.max_prompt_chars}", field=field,
                         lead=True)
    tok = state.engine.tokenizer
    # A chat template is Jinja (pure Python, its cost grows with the messages and tools):
    # always off the loop. A short plain prompt tokenizes in microseconds (Rust): inline.
    if messages is not None or size > _THREAD_TOKENIZE_CHARS:
        return await asyncio.to_thread(encode_prompt, tok, prompt, messages, tools,
                                       parse_special_tokens=parse_special_tokens, template_kwargs=template_kwargs)
    return encode_prompt(tok, prompt, messages, tools, parse_special_tokens=parse_special_tokens)


# -- parameters ------------------------------------------------------------------------------------

def sampling_params(cfg: ServiceConfig, *, max_tokens: int | None = None, temperature: float = 0.0,
                    stop: str | list[str] | None = None, soft_limits: dict | bool | None = None,
                    **fields: Any) -> SamplingParams:
    """Build ``SamplingParams`` from request fields under the service's policy.

    The service decides only what is its own: the default and the cap of ``max_tokens``, the
    default ``temperature`` (0: extraction wants the most likely answer), how many stop strings
    and how long, and the wire form of ``soft_limits``. Every other field goes
    to ``SamplingParams`` as given, whose ``verify`` is the one check of each value's range (a
    new sampling parameter needs no line here).

    Args:
        cfg: the service limits (``max_tokens_cap``, ``default_max_tokens``, stop limits).
        max_tokens: most output tokens; ``None`` = ``cfg.default_max_tokens``.
        temperature: 0 = greedy.
        stop: a stop string or a list of them (not included in the output).
        soft_limits: the run-on guard's bounds (``stencil.grammar.budget.SoftLimits`` fields), or
            ``False`` to turn it off; ``None``/``True``: the defaults.
        fields: any other ``SamplingParams`` field by name (``top_p``, ``top_k``, ``seed``,
            ``logprobs``, ``top_logprobs``, ``logit_bias``, the penalties, ``speculative``,
            ``close_on_budget``, ...); see ``sampling_fields`` for a wire request's.

    Raises:
        InputError: naming the field that is out of range (``logit_bias`` token ids are checked
            against the model's vocabulary at admission: ``LLMEngine.check_request``).
    """
    if max_tokens is None:
        max_tokens = cfg.default_max_tokens
    if max_tokens > cfg.max_tokens_cap:
        raise InputError(f"max_tokens is {max_tokens}; this server allows at most {cfg.max_tokens_cap}",
                         field="max_tokens", lead=True)
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if len(stops) > cfg.max_stop:
        raise InputError(f"{len(stops)} stop strings; the limit is {cfg.max_stop}", field="stop")
    for s in stops:
        if not s or len(s) > cfg.max_stop_chars:
            raise InputError(f"each stop string must have 1..{cfg.max_stop_chars} characters", field="stop")
    try:
        limits = SoftLimits.from_dict(soft_limits) if isinstance(soft_limits, dict) else \
            None if soft_limits is True else soft_limits
        return SamplingParams(max_tokens=max_tokens, temperature=temperature, stop=stops, soft_limits=limits,
                              **fields)
    except (EngineError, SpecConfigError, SoftLimitsError) as e:
        raise InputError(str(e), field=e.field, lead=getattr(e, "lead", False)) from None


def sampling_fields(data: Any) -> dict[str, Any]:
    """The fields of a wire request (a msgspec Struct) that ``SamplingParams`` has by the same
    name and that the request gives (not ``None``): what ``sampling_params`` takes as it is."""
    return {name: value for name in data.__struct_fields__ if name in _SAMPLING_FIELDS
            and (value := getattr(data, name)) is not None}


# ``reasoning`` is the service's to build (``stencil.service.reasoning``), never a wire field's.
_SAMPLING_FIELDS = frozenset(SamplingParams.__dataclass_fields__) - {"context_room", "reasoning"}


def grammar_spec(cfg: ServiceConfig, *, response_schema: Any = None, regex: str | None = None,
                 choice: list[str] | None = None, whitespace: str | None = None,
                 additional_properties: str | None = None,
                 strict: bool = True, grammar: str | None = None,
                 schemas: SchemaChecks | None = None) -> GrammarSpec | None:
    """The constraint a request asks for, checked against the service's limits.

    Args:
        response_schema: a JSON Schema (dict or bool), or ``None``.
        regex: a pattern the whole output must match, or ``None``.
        choice: the output must be exactly one of these strings, or ``None``.
        grammar: a Lark grammar the output must be in, or ``None``.
        whitespace: JSON only: "compact" or "flexible"; ``None``: the server's
            ``json_whitespace``.
        additional_properties: JSON only: "closed" (an object that declares properties and
            says nothing of ``additionalProperties`` takes no other key) or "schema" (it takes
            any, as JSON Schema says); ``None``: the server's ``additional_properties``.
        strict: JSON only: refuse keywords that cannot be enforced (True) or ignore them with a
            warning in the response (False).
        schemas: the app's record of schemas already checked (``None``: check every time).

    Returns:
        ``None`` when no constraint is given.

    Raises:
        InputError: more than one constraint; a schema that is invalid, too large, too deep or
            has a non-local ``$ref`` (see ``stencil.service.validation.check_schema``); a regex or
            choice over the limits.
    """
    given = [n for n, v in (("response_schema", response_schema), ("regex", regex), ("choice", choice),
                            ("grammar", grammar)) if v is not None]
    if len(given) > 1:
        raise InputError(f"give at most one of response_schema, regex, choice and grammar "
                         f"(got {', '.join(given)})", field=given[1])
    if whitespace is None:
        whitespace = cfg.json_whitespace
    if whitespace not in ("compact", "flexible"):
        raise InputError(f"whitespace must be 'compact' or 'flexible', got {whitespace!r}", field="whitespace")
    if additional_properties is None:
        additional_properties = cfg.additional_properties
    if additional_properties not in ("closed", "schema"):
        raise InputError(f"additional_properties must be 'closed' or 'schema', got {additional_properties!r}",
                         field="additional_properties")
    if response_schema is not None:
        check = schemas.check if schemas is not None else check_schema
        check(response_schema, max_bytes=cfg.max_schema_bytes, max_depth=cfg.max_schema_depth)
        return GrammarSpec.json_schema(response_schema, whitespace=whitespace, strict=strict,
                                       additional_properties=additional_properties)
    if regex is not None:
        if not regex:
            raise InputError("regex is empty", field="regex")
        if len(regex) > cfg.max_regex_chars:
            raise InputError(f"regex has {len(regex)} characters; the limit is {cfg.max_regex_chars}",
                             field="regex")
        return GrammarSpec("regex", regex)
    if choice is not None:
        if not choice:
            raise InputError("choice is empty: give at least one string", field="choice")
        if len(choice) > cfg.max_choices:
            raise InputError(f"{len(choice)} choices; the limit is {cfg.max_choices}", field="choice")
        if any(not isinstance(c, str) or len(c) > cfg.max_choice_chars for c in choice):
            raise InputError(f"each choice must be a string of at most {cfg.max_choice_chars} characters",
                             field="choice")
        return GrammarSpec("choice", json.dumps(list(choice), ensure_ascii=False))
    if grammar is not None:
        if not grammar.strip():
            raise InputError("grammar is empty: it needs a start rule", field="grammar")
        if len(grammar) > cfg.max_grammar_chars:
            raise InputError(f"grammar has {len(grammar)} characters; the limit is {cfg.max_grammar_chars}",
                             field="grammar")
        return GrammarSpec.grammar(grammar)
    return None


async def checked_grammar_spec(state: ServiceState, **fields) -> GrammarSpec | None:
    """``grammar_spec`` for a handler on the event loop: a schema seen before is checked from
    the app's record (µs); a new one is checked in a worker thread, since jsonschema takes up
    to hundreds of ms over a large schema and the loop must keep serving every other client.

    Args:
        fields: the keyword arguments of ``grammar_spec``.
    """
    cfg = state.config
    schema = fields.get("response_schema")
    if schema is not None and not state.schemas.known(schema, max_bytes=cfg.max_schema_bytes,
                                                      max_depth=cfg.max_schema_depth):
        return await asyncio.to_thread(grammar_spec, cfg, schemas=state.schemas, **fields)
    return grammar_spec(cfg, schemas=state.schemas, **fields)


async def check_schema_off_loop(state: ServiceState, schema: Any) -> None:
    """``check_schema`` under the service's limits, as ``checked_grammar_spec`` does it."""
    cfg = state.config
    kw = dict(max_bytes=cfg.max_schema_bytes, max_depth=cfg.max_schema_depth)
    if state.schemas.known(schema, **kw):
        return
    await asyncio.to_thread(state.schemas.check, schema, **kw)


__all__ = ["check_schema_off_loop", "checked_grammar_spec", "grammar_spec", "sampling_fields", "sampling_params",
           "tokenize"]
