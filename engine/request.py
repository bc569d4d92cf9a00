"""A generation request as the engine sees it, and its sampling parameters."""

from __future__ import annotations

import enum
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from stencil.engine.speculative.spec_config import SpecConfig, SpecConfigError

if TYPE_CHECKING:
    from stencil.grammar.base import GrammarMatcher
    from stencil.grammar.budget import SoftLimits


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


@dataclass(slots=True)
class SamplingParams:
    """How to pick each output token.

    Attributes:
        max_tokens: most output tokens (forced and accepted draft tokens count).
        temperature: 0 = greedy (argmax of the masked logits).
        top_p: nucleus mass kept, in (0, 1].
        top_k: keep the k most likely tokens; 0 = all.
        seed: per-request generator seed; ``None`` = derived from the engine seed and request id.
        stop: strings that end the output (not included in it).
        ignore_eos: keep going past EOS (unconstrained requests only).
        logprobs: return the log-probability of each chosen token.
        top_logprobs: also return, per position, this many most likely tokens with their
            log-probabilities (0 = none; implies ``logprobs``).
        logit_bias: token id -> value added to its logit (-100 / +100: ban / exclusive choice).
        presence_penalty / frequency_penalty: subtracted per output token already present /
            per occurrence (OpenAI's definitions; 0 = off).
        repetition_penalty: CTRL's penalty over prompt and output tokens (1 = off).
        speculative: this request's speculation: an ``stencil.engine.speculative.SpecConfig``, ``False``
            (off) or ``None`` (the engine's default). Given as a dict of ``SpecConfig`` fields
            (``{"method": "off"}`` is off) or ``True`` (n-gram, default settings), it is parsed
            when the params are made.
        close_on_budget: under a grammar, keep the output closable within ``max_tokens`` (budget-
            aware masks, ``stencil.grammar.budget``) so it ends complete; False: cut at ``max_tokens``.
        soft_limits: the run-on guard for JSON: a ``stencil.grammar.budget.SoftLimits``, ``False`` (off)
            or ``None`` (the defaults). Given as a dict of its fields or ``True`` (the defaults),
            it is parsed when the params are made.
        context_room: set by the engine's admission check (``LLMEngine.check_request``) when the
            prompt leaves fewer than ``max_tokens`` tokens of the model's context: ``max_tokens``
            was lowered to that room, so the budget closes a constrained answer before the
            context ends (as it does before ``max_tokens``); ``None`` otherwise.

    Raises (on construction):
        stencil.engine.speculative.SpecConfigError / stencil.grammar.budget.SoftLimitsError: ``speculative`` /
            ``soft_limits`` that cannot be parsed (``ValueError`` s whose ``field`` names the key).
    """

    max_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
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
    soft_limits: "SoftLimits | bool | None" = None
    context_room: int | None = None

    def __post_init__(self) -> None:
        from stencil.engine.structured_output import soft_limits_types

        SoftLimits, SoftLimitsError = soft_limits_types()  # (torch and the closing automaton: not at import)

        spec = self.speculative
        if isinstance(spec, dict):
            self.speculative = SpecConfig.from_dict(spec) or False  # from_dict: "off" is None
        elif spec is True:
            self.speculative = SpecConfig()
        elif not (spec is None or spec is False or isinstance(spec, SpecConfig)):
            raise SpecConfigError(f"speculative must be an object or a boolean, got {type(spec).__name__}")
        limits = self.soft_limits
        if isinstance(limits, dict):
            self.soft_limits = SoftLimits.from_dict(limits)
        elif limits is True:
            self.soft_limits = None
        elif not (limits is None or limits is False or isinstance(limits, SoftLimits)):
            raise SoftLimitsError("soft_limits must be an object or false")

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


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
        matcher: the request's grammar matcher once it runs, else None.
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
                 eos_token_id: int | None, matcher: "GrammarMatcher | None" = None,
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
