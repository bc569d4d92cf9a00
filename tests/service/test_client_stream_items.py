"""Items and nested values as an answer streams: ``PartialDocument`` (``partial_json``) on generated
documents against the standard library's decoder, and ``extract_iter`` (sync and async) on a fake
stream whose position is known at every item, and live on the tiny model."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import Iterator
from typing import Annotated, Any, Literal, TypedDict

import httpx
import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stencil.service.client import AsyncClient, Client, ExtractionError, Partial, item_path
from stencil.service.partial_json import PartialDocument, progress
from service_live import tiny_live_server

# -- the oracle: every value's span, read with the standard library's decoder ---------------------------

_DECODER = json.JSONDecoder()
_ABSENT = object()


@dataclasses.dataclass
class Node:
    """A value of a JSON text: where it starts, the prefix length at which a reader can know it
    has ended (``need``: a string or container at its closing character, a bare scalar at the
    delimiter after it), its decoded value, and its members or elements (None for a scalar)."""

    start: int
    need: int
    value: Any
    kids: list[tuple[Any, "Node"]] | None
    path: tuple


def _skip(text: str, i: int) -> int:
    while i < len(text) and text[i] in " \t\r\n":
        i += 1
    return i


def _read(text: str, i: int, path: tuple, nodes: list[Node]) -> Node:
    """The value at ``text[i]``: containers walked here, strings and scalars by ``raw_decode``;
    every node appended to ``nodes`` once it has ended (document order of ends)."""
    if text[i] not in "{[":
        value, end = _DECODER.raw_decode(text, i)
        node = Node(i, end if text[i] == '"' else end + 1, value, None, path)
    else:
        is_object, kids = text[i] == "{", []
        j = _skip(text, i + 1)
        while text[j] not in "}]":
            if is_object:
                key, j = _DECODER.raw_decode(text, j)
                j = _skip(text, j)
                assert text[j] == ":"
                kid = _read(text, _skip(text, j + 1), path + (key,), nodes)
            else:
                key, kid = None, _read(text, j, path + (None,), nodes)
            kids.append((key, kid))
            j = _skip(text, kid.need - 1 if kid.kids is None and text[kid.start] != '"' else kid.need)
            if text[j] == ",":
                j = _skip(text, j + 1)
        value = {k: n.value for k, n in kids} if is_object else [n.value for _, n in kids]
        node = Node(i, j + 1, value, kids, path)
    nodes.append(node)
    return node


def _expected_view(node: Node, n: int) -> Any:
    """What the view of ``text[:n]`` must be: complete values whole, open containers with their
    complete members and elements, nothing else."""
    if node.need <= n:
        return node.value
    if node.kids is None or node.start >= n:
        return _ABSENT
    shown = [(k, _expected_view(kid, n)) for k, kid in node.kids]
    if isinstance(node.value, dict):
        return {k: v for k, v in shown if v is not _ABSENT}
    return [v for _, v in shown if v is not _ABSENT]


def _extends(later: Any, earlier: Any) -> bool:
    """``later`` holds everything ``earlier`` holds, equal, in the same order."""
    if isinstance(earlier, dict):
        return (isinstance(later, dict) and list(later)[:len(earlier)] == list(earlier)
                and all(_extends(later[k], v) for k, v in earlier.items()))
    if isinstance(earlier, list):
        return (isinstance(later, list) and len(later) >= len(earlier)
                and all(_extends(a, b) for a, b in zip(later, earlier)))
    return type(later) is type(earlier) and later == earlier


keys = st.text(st.characters(codec="utf-8"), max_size=5) | st.sampled_from(["lines", 'a"b', "\\", "x/y"])
scalars = (st.none() | st.booleans() | st.integers(-10**9, 10**9) | st.floats(allow_nan=False, allow_infinity=False)
           | st.text(st.characters(codec="utf-8"), max_size=6) | st.sampled_from(['"', "\\", "\n", "\u00e9", "}]"]))
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(keys, inner, max_size=4),
                      max_leaves=16)
documents = st.lists(values, max_size=4) | st.dictionaries(keys, values, max_size=4)
layouts = st.sampled_from([dict(separators=(",", ":")), dict(indent=2), dict(indent=1, ensure_ascii=False), {}])


@settings(max_examples=150, deadline=None)
@given(documents, layouts, st.data())
def test_every_prefix_shows_exactly_the_complete_values_and_items_end_in_their_chunk(doc, layout, data):
    text = json.dumps(doc, **layout)
    nodes: list[Node] = []
    root = _read(text, _skip(text, 0), (), nodes)
    assert root.value == doc and root.need == len(text)
    lists = sorted({n.path for n in nodes if n.path and n.path[-1] is None}, key=repr) or [(None,)]
    path = data.draw(st.sampled_from(lists), label="items path")
    wanted = [n for n in nodes if n.path == path]  # in the order they end

    # one character at a time: the view is the oracle's at every prefix, each view extends the last,
    # and each item comes at exactly the prefix where it can be known to have ended
    reader = PartialDocument(items=path)
    seen, before = [], None
    for n in range(len(text) + 1):
        got = reader.feed(text[n - 1]) if n else []
        seen += [(n, v) for v in got]
        view = reader.value
        expected = _expected_view(root, n)
        assert view == (None if expected is _ABSENT else expected)
        assert before is None or _extends(view, before)
        before = view
    assert reader.complete and reader.value == json.loads(text)
    assert seen == [(w.need, w.value) for w in wanted]

    # in chunks: each item in the chunk holding the character that ends it, progress() agreeing
    cuts = sorted(set(data.draw(st.lists(st.integers(1, max(len(text) - 1, 1)), max_size=6), label="cuts")))
    bounds = [0] + [c for c in cuts if c < len(text)] + [len(text)]
    chunked = PartialDocument(items=path)
    for lo, hi in zip(bounds, bounds[1:]):
        for value in chunked.feed(text[lo:hi]):
            item = wanted.pop(0)
            assert value == item.value and lo < item.need <= hi
        assert chunked.value == progress(text[:hi]).value
    assert wanted == []


def test_view_by_hand():
    doc = PartialDocument(items=("lines", None))
    text = '{"no": "A1", "lines": [{"sku": "x", "qty": 12}, {"sku": "y\\"", "qty": 3}], "total": 15}'
    views = {}
    for i, ch in enumerate(text, 1):
        if doc.feed(ch):
            views[i] = doc.value
    ends = [text.index("}") + 1, text.index("}]") + 1]
    assert views == {ends[0]: {"no": "A1", "lines": [{"sku": "x", "qty": 12}]},
                     ends[1]: {"no": "A1", "lines": [{"sku": "x", "qty": 12}, {"sku": 'y"', "qty": 3}]}}
    assert progress(text[:ends[0] + 12]).value == {"no": "A1", "lines": [{"sku": "x", "qty": 12}, {}]}
    assert progress('{"n": 12').value == {} and progress('{"n": 12,').value == {"n": 12}
    assert progress("").value is None and progress("[").value == []


# -- item paths ----------------------------------------------------------------------------------------


class Line(msgspec.Struct):
    sku: str
    qty: Annotated[int, msgspec.Meta(ge=0)]


class Invoice(msgspec.Struct):
    no: str
    lines: list[Line]
    total: int


class Section(msgspec.Struct):
    title: str
    lines: Annotated[list[Line], msgspec.Meta(max_length=3)] | None = None


class Report(msgspec.Struct):
    sections: list[Section]


@dataclasses.dataclass
class LineDC:
    sku: str
    qty: int


class LineTD(TypedDict):
    sku: str
    qty: int


def test_item_paths_and_their_refusals():
    assert item_path(list[Line]) == ((None,), Line)
    assert item_path(tuple[int, ...]) == ((None,), int)
    assert item_path(Invoice, "lines") == (("lines", None), Line)
    assert item_path(Report, "sections.lines") == (("sections", None, "lines", None), Line)
    assert item_path(list[Section], "lines") == ((None, "lines", None), Line)
    with pytest.raises(TypeError, match="Invoice is not a list type"):
        item_path(Invoice)
    with pytest.raises(TypeError, match="items='total' of Invoice is int, not a list"):
        item_path(Invoice, "total")
    with pytest.raises(TypeError, match="Invoice has no field 'line' \\(it has: no, lines, total\\)"):
        item_path(Invoice, "line")


# -- extract_iter on a fake stream -----------------------------------------------------------------------

INVOICE_DELTAS = ['{"no": "A1", "lines": [', '{"sku": "x", "qty": 2', "}, ", '{"sku": "y", ', '"qty": 3}]',
                  ', "total": 5}']
INVOICE = {"no": "A1", "lines": [{"sku": "x", "qty": 2}, {"sku": "y", "qty": 3}], "total": 5}


def _event(payload: dict) -> bytes:
    return f"data: {json.dumps(payload)}\n\n".encode()


class FakeStream:
    """A ``/generate`` SSE answer sent one delta an event; ``sent`` counts the deltas the client has
    pulled, so a test knows the stream's position when an item arrives."""

    def __init__(self, deltas: list[str], output: Any, valid: bool = True):
        self.deltas, self.output, self.valid = deltas, output, valid
        self.sent = 0
        self.bodies: list[dict] = []

    def _events(self) -> Iterator[bytes]:
        for delta in self.deltas:
            self.sent += 1
            yield _event({"type": "delta", "text": delta})
        yield _event({"type": "final", "id": "r", "output": self.output, "valid": self.valid,
                      "finish_reason": "stop" if self.valid else "length", "usage": {}})
        yield b"data: [DONE]\n\n"

    def handler(self, request: httpx.Request) -> httpx.Response:
        self.bodies.append(json.loads(request.content))
        return httpx.Response(200, content=self._events())

    async def _aevents(self):
        for chunk in self._events():
            yield chunk

    def async_handler(self, request: httpx.Request) -> httpx.Response:
        self.bodies.append(json.loads(request.content))
        return httpx.Response(200, content=self._aevents())


class ReadingClient(Client):
    """``Client`` that keeps the text its stream has read (``read``)."""

    def stream(self, *args, **kwargs):
        self.read = ""
        for delta in super().stream(*args, **kwargs):
            self.read += delta
            yield delta


def test_extract_iter_yields_each_item_at_the_delta_that_ends_it():
    fake, log = FakeStream(INVOICE_DELTAS, INVOICE), []
    with ReadingClient("http://x", transport=httpx.MockTransport(fake.handler),
                       on_request=lambda body: log.append("request"),
                       on_response=lambda body, answer: log.append("response")) as c:
        for line in c.extract_iter(Invoice, "Invoice A1", items="lines", temperature=0):
            log.append((line, fake.sent, len(c.read), c.last))
    final_text = "".join(INVOICE_DELTAS)
    assert log == ["request", (Line("x", 2), 3, len("".join(INVOICE_DELTAS[:3])), None),
                   (Line("y", 3), 5, len("".join(INVOICE_DELTAS[:5])), None), "response"]
    assert log[1][2] < len(final_text) and c.last["text"] == final_text
    assert fake.bodies[0]["response_schema"]["properties"]["lines"]["type"] == "array"
    assert fake.bodies[0]["stream"] is True and fake.bodies[0]["temperature"] == 0


def _item_types():
    types = [(Line, Line("x", 2)), (LineDC, LineDC("x", 2)), (LineTD, {"sku": "x", "qty": 2})]
    try:
        import pydantic

        class LinePD(pydantic.BaseModel):
            sku: str
            qty: int = pydantic.Field(ge=0)

        types.append((LinePD, LinePD(sku="x", qty=2)))
    except ImportError:
        pass
    return types


@pytest.mark.parametrize("tp, first", _item_types(), ids=lambda x: getattr(x, "__name__", ""))
def test_extract_iter_of_a_list_type_converts_each_kind(tp, first):
    deltas = ['[{"sku": "x", "qty": 2}', ', {"sku": "y", "qty": 3}', "]"]
    fake = FakeStream(deltas, json.loads("".join(deltas)))
    with Client("http://x", transport=httpx.MockTransport(fake.handler)) as c:
        items = list(c.extract_iter(list[tp], "two lines"))
    assert items[0] == first and len(items) == 2 and type(items[1]) is type(first)
    assert fake.bodies[0]["response_schema"]["type"] == "array"


def test_extract_iter_of_plain_values_and_nested_lists():
    fake = FakeStream(["[4", "0, 1", "7]"], [40, 17])
    with Client("http://x", transport=httpx.MockTransport(fake.handler)) as c:
        got = [(n, fake.sent) for n in c.extract_iter(list[int], "numbers")]
        assert got == [(40, 2), (17, 3)]  # a number ends at its delimiter: 4 might have become 40
    report = {"sections": [{"title": "a", "lines": [{"sku": "x", "qty": 1}]}, {"title": "b", "lines": None},
                           {"title": "c", "lines": [{"sku": "y", "qty": 2}, {"sku": "z", "qty": 3}]}]}
    text = json.dumps(report)
    fake = FakeStream([text[i:i + 7] for i in range(0, len(text), 7)], report)
    with Client("http://x", transport=httpx.MockTransport(fake.handler)) as c:
        assert [ln.sku for ln in c.extract_iter(Report, "r", items="sections.lines")] == ["x", "y", "z"]


def test_extract_iter_errors():
    calls = []
    with Client("http://x", transport=httpx.MockTransport(lambda r: calls.append(r))) as c:
        with pytest.raises(TypeError, match="no field 'lins'"):
            c.extract_iter(Invoice, "x", items="lins")  # at the call, before any request
        with pytest.raises(TypeError, match="response_schema is derived from the type"):
            c.extract_iter(list[Line], "x", response_schema={"type": "array"})
    assert calls == []
    # an item that breaks its type (qty >= 0, which the fake's "grammar" ignored) raises in its place
    fake = FakeStream(['[{"sku": "x", "qty": 2}, ', '{"sku": "y", "qty": -1}', "]"], None, valid=False)
    got = []
    with Client("http://x", transport=httpx.MockTransport(fake.handler)) as c:
        with pytest.raises(ExtractionError, match="item 1 of the list does not fit Line") as e:
            got.extend(c.extract_iter(list[Line], "x"))
    assert got == [Line("x", 2)] and e.value.response["text"].endswith("-1}")
    # cut at max_tokens: the items that ended stand, then the answer's error
    fake = FakeStream(['{"no": "A1", "lines": [{"sku": "x", "qty": 2}, {"sku": "y'], None, valid=False)
    got = []
    with Client("http://x", transport=httpx.MockTransport(fake.handler)) as c:
        with pytest.raises(ExtractionError, match="finish_reason='length'"):
            got.extend(c.extract_iter(Invoice, "x", items="lines"))
    assert got == [Line("x", 2)]


def test_async_extract_iter_yields_each_item_at_the_delta_that_ends_it():
    fake, log = FakeStream(INVOICE_DELTAS, INVOICE), []

    async def go():
        async with AsyncClient("http://x", transport=httpx.MockTransport(fake.async_handler),
                               on_response=lambda body, answer: log.append("response")) as c:
            async for line in c.extract_iter(Invoice, "Invoice A1", items="lines"):
                log.append((line, fake.sent, c.last))
            with pytest.raises(TypeError, match="not a list type"):
                c.extract_iter(Invoice, "x")
        cut = FakeStream(INVOICE_DELTAS[:3], None, valid=False)
        async with AsyncClient("http://x", transport=httpx.MockTransport(cut.async_handler)) as c:
            with pytest.raises(ExtractionError):
                async for line in c.extract_iter(Invoice, "x", items="lines"):
                    log.append(line)

    asyncio.run(go())
    assert log == [(Line("x", 2), 3, None), (Line("y", 3), 5, None), "response", Line("x", 2)]


def test_partials_carry_the_nested_view():
    text = "".join(INVOICE_DELTAS)
    fake = FakeStream([text[i:i + 5] for i in range(0, len(text), 5)], INVOICE)
    with Client("http://x", transport=httpx.MockTransport(fake.handler)) as c:
        *partials, final = c.stream_extract(Invoice, "x")
    assert final == msgspec.convert(INVOICE, Invoice)
    assert all(isinstance(p, Partial) for p in partials) and partials[-1].value == INVOICE
    for before, after in zip(partials, partials[1:]):
        assert _extends(after.value, before.value)
    assert {"no": "A1", "lines": [{"sku": "x", "qty": 2}, {}]} in [p.value for p in partials]


# -- live, on the tiny model -------------------------------------------------------------------------------


class Item(msgspec.Struct):
    level: Annotated[int, msgspec.Meta(ge=0, le=9)]
    colour: Literal["red", "green", "blue"]


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    with tiny_live_server(tiny_model_dir) as live:
        yield live


def test_extract_iter_live_yields_items_before_the_answer_ends(server):
    tp = Annotated[list[Item], msgspec.Meta(min_length=2, max_length=3)]
    log: list = []
    with ReadingClient(server.url, on_response=lambda body, answer: log.append("response")) as c:
        for item in c.extract_iter(tp, "Three items.", temperature=0, max_tokens=80):
            log.append((item, len(c.read)))
        final = c.last
    *items, done = log
    assert done == "response" and final["valid"] is True and 2 <= len(items) <= 3
    assert [msgspec.to_builtins(item) for item, _ in items] == final["output"]
    assert items[0][1] < len(final["text"])  # the first item came while the answer was still being read
