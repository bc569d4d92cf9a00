"""The cluster ingress without Ray: the Litestar app over a ClusterEngine whose "replicas" are
real ``EngineReplica`` objects (tiny model) called in process, with injected failures.

Pins: the same answers as one engine; refusals as status codes before the first byte;
a replica dying mid-request is invisible to the client (retry + replay), a replay that differs
or attempts that run out give a clear 503; a client leaving cancels the replica call.
"""

from __future__ import annotations

import asyncio
import itertools
import json

import pytest
from litestar.testing import TestClient

from stencil.engine.config import EngineConfig
from stencil.engine.outputs import RequestOutput
from stencil.service.app import create_app
from stencil.service.state import service_state
from stencil.service.cluster.cluster_engine import ClusterEngine, ClusterSettings
from stencil.service.cluster.messages import Admitted, Refusal
from stencil.service.cluster.replica import EngineReplica
from stencil.service.state import ServiceConfig


class ReplicaGone(Exception):
    """Stands for Ray's ActorDiedError."""


class Full(Exception):
    """Stands for Serve's BackPressureError."""


class FakeCall:
    """A streaming call on an in-process replica; ``die_after`` items, then ``ReplicaGone``."""

    def __init__(self, agen, die_after: int | None = None):
        self._agen = agen
        self._n = 0
        self.die_after = die_after
        self.cancelled = False

    def __aiter__(self):
        return self

    async def __anext__(self):
        if self.die_after is not None and self._n >= self.die_after:
            await self._agen.aclose()  # the replica's engine aborts the request: blocks freed
            raise ReplicaGone("The actor died unexpectedly before finishing this task.")
        self._n += 1
        return await anext(self._agen)

    def cancel(self) -> None:
        self.cancelled = True
        asyncio.ensure_future(self._agen.aclose())


class FakeCluster:
    """Round-robin over replicas; ``plan`` gives, per call, how many items before it dies
    (``None``: it lives) or a replacement async generator factory."""

    def __init__(self, replicas: list[EngineReplica]):
        self.replicas = replicas
        self.calls: list[FakeCall] = []
        self.plan: list = []
        self._turn = itertools.count()
        self.unreachable = 0

    def call(self, request):
        replica = self.replicas[next(self._turn) % len(self.replicas)]
        step = self.plan.pop(0) if self.plan else None
        if callable(step):
            c = FakeCall(step(request))
        else:
            c = FakeCall(replica.generate(request), die_after=step)
        self.calls.append(c)
        return c

    async def broadcast(self, method: str) -> list:
        out: list = [getattr(r, method)() for r in self.replicas]
        out += [ReplicaGone("unreachable")] * self.unreachable
        return out


@pytest.fixture(scope="module")
def engine_config(tiny_model_dir):
    return EngineConfig(model=tiny_model_dir, num_kv_blocks=128, max_num_seqs=8, num_threads=1)


@pytest.fixture(scope="module")
def replicas(engine_config):
    reps = [EngineReplica(engine_config, replica_id=f"r{i}") for i in range(2)]
    yield reps
    for r in reps:
        r.close()


@pytest.fixture()
def cluster(replicas):
    return FakeCluster(replicas)


@pytest.fixture()
def client(engine_config, cluster, tokenizer):
    engine = ClusterEngine(engine_config, cluster.call, cluster.broadcast, retry_on=(ReplicaGone,),
                           overload_on=(Full,), tokenizer=tokenizer, vocab_size=49152,
                           settings=ClusterSettings(admission_timeout_s=2.0, stats_period_s=0.05))
    app = create_app(engine, ServiceConfig(max_tokens_cap=64, default_max_tokens=16, request_timeout_s=60))
    with TestClient(app, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def reference(engine_config):
    """What one engine answers: the cluster must answer the same."""
    app = create_app(engine_config, ServiceConfig(max_tokens_cap=64, default_max_tokens=16))
    with TestClient(app, timeout=60) as c:
        def ask(body: dict) -> dict:
            r = c.post("/generate", json=body)
            assert r.status_code == 200, r.text
            return r.json()
        yield ask


BODY = {"prompt": "The quick brown fox jumps over the lazy dog. " * 4, "max_tokens": 12}


def _sse(text: str) -> list:
    out = []
    for line in text.splitlines():
        if line.startswith("data: "):
            payload = line[len("data: "):]
            out.append(payload if payload == "[DONE]" else json.loads(payload))
    return out


def _engine(client) -> ClusterEngine:
    return service_state(client.app).engine


def test_cluster_answers_as_one_engine_does(client, reference, cluster):
    want = reference(BODY)
    for _ in range(2):  # once on each replica
        r = client.post("/generate", json=BODY)
        assert r.status_code == 200, r.text
        assert r.json()["text"] == want["text"]
        assert r.json()["usage"]["completion_tokens"] == want["usage"]["completion_tokens"]
    r = client.post("/generate", json={**BODY, "stream": True})
    events = _sse(r.text)
    assert "".join(e["text"] for e in events if isinstance(e, dict) and e["type"] == "delta") == want["text"]
    assert events[-1] == "[DONE]"
    model = client.get("/v1/models").json()["data"][0]["id"]
    r = client.post("/v1/completions", json={"model": model, "prompt": BODY["prompt"], "max_tokens": 12,
                                              "temperature": 0})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == want["text"]


def test_a_replica_dying_mid_request_is_replayed_on_another(client, reference, cluster):
    want = reference(BODY)
    eng = _engine(client)
    retries, replays = eng.retries, eng.replays
    cluster.plan = [4]  # Admitted and three outputs, then the actor dies
    r = client.post("/generate", json=BODY)
    assert r.status_code == 200, r.text
    assert r.json()["text"] == want["text"]
    assert (eng.retries - retries, eng.replays - replays) == (1, 1)
    cluster.plan = [5]
    r = client.post("/generate", json={**BODY, "stream": True})
    deltas = [e["text"] for e in _sse(r.text) if isinstance(e, dict) and e["type"] == "delta"]
    assert "".join(deltas) == want["text"]  # nothing repeated, nothing lost
    assert _sse(r.text)[-2]["type"] == "final"
    # A replica that dies before admitting is retried too (nothing was delivered: no replay).
    cluster.plan = [0]
    r = client.post("/generate", json=BODY)
    assert r.status_code == 200 and r.json()["text"] == want["text"]
    assert eng.replays - replays == 2
    for rep in cluster.replicas:
        assert rep.stats()["engine"]["running"] == 0


def test_a_replay_that_differs_fails_with_503(client, cluster):
    async def liar(request):
        yield Admitted("liar")
        yield RequestOutput(request.request_id, [5, 6, 7], "xyz", True, "length", 3, 3)

    cluster.plan = [3, liar]
    r = client.post("/generate", json=BODY)
    assert r.status_code == 503, r.text
    assert "produced different ones" in r.json()["detail"] and "liar" in r.json()["detail"]
    cluster.plan = [3, liar]
    r = client.post("/generate", json={**BODY, "stream": True})
    assert r.status_code == 200  # the stream had begun: the failure is its last event
    err = [e for e in _sse(r.text) if isinstance(e, dict) and e["type"] == "error"]
    assert err and err[0]["error"]["status"] == 503


def test_attempts_run_out_with_a_503_naming_the_replica(client, cluster):
    cluster.plan = [3, 3, 3]
    r = client.post("/generate", json=BODY)
    assert r.status_code == 503
    assert "no attempt left" in r.json()["detail"] and "replica r" in r.json()["detail"]
    cluster.plan = [0, 0, 0]
    r = client.post("/generate", json={**BODY, "stream": True})
    assert r.status_code == 503  # refused before the first byte
    assert "failed on 3 attempts" in r.json()["detail"]


def test_replica_refusals_are_status_codes_before_the_first_byte(client, cluster):
    r = client.post("/generate", json={**BODY, "stream": True, "response_schema": {"type": "object", "not": {}}})
    assert r.status_code == 400, r.text
    assert r.json()["keyword"] == "not" and r.json()["field"] == "response_schema"
    r = client.post("/generate", json={"prompt": "x " * 3000, "max_tokens": 4})  # the replica's limit
    assert r.status_code == 400 and "this model allows at most 2047" in r.json()["detail"]
    assert r.json()["field"] == "prompt"  # the refusal carries the field across
    r = client.post("/generate", json={"prompt": "x", "regex": "(ab["})
    assert r.status_code == 400 and (r.json()["field"], r.json()["position"]) == ("regex", 3), r.text

    async def full(request):
        yield Refusal("overloaded", "1 requests are waiting (limit 1)", replica_id="r0")

    cluster.plan = [full]
    r = client.post("/generate", json={**BODY, "stream": True})
    assert r.status_code == 429 and r.headers["retry-after"] == "1"

    async def backpressure(request):
        raise Full("queue of 10 requests is full")
        yield  # pragma: no cover

    cluster.plan = [backpressure]
    r = client.post("/generate", json=BODY)
    assert r.status_code == 429 and "every replica's queue is full" in r.json()["detail"]


def test_no_admission_within_the_timeout_is_a_503(client, cluster):
    async def silent(request):
        await asyncio.Event().wait()
        yield  # pragma: no cover

    cluster.plan = [silent]
    r = client.post("/generate", json=BODY)
    assert r.status_code == 503 and "no replica admitted" in r.json()["detail"]
    assert cluster.calls[-1].cancelled


def test_giving_a_request_up_cancels_the_replica_call(engine_config, cluster, tokenizer):
    """What the app does when a client leaves or a deadline passes: ``aclose`` the stream."""
    from stencil.engine.request import SamplingParams

    engine = ClusterEngine(engine_config, cluster.call, cluster.broadcast, retry_on=(ReplicaGone,),
                           tokenizer=tokenizer, vocab_size=49152)

    async def scenario():
        stream = engine.submit(tokenizer.encode(BODY["prompt"]), SamplingParams(max_tokens=1000, temperature=0,
                                                                                 ignore_eos=True), request_id="gone")
        await stream.admit()
        first = await anext(stream)
        assert first.new_token_ids and not first.finished
        await stream.aclose()
        for _ in range(500):  # the replica's engine aborts the request on its own thread
            if all(rep.stats()["engine"]["running"] == 0 for rep in cluster.replicas):
                break
            await asyncio.sleep(0.01)
        with pytest.raises(StopAsyncIteration):
            await anext(stream)

    asyncio.run(scenario())
    assert cluster.calls[-1].cancelled
    assert [rep.stats()["engine"]["running"] for rep in cluster.replicas] == [0, 0]
    assert [rep.stats()["engine"]["kv_blocks_free"] for rep in cluster.replicas] == [128, 128]


def test_health_reports_each_replica(client, cluster):
    for _ in range(100):
        h = client.get("/health").json()
        if h["replicas"] and len(h["replicas"]) == 2:
            break
        asyncio.run(asyncio.sleep(0.02))
    assert h["status"] == "ok"
    assert [r["replica"] for r in h["replicas"]] == ["r0", "r1"]
    assert h["engine"]["kv_blocks_total"] == sum(r["engine"]["kv_blocks_total"] for r in h["replicas"])
    metrics = client.get("/metrics").text
    assert 'stencil_replica_up{replica="r0"} 1.0' in metrics
    assert 'stencil_replica_kv_blocks_total{replica="r1"} 128.0' in metrics
    cluster.unreachable = 1
    for _ in range(100):
        h = client.get("/health").json()
        if len(h["replicas"]) == 3:
            break
        asyncio.run(asyncio.sleep(0.02))
    assert sorted(r["status"] for r in h["replicas"]) == ["ok", "ok", "unreachable"]
    saved, cluster.replicas = cluster.replicas, []
    try:
        for _ in range(100):
            r = client.get("/health")
            if r.status_code == 503:
                break
            asyncio.run(asyncio.sleep(0.02))
        assert r.status_code == 503 and r.json()["status"] == "dead"
    finally:
        cluster.replicas = saved
        cluster.unreachable = 0
