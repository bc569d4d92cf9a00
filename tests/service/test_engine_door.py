"""The engine door is enough: a third engine client, written from ``stencil.service.engine_client`` alone,
serves ``/generate`` and ``/v1/chat/completions`` through ``create_app``.

``SteppedEngine`` is the smallest engine that keeps the door's promises: an ``LLMEngine`` (the tiny model)
stepped on the event loop itself whenever a stream waits for an output, no thread, no compile behind
prefill (the grammar is compiled at admission, then the request added). Its answers are checked against
the same ``LLMEngine`` run directly, its refusals must come as status codes before any byte, and it must
end with every KV block back in the pool.
"""

from __future__ import annotations

import asyncio
import json
import time

import jsonschema
import pytest
from litestar.testing import TestClient

from stencil.engine.config import EngineConfig
from stencil.engine.llm_engine import LLMEngine
from stencil.engine.outputs import RequestOutput
from stencil.engine.request import SamplingParams
from stencil.service.app import create_app
from stencil.service.engine_client import EngineClient, RequestStream
from stencil.service.prompts import encode_prompt
from stencil.service.state import ServiceConfig

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"]}


class SteppedStream:
    """A ``RequestStream``: admission compiles the grammar and adds the request; iterating steps the engine."""

    replica = None  # one engine, in this process

    def __init__(self, door: "SteppedEngine", request_id: str, prompt: list[int], params: SamplingParams,
                 spec, backend: str | None, client: str | None):
        self._door, self._prompt, self._params, self._spec = door, prompt, params, spec
        self._backend, self._client = backend, client
        self.request_id = request_id
        self.started = asyncio.Event()
        self.grammar = None
        self.warnings: list[str] = []
        self.grammar_ms = 0.0
        self.outputs: list[RequestOutput] = []
        self._admitted = self._done = False

    async def admit(self) -> None:
        if self._admitted:
            return
        t = time.perf_counter()
        if self._spec is not None:
            # GrammarError (a 400 naming the constraint's field) comes out of the future.
            self.grammar = await asyncio.wrap_future(
                self._door.engine.grammar.submit(self._spec, self._backend, client=self._client))
            self.warnings = [str(w) for w in self.grammar.warnings]
        # EngineError (e.g. max_tokens below the grammar's shortest answer) or EngineOverloaded.
        self._door.engine.add_request(self.request_id, self._prompt, self._params, self.grammar)
        self._door.live[self.request_id] = self
        self.grammar_ms = (time.perf_counter() - t) * 1e3 if self._spec is not None else 0.0
        self._admitted = True
        self.started.set()  # no queue of its own to wait in: it runs at the next step

    def __aiter__(self) -> "SteppedStream":
        return self

    async def __anext__(self) -> RequestOutput:
        if self._done:
            raise StopAsyncIteration
        await self.admit()
        while not self.outputs:
            self._door.step()
            await asyncio.sleep(0)  # let the other requests' handlers run between steps
        out = self.outputs.pop(0)
        if out.finished:
            self._done = True
            self._door.live.pop(self.request_id, None)
        return out

    async def aclose(self) -> None:
        if not self._done:
            self._done = True
            if self._door.live.pop(self.request_id, None) is not None:
                self._door.engine.abort(self.request_id)  # its blocks go back at once


class SteppedEngine:
    """An ``EngineClient`` over a synchronous ``LLMEngine``, stepped on the caller's event loop. What the
    door reads of the model is fixed at construction: plain attributes serve where it declares properties
    (the grammar compiler's counters are a live object)."""

    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.error: BaseException | None = None
        self.on_dead = None
        self.vocab = engine.grammar.vocab
        self.vocab_size = self.vocab.model_vocab_size
        self.model_path = str(engine.config.model)
        self.kernels = engine.kernels
        self.grammar_stats = engine.grammar.stats
        self.stats = engine.stats
        self.live: dict[str, SteppedStream] = {}
        self.submitted: list[str] = []
        self._running = False

    def start(self) -> "SteppedEngine":
        self._running = True
        return self

    def shutdown(self, timeout: float = 10.0) -> None:
        self.abort_all()
        self._running = False
        self.engine.grammar.close()

    @property
    def is_alive(self) -> bool:
        return self._running

    def submit(self, prompt_token_ids, params, spec=None, *, request_id, grammar_backend=None,
               client=None) -> SteppedStream:
        self.submitted.append(request_id)
        return SteppedStream(self, request_id, list(prompt_token_ids), params, spec, grammar_backend, client)

    def step(self) -> None:
        for out in self.engine.step():
            stream = self.live.get(out.request_id)
            if stream is not None:
                stream.outputs.append(out)

    def abort_all(self) -> int:
        ids = list(self.live)
        for rid in ids:
            self.engine.abort(rid)
        return len(ids)

    def replica_health(self) -> None:
        return None


@pytest.fixture(scope="module")
def door(tiny_model_dir):
    return SteppedEngine(LLMEngine(EngineConfig(model=tiny_model_dir, num_kv_blocks=128, max_num_seqs=8)))


@pytest.fixture(scope="module")
def client(door):
    app = create_app(door, ServiceConfig(model_name="tiny", max_tokens_cap=128, default_max_tokens=16,
                                         request_timeout_s=60))
    with TestClient(app, timeout=60) as c:
        yield c


def _reference(door: SteppedEngine, ids: list[int], max_tokens: int, grammar=None) -> dict:
    """The same ``LLMEngine`` run directly, greedy: what the door must have served."""
    return door.engine.generate([ids], SamplingParams(max_tokens=max_tokens, temperature=0.0),
                                [grammar] if grammar is not None else None)[0]


def _sse(text: str) -> list:
    return [line[len("data: "):] if line == "data: [DONE]" else json.loads(line[len("data: "):])
            for line in text.splitlines() if line.startswith("data: ")]


def test_the_third_engine_is_an_engine_client(door):
    assert isinstance(door, EngineClient)
    assert isinstance(door.submit([1, 2], SamplingParams(max_tokens=1), request_id="x"), RequestStream)


def test_generate_serves_the_engines_own_answer_whole_and_streamed(client, door):
    ids = encode_prompt(door.tokenizer, "The capital of France is", None, None)
    want = _reference(door, ids, 12)
    r = client.post("/generate", json={"prompt": "The capital of France is", "max_tokens": 12, "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["text"] == want["text"] and body["finish_reason"] == want["finish_reason"]
    assert body["usage"]["prompt_tokens"] == len(ids) and body["usage"]["completion_tokens"] == len(want["token_ids"])
    assert "x-stencil-replica" not in r.headers  # the stream's replica is None here

    r = client.post("/generate", json={"prompt": "The capital of France is", "max_tokens": 12, "temperature": 0,
                                       "stream": True})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = _sse(r.text)
    assert events[-1] == "[DONE]" and events[-2]["type"] == "final"
    assert "".join(e["text"] for e in events if isinstance(e, dict) and e["type"] == "delta") == want["text"]


def test_a_constrained_answer_through_the_door(client, door):
    r = client.post("/generate", json={"prompt": "Ann is 30.", "response_schema": PERSON, "max_tokens": 64,
                                       "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["valid"] is True and body["finish_reason"] == "stop", body
    jsonschema.Draft202012Validator(PERSON).validate(body["output"])  # an independent oracle
    assert body["timings"]["grammar_ms"] > 0  # the stream's grammar_ms reached the response

    r = client.post("/v1/chat/completions", json={
        "model": "tiny", "max_tokens": 64, "temperature": 0, "messages": [{"role": "user", "content": "Ann, 30"}],
        "response_format": {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "stop"
    jsonschema.Draft202012Validator(PERSON).validate(json.loads(choice["message"]["content"]))


def test_chat_completions_free_text_is_the_engines_answer(client, door):
    messages = [{"role": "user", "content": "Say hello."}]
    ids = encode_prompt(door.tokenizer, None, messages, None)
    want = _reference(door, ids, 10)
    r = client.post("/v1/chat/completions", json={"model": "tiny", "max_tokens": 10, "temperature": 0,
                                                  "messages": messages})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["choices"][0]["message"]["content"] == want["text"]
    assert body["usage"]["prompt_tokens"] == len(ids)


def test_refusals_come_before_the_first_byte(client, door):
    """Every refusal ``admit`` raises is a status code, streamed or not, named by its field."""
    before = len(door.submitted)
    # max_tokens below the schema's shortest answer: the engine's EngineError at admission.
    r = client.post("/generate", json={"prompt": "x", "response_schema": PERSON, "max_tokens": 2, "stream": True})
    assert r.status_code == 400 and r.json()["field"] == "max_tokens", r.text
    assert "text/event-stream" not in r.headers.get("content-type", "")
    # A constraint the compiler refuses: its GrammarError named after the /generate field.
    r = client.post("/generate", json={"prompt": "x", "regex": "(ab[", "stream": True})
    assert r.status_code == 400 and r.json()["field"] == "regex", r.text
    # The same through the OpenAI route: its error shape, a status code, no stream.
    r = client.post("/v1/chat/completions", json={
        "model": "tiny", "max_tokens": 2, "stream": True, "messages": [{"role": "user", "content": "x"}],
        "response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens", r.text
    assert len(door.submitted) == before + 3  # each went through the door, and was refused there
    # ... and the engine is none the worse: nothing live, every block back, the next answer served.
    assert door.live == {}
    s = door.engine.stats()
    assert s["running"] == 0 and s["waiting"] == 0 and s["kv_blocks_free"] == s["kv_blocks_total"], s
    assert client.post("/generate", json={"prompt": "Hi", "max_tokens": 3}).status_code == 200


def test_health_and_metrics_read_the_door_only(client):
    h = client.get("/health")
    assert h.status_code == 200 and h.json()["status"] == "ok" and h.json()["replicas"] is None
    assert h.json()["engine"]["kv_blocks_total"] == 128
    m = client.get("/metrics").text
    assert "stencil_engine_alive 1.0" in m and "stencil_grammar_compiles_total" in m
    assert "stencil_replica_up" not in m
