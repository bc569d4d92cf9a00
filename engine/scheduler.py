"""Continuous-batching scheduler (the vLLM v1 rule: computed tokens catch up with known tokens).

Each step: running requests first (in admission order), then waiting ones, under a token budget
(``max_num_batched_tokens``) and a sequence cap (``max_num_seqs``). A prompt longer than the
chunk limit is read over several steps (chunked prefill). When the KV cache has no room (in any
of its groups: a hybrid cache's sliding-window pool counts like the full one,
``stencil.engine.kv_cache_manager``), the most recently admitted running request is preempted: its
blocks are freed and it goes back to the head of the waiting queue to be recomputed (its freed
blocks keep their hashes, so the recompute often hits the prefix cache).

A request whose grammar still compiles (``grammar_future``) is admitted all the same and reads
all but its last prompt token meanwhile; its last prompt token, and so its first sampled token,
waits for the grammar. Compile time then hides behind prefill instead of adding to TTFT. The
request's matcher is made when it first runs with its grammar ready (``_start_matcher``), never
while it queues.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field

from stencil.engine.config import EngineConfig
from stencil.engine.kv_cache_manager import KVCacheManager
from stencil.engine.request import Request, RequestStatus
from stencil.engine.structured_output import BudgetError, check_budget, is_dead_end, make_matcher, prefetch

log = logging.getLogger(__name__)


@dataclass(slots=True)
class ScheduledRequest:
    """One request's share of a step.

    Attributes:
        request: the request.
        start: ``num_computed_tokens`` before the step = position of the first new token.
        num_new_tokens: tokens fed this step (prompt chunk, decode/forced tokens, then drafts).
        num_drafts: draft tokens at the end of the new tokens (0 when not speculating).
        sample: True when the chunk reaches the end of the known tokens, so logits are taken:
            ``num_drafts + 1`` rows (one per draft position plus the bonus position).
    """

    request: Request
    start: int
    num_new_tokens: int
    num_drafts: int
    sample: bool

    @property
    def num_logits(self) -> int:
        return self.num_drafts + 1 if self.sample else 0


@dataclass(slots=True)
class SchedulerOutput:
    """What the model runner computes in one step (requests in batch order)."""

    scheduled: list[ScheduledRequest] = field(default_factory=list)
    num_batched_tokens: int = 0
    preempted: list[Request] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    """Decides which requests run each step and keeps their KV blocks."""

    def __init__(self, config: EngineConfig, kv: KVCacheManager, max_model_len: int):
        self.config = config
        self.kv = kv
        self.max_model_len = max_model_len
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._arrivals = 0
        self.num_preemptions = 0
        self.newly_finished: list[Request] = []  # finished since the engine last drained them
        self.newly_started: list[str] = []  # ids first scheduled since the engine last drained them
        self.enable_forced_tokens = True
        self.max_forced_tokens = 16

    # -- queue verbs -------------------------------------------------------------------------
    def add(self, request: Request) -> None:
        self._arrivals += 1
        request.arrival_index = self._arrivals
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def finish(self, request: Request, status: RequestStatus) -> None:
        """End a request with ``status``, freeing its blocks at once (idempotent)."""
        if request.is_finished:
            return
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        else:
            try:
                self.waiting.remove(request)
            except ValueError:
                pass
        request.status = status
        request.draft_token_ids = []
        self.kv.free(request)
        self.requests.pop(request.request_id, None)
        request.metrics.finished_time = time.perf_counter()
        self.newly_finished.append(request)

    def drain_finished(self) -> list[Request]:
        out, self.newly_finished = self.newly_finished, []
        return out

    def drain_started(self) -> list[str]:
        """Ids of the requests scheduled for the first time since the last call."""
        out, self.newly_started = self.newly_started, []
        return out

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.kv.free(request)
        request.num_computed_tokens = 0
        request.draft_token_ids = []
        request.status = RequestStatus.PREEMPTED
        request.metrics.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    # -- the step ------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        cfg = self.config
        budget = cfg.max_num_batched_tokens
        out = SchedulerOutput()
        scheduled_ids: set[str] = set()

        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            if req.grammar_future is not None and not self._grammar_ready(req) and req.is_finished:
                continue  # its compile failed: finish() took it out of running
            num_new = self._num_new_tokens(req, budget)
            if num_new == 0:
                i += 1
                continue
            while not self.kv.allocate_slots(req, num_new):
                victim = self.running[-1]
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is req:
                    break
            if req.status != RequestStatus.RUNNING:
                continue  # req itself was preempted; running[i] is now the next request
            out.scheduled.append(self._make(req, num_new))
            scheduled_ids.add(req.request_id)
            budget -= num_new
            i += 1

        if not out.preempted:
            self._admit_waiting(out, budget)
        out.num_batched_tokens = sum(s.num_new_tokens for s in out.scheduled)
        return out

    def _admit_waiting(self, out: SchedulerOutput, budget: int) -> None:
        cfg = self.config
        skipped: list[Request] = []
        while self.waiting and budget > 0 and len(self.running) < cfg.max_num_seqs:
            req = self.waiting[0]
            compiling = req.grammar_future is not None and not self._grammar_ready(req)
            if req.is_finished:
                continue  # its compile failed: finish() took it off the queue
            cached_blocks, num_cached = self.kv.get_computed_blocks(req) if not req.block_ids else ([], 0)
            num_new = min(req.num_tokens - num_cached, budget, cfg.max_prefill_chunk)
            if compiling:
                num_new = min(num_new, req.num_prompt_tokens - 1 - num_cached)  # all but the last token
                if num_new <= 0:
                    skipped.append(self.waiting.popleft())  # nothing to read until it compiles
                    continue
            req.num_computed_tokens = num_cached
            if not self.kv.allocate_slots(req, num_new, cached_blocks):
                req.num_computed_tokens = 0
                break
            if not compiling and not self._start_matcher(req):
                continue  # its matcher failed to start: finished, blocks freed
            self.waiting.popleft()
            self.kv.record_lookup(req.num_tokens, num_cached)
            if req.metrics.first_scheduled_time is None:
                req.metrics.num_cached_tokens = num_cached
                self.newly_started.append(req.request_id)
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            out.scheduled.append(self._make(req, num_new))
            budget -= num_new
        # Requests still compiling keep their place at the head, in arrival order.
        for req in reversed(skipped):
            self.waiting.appendleft(req)

    def _grammar_ready(self, req: Request) -> bool:
        """Whether ``req``'s compile has ended well (``req.grammar`` is then set). A failed
        compile, or a grammar whose shortest output exceeds ``max_tokens``, finishes the
        request with its error (blocks freed); False then too, and ``req.is_finished``."""
        fut = req.grammar_future
        if fut is None:
            return True
        if not fut.done():
            return False
        req.grammar_future = None
        exc = RuntimeError("the grammar compile was cancelled") if fut.cancelled() else fut.exception()
        if exc is not None:
            req.error = str(exc)
            self.finish(req, RequestStatus.FINISHED_ERROR)
            return False
        grammar = fut.result()
        try:
            check_budget(grammar, req.params)
        except BudgetError as e:
            req.error = str(e)
            self.finish(req, RequestStatus.FINISHED_ERROR)
            return False
        req.grammar = grammar
        if req.status == RequestStatus.WAITING_FOR_GRAMMAR:
            req.status = RequestStatus.WAITING
        if req.status == RequestStatus.RUNNING:
            return self._start_matcher(req)
        return True

    def _start_matcher(self, req: Request) -> bool:
        """Make the matcher of a request about to run with its grammar (no-op without one or
        once made). A matcher that fails to start finishes the request; False then."""
        if req.matcher is not None or req.grammar is None:
            return True
        try:
            req.matcher = make_matcher(req.grammar, req.params)
        except Exception as e:  # noqa: BLE001 - one request's grammar must not stop the batch
            self.fail(req, "starting its grammar matcher", e)
            return False
        req.grammar = None
        return True

    def prefill_pending(self) -> bool:
        """Whether the next step will likely read prompt tokens: a running request has some left
        (all but the last while its grammar compiles), or a waiting one could be admitted."""
        if any(r.num_computed_tokens < r.num_prompt_tokens - (r.grammar_future is not None) for r in self.running):
            return True
        return len(self.running) < self.config.max_num_seqs and any(
            r.grammar_future is None or r.num_prompt_tokens > 1 for r in self.waiting)

    def may_draft(self, req: Request) -> bool:
        """Whether draft tokens may follow ``req``'s uncomputed tokens this step: its prompt is
        in the cache and what is left are at most a sampled token and the grammar-forced tokens
        after it (not a recompute after preemption, which is a prefill again)."""
        pending = req.num_tokens - req.num_computed_tokens
        return req.num_computed_tokens >= req.num_prompt_tokens and 1 <= pending <= 1 + self.max_forced_tokens

    def _num_new_tokens(self, req: Request, budget: int) -> int:
        if req.held:
            return 0  # its caller is behind on its outputs: no step for it until it catches up
        if req.grammar_future is not None:  # compiling: read prompt tokens up to the last one only
            return max(0, min(req.num_prompt_tokens - 1 - req.num_computed_tokens, budget,
                              self.config.max_prefill_chunk))
        remaining = req.num_tokens - req.num_computed_tokens
        if req.draft_token_ids and not self.may_draft(req):
            req.draft_token_ids = []  # drafts only ride on a request whose prefill is done
        limit = min(budget, self.config.max_prefill_chunk if remaining > 1 else budget)
        num_new = remaining + len(req.draft_token_ids)
        if num_new > limit and req.draft_token_ids:
            # Not enough room to verify every draft: keep the ones that fit.
            keep = max(0, limit - remaining)
            req.draft_token_ids = req.draft_token_ids[:keep]
            num_new = remaining + keep
        return min(num_new, limit)

    def update(self, out: SchedulerOutput, sampled: list[list[int]],
               logprobs: list[list[float]] | None = None,
               top_logprobs: list[list[list[tuple[int, float]]]] | None = None) -> list[tuple[Request, list[int]]]:
        """Apply one step's results.

        Args:
            out: the step's schedule.
            sampled: for each scheduled request with ``sample`` (in order), the accepted draft
                tokens followed by one sampled token (so ``1 <= len <= num_drafts + 1``).
            logprobs: matching log-probabilities, when any request asked for them.
            top_logprobs: matching top alternatives per token (``[]`` for a request that did
                not ask), when any request asked for logprobs.

        Returns:
            (request, new output token ids) for every request that gained tokens (sampled, accepted
            drafts and grammar-forced tokens), in batch order. Requests finished here are freed.
        """
        now = time.perf_counter()
        updates: list[tuple[Request, list[int], list[float] | None, list | None]] = []
        k = 0
        for sr in out.scheduled:
            req = sr.request
            req.metrics.num_steps += 1
            if not sr.sample:
                req.num_computed_tokens += sr.num_new_tokens
                self.kv.cache_full_blocks(req)
                continue
            tokens = sampled[k]
            lps = logprobs[k] if logprobs is not None else None
            tops = top_logprobs[k] if top_logprobs is not None else None
            k += 1
            if req.is_finished:
                continue  # aborted (or failed) while the step ran
            new: list[int] = []
            try:
                new = self._apply(sr, tokens, lps, now, tops)
            except Exception as e:  # noqa: BLE001 - one request's grammar must not stop the batch
                self.fail(req, "appending tokens", e)
            updates.append((req, new, lps, tops))
        # Forced tokens read each matcher's mask of its new state: compute them all at once.
        if self.enable_forced_tokens:
            prefetch([req.matcher for req, *_ in updates if req.matcher is not None and not req.is_finished])
        out_updates: list[tuple[Request, list[int]]] = []
        for req, new, lps, tops in updates:
            if not req.is_finished:
                try:
                    new = new + self._apply_forced(req, lps, tops)
                except Exception as e:  # noqa: BLE001 - one request's grammar must not stop the batch
                    self.fail(req, "appending tokens", e)
            out_updates.append((req, new))
        return out_updates

    def fail(self, req: Request, stage: str, exc: BaseException) -> None:
        """Finish one request with an error (its blocks freed); the batch goes on without it.

        A ``stencil.grammar.base.DeadEndError`` (the constraint asks for text this vocabulary cannot
        spell) is the request's own fault: its message goes to the client and the output says
        ``constraint_error`` (the service's 400). Any other exception is internal: the client
        sees the stage and the exception's type, the log the traceback.
        """
        if is_dead_end(exc):
            log.info("request %s failed while %s: %s", req.request_id, stage, exc)
            req.error = str(exc)
            req.finish_reason_detail = "dead_end"
        else:
            log.error("request %s failed while %s", req.request_id, stage, exc_info=exc)
            req.error = f"internal error while {stage} ({type(exc).__name__}); see the server log"
        self.finish(req, RequestStatus.FINISHED_ERROR)

    def _apply(self, sr: ScheduledRequest, tokens: list[int], lps: list[float] | None, now: float,
               tops: list[list[tuple[int, float]]] | None = None) -> list[int]:
        """Record one sampled request's accepted drafts and new tokens; return them (the forced
        tokens after them come in ``_apply_forced``, once every request has its new state)."""
        req = sr.request
        num_rejected = sr.num_drafts - (len(tokens) - 1)
        req.num_computed_tokens = sr.start + sr.num_new_tokens - num_rejected
        if sr.num_drafts:
            req.metrics.num_draft_tokens += sr.num_drafts
            req.metrics.num_accepted_tokens += len(tokens) - 1
            req.metrics.num_verify_steps += 1
            if req.spec_state is not None:
                req.spec_state.record(sr.num_drafts, len(tokens) - 1)
        req.draft_token_ids = []
        if req.metrics.first_token_time is None:
            req.metrics.first_token_time = now
        return self._append(req, tokens, lps, tops)

    def _apply_forced(self, req: Request, lps: list[float] | None, tops: list | None) -> list[int]:
        """Append the grammar-forced tokens after a request's new tokens; register its full blocks."""
        new: list[int] = []
        if self.enable_forced_tokens and req.matcher is not None:
            forced = req.matcher.forced_tokens(self.max_forced_tokens)
            if forced:
                # The grammar allows a forced token alone: probability 1, the only alternative.
                new = self._append(req, forced, [0.0] * len(forced) if lps is not None else None,
                                   [[(t, 0.0)] for t in forced] if tops else None)
                req.metrics.num_forced_tokens += len(new)
        if not req.is_finished:
            self.kv.cache_full_blocks(req)
        return new

    def _append(self, req: Request, tokens: list[int], lps: list[float] | None,
                tops: list[list[tuple[int, float]]] | None = None) -> list[int]:
        """Append tokens one by one, stopping at EOS, max_tokens, model length or grammar end."""
        added: list[int] = []
        params = req.params
        for j, t in enumerate(tokens):
            if req.matcher is not None and not req.matcher.accept_tokens([t]):
                req.error = f"token {t} violates the grammar (internal error)"
                self.finish(req, RequestStatus.FINISHED_ERROR)
                break
            req.append_output([t])
            added.append(t)
            if lps is not None:
                req.output_logprobs.append(lps[j])
            if tops:
                req.output_top_logprobs.append(tops[j])
            if (t == req.eos_token_id or t in req.stop_token_ids) and not params.ignore_eos:
                self.finish(req, RequestStatus.FINISHED_STOPPED)
            elif req.matcher is not None and req.matcher.is_terminated():
                self.finish(req, RequestStatus.FINISHED_STOPPED)
            elif req.num_output_tokens >= params.max_tokens or req.num_tokens >= self.max_model_len:
                # A budget-aware matcher that steered the output (narrowed a mask, or the run-on
                # guard acted) closed it: at the budget it is complete, a "stop". An output it never
                # had to steer was cut where the model went on (free text, where every prefix is
                # accepted, or a number): "length", as OpenAI reports a cut, even if it parses.
                m = req.matcher
                complete = (getattr(m, "closed_by_budget", None) is not None and m.is_accepting()
                            and bool(m.closed_by_budget or getattr(m, "guarded", None)))
                if complete:
                    req.finish_reason_detail = "budget"
                self.finish(req, RequestStatus.FINISHED_STOPPED if complete else RequestStatus.FINISHED_LENGTH)
            if req.is_finished:
                break
        return added

    def _make(self, req: Request, num_new: int) -> ScheduledRequest:
        if req.metrics.first_scheduled_time is None:
            req.metrics.first_scheduled_time = time.perf_counter()
        end = req.num_computed_tokens + num_new
        sample = end >= req.num_tokens
        num_drafts = end - req.num_tokens if sample else 0
        return ScheduledRequest(req, req.num_computed_tokens, num_new, num_drafts, sample)
