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


def test_step_buffers_set_both_thresholds():
    calls: list[tuple[int, int]] = []
    from stencil.engine.malloc import keep_step_buffers

    assert keep_step_buffers(64 << 20, mallopt=lambda p, v: calls.append((p, v)) or 1)
    assert calls == [(-3, 64 << 20), (-1, 64 << 20)]  # M_MMAP_THRESHOLD, then M_TRIM_THRESHOLD
    assert not keep_step_buffers(64 << 20, mallopt=lambda p, v: 0)  # glibc refused the value


def test_a_large_buffer_comes_from_the_heap_after_keep_step_buffers():
    """In a child process: a 33.5 MB buffer is mapped on its own (glibc's mallinfo2 counts it in
    ``hblkhd``) before the call, and comes from the heap after it."""
    import subprocess
    import sys

    code = (
        "import ctypes, ctypes.util\n"
        "from stencil.engine.malloc import keep_step_buffers\n"
        "libc = ctypes.CDLL(ctypes.util.find_library('c'))\n"
        "class Info(ctypes.Structure):\n"
        "    _fields_ = [(n, ctypes.c_size_t) for n in ('arena ordblks smblks hblks hblkhd usmblks fsmblks '\n"
        "                                              'uordblks fordblks keepcost').split()]\n"
        "libc.mallinfo2.restype = Info\n"
        "libc.malloc.restype = ctypes.c_void_p; libc.malloc.argtypes = (ctypes.c_size_t,)\n"
        "libc.free.argtypes = (ctypes.c_void_p,)\n"
        "def mapped(n=32 * 262144 * 4):\n"
        "    p = libc.malloc(n); out = libc.mallinfo2().hblkhd >= n; libc.free(p)\n"
        "    return out\n"
        "print(mapped(), keep_step_buffers(), mapped())\n")
    if _glibc_malloc_trim() is None:
        pytest.skip("no glibc here: keep_step_buffers is a no-op")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    if "mallinfo2" in out.stderr:
        pytest.skip("glibc older than 2.33 (no mallinfo2)")
    assert out.stdout.split() == ["True", "True", "False"], out.stderr
