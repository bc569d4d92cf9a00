"""End to end with the real default model over a real socket (issue 2's acceptance checks)."""

from __future__ import annotations

import asyncio
import re

import httpx
import jsonschema
import pytest

from stencil.engine.config import EngineConfig
from stencil.engine.models.default_model import ensure_default_model
from stencil.service.state import ServiceConfig
from service_live import LiveServer

pytestmark = pytest.mark.slow

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 40},
                   "age": {"type": "integer", "minimum": 0, "maximum": 150},
                   "city": {"type": "string", "maxLength": 40}},
    "required": ["name", "age", "city"],
}
PEOPLE = [
    ("John Smith", 42, "Paris"),
    ("Maria Garcia", 34, "Lisbon"),
    ("Kenji Tanaka", 27, "Osaka"),
    ("Anna Schmidt", 58, "Berlin"),
]


@pytest.fixture(scope="module")
def server():
    # the model `stencil serve` serves by default: its GGUF file, as fetched (not the tests' fp32 copy)
    srv = LiveServer(EngineConfig(model=ensure_default_model(), num_kv_blocks=512),
                     ServiceConfig(request_timeout_s=120)).start()
    yield srv
    srv.stop()


def _body(name: str, age: int, city: str) -> dict:
    return {
        "messages": [
            {"role": "system", "content": "Extract the person from the text as JSON with name, age and city."},
            {"role": "user", "content": f"{name} is {age} years old and lives in {city}."},
        ],
        "response_schema": PERSON,
        "max_tokens": 64,
    }


def test_four_concurrent_extractions(server):
    async def fire():
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as c:
            return await asyncio.gather(*(c.post("/generate", json=_body(*p)) for p in PEOPLE))

    responses = asyncio.run(fire())
    for (name, _, _), r in zip(PEOPLE, responses):
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["finish_reason"] == "stop" and body["valid"] is True, body
        jsonschema.Draft202012Validator(PERSON).validate(body["output"])
        assert body["output"]["name"] == name, body["output"]


def test_iso_date_regex(server):
    rx = r"[0-9]{4}-[0-9]{2}-[0-9]{2}"
    r = httpx.post(server.url + "/generate", timeout=120, json={
        "messages": [{"role": "user", "content": "Write the date of the first Moon landing in ISO format."}],
        "regex": rx, "max_tokens": 16})
    assert r.status_code == 200
    body = r.json()
    assert body["finish_reason"] == "stop" and body["valid"] and re.fullmatch(rx, body["text"]), body


def test_strin_is_refused(server):
    r = httpx.post(server.url + "/generate", json={"prompt": "x", "response_schema": {"type": "strin"}})
    assert r.status_code == 400 and "strin" in r.json()["detail"]
