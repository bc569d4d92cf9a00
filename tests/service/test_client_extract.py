"""The client's validation re-asks, hooks and ``extract_many``: live on the tiny model where the
server's part matters (the conversation sent, the prefix cache, answers in order), a mock transport
where the timing must be forced (concurrency, errors in flight)."""

from __future__ import annotations

import asyncio
import json
import threading
from typing import Annotated

import httpx
import msgspec
import pytest

from stencil.service.client import (AsyncClient, Client, ExtractionError, StencilError, ValidationFailed,
                                    reask_message, validation_message)
from service_live import tiny_live_server

Digit = Annotated[int, msgspec.Meta(ge=0, le=9)]


class Span(msgspec.Struct):
    start: Digit
    end: Digit


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    with tiny_live_server(tiny_model_dir) as live:
        yield live


class Recorder:
    """The three hooks, recording what they were called with, and the requests in flight."""

    def __init__(self) -> None:
        self.requests: list[dict] = []
        self.answers: list[tuple[dict, dict]] = []
        self.retries: list[tuple[int, BaseException]] = []
        self.in_flight = self.peak = 0
        self._lock = threading.Lock()

    def on_request(self, body: dict) -> None:
        with self._lock:
            self.requests.append(body)
            self.in_flight += 1
            self.peak = max(self.peak, self.in_flight)

    def on_response(self, body: dict, answer: dict) -> None:
        with self._lock:
            self.answers.append((body, answer))
            self.in_flight -= 1

    def on_retry(self, attempt: int, error: BaseException) -> None:
        self.retries.append((attempt, error))

    def hooks(self) -> dict:
        return dict(on_request=self.on_request, on_response=self.on_response, on_retry=self.on_retry)


# -- re-asks (live) ------------------------------------------------------------------------------------


def test_reask_after_a_failed_check_then_accepts(server):
    """A check no schema states fails the first answer: the re-ask carries the answer and the
    error, the second answer passes, and the prefix cache holds the re-ask's start."""
    seen: list[Span] = []

    def validate(span: Span) -> None:
        seen.append(span)
        if len(seen) == 1:
            raise ValueError("end must come after start")

    rec = Recorder()
    with Client(server.url, **rec.hooks()) as c:
        span = c.extract(Span, "Give a span.", validate=validate, max_retries=2, max_tokens=24)
    assert len(seen) == 2 and span == seen[1]
    assert [(n, str(e)) for n, e in rec.retries] == [(1, "end must come after start")]
    first, second = rec.requests
    assert [body for body, _ in rec.answers] == [first, second]
    first_answer, second_answer = (answer for _, answer in rec.answers)
    assert first["messages"] == [{"role": "user", "content": "Give a span."}]  # a plain prompt becomes a turn
    assert second["messages"] == first["messages"] + [
        {"role": "assistant", "content": first_answer["text"]},
        {"role": "user", "content": reask_message("end must come after start")}]
    assert second["response_schema"] == first["response_schema"] and second["max_tokens"] == 24
    assert span == msgspec.convert(second_answer["output"], Span)
    # Whole 16-token blocks of the first prompt at least: the re-ask repeats it.
    assert second_answer["usage"]["prompt_tokens"] > first_answer["usage"]["prompt_tokens"]
    assert second_answer["usage"]["cached_tokens"] >= first_answer["usage"]["prompt_tokens"] // 16 * 16 > 0


def test_model_validator_failures_exhaust_the_retries(server):
    """A pydantic model validator that no answer can pass: three answers, each quoted back in the
    growing conversation, then ``ValidationFailed`` holding all three."""
    pydantic = pytest.importorskip("pydantic")

    class Window(pydantic.BaseModel):
        start: int = pydantic.Field(ge=0, le=9)
        end: int = pydantic.Field(ge=0, le=9)

        @pydantic.model_validator(mode="after")
        def wide(self):
            if self.end - self.start < 10:
                raise ValueError("end - start must be at least 10")
            return self

    rec = Recorder()

    async def go():
        async with AsyncClient(server.url, **rec.hooks()) as c:
            with pytest.raises(ValidationFailed) as e:
                await c.extract(Window, [{"role": "user", "content": "A wide window."}], max_retries=2, max_tokens=24)
            return e.value

    err = asyncio.run(go())
    assert isinstance(err, ExtractionError) and isinstance(err.__cause__, pydantic.ValidationError)
    error = "Value error, end - start must be at least 10"
    assert [(a.text, a.error) for a in err.attempts] == [(answer["text"], error) for _, answer in rec.answers]
    assert len(err.attempts) == 3 and err.response is rec.answers[-1][1]
    assert [n for n, _ in rec.retries] == [1, 2]
    assert [len(body["messages"]) for body in rec.requests] == [1, 3, 5]
    assert rec.requests[2]["messages"][3] == {"role": "assistant", "content": err.attempts[1].text}


# -- re-asks and hooks (mock transport) -------------------------------------------------------------------


def _answer(output) -> dict:
    return {"id": "r", "text": json.dumps(output), "output": output, "valid": True, "finish_reason": "stop",
            "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}


def test_without_retries_a_prompt_stays_a_prompt_and_one_failure_raises():
    bodies = []

    def handler(request):
        bodies.append(json.loads(request.content))
        return httpx.Response(200, json=_answer({"start": 5, "end": 2}))

    def ordered(span: Span) -> None:
        if span.end <= span.start:
            raise AssertionError  # an empty assert, as a plain ``assert`` outside pytest raises

    with Client("http://x", transport=httpx.MockTransport(handler)) as c:
        with pytest.raises(ValidationFailed) as e:
            c.extract(Span, "p", validate=ordered)
        assert c.extract(Span, "p") == Span(5, 2)  # no validate: the type alone decides
        with pytest.raises(ValueError):
            c.extract(Span, "p", max_retries=-1)
    assert [b["prompt"] for b in bodies] == ["p", "p"]
    assert [(a.text, a.error) for a in e.value.attempts] == [('{"start": 5, "end": 2}', "AssertionError")]


def test_a_cut_answer_is_not_reasked():
    calls = []

    def handler(request):
        calls.append(1)
        return httpx.Response(200, json={**_answer(None), "valid": False, "finish_reason": "length"})

    with Client("http://x", transport=httpx.MockTransport(handler)) as c:
        with pytest.raises(ExtractionError) as e:
            c.extract(Span, "p", max_retries=3)
    assert calls == [1] and not isinstance(e.value, ValidationFailed)


def test_validation_messages_are_short_lines():
    assert validation_message(ValueError("end  before\nstart")) == "end before start"
    assert validation_message(AssertionError()) == "AssertionError"
    with pytest.raises(msgspec.ValidationError) as e:
        msgspec.convert({"start": 12, "end": 1}, Span)
    assert validation_message(e.value) == "Expected `int` <= 9 - at `$.start`"
    assert len(validation_message(ValueError("x" * 1000))) == 300
    pydantic = pytest.importorskip("pydantic")

    class P(pydantic.BaseModel):
        a: int
        b: list[int]

    with pytest.raises(pydantic.ValidationError) as e:
        P.model_validate({"a": "x", "b": [1, "y"]})
    assert validation_message(e.value) == ("a: Input should be a valid integer, unable to parse string as an integer; "
                                           "b.1: Input should be a valid integer, unable to parse string as an integer")


def test_hooks_see_streams_but_not_failed_requests():
    stream = (b'data: {"type":"delta","text":"{}"}\n\n'
              b'data: {"type":"final","output":{},"valid":true,"finish_reason":"stop","usage":{}}\n\ndata: [DONE]\n\n')

    def handler(request):
        body = json.loads(request.content)
        if body.get("prompt") == "bad":
            return httpx.Response(400, json={"detail": "no"})
        return httpx.Response(200, content=stream)

    rec = Recorder()
    with Client("http://x", transport=httpx.MockTransport(handler), **rec.hooks()) as c:
        assert list(c.stream("p", max_tokens=3)) == ["{}"]
        with pytest.raises(StencilError):
            c.generate("bad")
    assert rec.requests == [{"prompt": "p", "stream": True, "max_tokens": 3}, {"prompt": "bad"}]
    assert rec.answers == [(rec.requests[0], {"output": {}, "valid": True, "finish_reason": "stop", "usage": {},
                                              "type": "final", "text": "{}"})]


# -- extract_many ---------------------------------------------------------------------------------------------


def test_extract_many_live_in_input_order(server):
    """Results in input order (each the answer to its own text), one progress call per item,
    never more than ``concurrency`` requests in flight."""
    texts = [f"Span number {i}." for i in range(5)]
    rec, calls = Recorder(), []
    with Client(server.url, **rec.hooks()) as c:
        results = c.extract_many(Span, texts, concurrency=2, progress=lambda done, total: calls.append((done, total)),
                                 max_tokens=24)
    assert calls == [(n, 5) for n in range(1, 6)]
    output_of = {body["prompt"]: answer["output"] for body, answer in rec.answers}
    assert results == [msgspec.convert(output_of[t], Span) for t in texts]
    assert 1 <= rec.peak <= 2


def test_sync_extract_many_runs_concurrency_requests_at_once():
    """Each request waits until three are in flight (a barrier): only exactly three workers pass."""
    barrier = threading.Barrier(3, timeout=10)

    def handler(request):
        barrier.wait()
        n = int(json.loads(request.content)["prompt"])
        return httpx.Response(200, json=_answer({"start": n, "end": n}))

    rec = Recorder()
    with Client("http://x", transport=httpx.MockTransport(handler), **rec.hooks()) as c:
        results = c.extract_many(Span, [str(n) for n in range(6)], concurrency=3)
        assert c.extract_many(Span, []) == []
        with pytest.raises(ValueError):
            c.extract_many(Span, ["1"], concurrency=0)
    assert results == [Span(n, n) for n in range(6)] and rec.peak == 3


def test_async_extract_many_concurrency_and_first_error():
    async def go():
        barrier = asyncio.Barrier(2)

        async def handler(request):
            prompt = json.loads(request.content)["prompt"]
            if prompt.startswith("together"):
                await asyncio.wait_for(barrier.wait(), 10)
            await asyncio.sleep(0)
            if prompt == "bad":
                return httpx.Response(400, json={"detail": "bad text"})
            if prompt == "slow":
                for _ in range(20):  # still in flight when "bad" has failed
                    await asyncio.sleep(0)
            return httpx.Response(200, json=_answer({"start": len(prompt) % 10, "end": 0}))

        rec = Recorder()
        async with AsyncClient("http://x", transport=httpx.MockTransport(handler), **rec.hooks()) as c:
            together = await c.extract_many(Span, ["together1", "together22", "x"], concurrency=2)
            peak = rec.peak
            kept = await c.extract_many(Span, ["ab", "bad"], return_exceptions=True)
            rec.requests.clear()
            rec.answers.clear()
            with pytest.raises(StencilError) as e:
                await c.extract_many(Span, ["bad", "slow", "later", "later"], concurrency=2)
        return together, peak, kept, e.value, rec

    together, peak, kept, err, rec = asyncio.run(go())
    assert together == [Span(9, 0), Span(0, 0), Span(1, 0)] and peak == 2
    assert kept[0] == Span(2, 0) and isinstance(kept[1], StencilError) and kept[1].status == 400
    assert err.status == 400 and err.message == "bad text"
    # "slow" was in flight and finished; nothing was started after the failure
    assert [b["prompt"] for b in rec.requests] == ["bad", "slow"]
    assert [b["prompt"] for b, _ in rec.answers] == ["slow"]
