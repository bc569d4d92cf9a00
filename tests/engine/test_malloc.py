"""stencil.engine.malloc.HeapTrimmer: at most one trim per interval, on an injected clock."""

from __future__ import annotations

import pytest

from stencil.engine.malloc import HeapTrimmer, _glibc_malloc_trim


def test_trims_at_most_once_per_interval():
    now = [100.0]
    calls: list[int] = []
    t = HeapTrimmer(interval_s=10.0, clock=lambda: now[0], trim=lambda pad: calls.append(pad) or 1)
    assert t.available and not t.maybe_trim()  # the interval counts from construction
    now[0] = 109.9
    assert not t.maybe_trim()
    now[0] = 110.0
    assert t.maybe_trim() and calls == [0]
    now[0] = 115.0
    assert not t.maybe_trim()
    now[0] = 121.0
    assert t.maybe_trim() and t.trims == 2 and calls == [0, 0]


def test_without_a_trim_function_nothing_happens(monkeypatch):
    import stencil.engine.malloc as m

    monkeypatch.setattr(m, "_glibc_malloc_trim", lambda: None)
    t = m.HeapTrimmer(interval_s=0.0)
    assert not t.available and not t.maybe_trim() and t.trims == 0


def test_glibc_trim_runs_here():
    fn = _glibc_malloc_trim()
    if fn is None:
        pytest.skip("no glibc malloc_trim here: the engine never trims")
    assert fn(0) in (0, 1)
