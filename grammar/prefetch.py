"""Grammar masks of many requests computed at once, ahead of the calls that read them.

The engine asks each constrained request for its mask (``fill_bitmask``) and for its forced
tokens (``forced_tokens``), one request after another. For lazy (llguidance) matchers the mask
is the expensive part, so before those loops the engine hands every matcher to
``prefetch_masks``: all the pending masks are computed on several threads at once, without the
GIL (``lazy.prefetch_masks``), and each matcher keeps its mask. The loops that
follow then only copy rows. Nothing changes in what any call returns.
"""

from __future__ import annotations

from stencil.grammar.backends.lazy import LazyMatcher, prefetch_masks as _prefetch_lazy

MIN_BATCH = 2  # one pending mask is as fast computed by its own call


def prefetch_masks(matchers) -> None:
    """Compute the pending masks of ``matchers`` (any backend; budget-aware ones unwrapped).

    Matchers that are not lazy, already hold their mask, or ended are left alone. A matcher
    whose mask fails raises on its next call, exactly as without the prefetch, so its request
    fails alone. Call it from the thread that owns the matchers.
    """
    groups: dict[int, tuple[object, list[LazyMatcher]]] = {}
    for m in matchers:
        inner = m  # a BudgetMatcher wraps the backend's matcher; a ReasoningMatcher, the answer's
        while not isinstance(inner, LazyMatcher) and getattr(inner, "inner", None) is not None:
            inner = inner.inner
        if isinstance(inner, LazyMatcher) and inner.needs_mask:
            backend = inner.grammar.backend
            groups.setdefault(id(backend), (backend, []))[1].append(inner)
    for backend, lazy in groups.values():
        if len(lazy) >= MIN_BATCH:
            _prefetch_lazy(lazy, backend)
