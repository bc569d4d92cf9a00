"""The typed Python client: schemas from types, retries and errors (mock transport), and real
round trips against a live server on the tiny model (jsonschema as the oracle)."""

from __future__ import annotations

import asyncio
import dataclasses
import email.utils
import json
import time
from typing import Annotated, Literal, TypedDict

import httpx
import jsonschema
import msgspec
import pytest

from stencil.service.client import AsyncClient, Client, ExtractionError, StencilError, json_schema_for, retry_delay
from service_live import tiny_live_server

Level = Annotated[int, msgspec.Meta(ge=0, le=9)]
Colour = Literal["red", "green", "blue"]


class Item(msgspec.Struct):
    level: Level
    colour: Colour


@dataclasses.dataclass
class ItemDC:
    level: Level
    colour: Colour


class ItemTD(TypedDict):
    level: Level
    colour: Colour


@dataclasses.dataclass
class Pair:
    left: ItemDC
    right: ItemDC


class Tree(msgspec.Struct):
    label: Colour
    kids: list["Tree"] = []


# -- schemas -------------------------------------------------------------------------------------


def test_schema_inlines_refs_and_closes_objects():
    s = json_schema_for(Pair)
    assert "$defs" not in s and "$ref" not in json.dumps(s)
    assert s["additionalProperties"] is False and s["properties"]["left"]["additionalProperties"] is False
    v = jsonschema.Draft202012Validator(s)
    assert v.is_valid({"left": {"level": 1, "colour": "red"}, "right": {"level": 9, "colour": "blue"}})
    assert not v.is_valid({"left": {"level": 10, "colour": "red"}, "right": {"level": 9, "colour": "blue"}})
    assert not v.is_valid({"left": {"level": 1, "colour": "red", "x": 0}, "right": {"level": 9, "colour": "blue"}})


def test_schema_keeps_recursive_defs():
    s = json_schema_for(Tree)
    assert s["properties"]["kids"]["items"] == {"$ref": "#/$defs/Tree"}
    assert set(s["$defs"]) == {"Tree"}
    v = jsonschema.Draft202012Validator(s)
    assert v.is_valid({"label": "red", "kids": [{"label": "blue", "kids": []}]})
    assert not v.is_valid({"label": "red", "kids": [{"label": "pink"}]})


@pytest.mark.parametrize("tp", [Item, ItemDC, ItemTD])
def test_schemas_of_each_kind_agree(tp):
    s = json_schema_for(tp)
    assert sorted(s["required"]) == ["colour", "level"]  # msgspec sorts TypedDict keys and enum values
    assert s["properties"]["level"] == {"type": "integer", "minimum": 0, "maximum": 9}
    assert sorted(s["properties"]["colour"]["enum"]) == ["blue", "green", "red"]
    assert s["additionalProperties"] is False


# -- retries and errors (mock transport) -------------------------------------------------------------


def _answer(output) -> dict:
    return {"id": "r", "text": json.dumps(output), "output": output, "valid": output is not None,
            "finish_reason": "stop" if output is not None else "length", "usage": {}, "timings": {}, "warnings": []}


def test_retry_delay_rules():
    r = httpx.Response(429, headers={"Retry-After": "2"})
    assert retry_delay(r, 0, 0.5, 30) == 2.0
    assert retry_delay(httpx.Response(429, headers={"Retry-After": "120"}), 0, 0.5, 30) == 30
    when = email.utils.formatdate(time.time() + 5, usegmt=True)
    assert 3.5 <= retry_delay(httpx.Response(503, headers={"Retry-After": when}), 0, 0.5, 30) <= 5.0
    assert [retry_delay(None, a, 0.5, 3) for a in range(4)] == [0.5, 1.0, 2.0, 3]


def test_retries_429_and_503_then_succeeds():
    seen = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(json.loads(request.content))
        if len(seen) == 1:
            return httpx.Response(429, headers={"Retry-After": "0"}, json={"detail": "busy"})
        if len(seen) == 2:
            return httpx.Response(503, json={"detail": "draining"})
        return httpx.Response(200, json=_answer({"level": 3, "colour": "red"}))

    with Client("http://x", transport=httpx.MockTransport(handler), backoff_s=0.001, max_retries=2) as c:
        assert c.extract(Item, "text", max_tokens=5) == Item(3, "red")
    assert len(seen) == 3
    assert seen[0]["prompt"] == "text" and seen[0]["max_tokens"] == 5
    assert seen[0]["response_schema"] == json_schema_for(Item)


def test_gives_up_after_max_retries_with_server_message():
    calls = []

    def handler(request):
        calls.append(1)
        return httpx.Response(429, headers={"Retry-After": "0"},
                              json={"title": "Too Many Requests", "status": 429, "detail": "12 requests are waiting"})

    with Client("http://x", transport=httpx.MockTransport(handler), max_retries=2) as c:
        with pytest.raises(StencilError) as e:
            c.generate("p")
    assert len(calls) == 3
    assert e.value.status == 429 and e.value.message == "12 requests are waiting"


def test_client_errors_are_not_retried():
    calls = []

    def handler(request):
        calls.append(1)
        return httpx.Response(400, json={"title": "Bad Request", "status": 400, "detail": "bad schema: strin",
                                         "keyword": "type"})

    with Client("http://x", transport=httpx.MockTransport(handler)) as c:
        with pytest.raises(StencilError) as e:
            c.generate("p")
    assert calls == [1] and e.value.status == 400 and e.value.body["keyword"] == "type"


def test_timeout_becomes_stencil_error():
    def handler(request):
        raise httpx.ReadTimeout("slow", request=request)

    with Client("http://x", transport=httpx.MockTransport(handler), timeout=0.5) as c:
        with pytest.raises(StencilError) as e:
            c.generate("p")
    assert e.value.status is None and "timed out" in e.value.message


def test_cut_short_output_is_an_extraction_error():
    with Client("http://x", transport=httpx.MockTransport(lambda r: httpx.Response(200, json=_answer(None)))) as c:
        with pytest.raises(ExtractionError) as e:
            c.extract(Item, "p")
    assert e.value.response["finish_reason"] == "length"


def test_stream_parses_events_and_error_event():
    body = (b'data: {"type":"delta","text":"ab"}\n\n: keep-alive\n\ndata: {"type":"delta","text":"c"}\n\n'
            b'data: {"type":"final","id":"r","output":null,"valid":true,"finish_reason":"stop","usage":{}}\n\n'
            b"data: [DONE]\n\n")
    with Client("http://x", transport=httpx.MockTransport(lambda r: httpx.Response(200, content=body))) as c:
        assert list(c.stream("p")) == ["ab", "c"]
        assert c.last["text"] == "abc" and c.last["finish_reason"] == "stop"
    err = b'data: {"type":"delta","text":"a"}\n\ndata: {"type":"error","error":{"status":504,"detail":"late"}}\n\n'
    with Client("http://x", transport=httpx.MockTransport(lambda r: httpx.Response(200, content=err))) as c:
        with pytest.raises(StencilError) as e:
            list(c.stream("p"))
    assert e.value.status == 504 and e.value.message == "late"


def test_async_retries():
    n = []

    def handler(request):
        n.append(1)
        if len(n) == 1:
            return httpx.Response(503, headers={"Retry-After": "0"})
        return httpx.Response(200, json=_answer({"level": 1, "colour": "blue"}))

    async def go():
        async with AsyncClient("http://x", transport=httpx.MockTransport(handler)) as c:
            return await c.extract(ItemDC, "p")

    assert asyncio.run(go()) == ItemDC(1, "blue") and len(n) == 2


def test_every_request_declares_its_json_body():
    """The server refuses a body without ``Content-Type: application/json`` (415): the client, sync
    and async, whole and streamed, always sends it."""
    seen = []

    def handler(request):
        seen.append(request.headers.get("content-type"))
        if json.loads(request.content).get("stream"):
            return httpx.Response(200, content=b'data: {"type": "delta", "text": "a"}\n\ndata: [DONE]\n\n')
        return httpx.Response(200, json=_answer({"level": 1, "colour": "red"}))

    with Client("http://x", transport=httpx.MockTransport(handler)) as c:
        c.generate("p")
        list(c.stream("p"))

    async def go():
        async with AsyncClient("http://x", transport=httpx.MockTransport(handler)) as c:
            await c.generate("p")
            [d async for d in c.stream("p")]

    asyncio.run(go())
    assert seen == ["application/json"] * 4


# -- live server ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    with tiny_live_server(tiny_model_dir) as live:
        yield live


def _types():
    types = [Item, ItemDC, ItemTD]
    try:
        import pydantic

        class ItemPD(pydantic.BaseModel):
            level: int = pydantic.Field(ge=0, le=9)
            colour: Colour

        types.append(ItemPD)
    except ImportError:
        pass
    return types


def test_extract_round_trips_each_type(server):
    with Client(server.url) as c:
        for tp in _types():
            value = c.extract(tp, [{"role": "user", "content": "Pick one."}], max_tokens=24, seed=1)
            if hasattr(value, "model_dump"):
                assert isinstance(value, tp)
                value = value.model_dump()
            elif tp is ItemTD:
                assert isinstance(value, dict)
            else:
                assert isinstance(value, tp)
            jsonschema.validate(msgspec.to_builtins(value), json_schema_for(Item))


def test_stream_equals_generate_live(server):
    kw = dict(response_schema=json_schema_for(Item), max_tokens=24, seed=5, temperature=0.8)
    with Client(server.url) as c:
        whole = c.generate("Pick one.", **kw)
        deltas = list(c.stream("Pick one.", **kw))
        assert "".join(deltas) == whole["text"] == c.last["text"]
        assert c.last["output"] == whole["output"] and c.last["valid"] is True


def test_async_extract_live_and_server_errors(server):
    async def go():
        async with AsyncClient(server.url) as c:
            items = await asyncio.gather(*(c.extract(Item, "Pick one.", max_tokens=24, seed=s) for s in range(3)))
            with pytest.raises(StencilError) as e:
                await c.generate("x", response_schema={"type": "strin"})
            return items, e.value

    items, err = asyncio.run(go())
    assert all(isinstance(i, Item) for i in items)
    assert err.status == 400 and "strin" in err.message


# -- typed partial streaming ---------------------------------------------------------------------------

def test_progress_reads_every_prefix_of_a_document():
    from stencil.service.partial_json import progress

    doc = {"name": 'Ann "A" {x}', "home": {"city": "Oslo", "zip": [1, 2]}, "tags": ["a", "b"], "n": -1.5e3,
           "ok": True, "none": None}
    for text in (json.dumps(doc, separators=(",", ":")), json.dumps(doc, indent=2)):
        seen: dict = {}
        view = None
        for i in range(len(text) + 1):
            p = progress(text[:i])
            # the nested view holds every complete member, and only grows
            assert all(p.value[k] == v for k, v in p.done.items())
            assert view is None or list(p.value)[:len(view)] == list(view)
            view = p.value
            # complete members are final: each appears once, with its final value, in order
            assert list(p.done) == list(doc)[:len(p.done)]
            assert all(p.done[k] == doc[k] for k in p.done)
            assert all(seen[k] == p.done[k] for k in seen)
            seen = dict(p.done)
            assert p.complete == (i == len(text))
        assert seen == doc and view == doc
    assert progress('{"name":"Ann","home":{"city":"Os').writing == "home.city"
    assert progress('{"name":"Ann","home":{"city":"Oslo","zip":[1,2').value == \
        {"name": "Ann", "home": {"city": "Oslo", "zip": [1]}}  # 2 may yet become 23
    assert progress('{"tags":["a","b').value == {"tags": ["a"]}
    assert progress('{"tags":["a","b').writing == "tags[1]"
    assert progress('{"tags":["a",').writing == "tags"
    assert progress('{"name":"Ann",').writing is None
    assert progress('{"n":12').writing == "n" and progress('{"n":12').done == {}


class Home(msgspec.Struct):
    city: Annotated[str, msgspec.Meta(max_length=8)]


class Card(msgspec.Struct):
    name: Annotated[str, msgspec.Meta(max_length=8)]
    home: Home
    tags: Annotated[list[Colour], msgspec.Meta(max_length=3)]
    level: Level


def test_stream_extract_yields_typed_partials_then_the_instance(server):
    from stencil.service.client import Partial

    prompt = [{"role": "user", "content": "Describe a card."}]
    with Client(server.url) as c:
        items = list(c.stream_extract(Card, prompt, max_tokens=80, seed=3))
        whole = c.extract(Card, prompt, max_tokens=80, seed=3)
    *partials, final = items
    assert isinstance(final, Card) and final == whole
    assert partials and all(isinstance(p, Partial) for p in partials)
    assert partials[-1].text == c.last["text"]
    order = ["name", "home", "tags", "level"]
    for before, after in zip(partials, partials[1:]):
        assert after.text.startswith(before.text)  # each a prefix of the next
        assert all(after.done[k] == v for k, v in before.done.items())  # done fields are final
        assert all(after.value[k] == v for k, v in before.value.items() if k in before.done)
        assert list(after.value)[:len(before.value)] == list(before.value)
    for p in partials:
        assert list(p.done) == order[:len(p.done)]
        if "home" in p.done:
            assert isinstance(p.done["home"], Home) and p.done["home"] == final.home
        assert p.writing is None or p.writing.split(".")[0].split("[")[0] in order
    assert any(p.writing == "home.city" for p in partials)
    assert any(p.value.get("home") == {} for p in partials)  # open, its city being written
    assert partials[-1].value == json.loads(partials[-1].text) or partials[-1].writing == "level"
    assert {k: getattr(final, k) for k in order} == partials[-1].done or partials[-1].writing == "level"


def test_async_stream_extract_with_pydantic(server):
    pydantic = pytest.importorskip("pydantic")

    class Where(pydantic.BaseModel):
        city: str = pydantic.Field(max_length=8)

    class Who(pydantic.BaseModel):
        name: str = pydantic.Field(max_length=8)
        where: Where
        colours: set[Colour] = pydantic.Field(max_length=3)

    async def go():
        async with AsyncClient(server.url) as c:
            # a set is uniqueItems, which /generate refuses unless told to relax it
            return [item async for item in c.stream_extract(Who, "Who?", max_tokens=80, seed=1, strict=False)]

    *partials, final = asyncio.run(go())
    assert isinstance(final, Who)
    with_where = [p for p in partials if "where" in p.done]
    assert with_where and all(isinstance(p.done["where"], Where) for p in with_where)
    assert all(isinstance(p.done["colours"], set) for p in partials if "colours" in p.done)
