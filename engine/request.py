"""A generation request as the engine sees it, and its sampling parameters."""

from __future__ import annotations

import enum
import numbers
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from stencil.engine.speculative.spec_config import SpecConfig, SpecConfigError


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    WAITING_FOR_GRAMMAR = "waiting_for_grammar"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH = "finished_length"
    FINISHED_ABORTED = "finished_aborted"
    FINISHED_ERROR = "finished_error"

    @property
    def is_finished(self) -> bool:
        return self in _FINISHED


_FINISHED = {RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH,
             RequestStatus.FINISHED_ABORTED, RequestStatus.FINISHED_ERROR}

FINISH_REASON = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


class EngineError(ValueError):
    """A request the engine cannot take (too long, bad parameters); the message names the field.

    Attributes:
        field: the request field at fault, when one is (``"max_tokens"``), else None.
        lead: the message begins with ``field``'s name ("max_tokens must be >= 1"), so a caller
            whose request calls the field otherwise can say so (``stencil.service.errors.named_as``)
            without reading the message.
    """

    def __init__(self, message: str, field: str | None = None, *, lead: bool = False):
        super().__init__(message)
        self.field = field
        self.lead = lead and field is not None and message.startswith(field)


MAX_TEMPERATURE = 1e6  # far beyond any useful value (logits / 1e6 is uniform), far inside float32
MAX_TOP_LOGPROBS = 20  # OpenAI's limit for chat completions
MAX_LOGIT_BIAS = 1024  # entries per request
BIAS_LIMIT = 100.0  # OpenAI's range for a logit_bias value
MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY = 0.01, 10.0


REASONING_MARGIN = 32  # tokens: ReasoningParams.margin's default


@dataclass(frozen=True, slots=True)
class ReasoningParams:
    """A reasoning region before the answer: the model thinks freely, then writes the answer
    (constrained or not), both within one ``max_tokens`` (``stencil.grammar.reasoning``).

    The output is ``start_ids`` (when the prompt did not open the region), the reasoning, then
    ``end_ids`` and ``after_ids``, then the answer. The engine forces the end marker when the
    tokens left reach what the answer needs (``len(end_ids) + len(after_ids)`` + the answer's
    shortest completion + ``margin``) or when the reasoning reaches ``max_reasoning_tokens``, so a
    structured answer still closes valid within ``max_tokens``.

    Attributes:
        end_text: the end marker's text ("</think>"); the reasoning never contains it.
        end_ids: its token ids (usually one added token); forced when the reasoning is cut.
        start_ids: forced before the reasoning when the prompt did not open it (the ids of
            "<think>\n"); () when the prompt did.
        after_ids: forced right after the end marker (the template's separator, the ids of "\n\n").
        max_reasoning_tokens: most tokens of reasoning (the region between ``start_ids`` and
            ``end_ids``, both excluded); ``None``: no cap but the budget; 0: an empty region.
        margin: tokens kept for the answer beyond its shortest completion when the budget cuts
            the reasoning (default ``REASONING_MARGIN``, 32: room for a short free answer or a
            JSON answer's values beyond their shortest spelling); 0 cuts at the last moment.

    Lists given for the id fields are stored as tuples. Checked by ``SamplingParams.verify``.
    """

    end_text: str
    end_ids: tuple[int, ...]
    start_ids: tuple[int, ...] = ()
    after_ids: tuple[int, ...] = ()
    max_reasoning_tokens: int | None = None
    margin: int = REASONING_MARGIN

    def __post_init__(self) -> None:
        for name in ("end_ids", "start_ids", "after_ids"):
            v = getattr(self, name)
            if isinstance(v, list):
                object.__setattr__(self, name, tuple(v))

    def verify(self) -> None:
        """Raises: EngineError naming the field (``reasoning.end_ids``)."""
        if not isinstance(self.end_text, str) or not self.end_text:
            raise EngineError(f"reasoning.end_text must be a non-empty string, got {self.end_text!r}",
                              field="reasoning.end_text", lead=True)
        for name in ("end_ids", "start_ids", "after_ids"):
            v = getattr(self, name)
            if not isinstance(v, tuple) or any(isinstance(t, bool) or not isinstance(t, numbers.Integral)
                                               or t < 0 for t in v):
                raise EngineError(f"reasoning.{name} must be a list of token ids (integers >= 0), got {v!r}",
                                  field=f"reasoning.{name}", lead=True)
        if not self.end_ids:
            raise EngineError("reasoning.end_ids must hold at least one token id", field="reasoning.end_ids",
                              lead=True)
        if self.max_reasoning_tokens is not None:
            _integer("reasoning.max_reasoning_tokens", self.max_reasoning_tokens, 0)
        _integer("reasoning.margin", self.margin, 0)

    @property
    def fixed_tokens(self) -> int:
        """Tokens the region itself costs at least: ``start_ids + end_ids + after_ids``."""
        return len(self.start_ids) + len(self.end_ids) + len(self.after_ids)


@dataclass(slots=True)
class SamplingParams:
    """How to pick each output token; verified when made (``verify``).

    Attributes:
        max_tokens: most output tokens (forced and accepted draft tokens count), >= 1.
        temperature: 0 = greedy (argmax of the masked logits); at most ``MAX_TEMPERATURE``.
        top_p: nucleus mass kept, in (0, 1].
        top_k: keep the k most likely tokens; 0 = all.
        min_p: keep the tokens whose probability is at least ``min_p`` times the most likely
            token's, in [0, 1]; 0 = off. Taken over the tokens the grammar allows, after the
            penalties, biases and temperature, before top-k / top-p (``stencil.engine.sampler``).
        seed: per-request generator seed; ``None`` = derived from the engine seed and request id.
        stop: strings that end the output (not included in it).
        ignore_eos: keep going past EOS (unconstrained requests only).
        logprobs: return the log-probability of each chosen token.
        top_logprobs: also return, per position, this many most likely tokens with their
            log-probabilities (0 = none, at most ``MAX_TOP_LOGPROBS``; implies ``logprobs``).
        logit_bias: token id -> value added to its logit, in [-100, 100] (-100 / +100: ban /
            exclusive choice); at most ``MAX_LOGIT_BIAS`` entries.
        presence_penalty / frequency_penalty: subtracted per output token already present /
            per occurrence (OpenAI's definitions, in [-2, 2]; 0 = off).
        repetition_penalty: CTRL's penalty over prompt and output tokens, in
            [``MIN_REPETITION_PENALTY``, ``MAX_REPETITION_PENALTY``] (1 = off).
        speculative: this request's speculation: an ``stencil.engine.speculative.SpecConfig``, ``False``
            (off) or ``None`` (the engine's default). Given as a dict of ``SpecConfig`` fields
            (``{"method": "off"}`` is off) or ``True`` (n-gram, default settings), it is parsed
            when the params are made.
        close_on_budget: under a grammar, keep the output closable within ``max_tokens`` (budget-
            aware masks, ``stencil.grammar.budget``) so it ends complete; False: cut at ``max_tokens``.
        soft_limits: the run-on guard for JSON: a ``stencil.grammar.budget.SoftLimits`` (the
            caller parses its wire form: ``stencil.service.inputs``), ``False`` (off) or ``None``
            (the defaults).
        context_room: set on the copy the engine runs a request with (``LLMEngine.check_request``)
            when the prompt leaves fewer than ``max_tokens`` tokens of the model's context: its
            ``max_tokens`` is that room, so the budget closes a constrained answer before the
            context ends (as it does before ``max_tokens``); ``None`` otherwise.
        reasoning: a reasoning region before the answer (``ReasoningParams``), or ``None``. With
            it, ``stop`` strings and ``RequestOutput.new_text`` concern the answer alone, and the
            grammar (if any) constrains the answer alone.

    Raises (on construction, and so on ``dataclasses.replace``):
        EngineError: a value out of range; ``field`` names it (``verify``).
        stencil.engine.speculative.SpecConfigError: ``speculative`` that cannot be parsed (a
            ``ValueError`` whose ``field`` names the key).
    """

    max_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: bool = False
    top_logprobs: int = 0
    logit_bias: dict[int, float] | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    speculative: SpecConfig | bool | None = None
    close_on_budget: bool = True
    soft_limits: Any = None
    context_room: int | None = None
    reasoning: ReasoningParams | None = None

    def __post_init__(self) -> None:
        spec = self.speculative
        if isinstance(spec, dict):
            self.speculative = SpecConfig.from_dict(spec) or False  # from_dict: "off" is None
        elif spec is True:
            self.speculative = SpecConfig()
        elif not (spec is None or spec is False or isinstance(spec, SpecConfig)):
            raise SpecConfigError(f"speculative must be an object or a boolean, got {type(spec).__name__}")
        self.verify()
        if self.top_logprobs:
            self.logprobs = True  # the alternatives come with the chosen token's own

    def verify(self) -> None:
        """Refuse a value out of its range (the one place where they are checked, in the manner
        of vLLM's ``SamplingParams._verify_args``). What depends on the model (``logit_bias``
        token ids, the context) is checked at admission (``LLMEngine.check_request``).

        Raises:
            EngineError: naming the field; NaN and infinities are out of every range.
        """
        _integer("max_tokens", self.max_tokens, 1)
        if _number("temperature", self.temperature) and not 0 <= self.temperature <= MAX_TEMPERATURE:
            # Above float32's range the sampler divides -inf (masked) logits by inf: NaN, and
            # the draw would take the whole engine loop down with it.
            raise EngineError(f"temperature must be between 0 and {MAX_TEMPERATURE:g}, got {self.temperature}",
                              field="temperature")
        if _number("top_p", self.top_p) and not 0 < self.top_p <= 1:
            raise EngineError(f"top_p must be in (0, 1], got {self.top_p}", field="top_p")
        _integer("top_k", self.top_k, 0)
        if _number("min_p", self.min_p) and not 0 <= self.min_p <= 1:
            raise EngineError(f"min_p must be in [0, 1], got {self.min_p}", field="min_p")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if _number(name, v) and not -2.0 <= v <= 2.0:
                raise EngineError(f"{name} must be between -2 and 2, got {v}", field=name)
        r = self.repetition_penalty
        if _number("repetition_penalty", r) and not MIN_REPETITION_PENALTY <= r <= MAX_REPETITION_PENALTY:
            # Dividing a logit by a penalty near 0 overflows float32 to inf, and the sampler's
            # softmax to NaN (the API fuzzer found 8e-258): the range keeps every logit finite.
            raise EngineError(f"repetition_penalty must be between {MIN_REPETITION_PENALTY} and "
                              f"{MAX_REPETITION_PENALTY}, got {r}", field="repetition_penalty")
        _integer("top_logprobs", self.top_logprobs, 0)
        if self.top_logprobs > MAX_TOP_LOGPROBS:
            raise EngineError(f"top_logprobs must be between 0 and {MAX_TOP_LOGPROBS}, got {self.top_logprobs}",
                              field="top_logprobs")
        bias = self.logit_bias or {}
        if len(bias) > MAX_LOGIT_BIAS:
            raise EngineError(f"logit_bias has {len(bias)} entries; the limit is {MAX_LOGIT_BIAS}",
                              field="logit_bias")
        for token, value in bias.items():
            if isinstance(value, bool) or not isinstance(value, numbers.Real) or not -BIAS_LIMIT <= value <= BIAS_LIMIT:
                raise EngineError(f"logit_bias: the bias of token {token} must be between -100 and 100, "
                                  f"got {value}", field="logit_bias")
        if self.soft_limits is True or isinstance(self.soft_limits, dict):
            raise EngineError("soft_limits must be a stencil.grammar.budget.SoftLimits, false or null here "
                              "(SoftLimits.from_dict parses its object form)", field="soft_limits")
        if self.reasoning is not None:
            if not isinstance(self.reasoning, ReasoningParams):
                raise EngineError(f"reasoning must be a ReasoningParams or None, got {type(self.reasoning).__name__}",
                                  field="reasoning", lead=True)
            self.reasoning.verify()

    def verify_token_ids(self, vocab_size: int) -> None:
        """Refuse ``logit_bias`` (and ``reasoning``) token ids outside a vocabulary of
        ``vocab_size`` tokens.

        Raises:
            EngineError: naming the field and the first id out of range.
        """
        for token in self.logit_bias or ():
            if not isinstance(token, int) or not 0 <= token < vocab_size:
                raise EngineError(f"logit_bias: token id {token!r} is not in this model's vocabulary "
                                  f"(0..{vocab_size - 1})", field="logit_bias")
        r = self.reasoning
        if r is not None:
            for name in ("end_ids", "start_ids", "after_ids"):
                for token in getattr(r, name):
                    if token >= vocab_size:
                        raise EngineError(f"reasoning.{name}: token id {token} is not in this model's vocabulary "
                                          f"(0..{vocab_size - 1})", field=f"reasoning.{name}", lead=True)

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


def _number(name: str, value: Any) -> bool:
    """True for a real number (bool excluded), else an ``EngineError`` naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise EngineError(f"{name} must be a number, got {value!r}", field=name)
    return True


def _integer(name: str, value: Any, least: int) -> None:
    """An integer (bool excluded) >= ``least``, else an ``EngineError`` naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise EngineError(f"{name} must be an integer, got {value!r}", field=name, lead=True)
    if value < least:
        raise EngineError(f"{name} must be >= {least}, got {value}", field=name, lead=True)


@dataclass(slots=True)
class RequestMetrics:
    """Timestamps (``time.perf_counter`` seconds) and counters of one request."""

    arrival_time: float = field(default_factory=time.perf_counter)
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_verify_steps: int = 0
    num_forced_tokens: int = 0
    num_steps: int = 0


class Request:
    """Engine-side state of one request.

    The scheduler's rule: ``num_computed_tokens`` (tokens whose K/V is in the cache) catches up
    with ``num_tokens + len(draft_token_ids)``. Prefill, prefill chunks, decode, forced tokens
    and drafts are all just tokens not yet computed.

    A request that waits holds its prompt tokens and parameters only: its grammar matcher is
    made when the scheduler first runs it (``grammar`` until then), and the engine makes its
    detokenizer at its first output token. So thousands of queued requests cost kilobytes
    each, not a matcher's state and mask buffer apiece.

    Attributes (beside the counters):
        grammar: the compiled grammar whose matcher is not made yet, else None.
        grammar_future: the grammar still compiling (a ``concurrent.futures.Future``), else
            None. Meanwhile the request may prefill all but its last prompt token; the first
            sampled token waits for the grammar.
        matcher: the request's grammar matcher (a ``stencil.grammar.base.GrammarMatcher``) once it
            runs, else None.
        held: its caller has not taken its outputs (a client that stopped reading its stream):
            the scheduler gives it no new tokens until the caller catches up
            (``stencil.engine.async_engine.EngineStream``); it keeps its KV blocks meanwhile.
    """

    __slots__ = ("held", "request_id", "prompt_token_ids", "output_token_ids", "all_token_ids",
                 "num_computed_tokens", "draft_token_ids", "block_ids", "window_block_ids", "status", "params",
                 "matcher", "grammar", "grammar_future", "eos_token_id", "metrics", "generator",
                 "error", "finish_reason_detail", "arrival_index", "num_cached_blocks",
                 "output_logprobs", "output_top_logprobs", "spec_state", "stop_token_ids")

    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 eos_token_id: int | None, matcher=None,
                 grammar_future: "Future | None" = None, grammar=None, *,
                 stop_token_ids: frozenset[int] = frozenset()):
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.num_computed_tokens = 0
        self.draft_token_ids: list[int] = []
        self.block_ids: list[int] = []
        # The block table of a hybrid KV cache's sliding-window group (stencil.engine.kv_cache_manager):
        # as long as block_ids, its entries out of every window NULL_BLOCK; empty with one group.
        self.window_block_ids: list[int] = []
        self.num_cached_blocks = 0  # leading blocks of block_ids already hashed/registered
        self.params = params
        self.matcher = matcher
        self.grammar = grammar
        self.grammar_future = grammar_future
        self.status = RequestStatus.WAITING_FOR_GRAMMAR if grammar_future is not None else RequestStatus.WAITING
        self.eos_token_id = eos_token_id
        self.stop_token_ids = stop_token_ids  # end the output like EOS (end-of-turn tokens)
        self.metrics = RequestMetrics()
        self.generator = None  # torch.Generator, created lazily by the sampler
        self.error: str | None = None
        self.finish_reason_detail: str | None = None
        self.arrival_index = 0
        self.output_logprobs: list[float] = []
        # Per output token, when ``params.top_logprobs``: [(token id, logprob), ...], best first.
        self.output_top_logprobs: list[list[tuple[int, float]]] = []
        self.spec_state = None  # its speculation settings and record (stencil.engine.speculative.spec_state.SpecState)
        self.held = False

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        """Prompt + output tokens (drafts excluded)."""
        return len(self.all_token_ids)

    def append_output(self, token_ids: list[int]) -> None:
        self.output_token_ids.extend(token_ids)
        self.all_token_ids.extend(token_ids)

    def token_at(self, i: int) -> int:
        """Token at position ``i`` of prompt + output + drafts."""
        n = len(self.all_token_ids)
        return self.all_token_ids[i] if i < n else self.draft_token_ids[i - n]

    def tokens_range(self, start: int, end: int) -> list[int]:
        n = len(self.all_token_ids)
        if end <= n:
            return self.all_token_ids[start:end]
        return self.all_token_ids[start:] + self.draft_token_ids[max(0, start - n):end - n]

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def finish_reason(self) -> str | None:
        return FINISH_REASON.get(self.status)

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, status={self.status.value}, prompt={self.num_prompt_tokens}, "
                f"output={self.num_output_tokens}, computed={self.num_computed_tokens}, blocks={len(self.block_ids)})")
