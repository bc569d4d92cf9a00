"""``stencil.service.json_scan``: the one incremental JSON scanner behind streamed progress
(``partial_json``), ``shortened`` pointers (``json_paths``) and tool-call arguments
(``tool_parser``), checked on generated JSON documents against the parsed document itself."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from stencil.service.json_paths import value_spans
from stencil.service.json_scan import JsonScanner
from stencil.service.partial_json import progress
from stencil.service.tool_parser import ToolCallParser

scalars = st.none() | st.booleans() | st.integers(-10**12, 10**12) | st.floats(allow_nan=False, allow_infinity=False) \
    | st.text(st.characters(codec="utf-8"), max_size=8)
documents = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4)
                         | st.dictionaries(st.text(st.characters(codec="utf-8"), max_size=6), inner, max_size=4),
                         max_leaves=20)


def _resolve(doc, pointer: str):
    for part in pointer.split("/")[1:]:
        part = part.replace("~1", "/").replace("~0", "~")
        doc = doc[int(part)] if isinstance(doc, list) else doc[part]
    return doc


def _events(text: str, cuts: list[int]) -> list[tuple]:
    events: list[tuple] = []
    scanner = JsonScanner(lambda at: events.append(("begin", at, scanner.pointer())),
                          lambda start, end: events.append(("end", start, end)))
    pos = 0
    for cut in sorted(set(cuts)) + [len(text)]:
        scanner.feed(text[pos:cut])
        pos = cut
    return events


@settings(max_examples=300, deadline=None)
@given(documents, st.sampled_from([None, 1]))
def test_every_span_is_the_value_its_pointer_names(doc, indent):
    text = json.dumps(doc, indent=indent, ensure_ascii=False)
    data = text.encode()
    spans = value_spans(text)
    assert spans[0] == (0, len(data), "")
    for start, end, pointer in spans:
        assert json.loads(data[start:end]) == _resolve(doc, pointer)
    # one span per value, outer before inner
    def count(v):
        return 1 + (sum(map(count, v)) if isinstance(v, list) else
                    sum(map(count, v.values())) if isinstance(v, dict) else 0)
    assert len(spans) == count(doc)


@settings(max_examples=200, deadline=None)
@given(documents, st.lists(st.integers(0, 400), max_size=6))
def test_fragments_give_the_events_of_the_whole_text(doc, cuts):
    text = json.dumps(doc, separators=(",", ":"), ensure_ascii=False)
    cuts = [c for c in cuts if c <= len(text)]
    assert _events(text, cuts) == _events(text, [])


@settings(max_examples=150, deadline=None)
@given(st.dictionaries(st.text(max_size=5), documents, min_size=1, max_size=4))
def test_progress_on_every_prefix_reports_only_final_members(doc):
    text = json.dumps(doc, separators=(",", ":"))
    seen = 0
    for n in range(len(text) + 1):
        p = progress(text[:n])
        assert all(doc[k] == v for k, v in p.done.items())
        assert len(p.done) >= seen  # members, once complete, stay complete
        seen = len(p.done)
        assert p.complete == (n == len(text))
    assert progress(text).done == doc


def test_a_bare_scalar_ends_at_its_delimiter_and_top_level_text_after_the_end_is_not_read():
    scanner = JsonScanner()
    assert scanner.feed("12") is None and scanner.in_scalar  # may still grow
    assert scanner.feed("3} tail") == 1 and scanner.end == 3
    assert scanner.feed("{}") is None
    assert JsonScanner().feed('"a\\"b" x') == 6


@settings(max_examples=100, deadline=None)
@given(st.dictionaries(st.text(max_size=5), documents, max_size=4), st.integers(1, 7))
def test_tool_call_arguments_end_where_their_json_does_in_any_fragments(args, step):
    arguments = json.dumps(args, separators=(",", ":"), ensure_ascii=False)
    answer = '<tool_call>{"name":"f","arguments":' + arguments + "}</tool_call>"
    parser = ToolCallParser(may_be_text=False)
    for i in range(0, len(answer), step):
        parser.feed(answer[i:i + step])
    parser.finish()
    assert parser.complete and [c.arguments for c in parser.calls] == [arguments]
