"""JSON pointers of the values at given byte offsets of a JSON text (for ``shortened``)."""

from __future__ import annotations

import json

_WS = " \t\n\r"


def value_spans(text: str) -> list[tuple[int, int, str]]:
    """``(start, end, pointer)`` in bytes for every value of the JSON document ``text``, outer
    values before the values inside them. RFC 6901 pointers (``/tags/3``, ``""`` = the root).

    Raises:
        ValueError: ``text`` is not one JSON document.
    """
    data = text.encode()
    spans: list[tuple[int, int, str]] = []
    pos = _value(text, data, _skip(text, 0), "", spans, [0])
    if _skip(text, pos) != len(text):
        raise ValueError("trailing text after the JSON value")
    return spans


def shortened_paths(text: str, byte_offsets: list[int]) -> list[str]:
    """Pointers of the innermost values that contain each offset (deduplicated, in order); [] when
    ``text`` is not JSON. A scalar's offset at its end (the budget closed it) counts as inside."""
    try:
        spans = value_spans(text)
    except ValueError:
        return []
    out: list[str] = []
    for off in byte_offsets:
        best = None
        for start, end, ptr in spans:
            if start <= off <= end and (best is None or end - start <= best[1] - best[0]):
                best = (start, end, ptr)
        if best is not None and best[2] not in out:
            out.append(best[2])
    return out


def _skip(text: str, i: int) -> int:
    while i < len(text) and text[i] in _WS:
        i += 1
    return i


def _escape(key: str) -> str:
    return key.replace("~", "~0").replace("/", "~1")


def _value(text: str, data: bytes, i: int, ptr: str, spans: list, slot: list) -> int:
    """Parse the value at char ``i``; append its span; return the char index after it."""
    if i >= len(text):
        raise ValueError("unexpected end of JSON")
    start_b = len(text[:i].encode())
    k = len(spans)
    spans.append((start_b, start_b, ptr))
    c = text[i]
    if c == "{":
        i = _skip(text, i + 1)
        if i < len(text) and text[i] == "}":
            i += 1
        else:
            while True:
                key, i = _string(text, i)
                i = _skip(text, i)
                if i >= len(text) or text[i] != ":":
                    raise ValueError("expected ':'")
                i = _value(text, data, _skip(text, i + 1), f"{ptr}/{_escape(key)}", spans, slot)
                i = _skip(text, i)
                if i < len(text) and text[i] == ",":
                    i = _skip(text, i + 1)
                    continue
                if i < len(text) and text[i] == "}":
                    i += 1
                    break
                raise ValueError("expected ',' or '}'")
    elif c == "[":
        i = _skip(text, i + 1)
        n = 0
        if i < len(text) and text[i] == "]":
            i += 1
        else:
            while True:
                i = _skip(text, _value(text, data, i, f"{ptr}/{n}", spans, slot))
                n += 1
                if i < len(text) and text[i] == ",":
                    i = _skip(text, i + 1)
                    continue
                if i < len(text) and text[i] == "]":
                    i += 1
                    break
                raise ValueError("expected ',' or ']'")
    elif c == '"':
        _, i = _string(text, i)
    else:
        j = i
        while j < len(text) and text[j] not in _WS + ",]}":
            j += 1
        json.loads(text[i:j])
        i = j
    spans[k] = (start_b, len(text[:i].encode()), ptr)
    return i


def _string(text: str, i: int) -> tuple[str, int]:
    if i >= len(text) or text[i] != '"':
        raise ValueError("expected a string")
    j = i + 1
    while j < len(text):
        if text[j] == "\\":
            j += 2
            continue
        if text[j] == '"':
            return json.loads(text[i:j + 1]), j + 1
        j += 1
    raise ValueError("unterminated string")
