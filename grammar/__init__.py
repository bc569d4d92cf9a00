"""Grammar-constrained decoding: vocabulary, compiler, matchers, bitmasks (docs/architecture.md,
"Grammar backends").

Exports resolve lazily (PEP 562): the index-building child process imports
``stencil.grammar.backends.index_worker`` and must not pay for torch.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "GrammarError": "stencil.grammar.base",
    "GrammarTimeout": "stencil.grammar.base",
    "GrammarSpec": "stencil.grammar.base",
    "CompileStats": "stencil.grammar.base",
    "GrammarMatcher": "stencil.grammar.base",
    "TokenVocabulary": "stencil.grammar.vocab",
    "build_vocabulary": "stencil.grammar.vocab",
    "GrammarCompiler": "stencil.grammar.compiler",
    "CompiledGrammar": "stencil.grammar.compiled",
    "EagerMatcher": "stencil.grammar.backends.eager",
    "LazyMatcher": "stencil.grammar.backends.lazy",
    "Program": "stencil.grammar.base",
    "allocate_bitmask": "stencil.grammar.bitmask",
    "apply_bitmask_": "stencil.grammar.bitmask",
    "bitmask_to_bool": "stencil.grammar.bitmask",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'grammar' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
