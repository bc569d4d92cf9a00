"""One token per character: the vocabulary of grammar tests whose oracle runs over every short text
of a small alphabet (a language compared string by string, not sampled)."""

from __future__ import annotations

import json

from stencil.grammar.compiler import GrammarCompiler
from stencil.grammar.vocab import TokenVocabulary

EOS = 20  # the end-of-sequence id (past every alphabet's characters)
SIZE = 32  # the vocabulary's size


def char_compiler(chars: str) -> GrammarCompiler:
    """A lazy-backend compiler over ``chars`` (token ``i`` spells ``chars[i]``), nothing cached."""
    vocab = TokenVocabulary.from_token_bytes({i: c.encode() for i, c in enumerate(chars)}, EOS, SIZE)
    return GrammarCompiler(vocab, SIZE, max_workers=1, backend="lazy", cache_size=0)


def accepts(grammar, value, chars: str) -> bool:
    """Whether ``grammar`` takes ``value``'s compact JSON text whole, then EOS."""
    m = grammar.matcher()
    ids = [chars.index(ch) for ch in json.dumps(value, separators=(",", ":"))]
    return m.accept_tokens(ids) and m.accept_tokens([EOS])
