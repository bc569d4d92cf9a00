"""Schema-driven fuzzing of the HTTP API (schemathesis) against a live server on the tiny model.

The checks are ``stencil.benchmarks.api_fuzz``'s (its docstring lists them): every answer is never a
5xx, is what the published OpenAPI document declares (status, content type, headers, body; 4xx
bodies against the problem-details / OpenAI error shapes), schema-breaking bodies get a 4xx,
errors name the problem, streams are made of documented events; sequences that follow the
document's links get the same checks; and after the whole run no request is left in the engine
and every KV block is free.

Bounded for CI: ``STENCIL_FUZZ_EXAMPLES`` (default 25) examples per operation and mode,
derandomized (the same cases every run; ``STENCIL_FUZZ_RANDOM=1`` explores new ones), a cap of
16 output tokens and a 2 s grammar-compile timeout on the server. The deep, random runs are
``stencil bench fuzz`` (docs/benchmarks.md, "Fuzz").
"""

from __future__ import annotations

import math
import os
import time

import httpx
import msgspec
import pytest
import torch

import stencil.schemas.generate
import stencil.schemas.openai
import stencil.schemas.responses
from stencil.benchmarks import api_fuzz
from stencil.engine.config import EngineConfig
from stencil.service.state import ServiceConfig
from service_live import LiveServer

EXAMPLES = int(os.environ.get("STENCIL_FUZZ_EXAMPLES", "25"))
DERANDOMIZE = os.environ.get("STENCIL_FUZZ_RANDOM", "") != "1"
OPERATIONS = [("/generate", "POST"), ("/health", "GET"), ("/metrics", "GET"), ("/v1/chat/completions", "POST"),
              ("/v1/completions", "POST"), ("/v1/models", "GET"), ("/v1/models/{model_id}", "GET"),
              ("/v1/responses", "POST"), ("/v1/responses/{response_id}", "GET")]
WITH_BODY = [(p, m) for p, m in OPERATIONS if m == "POST"]


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    srv = LiveServer(EngineConfig(model=tiny_model_dir, num_kv_blocks=256, max_num_seqs=16, grammar_timeout_s=2.0),
                     ServiceConfig(max_tokens_cap=16, default_max_tokens=4, max_body_bytes=256 << 10,
                                   request_timeout_s=60)).start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def api(server):
    return api_fuzz.load_api(server.url)


def test_document_lists_the_operations_fuzzed_here(api):
    assert api_fuzz.operations(api, "positive") == OPERATIONS
    assert api_fuzz.operations(api, "negative") == WITH_BODY
    assert api_fuzz.operations(api, "servable") == WITH_BODY


def test_document_says_which_bodies_refuse_unknown_fields(api):
    """Every request Struct with ``forbid_unknown_fields`` is ``additionalProperties: false`` in
    the published document (Litestar's generator alone drops it), and only those."""
    components = api.raw_schema["components"]["schemas"]
    checked = 0
    for module in (stencil.schemas.generate, stencil.schemas.openai, stencil.schemas.responses):
        for name, obj in vars(module).items():
            if isinstance(obj, type) and issubclass(obj, msgspec.Struct) and name in components:
                forbids = obj.__struct_config__.forbid_unknown_fields
                assert (components[name].get("additionalProperties") is False) == forbids, name
                checked += forbids
    assert checked >= 5  # GenerateRequest, ChatCompletionRequest, CompletionRequest, ResponsesRequest, ...


def test_document_links_the_models_list_to_its_consumers(api):
    links = api.raw_schema["paths"]["/v1/models"]["get"]["responses"]["200"]["links"]
    assert {link["operationId"] for link in links.values()} == {
        "retrieveModel", "createChatCompletion", "createCompletion", "createResponse"}
    cont = api.raw_schema["paths"]["/v1/responses"]["post"]["responses"]["200"]["links"]["ContinueConversation"]
    assert cont["requestBody"] == {"input": "$response.body#/output"}


# Control bytes no token of SmolLM2's vocabulary spells, and top_p values that round to 0 in
# float32: the two engine defects pinned at the end of this file. Remove with them.
_UNSPELLABLE = {chr(b) for b in (0x04, 0x06, 0x13, 0x14, 0x16, 0x1D)}


def _leaves(value):
    if isinstance(value, dict):
        for k, v in value.items():
            yield k
            yield from _leaves(v)
    elif isinstance(value, list):
        for v in value:
            yield from _leaves(v)
    else:
        yield value


def _known(case) -> bool:
    """Whether a case would only meet a defect pinned below (a tiny top_p, an unspellable byte)."""
    for leaf in _leaves(case.body):
        if isinstance(leaf, float) and 0 < leaf < 1e-30:
            return True
        if isinstance(leaf, str) and _UNSPELLABLE & set(leaf):
            return True
    return False


def _run(api, server, path, method, mode):
    tally = api_fuzz.run_mode(api, server.url, path, method, mode, examples=EXAMPLES, derandomize=DERANDOMIZE,
                              skip=_known)
    assert tally.examples >= 1 and tally.failures == 0


@pytest.mark.parametrize("path, method", OPERATIONS)
def test_fuzz_positive(api, server, path, method):
    _run(api, server, path, method, "positive")


@pytest.mark.parametrize("path, method", WITH_BODY)
def test_fuzz_negative(api, server, path, method):
    _run(api, server, path, method, "negative")


@pytest.mark.parametrize("path, method", WITH_BODY)
def test_fuzz_servable_bodies(api, server, path, method):
    _run(api, server, path, method, "servable")


def test_fuzz_stateful_links(api, server):
    tally = api_fuzz.run_stateful(api, server.url, examples=EXAMPLES, derandomize=DERANDOMIZE, skip=_known)
    followed = {key.rsplit(" ", 1)[0] for key in tally.statuses}
    # The links were followed: from the model list to the model and to generation.
    assert {"GET /v1/models", "GET /v1/models/{model_id}"} <= followed and len(followed) >= 4, tally.statuses
    assert tally.statuses["GET /v1/models/{model_id} 200"] >= 1, tally.statuses
    assert tally.failures == 0


def test_nothing_left_behind(server):
    """After every fuzz case: no request running or waiting, every KV block free, still healthy."""
    deadline = time.monotonic() + 30
    while True:
        h = httpx.get(server.url + "/health", timeout=10)
        stats = h.json()["engine"]
        idle = stats["running"] == 0 and stats["waiting"] == 0 and stats["kv_blocks_free"] == stats["kv_blocks_total"]
        if idle or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert h.status_code == 200 and h.json()["status"] == "ok" and h.json()["inflight"] == 0
    assert idle, stats


# -- what `stencil bench fuzz` found --------------------------------------------------------------
# Engine defects it found: each pinned by a test. A defect not fixed yet is a strict xfail, so the
# fix makes it pass and the marker must go.

def test_found_top_p_below_float32_keeps_the_first_token():
    from stencil.engine.request import Request, SamplingParams
    from stencil.engine.sampler import Sampler

    logits = torch.randn(1, 10)
    req = Request("r", [1], SamplingParams(seed=0, temperature=0.7, top_p=1e-46), eos_token_id=None)
    tokens, lps, _ = Sampler()(logits, [req], [[]], want_logprobs=True)
    assert tokens == [[int(torch.argmax(logits))]]  # the nucleus is the top token alone
    assert math.isfinite(lps[0][0])


def test_found_unspellable_regex_is_a_client_error(server):
    """SmolLM2's vocabulary has no token for byte 0x06: the regex compiles, and after ``a`` no
    token can go on. That dead end is the constraint's fault: a 400 naming ``regex`` (it was a
    500), ``param`` under /v1, and the server goes on serving."""
    r = httpx.post(server.url + "/generate", json={"prompt": "fuzz", "regex": "a\x06"}, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["field"] == "regex" and "cannot spell" in r.json()["detail"], r.text
    r = httpx.post(server.url + "/v1/completions", timeout=60, json={
        "prompt": "fuzz", "max_tokens": 4, "structured_outputs": {"regex": "a\x06"}})
    assert r.status_code == 400 and "cannot spell" in r.json()["error"]["message"], r.text
    r = httpx.post(server.url + "/generate", json={"prompt": "fuzz", "regex": "a\x06", "stream": True}, timeout=60)
    assert r.status_code == 200 and "cannot spell" in r.text, r.text  # in-band: the stream had begun
    assert httpx.get(server.url + "/health", timeout=10).json()["status"] == "ok"


@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2}),
    ("/v1/completions", {"prompt": "x", "max_tokens": 2}), ("/v1/responses", {"input": "x", "max_output_tokens": 2})])
def test_found_seed_beyond_int64_is_refused_and_the_engine_lives(server, path, body):
    """A seed past int64 passed admission and killed the engine loop in the sampler (fixed in schemas)."""
    r = httpx.post(server.url + path, json={**body, "seed": 2**64, "temperature": 1}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "seed", r.text
    r = httpx.post(server.url + path, json={**body, "seed": -2**63, "temperature": 1}, timeout=60)
    assert r.status_code == 200, r.text
    assert httpx.get(server.url + "/health", timeout=10).json()["status"] == "ok"


def test_found_responses_streams_are_read_whole(api, server):
    """A 16-token Responses stream has 24 events; schemathesis stopped reading streams after 20, so
    a long one looked cut before its terminal event (2 of 500 cases under soak). The fuzzer now
    reads every stream whole; one cut by the call's timeout is a failure of its own."""
    op = api["/v1/responses"]["POST"]
    case = op.Case(body={"input": "fuzz", "stream": True, "max_output_tokens": 16, "temperature": 0,
                         "text": {"format": {"type": "json_schema", "name": "s", "strict": True,
                                             "schema": {"type": "string", "pattern": "^a{16}$"}}}},
                   media_type="application/json")
    response = case.call(base_url=server.url, timeout=api_fuzz.CALL_TIMEOUT_S)
    events = [ln for ln in response.text.split("\n") if ln.startswith("data: ")]
    assert len(events) > 20 and '"response.completed"' in events[-1], response.text[-300:]
    api_fuzz.check_beyond_schema("/v1/responses", response)
    response.stream_cut_short = True
    with pytest.raises(AssertionError, match="went silent"):
        api_fuzz.check_beyond_schema("/v1/responses", response)
