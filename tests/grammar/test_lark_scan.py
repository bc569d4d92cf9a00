"""The Lark checks' scanners (``stencil.grammar.regex_tools``): where a string or regex terminal's
body ends, and which names a terminal's body refers to outside its strings and regexes. Oracle:
the same readings written as plain character-by-character loops, on generated texts over the
characters that matter (quotes, slashes, backslashes, newlines, names).
"""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from stencil.grammar.regex_tools import _QUOTED_BODY, _TERMINAL_REFS, lark_regex_bodies

TEXTS = st.lists(st.sampled_from(['"', "/", "\\", "\n", "a", "B", "X_1", " ", "i", "{", "~"]), max_size=16).map("".join)


def body_end(text: str, start: int, quote: str, escape_newline: bool = True) -> int:
    """Where the body from ``start`` ends: before the closing ``quote``, a newline, a lone final
    backslash or the text's end; a backslash and the character after it are one escape (a
    newline too where ``escape_newline``)."""
    j = start
    while j < len(text):
        c = text[j]
        if c == "\\":
            if j + 1 < len(text) and (escape_newline or text[j + 1] != "\n"):
                j += 2
                continue
            break
        if c in (quote, "\n"):
            break
        j += 1
    return j


def terminal_refs(text: str) -> list[str]:
    """The uppercase names of ``text`` outside its "strings" (an optional ``i`` after) and
    /regexes/ (non-empty; flags after), left to right, as ``_TERMINAL_REFS.findall`` reads them
    (its empty groups for strings and regexes included)."""
    out, i = [], 0
    while i < len(text):
        c = text[i]
        if c == '"':
            j = body_end(text, i + 1, '"', escape_newline=False)
            if j < len(text) and text[j] == '"':
                i = j + 1 + (text[j + 1:j + 2] == "i")
                out.append("")
                continue
        elif c == "/":
            j = body_end(text, i + 1, "/", escape_newline=False)
            if j > i + 1 and j < len(text) and text[j] == "/":
                j += 1
                while j < len(text) and text[j] in "imslux":
                    j += 1
                i = j
                out.append("")
                continue
        elif (c == "_" or c.isupper()) and (i == 0 or not (text[i - 1].isalnum() or text[i - 1] == "_")):
            j = i + 1
            while j < len(text) and (text[j].isalnum() or text[j] == "_"):
                j += 1
            word = text[i:j]
            name = word[1:] if word.startswith("_") else word
            if name[:1].isupper() and all(ch.isupper() or ch.isdigit() or ch == "_" for ch in name):
                out.append(word)
                i = j
                continue
            i = j
            continue
        i += 1
    return out


@given(TEXTS, st.integers(0, 16))
def test_a_quoted_body_ends_where_a_character_by_character_reading_ends_it(text, start):
    start = min(start, len(text))
    for quote in "\"/":
        assert _QUOTED_BODY[quote].match(text, start).end() == body_end(text, start, quote), (quote, text, start)


@given(TEXTS)
def test_terminal_references_skip_strings_and_regexes_as_a_plain_reading_does(text):
    assert _TERMINAL_REFS.findall(text) == terminal_refs(text), text


def test_scanners_on_written_examples():
    assert _QUOTED_BODY["/"].match(r"/a\/b/ x", 1).end() == 5
    assert _QUOTED_BODY['"'].match('"a\\"b" x', 1).end() == 5
    assert [r for r in _TERMINAL_REFS.findall('"A B" /C|D/i E _F g') if r] == ["E", "_F"]


def test_regex_bodies_skip_strings_and_comments():
    text = 'A: /a\\/b/ "x/y" // c /z/\nB: /q/i\n'
    assert [text[s:e] for s, e in lark_regex_bodies(text)] == ["a\\/b", "q"]
