"""Backend name → implementation, imported on first use (as ``kernels/registry.py`` does).

The one home of the grammar backends' names: ``names()`` are the backends, ``POLICIES`` what a
server or a request may choose (the backends and ``"auto"``, the compiler's policy of using both).
The compiler, the engine's config check and the CLI read them from here; the wire type
(``stencil.schemas.generate.GenerateRequest.grammar_backend``) spells them out as a ``Literal`` for
the OpenAPI schema, and a test holds it equal to ``POLICIES``.

Each backend module defines a class with ``name``, ``kinds`` (the program kinds it takes:
"regex", "lark"), ``build(program, ...)`` returning a grammar with ``matcher()`` and ``nbytes``,
and ``close()``.
"""

from __future__ import annotations

import importlib

_BACKENDS = {
    "eager": ("stencil.grammar.backends.eager", "EagerBackend", frozenset({"regex"})),
    "lazy": ("stencil.grammar.backends.lazy", "LazyBackend", frozenset({"regex", "lark"})),
}
AUTO = "auto"
POLICIES = (AUTO, *_BACKENDS)
"""Every ``grammar_backend`` value: "auto" (lazy at once, eager built behind it for reused
grammars; ``stencil.grammar.compiler``) or one backend's name."""


def names() -> tuple[str, ...]:
    """The backends' names ("eager", "lazy"), without the "auto" policy."""
    return tuple(_BACKENDS)


def kinds(name: str) -> frozenset:
    """Program kinds backend ``name`` accepts (without importing it)."""
    return _BACKENDS[name][2]


def create(name: str, vocab, **options):
    """A new backend ``name`` over ``vocab``.

    Raises:
        ValueError: an unknown name.
        ImportError: its library is not installed (the message says which).
    """
    try:
        module, cls, _ = _BACKENDS[name]
    except KeyError:
        raise ValueError(f"unknown grammar backend {name!r}; known: {sorted(_BACKENDS)}") from None
    return getattr(importlib.import_module(module), cls)(vocab, **options)
