"""What the engine hands back to its callers after each step."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class RequestOutput:
    """A request's progress after one step (or its end).

    Attributes:
        request_id: the caller's id.
        new_token_ids: output tokens added this step (sampled, accepted drafts, forced).
        new_text: text made final this step (complete UTF-8 characters, stop strings removed).
        finished: True on the last output of a request.
        finish_reason: "stop" (EOS, stop string, grammar complete), "length" (max_tokens or model
            length), "abort", or "error"; None until finished.
        num_prompt_tokens / num_output_tokens: usage counts so far.
        num_cached_tokens: prompt tokens served from the prefix cache.
        error: message when ``finish_reason == "error"``.
        constraint_error: with ``finish_reason == "error"``: the request's constraint asked for
            text this model's vocabulary cannot spell (``stencil.grammar.base.DeadEndError``), the
            client's fault; ``error`` says so. False for every other error (internal).
        ttft_ms: time from arrival to first output token (ms), once known.
        total_ms: time from arrival to finish (ms), once finished.
        num_draft_tokens / num_accepted_tokens / num_forced_tokens: speculation counters.
        new_logprobs: log-probabilities of ``new_token_ids`` when requested.
        closed_by_budget: on the last output: the budget narrowed the grammar's masks so that the
            output ended complete within ``max_tokens`` (``stencil.grammar.budget``).
        budget_cuts: on the last output: output byte offsets where it did.
        guard_hits: on the last output: ``(what, byte offset)`` for each run-on bound that bound.
        budget_unenforced: on the last output of a constrained request that asked for its budget
            to be kept (``close_on_budget``): why it could not be (``BudgetMatcher.disabled``, e.g.
            no closing automaton for an intersection too large to model), else None.
        new_top_logprobs: per token of ``new_token_ids``, its position's most likely tokens as
            ``(token id, logprob)``, best first, when ``top_logprobs`` was requested.
        context_room: on the last output: the tokens the prompt left of ``max_model_len`` where
            that was below the request's ``max_tokens`` (its budget then), else None
            (``SamplingParams.context_room``).
        new_reasoning_text: with ``SamplingParams.reasoning``: the reasoning's text made final
            this step (its markers and separator excluded); ``new_text`` then carries the
            answer's text only, and stop strings apply to the answer only. ``new_token_ids`` and
            the logprobs still cover every output token, reasoning and answer.
        num_reasoning_tokens: with reasoning: output tokens from the first through the end
            marker and its separator (``start_ids`` included when forced); while still
            reasoning, every output token so far. 0 without reasoning.
        reasoning_cut: the end marker was forced (the budget needed the room for the answer, or
            ``max_reasoning_tokens`` was reached), not chosen by the model.
    """

    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int = 0
    error: str | None = None
    constraint_error: bool = False
    ttft_ms: float | None = None
    total_ms: float | None = None
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_verify_steps: int = 0
    num_forced_tokens: int = 0
    num_steps: int = 0
    new_logprobs: list[float] = field(default_factory=list)
    closed_by_budget: bool = False
    budget_cuts: list[int] = field(default_factory=list)
    guard_hits: list[tuple[str, int]] = field(default_factory=list)
    budget_unenforced: str | None = None
    new_top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    context_room: int | None = None
    new_reasoning_text: str = ""
    num_reasoning_tokens: int = 0
    reasoning_cut: bool = False
