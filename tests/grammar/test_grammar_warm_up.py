"""GrammarCompiler.warm_up: the first compile's one-time costs are paid through the request path,
yet the warm-up leaves nothing a user sees (no compile counted, no grammar cached); the engine's
manager waits for it; a closed compiler's grammars still build their closing automaton."""

from __future__ import annotations

import threading

import pytest

import stencil.grammar.compiler as compiler_module
from stencil.engine.structured_output import StructuredOutputManager
from stencil.grammar.base import CompileStats, GrammarSpec
from stencil.grammar.compiler import _WARM_SCHEMA, GrammarCompiler
from stencil.grammar.vocab import TokenVocabulary

EOS = 60
JSON_CHARS = '{}":,[]abcdefghijklmnopqrstuvwxyz0123456789 \n'  # id 0 is "{"
NO_BRACES = "abcdxyz0123456789.-()[]^$\\ "


def _vocab(chars: str) -> TokenVocabulary:
    return TokenVocabulary.from_token_bytes({i: ch.encode() for i, ch in enumerate(chars)}, EOS, 64)


@pytest.mark.parametrize("policy", ["auto", "lazy"])
def test_warm_up_takes_the_request_path_and_leaves_no_trace(policy, monkeypatch):
    firsts = []

    def first_allowed(words):
        firsts.append(real(words))
        return firsts[-1]

    real = compiler_module._first_allowed
    monkeypatch.setattr(compiler_module, "_first_allowed", first_allowed)
    with GrammarCompiler(_vocab(JSON_CHARS), 64, max_workers=1, backend=policy) as c:
        c.warm_up()
        c.warm_up()  # idempotent: the same warm-up, not a second one
        assert firsts == [0]  # one warm-up, whose first mask allowed "{" (id 0): the matcher took it
        assert c.stats == CompileStats()  # no compile, hit, error or time counted
        g = c.compile(GrammarSpec.json_schema(_WARM_SCHEMA))
        assert (c.stats.compiles, c.stats.cache_hits, c.stats.compile_ms_count) == (1, 0, 1)  # not cached by it
        assert c.compile(GrammarSpec.json_schema(_WARM_SCHEMA)) is g
        assert (c.stats.compiles, c.stats.cache_hits) == (1, 1)


def test_a_vocabulary_that_cannot_spell_json_stops_the_warm_up_quietly():
    with GrammarCompiler(_vocab(NO_BRACES), 64, max_workers=1) as c:
        c.warm_up()
        assert c.stats == CompileStats()


def test_the_engine_manager_waits_for_the_warm_up():
    manager = StructuredOutputManager(_vocab(JSON_CHARS), 64, workers=1)
    try:
        assert manager.compiler._warm.done() and manager.compiler._warm.exception() is None
    finally:
        manager.compiler.close()


def test_a_closed_compilers_grammar_builds_its_closing_automaton_inline():
    """After ``close`` the closing pool refuses work: the automaton is built on the caller's
    thread. That build reads ``own_program``, which takes the grammar's lock, so it must not run
    under that lock (it did, and waited for itself forever)."""
    spec = GrammarSpec.json_schema({"type": "object", "properties": {"ab": {"type": "integer"}},
                                    "required": ["ab"]})
    with GrammarCompiler(_vocab(JSON_CHARS), 64, max_workers=1, backend="lazy") as open_c:
        expected = open_c.compile(spec).min_output_tokens(0)
    c = GrammarCompiler(_vocab(JSON_CHARS), 64, max_workers=1, backend="lazy")
    c.warm_up()  # (done before ``close``: its own closing automaton is built on the pool)
    grammar = c.compile(spec)
    assert grammar.program.kind == "json"  # (handed to llguidance: the closing reads Stencil's own translation)
    c.close()
    c.warm_up()  # a closed compiler's returns
    got = []
    t = threading.Thread(target=lambda: got.append(grammar.min_output_tokens(0)), daemon=True)
    t.start()
    t.join(20)
    assert not t.is_alive(), "the inline closing build waits for its own lock"
    assert expected is not None and got == [expected]  # {"ab":0} is 8 one-byte tokens
    assert expected == len('{"ab":0}')
