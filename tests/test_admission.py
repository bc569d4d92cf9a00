"""Admission is first come, first served: the scheduler starts waiting requests in arrival order,
a request still compiling its grammar keeps its place, and the engine reports each start once."""

from __future__ import annotations

from concurrent.futures import Future

from engine.config import EngineConfig
from engine.kv_cache_manager import KVCacheManager
from engine.request import Request, RequestStatus, SamplingParams
from engine.scheduler import Scheduler


class _Ready:
    """A compiled grammar stand-in (the scheduler only asks it for a matcher)."""

    def matcher(self):
        return None


def test_waiting_requests_start_in_arrival_order():
    sched = Scheduler(EngineConfig(model="unused", max_num_seqs=2, max_num_batched_tokens=64),
                      KVCacheManager(64, 16), max_model_len=256)
    compiling: Future = Future()
    reqs = [Request(f"r{i}", [1, 2, 3, i], SamplingParams(max_tokens=4, close_on_budget=False), eos_token_id=None,
                    grammar_future=compiling if i == 1 else None) for i in range(6)]
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
