"""JSON pointers of the values at given byte offsets of a JSON text (for ``shortened``)."""

from __future__ import annotations

import itertools
import json

from stencil.service.json_scan import JsonScanner


def value_spans(text: str) -> list[tuple[int, int, str]]:
    """``(start, end, pointer)`` in bytes for every value of the JSON document ``text``, outer
    values before the values inside them. RFC 6901 pointers (``/tags/3``, ``""`` = the root);
    the offsets are read by ``stencil.service.json_scan``.

    Raises:
        ValueError: ``text`` is not one JSON document.
    """
    json.loads(text)  # one valid document (a JSONDecodeError is a ValueError), or nothing
    if text.isascii():
        offset = int  # characters are bytes
    else:  # the byte offset of every character, once (not an encode of each prefix)
        at = [0, *itertools.accumulate(len(ch.encode()) for ch in text)]
        offset = at.__getitem__
    spans: list[tuple[int, int, str]] = []
    open_spans: list[int] = []  # indices in spans of the values begun and not ended

    def begins(start: int) -> None:
        open_spans.append(len(spans))
        spans.append((offset(start), offset(start), scanner.pointer()))

    def ends(start: int, end: int) -> None:
        k = open_spans.pop()
        spans[k] = (spans[k][0], offset(end), spans[k][2])

    scanner = JsonScanner(begins, ends)
    end = scanner.feed(text)
    if end is None:  # a bare top-level scalar: it ends with the text
        scanner.feed(" ")
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


__all__ = ["shortened_paths", "value_spans"]
