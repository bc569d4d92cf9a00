"""Overload: past the waiting-queue limit, requests are refused at once with 429 + Retry-After,
while every admitted request still completes and the server stays responsive.

A live server on the tiny model with 2 running slots and a waiting queue of 4. Six long requests
fill both; while they run, a burst of ten more must each get 429 promptly (no queueing, no
timeout), ``/health`` must answer promptly, and afterwards the six admitted ones must finish
with all their tokens and leave no block behind.
"""

from __future__ import annotations

import asyncio
import re

import httpx
import pytest

from stencil.engine.config import EngineConfig
from stencil.service.state import service_state
from stencil.service.state import ServiceConfig
from service_live import LiveServer, wait_until

RUNNING, WAITING = 2, 4
LONG = {"prompt": "load", "regex": "[ab]{2000}", "max_tokens": 600, "close_on_budget": False}  # seconds per request on the tiny model


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    srv = LiveServer(EngineConfig(model=tiny_model_dir, num_kv_blocks=256, max_num_seqs=RUNNING, max_waiting=WAITING),
                     ServiceConfig(max_tokens_cap=1024, retry_after_s=2, request_timeout_s=120)).start()
    yield srv
    srv.stop()


def _wait(pred, timeout_s: float = 20.0) -> bool:
    return wait_until(pred, timeout_s)


async def _post(ac: httpx.AsyncClient, path: str, body: dict) -> httpx.Response:
    return await ac.post(path, json=body)


def test_burst_beyond_the_queue_gets_429_and_admitted_requests_complete(server):
    eng = service_state(server.app).engine.engine

    async def scenario():
        limits = httpx.Limits(max_connections=64)
        async with httpx.AsyncClient(base_url=server.url, timeout=120, limits=limits) as ac:
            # Fill the running slots first, then the queue: requests that arrive between two engine
            # steps all count as waiting until the next step admits some.
            admitted = [asyncio.ensure_future(_post(ac, "/generate", LONG)) for _ in range(RUNNING)]
            assert await asyncio.to_thread(_wait, lambda: eng.stats()["running"] == RUNNING), eng.stats()
            admitted += [asyncio.ensure_future(_post(ac, "/generate", LONG)) for _ in range(WAITING)]
            assert await asyncio.to_thread(_wait, lambda: eng.stats()["waiting"] == WAITING), eng.stats()
            burst = await asyncio.gather(*(_post(ac, "/generate", {**LONG, "prompt": f"extra {i}"})
                                           for i in range(10)))
            openai = await _post(ac, "/v1/completions", {"prompt": "extra", "max_tokens": 4})
            h = await ac.get("/health")
            # The refusals and the health answer came while every admitted request still ran: none
            # of them waited for a slot (no clock needed to say so).
            assert eng.stats()["running"] == RUNNING, "the burst ran out before the admitted requests"
            return await asyncio.gather(*admitted), burst, openai, h

    admitted, burst, openai, health = asyncio.run(scenario())

    for r in burst:
        assert r.status_code == 429, r.text
        assert r.headers["retry-after"] == "2", r.headers
        p = r.json()
        assert p["title"] == "Too Many Requests" and f"limit {WAITING}" in p["detail"], p
    r = openai
    assert r.status_code == 429 and r.headers["retry-after"] == "2", r.text
    assert r.json()["error"]["type"] == "rate_limit_error"
    assert health.status_code == 200, health.text

    for r in admitted:
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["finish_reason"] == "length" and body["usage"]["completion_tokens"] == LONG["max_tokens"]
        assert re.fullmatch("[ab]+", body["text"])

    assert _wait(lambda: eng.stats()["running"] == 0 and eng.stats()["waiting"] == 0)
    stats = eng.stats()
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"], stats
    # Once the queue drains, new requests are admitted again.
    assert httpx.post(server.url + "/generate", json={"prompt": "x", "max_tokens": 2}, timeout=30).status_code == 200


def test_a_request_queued_past_its_deadline_gets_429_and_leaves_the_queue(server):
    """With both running slots busy, requests that may wait 0.5 s for one (plain and streamed)
    are answered 429 + Retry-After when the wait runs out, never a started stream, and leave the
    queue; a client that hangs up while queued takes its request off the queue."""
    eng = service_state(server.app).engine.engine

    async def scenario():
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as ac:
            busy = [asyncio.ensure_future(ac.post("/generate", json=LONG)) for _ in range(RUNNING)]
            assert await asyncio.to_thread(_wait, lambda: eng.stats()["running"] == RUNNING), eng.stats()
            quick = {**LONG, "queue_timeout": 0.5}
            plain, streamed = await asyncio.gather(ac.post("/generate", json=quick),
                                                   ac.post("/generate", json={**quick, "stream": True}))
            # Their aborts reach the engine thread between two steps.
            emptied = await asyncio.to_thread(_wait, lambda: eng.stats()["waiting"] == 0)
            # A client that gives up while queued: its request must leave the queue.
            gone = asyncio.ensure_future(ac.post("/generate", json={**LONG, "prompt": "gone"}))
            assert await asyncio.to_thread(_wait, lambda: eng.stats()["waiting"] == 1), eng.stats()
            gone.cancel()
            left = await asyncio.to_thread(_wait, lambda: eng.stats()["waiting"] == 0)
            for b in busy:
                b.cancel()
            await asyncio.gather(*busy, return_exceptions=True)
            return plain, streamed, emptied, left

    plain, streamed, emptied, left = asyncio.run(scenario())
    for r in (plain, streamed):
        assert r.status_code == 429, r.text
        assert r.headers["retry-after"] == "2"
        assert "waited" in r.json()["detail"] and "retry later" in r.json()["detail"]
        assert "text/event-stream" not in r.headers.get("content-type", "")
    assert emptied, "the timed-out requests stayed queued"
    assert left, "a request whose client hung up stayed queued"
    assert _wait(lambda: eng.stats()["running"] == 0 and eng.stats()["waiting"] == 0)
    stats = eng.stats()
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"], stats


def test_a_request_may_queue_for_half_its_deadline_unless_told_otherwise():
    """The queue may not eat the whole deadline (a request admitted at its end would run into a
    504): by default it waits for a slot at most half the request timeout, then gets a 429."""
    from types import SimpleNamespace

    from stencil.engine.config import ConfigError
    from stencil.service.generation import GenerationStream

    def deadline(config, queue_timeout_s=None):
        state = SimpleNamespace(config=config.validate())
        return GenerationStream(state, None, None, None, "r", arrival=100.0,
                                queue_timeout_s=queue_timeout_s).queue_deadline

    assert deadline(ServiceConfig(request_timeout_s=300)) == 250.0
    assert deadline(ServiceConfig(request_timeout_s=300, max_queue_wait_s=20)) == 120.0
    assert deadline(ServiceConfig(request_timeout_s=300), queue_timeout_s=280) == 380.0  # the client's own
    assert deadline(ServiceConfig(request_timeout_s=60), queue_timeout_s=999) == 160.0
    with pytest.raises(ConfigError, match="max_queue_wait_s"):
        ServiceConfig(request_timeout_s=60, max_queue_wait_s=61).validate()
