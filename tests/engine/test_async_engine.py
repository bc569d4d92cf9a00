"""AsyncEngine's flow control: a stream whose caller stops taking outputs holds its request."""

from __future__ import annotations

import asyncio
import time

import pytest

from stencil.engine import async_engine
from stencil.engine.async_engine import AsyncEngine
from stencil.engine.config import EngineConfig
from stencil.engine.request import SamplingParams

PROMPT = [1, 2, 3, 4, 5]
PARAMS = SamplingParams(max_tokens=120, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def aeng(tiny_model_dir):
    eng = AsyncEngine(EngineConfig(model=tiny_model_dir, num_kv_blocks=64)).start()
    yield eng
    eng.shutdown()


async def _until(pred, timeout_s: float = 60.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if pred():
            return True
        await asyncio.sleep(0.01)
    return False


def test_an_unread_stream_is_held_then_let_go_and_ends_with_the_same_tokens(aeng):
    async def main():
        ref = [t async for out in aeng.generate(PROMPT, PARAMS) for t in out.new_token_ids]
        assert len(ref) == PARAMS.max_tokens

        stream = aeng.submit(PROMPT, PARAMS, request_id="unread")
        assert await _until(lambda: "unread" in aeng.engine.scheduler.requests)
        req = aeng.engine.scheduler.requests["unread"]
        # Nobody reads: the engine runs until HOLD_AT outputs wait, then holds the request.
        assert await _until(lambda: req.held)
        assert stream.held and not req.is_finished
        made = req.num_output_tokens
        # Another request runs to its end meanwhile; the held one makes no token.
        other = [t async for out in aeng.generate([9, 8, 7], PARAMS) for t in out.new_token_ids]
        assert len(other) == PARAMS.max_tokens
        assert req.num_output_tokens == made < PARAMS.max_tokens
        assert stream._queue.qsize() >= async_engine.HOLD_AT
        # Reading lets it go (below RELEASE_AT untaken) and it runs to the end, tokens unchanged.
        got = [t async for out in stream for t in out.new_token_ids]
        assert got == ref
        assert not req.held and aeng.engine.stats()["running"] == 0

    asyncio.run(main())


def test_a_held_request_frees_its_blocks_when_aborted(aeng):
    async def main():
        free = aeng.engine.stats()["kv_blocks_free"]
        stream = aeng.submit(PROMPT, PARAMS, request_id="abandoned")
        assert await _until(lambda: "abandoned" in aeng.engine.scheduler.requests)
        req = aeng.engine.scheduler.requests["abandoned"]
        assert await _until(lambda: req.held)
        assert aeng.engine.stats()["kv_blocks_free"] < free
        await stream.aclose()  # the caller gives up: abort
        assert await _until(lambda: aeng.engine.stats()["kv_blocks_free"] == free)
        assert aeng.engine.stats()["running"] == 0

    asyncio.run(main())


def test_submit_queues_the_request_while_its_grammar_compiles_and_admit_raises_its_refusals(aeng):
    """``submit`` takes the whole request: it is in the engine before ``admit`` returns (compile
    behind prefill); ``admit`` gives the compiled grammar, its wait and its notes, or raises the
    compile's and the budget's errors with the request gone and its blocks back."""
    from concurrent.futures import Future

    from stencil.engine.llm_engine import EngineError
    from stencil.grammar.base import GrammarError, GrammarSpec

    sent = []
    inbox = aeng._inbox

    class Spy:  # the commands submit sends the engine thread
        def put(self, cmd):
            sent.append(cmd)
            inbox.put(cmd)

        def __getattr__(self, name):
            return getattr(inbox, name)

    async def main():
        free = aeng.engine.stats()["kv_blocks_free"]
        params = SamplingParams(max_tokens=8, temperature=0.0)
        aeng._inbox = Spy()
        try:
            stream = aeng.submit(PROMPT, params, GrammarSpec("regex", "(yes|no)"), request_id="yesno")
        finally:
            aeng._inbox = inbox
        # Queued at once, its grammar a future the engine polls while it reads the prompt.
        assert [(c[0], c[1], type(c[4])) for c in sent] == [("add", "yesno", Future)]
        assert stream.grammar is None and stream.replica is None  # not admitted yet
        await stream.admit()
        assert stream.grammar is not None and stream.grammar_ms > 0 and stream.warnings == []
        outs = [out async for out in stream]
        assert "".join(o.new_text for o in outs) in ("yes", "no") and outs[-1].finish_reason == "stop"
        assert stream.started.is_set()

        bad = aeng.submit(PROMPT, params, GrammarSpec("regex", "(ab["), request_id="bad")
        with pytest.raises(GrammarError):
            await bad.admit()
        short = aeng.submit(PROMPT, SamplingParams(max_tokens=2, temperature=0.0),
                            GrammarSpec("regex", "[0-9]{5}"), request_id="short")
        with pytest.raises(EngineError) as e:
            await short.admit()
        assert e.value.field == "max_tokens"
        assert await _until(lambda: not aeng.engine.scheduler.requests)
        assert aeng.engine.stats()["kv_blocks_free"] == free

    asyncio.run(main())


def test_the_local_engine_is_an_engine_client(aeng):
    from stencil.service.engine_client import EngineClient

    assert isinstance(aeng, EngineClient)
    assert aeng.vocab_size == aeng.engine.runner.vocab_size
    assert aeng.stats()["kv_blocks_total"] == 64 and aeng.vocab.token_bytes


def test_shutdown_closes_the_grammar_pool_even_when_the_join_fails():
    from types import SimpleNamespace

    closed = []
    aeng = AsyncEngine(engine=SimpleNamespace(grammar=SimpleNamespace(close=lambda: closed.append(True))))

    class BrokenThread:
        def join(self, timeout=None):
            raise RuntimeError("join failed")

    aeng._thread = BrokenThread()
    with pytest.raises(RuntimeError, match="join failed"):
        aeng.shutdown()
    assert closed == [True]
    from stencil.service.app import stop_engine

    stop_engine(aeng)  # logs, never raises
    assert closed == [True, True]
