"""Admission is first come, first served: the scheduler starts waiting requests in arrival order,
a request still compiling its grammar starts reading its prompt in its turn (or, with nothing to
read before its last token, keeps its place), and the engine reports each start once."""

from __future__ import annotations

from concurrent.futures import Future

from stencil.engine.config import EngineConfig
from stencil.engine.kv_cache_manager import KVCacheManager
from stencil.engine.request import Request, RequestStatus, SamplingParams
from stencil.engine.scheduler import Scheduler


class _Ready:
    """A compiled grammar stand-in (the scheduler only asks it for a matcher)."""

    def matcher(self):
        return None


def test_waiting_requests_start_in_arrival_order():
    sched = Scheduler(EngineConfig(model="unused", max_num_seqs=2, max_num_batched_tokens=64),
                      KVCacheManager(64, 16), max_model_len=256)
    compiling: Future = Future()
    # r1's prompt is one token: nothing of it can be read before its grammar is ready.
    reqs = [Request(f"r{i}", [1] if i == 1 else [1, 2, 3, i], SamplingParams(max_tokens=4, close_on_budget=False),
                    eos_token_id=None, grammar_future=compiling if i == 1 else None) for i in range(6)]
    for r in reqs:
        sched.add(r)
    order: list[str] = []
    for step in range(20):
        if step == 1:
            # r1's grammar is ready now: it goes before every request still waiting behind it.
            compiling.set_result(_Ready())
        sched.schedule()
        order += sched.drain_started()
        for r in list(sched.running):  # each running request finishes after one step
            sched.finish(r, RequestStatus.FINISHED_STOPPED)
        if not sched.waiting:
            break
    # r2 went ahead while r1 compiled; then r1 took the first free slot, before r3.
    assert order == ["r0", "r2", "r1", "r3", "r4", "r5"]


def test_a_compiling_request_starts_in_its_turn_and_reads_all_but_its_last_token():
    sched = Scheduler(EngineConfig(model="unused", max_num_seqs=4, max_num_batched_tokens=64),
                      KVCacheManager(64, 16), max_model_len=256)
    compiling: Future = Future()
    slow = Request("slow", list(range(1, 21)), SamplingParams(max_tokens=4, close_on_budget=False),
                   eos_token_id=None, grammar_future=compiling)
    fast = Request("fast", [5, 6, 7], SamplingParams(max_tokens=4), eos_token_id=None)
    sched.add(slow)
    sched.add(fast)
    out = sched.schedule()
    assert sched.drain_started() == ["slow", "fast"]
    assert [(s.request.request_id, s.num_new_tokens, s.sample) for s in out.scheduled] == [
        ("slow", 19, False), ("fast", 3, True)]
    slow.num_computed_tokens = 19  # the step ran
    assert not any(s.request is slow for s in sched.schedule().scheduled)  # waits for its grammar
    compiling.set_result(_Ready())
    out = sched.schedule()
    assert [(s.request.request_id, s.num_new_tokens, s.sample) for s in out.scheduled if s.request is slow] == [
        ("slow", 1, True)]
    assert slow.grammar_future is None
