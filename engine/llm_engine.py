"""The synchronous engine: add requests, step, collect outputs (schedule → mask → run → update → propose)."""

from __future__ import annotations

import dataclasses
import logging
import time
import uuid
from concurrent.futures import Future
from typing import Callable

from stencil.engine.config import EngineConfig
from stencil.engine.detokenizer import IncrementalDetokenizer, ReasoningDetokenizer
from stencil.engine.kv_cache_manager import KVCacheManager
from stencil.engine.model_runner import ModelRunner, ModelRunnerOutput
from stencil.engine.outputs import RequestOutput
from stencil.engine.request import EngineError, Request, RequestStatus, SamplingParams  # EngineError: here too
from stencil.engine.scheduler import Scheduler, SchedulerOutput
from stencil.engine.speculative import DraftBudget, Drafter, Goodput, SpecConfig, SpecState, StepShape
from stencil.engine.speculative.drafter import pending_rows
from stencil.engine.step_timing import StepTimer
from stencil.engine.structured_output import BudgetError, StructuredOutputManager, check_budget

log = logging.getLogger(__name__)




class EngineOverloaded(RuntimeError):
    """The waiting queue is full; retry later."""


class LLMEngine:
    """One model, one paged KV cache, one scheduler; ``step()`` advances every running request.

    Not thread-safe: ``stencil.engine.async_engine.AsyncEngine`` runs it on a thread of its own.

    Args:
        config: the engine's settings.
        cost_model: what a decode step costs, in ms, given its ``StepShape``; None (the
            default) measures it on the wall clock. Speculation decides from these costs
            (``stencil.engine.speculative.goodput``); tests inject one so their decisions never depend on the
            machine's speed or load.
        row_floor_ms: least price of a draft row (ms). None: measured on the model's own
            projections before the first drafting step (``stencil.engine.speculative.row_cost``), or 0 with a
            ``cost_model`` (no clock is read then).
    """

    def __init__(self, config: EngineConfig, *, cost_model: Callable[[StepShape], float] | None = None,
                 row_floor_ms: float | None = None):
        from stencil.engine.models.tokenizer import load_tokenizer

        self.config = config.validate()
        t0 = time.perf_counter()
        self.tokenizer = load_tokenizer(config.model)
        self.runner = ModelRunner(config)
        hf = self.runner.hf_config
        model_limit = int(self.runner.model.max_context_len)
        context = min(config.max_model_len or model_limit, model_limit)
        # One request's tokens must fit the whole KV cache (the full-attention group: a window
        # group holds a request's window at most): a longer one would preempt itself forever.
        # vLLM refuses to start then; llama.cpp caps a slot's context. Stencil caps the context.
        kv_tokens = self.runner.num_blocks * config.block_size
        self.max_model_len = min(context, kv_tokens)
        self.kv_bound = kv_tokens < context  # max_model_len is the KV cache's, not the model's
        if self.kv_bound:
            log.warning("the KV cache holds %d tokens, fewer than the context of %d: max_model_len is %d "
                        "(a larger --num-kv-blocks or --kv-cache-gib lifts it)", kv_tokens, context, kv_tokens)
        self.kv = KVCacheManager(self.runner.num_blocks, config.block_size, config.enable_prefix_caching,
                                 hash_prompt_boundary=self.runner.prompt_rows_routed, groups=self.runner.kv_groups)
        self.scheduler = Scheduler(config, self.kv, self.max_model_len)
        self.eos_token_id = self.tokenizer.eos_token_id
        if self.eos_token_id is None:
            self.eos_token_id = getattr(hf, "eos_token_id", None)
        # Other tokens that end an output besides EOS: a GGUF's end-of-turn tokens (Gemma's
        # <end_of_turn>; ``gguf_config.stop_token_ids``). An HF directory names only its EOS.
        self.extra_stop_token_ids = frozenset(
            t for t in getattr(hf, "stop_token_ids", ()) if t != self.eos_token_id)
        eos = None
        if self.extra_stop_token_ids and self.eos_token_id is not None:
            eos = (self.eos_token_id, *sorted(self.extra_stop_token_ids))
        self.structured = StructuredOutputManager(self.tokenizer, self.runner.vocab_size, eos_token_ids=eos,
                                                  workers=config.grammar_workers,
                                                  timeout_s=config.grammar_timeout_s, backend=config.grammar_backend)
        self.grammar = self.structured.compiler  # (the public name: the service compiles through it)
        self.default_spec = SpecConfig.from_dict(config.speculative)
        from stencil.engine.models.gguf_layers import QuantLinear
        from stencil.engine.models.quant import Int4Linear
        from stencil.kernels import ggml_blocks

        int4 = [m for m in self.runner.model.modules() if isinstance(m, Int4Linear)]
        self._int4_gemm = "none" if not int4 else "native" if all(m.native is not None for m in int4) else "torch"
        blocks = [m for m in self.runner.model.modules() if isinstance(m, QuantLinear)]
        self._gguf_gemm = ("none" if not blocks else "torch" if not all(m.native for m in blocks)
                           else f"{ggml_blocks.isa()}, {'/'.join(sorted({str(m.terms) for m in blocks}))} term(s)")
        # Rows torch's CPU int4 kernel multiplies together (4): speculation sizes drafts to it.
        # The native kernel (kernels/native.py) has no such tile.
        self.row_tile = 4 if self._int4_gemm == "torch" else 1
        self._detok: dict[str, IncrementalDetokenizer | ReasoningDetokenizer] = {}
        self.drafter = Drafter(self.tokenizer, self._output_text, self.scheduler.may_draft, self.max_model_len)
        # Whether drafting pays, from what decode steps cost with and without it.
        self.goodput = Goodput(row_floor_ms=0.0 if row_floor_ms is None and cost_model is not None else row_floor_ms)
        self.cost_model = cost_model
        if self.goodput.row_floor_ms is None and self.default_spec is not None:
            self._measure_row_floor()  # at start where speculation is on: no request waits for it
        self._proposed = 0  # requests the proposers ran for, for the next step
        self._propose_ms = 0.0  # ... and the time that took
        self.num_steps = 0
        self.timer = StepTimer()  # phases of the last step (ms), for ``stencil bench overhead``
        self.started: list[str] = []  # ids of the requests the last step scheduled for the first time
        self.idle = True  # the last step scheduled nothing
        self.load_time_s = time.perf_counter() - t0
        log.info("engine ready: %s, %d KV blocks%s (%.2f GiB), max_model_len %d, kernels %s, %.1f s",
                 config.model, self.runner.num_blocks,
                 "".join(f", {g.num_blocks} for the {g.window}-token windows" for g in self.kv.groups[1:]),
                 self.runner.kv_cache_bytes / (1 << 30), self.max_model_len, self.kernels, self.load_time_s)

    # -- requests ------------------------------------------------------------------------------
    def add_request(self, request_id: str | None, prompt_token_ids: list[int], params: SamplingParams,
                    grammar=None, *, admitted: bool = False) -> str:
        """Queue a request.

        Args:
            request_id: caller's id (a fresh one when None); must be unique among live requests.
            prompt_token_ids: the tokenized prompt (at least one token).
            params: sampling parameters.
            grammar: a ``CompiledGrammar``, a ``Future`` of one (the request waits in
                WAITING_FOR_GRAMMAR while it compiles), or None.
            admitted: the caller already checked admission (``check_request``); the waiting
                queue may then exceed ``max_waiting`` by the requests admitted meanwhile.

        Raises:
            EngineError: empty or too long prompt, bad parameters, duplicate id.
            EngineOverloaded: the waiting queue is full (unless ``admitted``).
        """
        request_id = request_id or uuid.uuid4().hex
        params = self.check_request(prompt_token_ids, params, admission=not admitted)
        if request_id in self.scheduler.requests:
            raise EngineError(f"request id {request_id!r} is already in use")
        future = None
        if isinstance(grammar, Future):
            future, grammar = grammar, None
        elif grammar is not None or params.reasoning is not None:
            # reasoning without a constraint: a free answer, still behind the reasoning's matcher
            grammar = grammar if grammar is not None else self.structured.free_answer()
            self.check_budget(grammar, params)
        # No matcher and no detokenizer yet: the scheduler makes the matcher when it first runs
        # the request, _output the detokenizer at its first token (a queued request stays small).
        req = Request(request_id, prompt_token_ids, params, self.eos_token_id, None, future, grammar=grammar,
                      stop_token_ids=self.extra_stop_token_ids)
        spec = None if params.speculative is False else params.speculative or self.default_spec
        if spec is not None:
            req.spec_state = SpecState(spec)
        self.scheduler.add(req)
        return request_id

    def check_request(self, prompt_token_ids: list[int], params: SamplingParams, *,
                      admission: bool = True) -> SamplingParams:
        """Check a request against this engine without queueing it (safe from any thread, and a
        query: nothing is written); return the parameters it runs with.

        The parameters' values were verified when they were made (``SamplingParams.verify``);
        what is checked here depends on the model and the engine: the prompt's length against
        ``max_model_len`` (the model's context, or the KV cache's capacity where that is smaller:
        ``kv_bound``), ``logit_bias`` token ids against the vocabulary, and (``admission``) room in
        the waiting queue. ``admission=False`` skips the queue: the caller admitted the request
        earlier. A server decides admission once, before it answers; deciding again later (on the
        engine thread, after a stream's headers are out) would turn a 429 into a broken stream.

        Returns:
            ``params`` itself; or, where the prompt leaves fewer than ``params.max_tokens`` tokens
            of ``max_model_len``, a copy whose ``max_tokens`` is that room (``context_room``
            records it): the budget check and the budget-aware masks then close a constrained
            answer before the context ends, where they would have planned for tokens the context
            cannot hold. Give the returned params to ``check_budget`` and ``add_request``.

        Raises:
            EngineError: naming the offending field.
            EngineOverloaded: the waiting queue is full.
        """
        n = len(prompt_token_ids)
        if n == 0:
            raise EngineError("prompt is empty: at least one token is needed", field="prompt", lead=True)
        if n >= self.max_model_len:
            if self.kv_bound:
                raise EngineError(f"the prompt of {n} tokens does not fit in the KV cache ({self.kv.num_blocks} "
                                  f"blocks of {self.config.block_size} tokens: at most {self.max_model_len - 1} "
                                  f"prompt tokens and one output token)", field="prompt")
            raise EngineError(f"the prompt has {n} tokens; this model allows at most {self.max_model_len - 1} "
                              f"(max_model_len {self.max_model_len} includes at least one output token)",
                              field="prompt")
        params.verify_token_ids(self.runner.vocab_size)
        if admission and len(self.scheduler.waiting) >= self.config.max_waiting:
            raise EngineOverloaded(f"{len(self.scheduler.waiting)} requests are waiting "
                                   f"(limit {self.config.max_waiting})")
        room = self.max_model_len - n
        if params.max_tokens > room:
            return dataclasses.replace(params, max_tokens=room, context_room=room)
        return params

    def check_budget(self, grammar, params: SamplingParams) -> None:
        """Refuse a constrained request whose ``max_tokens`` cannot hold the shortest output
        (with ``params.reasoning``: the region's forced tokens and the answer's shortest output;
        ``grammar`` None then stands for a free answer).

        Raises:
            EngineError: naming ``max_tokens`` and the minimum.
        """
        if grammar is None:
            if params.reasoning is None:
                return
            grammar = self.structured.free_answer()
        try:
            check_budget(grammar, params)
        except BudgetError as e:
            why = str(e)
            if params.context_room is not None:
                whose = "KV cache's room" if self.kv_bound else "model's context"
                why += (f" (max_tokens was lowered to {params.context_room}, the tokens the prompt leaves of the "
                        f"{whose} of {self.max_model_len}: shorten the prompt)")
            raise EngineError(why, field="max_tokens", lead=True) from None

    @property
    def kernels(self) -> dict[str, str]:
        """What computes the model: ``attention`` (backend name, plus "(torch fallback)" when the
        native backend cannot take this KV-cache dtype), ``int4_gemm`` ("native", "torch", or
        "none" without int4 weights), ``gguf_gemm`` (the GGUF block kernel's ISA and activation
        terms, "torch" for its fallback, "none" without block layers) and ``kv_cache_dtype``."""
        backend = self.runner.backend
        attention = backend.name
        supports = getattr(backend, "supports_cache", None)
        if supports is not None and not supports(self.runner.kv_caches[0][0]):
            attention += " (torch fallback)"
        return {"attention": attention, "int4_gemm": self._int4_gemm, "gguf_gemm": self._gguf_gemm,
                "kv_cache_dtype": str(self.runner.kv_dtype).removeprefix("torch.")}

    def stats(self) -> dict:
        """Gauges and counters for /metrics and /health (read without locks: approximate).

        ``kv_blocks_*`` and ``kv_usage`` speak of the KV cache's group 0 (the token capacity);
        a hybrid cache adds its sliding-window group's ``kv_sliding_blocks_total`` and
        ``kv_sliding_blocks_free``."""
        kv = self.kv
        sliding = {}
        if len(kv.groups) > 1:
            total, free = kv.group_blocks()[1]
            sliding = {"kv_sliding_blocks_total": total, "kv_sliding_blocks_free": free}
        return {
            "running": len(self.scheduler.running),
            "waiting": len(self.scheduler.waiting),
            "kv_blocks_total": kv.num_blocks,
            "kv_blocks_free": kv.num_free_blocks,
            **sliding,
            "kv_usage": kv.usage,
            "prefix_cache_hit_rate": kv.hit_rate,
            "prefix_cache_queries": kv.prefix_queries,
            "prefix_cache_hits": kv.prefix_hits,
            "num_preemptions": self.scheduler.num_preemptions,
            "num_steps": self.num_steps,
            "speculation": self.goodput.stats(),
        }

    def abort(self, request_id: str) -> bool:
        """Finish a request at once, freeing its blocks; False if it is unknown or already done."""
        req = self.scheduler.requests.get(request_id)
        if req is None:
            return False
        self.scheduler.finish(req, RequestStatus.FINISHED_ABORTED)
        return True

    def hold(self, request_id: str, held: bool) -> bool:
        """Hold a running request (``held=True``: the scheduler gives it no tokens; it keeps its
        blocks) or let it go on; False if it is unknown or already done. For a caller that is
        behind on the request's outputs (``stencil.engine.async_engine.EngineStream``)."""
        req = self.scheduler.requests.get(request_id)
        if req is None or req.is_finished:
            return False
        req.held = held
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.num_unfinished > 0

    # -- the step ------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule, mask, run, update, propose; return outputs of every request that changed
        (``self.started`` then lists the requests this step scheduled for the first time)."""
        start = time.perf_counter()
        timer = self.timer
        timer.start()
        sched = self.scheduler.schedule()
        self.idle = sched.is_empty  # nothing could run (e.g. every request waits for its grammar)
        self.started = self.scheduler.drain_started()
        timer.mark("schedule")
        outputs: list[RequestOutput] = []
        if not sched.is_empty:
            self.num_steps += 1
            failed: list[tuple[Request, BaseException]] = []
            bitmask = self.structured.grammar_bitmask(sched, failed)
            timer.mark("mask")
            result = self.runner.execute(sched, bitmask, timer)
            # Finished only now: the forward above still reads their block tables.
            for req, exc in failed:
                self._fail(req, "computing its grammar mask", exc)
            outputs = self._update(sched, result)
            self._account(sched, result.sampled, outputs, start)
            self._propose()  # may fail a request that already had an (unfinished) output
            timer.mark("propose")
        reported = {out.request_id for out in outputs if out.finished}
        for req in self.scheduler.drain_finished():
            if req.request_id not in reported:
                outputs.append(self._output(req, []))
        timer.mark("outputs")
        return outputs

    def _update(self, sched: SchedulerOutput, result: ModelRunnerOutput) -> list[RequestOutput]:
        """Apply the step's sampled tokens; an output per request that gained tokens."""
        self.drafter.learn(sched, result.sampled)
        updates = self.scheduler.update(sched, result.sampled, result.logprobs, result.top_logprobs)
        self.timer.mark("update")
        outputs = [self._output(req, new) for req, new in updates]
        self.timer.mark("outputs")
        return outputs

    def _account(self, sched: SchedulerOutput, sampled: list[list[int]], outputs: list[RequestOutput],
                 start: float) -> None:
        """Tell ``self.goodput`` what a decode step (no prompt rows) made and what it cost.

        Its cost runs from the schedule to the end of the update, plus the proposing of its
        drafts at the end of the step before; with a cost model, whatever the model says.
        """
        proposed, propose_ms = self._proposed, self._propose_ms
        self._proposed, self._propose_ms = 0, 0.0
        if any(sr.start < sr.request.num_prompt_tokens for sr in sched.scheduled):
            return  # prompt rows: the step's time says nothing about drafts
        drafts = sum(sr.num_drafts for sr in sched.scheduled)
        verified = [sr for sr in sched.scheduled if sr.sample]
        shape = StepShape(base_rows=sched.num_batched_tokens - drafts, draft_rows=drafts,
                          tokens=sum(len(o.new_token_ids) for o in outputs),
                          accepted=sum(len(t) - 1 for sr, t in zip(verified, sampled) if sr.num_drafts),
                          proposed=proposed, requests=len(sched.scheduled))
        if self.cost_model is not None:
            ms = self.cost_model(shape)
        else:
            ms = (time.perf_counter() - start) * 1e3 + propose_ms
        self.goodput.observe(shape, ms)

    def _propose(self) -> None:
        """Give each running request that may speculate its draft tokens for the next step,
        as far as ``self.goodput`` finds that drafting pays."""
        running = self.scheduler.running
        for req in running:
            req.draft_token_ids = []
        if not any(r.spec_state is not None for r in running):
            return
        plan = self.goodput.plan(pending_rows(running), measurable=not self.scheduler.prefill_pending())
        if not plan.draft:
            return
        if self.goodput.row_floor_ms is None:  # once, before the first drafts, after the step's time
            self._measure_row_floor()
        t0 = time.perf_counter()
        drafts = self.drafter.propose(running, DraftBudget(plan.threshold, self.row_tile, plan.max_drafts))
        for req, exc in drafts.failed:
            self._fail(req, "proposing draft tokens", exc)
        for req in running:
            req.draft_token_ids = drafts.tokens.get(req.request_id, [])
        self._proposed = drafts.proposed
        self._propose_ms = (time.perf_counter() - t0) * 1e3

    def _measure_row_floor(self) -> None:
        from stencil.engine.speculative.row_cost import decoder_row_ms

        self.goodput.row_floor_ms = decoder_row_ms(self.runner.model)
        log.info("a draft row costs at least %.3f ms (the decoder's projections, measured)", self.goodput.row_floor_ms)

    def _fail(self, req: Request, stage: str, exc: BaseException) -> None:
        """Finish one request with an error; the batch goes on without it (``Scheduler.fail``)."""
        self.scheduler.fail(req, stage, exc)

    def _output_text(self, req: Request) -> str:
        """The request's output text so far ("" before any, or without a detokenizer)."""
        detok = self._detok.get(req.request_id)
        return detok.text if detok is not None else ""

    def _output(self, req: Request, new: list[int]) -> RequestOutput:
        detok = self._detok.get(req.request_id)
        reasoning = req.params.reasoning
        split = reasoning is not None and req.matcher is not None
        if detok is None and new:
            detok = self._detok[req.request_id] = (
                ReasoningDetokenizer(self.tokenizer, req.params.stop, reasoning.end_text) if split
                else IncrementalDetokenizer(self.tokenizer, req.params.stop))
        text = thought = ""
        if detok is not None:
            try:
                if split:  # the answer's text in text, the reasoning's in thought
                    text, thought = detok.push(new, req.matcher)
                else:
                    text = detok.push(new)
                if detok.stopped and not req.is_finished:
                    # step() skips requests whose end it already reported: not reported twice.
                    self.scheduler.finish(req, RequestStatus.FINISHED_STOPPED)
                if req.is_finished:
                    if split:
                        more, more_thought = detok.finish()
                        text, thought = text + more, thought + more_thought
                    else:
                        text += detok.finish()
            except Exception as e:  # noqa: BLE001 - one request's text must not stop the batch
                text = thought = ""
                if req.is_finished:  # already ended (length, stop): report the failure all the same
                    req.status = RequestStatus.FINISHED_ERROR
                    req.error = f"internal error while detokenizing ({type(e).__name__}); see the server log"
                    log.error("request %s failed while detokenizing", req.request_id, exc_info=e)
                else:
                    self._fail(req, "detokenizing", e)
        finished = req.is_finished
        if finished:
            self._detok.pop(req.request_id, None)
        m = req.metrics
        return RequestOutput(
            request_id=req.request_id, new_token_ids=new, new_text=text, finished=finished,
            finish_reason=req.finish_reason if finished else None,
            num_prompt_tokens=req.num_prompt_tokens, num_output_tokens=req.num_output_tokens,
            num_cached_tokens=m.num_cached_tokens, error=req.error,
            ttft_ms=(m.first_token_time - m.arrival_time) * 1e3 if m.first_token_time else None,
            total_ms=(m.finished_time - m.arrival_time) * 1e3 if finished and m.finished_time else None,
            num_draft_tokens=m.num_draft_tokens, num_accepted_tokens=m.num_accepted_tokens,
            num_verify_steps=m.num_verify_steps, num_forced_tokens=m.num_forced_tokens,
            num_steps=m.num_steps,
            new_logprobs=req.output_logprobs[len(req.output_logprobs) - len(new):] if req.params.logprobs and new else [],
            closed_by_budget=finished and (bool(getattr(req.matcher, "closed_by_budget", False))
                                           or req.finish_reason_detail == "budget"),
            constraint_error=req.finish_reason_detail == "dead_end",
            budget_cuts=list(getattr(req.matcher, "narrowed", ())) if finished else [],
            guard_hits=list(getattr(req.matcher, "guarded", ())) if finished else [],
            budget_unenforced=getattr(req.matcher, "disabled", None) if finished else None,
            new_top_logprobs=(req.output_top_logprobs[len(req.output_top_logprobs) - len(new):]
                              if req.params.top_logprobs and new else []),
            context_room=req.params.context_room if finished else None,
            new_reasoning_text=thought,
            num_reasoning_tokens=self._reasoning_tokens(req) if split else 0,
            reasoning_cut=split and req.matcher.reasoning_cut,
        )

    @staticmethod
    def _reasoning_tokens(req: Request) -> int:
        """Output tokens through the reasoning's end marker and separator (all of them while
        the answer has not begun)."""
        start = req.matcher.answer_start
        return req.num_output_tokens if start is None else min(start, req.num_output_tokens)

    # -- convenience ---------------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams],
                 grammars: list | None = None) -> list[dict]:
        """Run requests to completion (tests, benchmarks, one-shot CLI).

        Returns, per prompt in order: ``{"token_ids", "text", "finish_reason", "error", "output"}``
        where ``output`` is the last RequestOutput.
        """
        plist = params if isinstance(params, list) else [params] * len(prompts)
        ids = []
        for i, p in enumerate(prompts):
            g = grammars[i] if grammars else None
            ids.append(self.add_request(None, p, plist[i], g))
        results = {rid: {"token_ids": [], "text": "", "finish_reason": None, "error": None, "output": None}
                   for rid in ids}
        while self.has_unfinished():
            for out in self.step():
                r = results.get(out.request_id)
                if r is None:
                    continue
                r["token_ids"].extend(out.new_token_ids)
                r["text"] += out.new_text
                r["output"] = out
                if out.finished:
                    r["finish_reason"] = out.finish_reason
                    r["error"] = out.error
        return [results[rid] for rid in ids]
