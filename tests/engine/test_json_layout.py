"""``JsonLayout.of`` and ``position`` against a reference written another way: a regex splits the
prefix into tokens (a string is one token, escapes and all) and the whitespace before each, and
the layout is read off the list of gaps between tokens. Every prefix of a set of documents in
several layouts is checked, so that prefixes ending inside strings, escapes and whitespace runs
all come up."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

import pytest

from stencil.engine.speculative.layout import JsonLayout, Position, position

# Whitespace, then one token: a string (to its closing quote, or to the end of an unfinished
# one, a lone trailing backslash included) or any other single character.
_TOKEN = re.compile(r'([ \t\r\n]*)("(?:[^"\\]|\\.)*(?:"|\\?\Z)|[^ \t\r\n"])', re.S)


@dataclass(frozen=True)
class _Gap:
    before: str  # the token before the whitespace ("{", ",", ":", '"' for a string, "1", ...)
    ws: str
    after: str  # the first character of the token after it
    depth: int  # containers open between the two tokens


def _tokens(text: str) -> tuple[list[tuple[str, str]], str]:
    """(whitespace before, token) pairs, and the whitespace after the last token."""
    out, at = [], 0
    while (m := _TOKEN.match(text, at)) is not None:
        out.append((m.group(1), m.group(2)))
        at = m.end()
    assert text[at:].strip(" \t\r\n") == ""
    return out, text[at:]


def _depths(tokens: list[tuple[str, str]]) -> list[int]:
    """The containers open after each token (a stray closer closes nothing)."""
    depths, depth = [], 0
    for _, tok in tokens:
        depth = depth + 1 if tok in "{[" else max(depth - 1, 0) if tok in "}]" else depth
        depths.append(depth)
    return depths


def _unfinished_string(tok: str) -> bool:
    return tok[0] == '"' and (len(tok) == 1 or not re.fullmatch(r'"(?:[^"\\]|\\.)*"', tok, re.S))


def reference_position(text: str) -> Position:
    tokens, trailing = _tokens(text)
    if not tokens:
        return Position(False, 0, "", trailing)
    tok = tokens[-1][1]
    return Position(_unfinished_string(tok), _depths(tokens)[-1], tok[0], trailing)


def reference_layout(text: str) -> JsonLayout:
    tokens, _ = _tokens(text)
    depths = _depths(tokens)
    gaps = [_Gap(a[1][0], b[0], b[1][0], d) for a, b, d in zip(tokens, tokens[1:], depths)]
    members = [g for g in gaps if g.before in "{[," and g.after not in "}]"]
    colons = [g for g in gaps if g.before == ":"]
    inline_commas = [g for g in members if g.before == "," and "\n" not in g.ws]
    default = JsonLayout()
    newline, indent = default.newline, default.indent
    if members:
        first = members[0]
        newline = "\n" in first.ws
        tail = first.ws.rsplit("\n", 1)[-1]
        if newline and first.depth and tail and len(tail) % first.depth == 0:
            indent = tail[:len(tail) // first.depth]
    return JsonLayout(newline=newline, indent=indent,
                      colon_space=colons[0].ws != "" if colons else default.colon_space,
                      comma_space=inline_commas[0].ws != "" if inline_commas else False)


_VALUE = {"name": 'Ada "the" Countess', "path": "C:\\dir\\", "q": "\\\"", "uni": "Zoë — 東京 🙂",
          "nested": {"list": [1, [2, {"x": []}], {}], "s": "{[,:]}"}, "empty": "", "n": -1.5e3}
_DOCUMENTS = [
    json.dumps(_VALUE, indent=2, ensure_ascii=False),
    json.dumps(_VALUE, indent=4),  # \u escapes
    json.dumps(_VALUE, indent="\t", ensure_ascii=False),
    json.dumps(_VALUE, separators=(",", ":"), ensure_ascii=False),
    json.dumps(_VALUE, ensure_ascii=False),  # ", " and ": "
    json.dumps([_VALUE, [_VALUE["nested"]]], separators=(", ", ":")),
    '{ "a" :  [ 1 ,\r\n  2 ]\t, "b\\\\" : "x\\"y" }',
    '[\n\n   "\\\\\\"",\n   {  }\n]',
    ']}{"stray": 1}',
]
_PREFIXES = sorted({doc[:i] for doc in _DOCUMENTS for i in range(len(doc) + 1)})


def test_the_reference_itself_on_hand_checked_prefixes():
    assert reference_position('{"a": {"b": "x}"') == Position(False, 2, '"', "")
    assert reference_position('{"a": "x\\"') == Position(True, 1, '"', "")
    assert reference_position('{"a": "x\\\\"') == Position(False, 1, '"', "")
    assert reference_position('[1,\n  ') == Position(False, 1, ",", "\n  ")
    assert reference_layout('{\n    "a": {\n        "b"') == JsonLayout(True, "    ", True, False)
    assert reference_layout('{"a":1, "b"') == JsonLayout(False, "  ", False, True)


def test_there_are_prefixes_of_every_kind():
    ends = [reference_position(p) for p in _PREFIXES]
    assert any(e.in_string for e in ends) and any(e.trailing_ws for e in ends)
    assert max(e.depth for e in ends) >= 4
    assert any(p.endswith("\\") and reference_position(p).in_string for p in _PREFIXES)


@pytest.mark.parametrize("doc", _DOCUMENTS)
def test_position_and_layout_agree_with_the_reference_on_every_prefix(doc):
    for i in range(len(doc) + 1):
        prefix = doc[:i]
        assert position(prefix) == reference_position(prefix), prefix
        assert JsonLayout.of(prefix) == reference_layout(prefix), prefix


@pytest.mark.parametrize("doc, layout", [
    (_DOCUMENTS[0], JsonLayout(True, "  ", True, False)),
    (_DOCUMENTS[1], JsonLayout(True, "    ", True, False)),
    (_DOCUMENTS[2], JsonLayout(True, "\t", True, False)),
    (_DOCUMENTS[3], JsonLayout(False, "  ", False, False)),
    (_DOCUMENTS[4], JsonLayout(False, "  ", True, True)),
    # "{ " is on one line; the first inline comma gap is ", " (",\r\n  " has a line break)
    (_DOCUMENTS[6], JsonLayout(False, "  ", True, True)),
])
def test_whole_documents_show_the_layout_they_were_written_in(doc, layout):
    assert JsonLayout.of(doc) == layout
