"""Grammar-constrained decoding: vocabulary, compiler, matchers, bitmasks (docs/architecture.md,
"Grammar backends").

Exports resolve lazily (PEP 562): the index-building child process imports
``grammar.backends.index_worker`` and must not pay for torch.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "GrammarError": "grammar.base",
    "GrammarTimeout": "grammar.base",
    "GrammarSpec": "grammar.base",
    "CompileStats": "grammar.base",
    "GrammarMatcher": "grammar.base",
    "TokenVocabulary": "grammar.vocab",
    "build_vocabulary": "grammar.vocab",
    "GrammarCompiler": "grammar.compiler",
    "CompiledGrammar": "grammar.compiled",
    "EagerMatcher": "grammar.backends.eager",
    "LazyMatcher": "grammar.backends.lazy",
    "Program": "grammar.base",
    "allocate_bitmask": "grammar.bitmask",
    "apply_bitmask_": "grammar.bitmask",
    "bitmask_to_bool": "grammar.bitmask",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'grammar' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
