"""The engine's one door to ``grammar/``: the structured-output manager.

Everything the engine does with constraints goes through here, in the manner of vLLM's
``StructuredOutputManager`` (``vllm/v1/structured_output``): the grammar compiler of the engine's
vocabulary, each request's matcher (budget-aware unless the request says otherwise), the admission
check of a grammar's shortest output against ``max_tokens``, the step's bitmask (one row per
logits position, draft positions included), the masks computed ahead in one parallel call, and
applying the bitmask to the logits. The scheduler and the model runner use the module-level
functions; ``LLMEngine`` holds one :class:`StructuredOutputManager`. No other
module of ``engine/`` imports ``grammar/``, so what the engine asks of a grammar is written here once.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from stencil.engine.request import Request, SamplingParams
    from stencil.engine.scheduler import SchedulerOutput


class BudgetError(ValueError):
    """``max_tokens`` cannot hold the shortest output the grammar admits (message names both)."""


class StructuredOutputManager:
    """The constraints of one engine: its compiler, matchers and per-step bitmask.

    Args:
        tokenizer: the engine's tokenizer (a Hugging Face tokenizer or a ``TokenVocabulary``).
        vocab_size: the model's logits width.
        eos_token_ids: the ids that end an output where the tokenizer names more than its EOS
            (a GGUF's end-of-turn tokens), or None for the tokenizer's EOS alone.
        workers, timeout_s, backend: the compiler's (``GrammarCompiler``: ``max_workers``,
            ``timeout_s``, ``backend``).

    Attributes:
        compiler: the ``GrammarCompiler`` (the engine's ``grammar`` attribute).
    """

    def __init__(self, tokenizer: Any, vocab_size: int, *, eos_token_ids: tuple[int, ...] | None = None,
                 workers: int = 2, timeout_s: float = 10.0, backend: str = "auto"):
        from stencil.grammar.compiler import GrammarCompiler

        vocab = tokenizer
        if eos_token_ids is not None:
            from stencil.grammar.vocab import build_vocabulary

            vocab = build_vocabulary(tokenizer, model_vocab_size=vocab_size, eos_token_ids=eos_token_ids)
        self.vocab_size = vocab_size
        self.compiler = GrammarCompiler(vocab, vocab_size, max_workers=workers, timeout_s=timeout_s,
                                        backend=backend)
        self.compiler.warm_up()  # the first compile's one-time costs: here, before the server is healthy
        self._free = None

    def free_answer(self):
        """The "grammar" of an unconstrained answer after reasoning (``SamplingParams.reasoning``
        without a constraint): ``make_matcher`` gives it a reasoning matcher with a free answer."""
        from stencil.grammar.reasoning import FreeAnswer

        if self._free is None:
            self._free = FreeAnswer(self.compiler.vocab)
        return self._free

    def grammar_bitmask(self, sched: "SchedulerOutput",
                        failed: list[tuple["Request", BaseException]]) -> "torch.Tensor | None":
        """int32 ``[rows, ceil(vocab_size / 32)]``: one row per logits position of the step, row j
        of a request reflecting its grammar after its drafts[:j]; None when no sampled request has
        a matcher. A request whose matcher raises is appended to ``failed`` with the exception
        and its rows are left all-allowed (the caller fails it after the forward pass)."""
        if not any(sr.sample and sr.request.matcher is not None for sr in sched.scheduled):
            return None
        from stencil.grammar.bitmask import allocate_bitmask

        rows = sum(sr.num_logits for sr in sched.scheduled)
        # Every pending mask in one parallel call; the loop below then copies rows.
        prefetch([sr.request.matcher for sr in sched.scheduled if sr.sample and sr.request.matcher is not None])
        bitmask = allocate_bitmask(rows, self.vocab_size)
        row = 0
        for sr in sched.scheduled:
            if not sr.sample:
                continue
            m = sr.request.matcher
            if m is not None:
                try:
                    self.fill_rows(m, sr.request.draft_token_ids[:sr.num_drafts], bitmask, row)
                except Exception as e:  # noqa: BLE001 - one request's grammar must not stop the batch
                    bitmask[row:row + sr.num_logits] = -1
                    failed.append((sr.request, e))
            row += sr.num_logits
        return bitmask

    @staticmethod
    def fill_rows(m, drafts: list[int], bitmask: "torch.Tensor", row: int) -> None:
        """Rows ``row``, ``row + 1``, ... of ``bitmask``: ``m``'s mask, then after each draft the
        grammar admits (the matcher is rolled back after)."""
        m.fill_bitmask(bitmask, row)
        accepted = 0
        for d in drafts:
            # A draft the grammar refuses is also refused by the verifier (its row masks it
            # out), so later rows are never read: leave them as they are.
            if not m.accept_tokens([d]):
                break
            accepted += 1
            m.fill_bitmask(bitmask, row + accepted)
        if accepted:
            m.rollback(accepted)


def check_budget(grammar, params: "SamplingParams") -> None:
    """Refuse a constrained request whose ``max_tokens`` cannot hold the shortest output (the
    one budget check: at admission, ``LLMEngine.check_budget``; for a grammar that compiled
    behind prefill, ``stencil.engine.scheduler``).

    Raises:
        BudgetError: naming ``max_tokens`` and the minimum.
    """
    if params.reasoning is not None:
        _check_reasoning_budget(grammar, params)
        return
    if not params.close_on_budget or not hasattr(grammar, "min_output_tokens"):
        return
    need = grammar.min_output_tokens(params.max_tokens)
    if need is not None:
        raise BudgetError(f"max_tokens {params.max_tokens} is below the shortest output this grammar "
                          f"admits: it needs at least {need} tokens (or set close_on_budget false)")


def _check_reasoning_budget(grammar, params: "SamplingParams") -> None:
    """With a reasoning region the shortest output is its forced tokens (start, end marker,
    separator) and then the answer's shortest output (none for a free answer, or without
    ``close_on_budget``). The answer's minimum is asked for exactly (``min_output_tokens(0)``),
    which builds its closing automaton now: the reasoning's cut needs it from the first step."""
    r = params.reasoning
    fixed = r.fixed_tokens
    answer = 0
    if params.close_on_budget and hasattr(grammar, "min_output_tokens"):
        answer = grammar.min_output_tokens(0) or 0
    if params.max_tokens < fixed + answer:
        raise BudgetError(f"max_tokens {params.max_tokens} is below the shortest output with reasoning: it needs at "
                          f"least {fixed + answer} tokens ({fixed} for the reasoning's start, end marker and "
                          f"separator, {answer} for the answer)")


def make_matcher(grammar, params: "SamplingParams"):
    """The request's matcher: budget-aware unless ``params.close_on_budget`` is off; with
    ``params.reasoning``, a ``stencil.grammar.reasoning.ReasoningMatcher`` around the answer's
    (``grammar`` may then be the engine's ``free_answer()``: no matcher for the answer)."""
    if params.reasoning is not None:
        return _reasoning_matcher(grammar, params)
    return _answer_matcher(grammar, params, params.max_tokens)


def _answer_matcher(grammar, params: "SamplingParams", max_tokens: int):
    if params.close_on_budget and hasattr(grammar, "budget_matcher"):
        from stencil.grammar.budget import SoftLimits

        limits = params.soft_limits
        soft = None if limits is False else limits if isinstance(limits, SoftLimits) else SoftLimits()
        return grammar.budget_matcher(max_tokens, soft_limits=soft)
    return grammar.matcher()


def _reasoning_matcher(grammar, params: "SamplingParams"):
    from stencil.grammar.reasoning import FreeAnswer, ReasoningMatcher

    r = params.reasoning
    if isinstance(grammar, FreeAnswer):
        return ReasoningMatcher(None, grammar.vocab, r, params.max_tokens, answer_min=0)
    # The answer's budget is set again when it starts (what the reasoning left of max_tokens).
    answer = _answer_matcher(grammar, params, max(1, params.max_tokens - r.fixed_tokens))
    answer_min = None  # a BudgetMatcher's distance from its start
    if not hasattr(answer, "set_budget"):
        answer_min = (lambda: grammar.min_output_tokens(0)) if hasattr(grammar, "min_output_tokens") else 0
    return ReasoningMatcher(answer, grammar.vocab, r, params.max_tokens, answer_min=answer_min)


def prefetch(matchers: list) -> None:
    """Compute the pending masks of ``matchers`` in one parallel call (``stencil.grammar.prefetch``)."""
    from stencil.grammar.prefetch import prefetch_masks

    prefetch_masks(matchers)


def grammar_backends() -> tuple[str, ...]:
    """Every ``EngineConfig.grammar_backend`` value: "auto" and the backends' names
    (``stencil.grammar.backends.backend_registry.POLICIES``; importing it imports no backend)."""
    from stencil.grammar.backends.backend_registry import POLICIES

    return POLICIES


def is_dead_end(exc: BaseException) -> bool:
    """Whether ``exc`` says the constraint asks for text no token of the vocabulary spells
    (``stencil.grammar.base.DeadEndError``: the request's own fault, a 400)."""
    from stencil.grammar.base import DeadEndError

    return isinstance(exc, DeadEndError)


def apply_bitmask_(logits: "torch.Tensor", bitmask: "torch.Tensor") -> None:
    """Set the logits of disallowed tokens to -inf in place (``stencil.grammar.bitmask.apply_bitmask_``)."""
    from stencil.grammar.bitmask import apply_bitmask_ as apply

    apply(logits, bitmask)
