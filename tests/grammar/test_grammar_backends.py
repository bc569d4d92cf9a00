"""Differential tests: the eager (outlines-core) and lazy (llguidance) backends hold the same
program to the same language, token sequence by token sequence and mask by mask; and the new
constructs of the served programs (Lark rules for recursion, shared terminals, intersections).
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

import interegular
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stencil.grammar.backends.eager import EagerBackend
from stencil.grammar.backends.lazy import LazyBackend
from stencil.grammar.base import GrammarError, GrammarSpec, Program
from stencil.grammar.bitmask import allocate_bitmask
from stencil.grammar.compiler import GrammarCompiler
from stencil.grammar.frontend import to_program
from stencil.grammar.program import expand, to_lark
from stencil.grammar.vocab import TokenVocabulary

EOS = 30
CHARS = "abcdxyz0123456789.-"
MULTI = ["bc", "cd", "12", "xyz", "5.", "ab", "a1", "9-"]
TOKENS = {i: ch.encode() for i, ch in enumerate(CHARS)} | {
    len(CHARS) + k: s.encode() for k, s in enumerate(MULTI)}
ID = {b.decode(): i for i, b in TOKENS.items()}
SIZE = 40

REGEXES = [
    r"ab(cd)?", r"-?(0|[1-9][0-9]*)(\.[0-9]+)?", r"(ab|cd){2,4}-[0-9]{3}", r"x(yz)*|xy",
    r"[a-d]{1,5}\.[0-9]{0,2}", r"(a|ab)(c|bcd)(d*)", r"1(2|23)?3*", r"a{0,3}b{2}c?",
    r"(0|1[0-9]{0,2}|2[0-4][0-9])(\.(0|1[0-9]{0,2})){3}",
]


@pytest.fixture(scope="module")
def vocab() -> TokenVocabulary:
    return TokenVocabulary.from_token_bytes(TOKENS, EOS, SIZE)


@pytest.fixture(scope="module", params=["c_api", "python_bindings"])
def both_backends(vocab, request):
    """The eager backend and a lazy one building regex/Lark programs through llguidance's C API
    (the default) or its Python bindings (where the C API is not used: explicit parser limits
    here, or another llguidance release)."""
    import llguidance

    limits = None if request.param == "c_api" else llguidance.LLParserLimits()
    eager, lazy = EagerBackend(vocab, timeout_s=10), LazyBackend(vocab, limits=limits)
    yield eager, lazy
    eager.close()


def _mask_rows(matcher, tokens: list[int]) -> list[bytes]:
    """The mask before each token of ``tokens`` (as bytes), following them while admitted."""
    bm = allocate_bitmask(1, SIZE)
    rows = []
    for t in tokens + [None]:
        matcher.fill_bitmask(bm, 0)
        rows.append(bm.numpy().tobytes())
        if t is None or not matcher.accept_tokens([t]):
            break
    return rows


def _tokenizations(text: str, rng: random.Random) -> list[int]:
    """A random tokenization of ``text`` over the tiny vocabulary (greedy over random lengths)."""
    out, i = [], 0
    while i < len(text):
        options = [n for n in (3, 2, 1) if text[i:i + n] in ID]
        n = rng.choice(options)
        out.append(ID[text[i:i + n]])
        i += n
    return out


@pytest.mark.parametrize("pattern", REGEXES)
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_same_regex_same_tokens_and_masks_on_both_backends(both_backends, pattern, data):
    """Strings from the regex (valid) and mutations of them (mostly invalid), each tokenized at
    random: validate_tokens, acceptance and every mask along the way agree."""
    eager, lazy = both_backends
    prog = Program("regex", pattern)
    ge, gl = _grammar(eager, prog), _grammar(lazy, prog)
    text = data.draw(st.from_regex(re.compile(pattern), fullmatch=True).filter(
        lambda s: all(c in CHARS for c in s)))
    if data.draw(st.booleans()):
        pos = data.draw(st.integers(0, len(text)))
        text = text[:pos] + data.draw(st.sampled_from(list(CHARS))) + text[pos:]
    tokens = _tokenizations(text, random.Random(data.draw(st.integers(0, 1000)))) + [EOS]
    me, ml = ge.matcher(), gl.matcher()
    assert me.validate_tokens(tokens) == ml.validate_tokens(tokens)
    assert _mask_rows(ge.matcher(), tokens) == _mask_rows(gl.matcher(), tokens)
    assert me.accept_tokens(tokens) == ml.accept_tokens(tokens) == bool(re.fullmatch(pattern, text))
    assert me.forced_tokens(4) == ml.forced_tokens(4)


_GRAMMARS: dict = {}


def _grammar(backend, program):
    key = (backend.name, getattr(backend, "_limits", None) is None, program.text)
    if key not in _GRAMMARS:
        _GRAMMARS[key] = backend.build(program)
    return _GRAMMARS[key]


def test_rollback_and_forced_tokens_agree_on_random_walks(both_backends):
    eager, lazy = both_backends
    rng = random.Random(1)
    for pattern in REGEXES:
        prog = Program("regex", pattern)
        me, ml = _grammar(eager, prog).matcher(), _grammar(lazy, prog).matcher()
        for _ in range(30):
            bm_e, bm_l = allocate_bitmask(1, SIZE), allocate_bitmask(1, SIZE)
            me.fill_bitmask(bm_e, 0)
            ml.fill_bitmask(bm_l, 0)
            assert torch.equal(bm_e, bm_l), pattern
            assert me.forced_tokens(3) == ml.forced_tokens(3)
            assert me.is_accepting() == ml.is_accepting()
            allowed = [t for t in range(SIZE) if (int(bm_e[0, t >> 5]) >> (t & 31)) & 1]
            assert me.is_terminated() == ml.is_terminated()
            if allowed and not me.is_terminated() and rng.random() < 0.8:
                t = rng.choice(allowed)
                assert me.accept_tokens([t]) and ml.accept_tokens([t])
            elif me.num_tokens:
                k = rng.randint(1, me.num_tokens)
                me.rollback(k)
                ml.rollback(k)


# -- programs the front end writes --------------------------------------------------------------

TREE = {"$defs": {"node": {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 8},
    "children": {"type": "array", "items": {"$ref": "#/$defs/node"}}}, "required": ["name", "children"]}},
    "$ref": "#/$defs/node"}


@pytest.fixture(scope="module")
def real_compilers(tokenizer):
    # The tests check languages, not time: an index build of seconds on 49k tokens must not meet the
    # 10 s compile limit when two test processes share a busy machine's 2 cores.
    with GrammarCompiler(tokenizer, len(tokenizer), backend="eager", timeout_s=120) as e, \
            GrammarCompiler(tokenizer, len(tokenizer), backend="lazy", timeout_s=120) as lz:
        yield e, lz


def _accepts(grammar, tokenizer, text: str) -> bool:
    m = grammar.matcher()
    return m.accept_tokens(tokenizer.encode(text, add_special_tokens=False)) and m.is_accepting()


def test_recursive_schema_is_a_grammar_exact_at_any_depth(real_compilers, tokenizer):
    _, lazy = real_compilers
    prog = to_program(GrammarSpec.json_schema(TREE), handover=False)  # Stencil's own translation
    assert prog.kind == "lark" and "r0" in prog.text
    g = lazy.compile(GrammarSpec.json_schema(TREE))
    deep = '{"name":"a","children":[]}'
    for i in range(12):  # 12 levels: far past the 3 levels a regex unrolls
        deep = '{"name":"n%d","children":[%s]}' % (i, deep)
    assert _accepts(g, tokenizer, deep)
    assert _accepts(g, tokenizer, '{"name":"a","children":[{"name":"b","children":[]},{"name":"c","children":[]}]}')
    for bad in ('{"name":"a","children":[{"name":"b"}]}', '{"name":"toolongname","children":[]}',
                '{"children":[],"name":"a"}'):
        assert not _accepts(g, tokenizer, bad), bad
    with pytest.raises(GrammarError, match="no value"):
        lazy.compile(GrammarSpec.json_schema({"$defs": {"a": {"type": "array", "items": {"$ref": "#/$defs/a"},
                                                               "minItems": 1}}, "$ref": "#/$defs/a"}))


def test_an_eager_only_request_unrolls_the_recursion(real_compilers, tokenizer):
    eager, _ = real_compilers
    g = eager.compile(GrammarSpec.json_schema(TREE))
    assert _accepts(g, tokenizer, '{"name":"a","children":[{"name":"b","children":[]}]}')
    deep = '{"name":"a","children":[]}'
    for i in range(8):
        deep = '{"name":"n%d","children":[%s]}' % (i, deep)
    assert not _accepts(g, tokenizer, deep)  # a subset: depth is bounded


@pytest.mark.parametrize("schema, good, bad", [
    ({"type": "string", "pattern": "^[a-z]+(-[a-z]+)*$", "minLength": 3, "maxLength": 8},
     ['"abc"', '"ab-cd"', '"abcdefgh"'], ['"ab"', '"abcdefghi"', '"a--b"', '"ab-"']),
    ({"type": "string", "format": "email", "pattern": "@example\\.com$"},
     ['"a@example.com"'], ['"a@other.com"', '"example.com"']),
    ({"type": "string", "pattern": "^https?://", "maxLength": 12},
     ['"http://a.b"', '"https://x"'], ['"ftp://a"', '"https://abcdefgh"']),
])
def test_pattern_with_length_or_format_is_an_exact_intersection(real_compilers, tokenizer, schema, good, bad):
    _, lazy = real_compilers
    prog = to_program(GrammarSpec.json_schema(schema))
    assert not prog.regular  # an intersection: lazy only
    g = lazy.compile(GrammarSpec.json_schema(schema))
    for doc in good:
        assert _accepts(g, tokenizer, doc), doc
    for doc in bad:
        assert not _accepts(g, tokenizer, doc), doc
    with pytest.raises(GrammarError, match="pattern"):  # the regex-only compilation still refuses it
        to_program(GrammarSpec.json_schema(schema), grammar=False)


def test_pattern_properties_beside_declared_names_and_disjoint_patterns(real_compilers, tokenizer):
    _, lazy = real_compilers
    # A pattern that also matches a declared name: that name takes both schemas, and the extra
    # keys are the pattern's minus the declared names (an intersection: lazy only).
    schema = {"type": "object", "properties": {"basic": {"type": "string"}},
              "patternProperties": {".*": {"type": "string", "maxLength": 3}}, "additionalProperties": False}
    g = lazy.compile(GrammarSpec.json_schema(schema))
    for doc in ('{"basic":"abc"}', '{"x":"ab"}', '{"basic":"a","y":""}'):
        assert _accepts(g, tokenizer, doc), doc
    for doc in ('{"basic":"abcd"}', '{"x":"abcd"}', '{"x":1}', '{"basic":"a","basic":"b"}'):
        assert not _accepts(g, tokenizer, doc), doc
    with pytest.raises(GrammarError, match="declared property"):
        to_program(GrammarSpec.json_schema(schema), grammar=False)
    # Patterns with different literal prefixes never match one key together: each takes its own.
    schema = {"type": "object", "additionalProperties": False,
              "patternProperties": {"^name:(en|nl)$": {"type": "string"}, "^size:": {"type": "integer"}}}
    g = lazy.compile(GrammarSpec.json_schema(schema))
    for doc in ('{"name:en":"a","size:x":3}', '{}', '{"size:":1}'):
        assert _accepts(g, tokenizer, doc), doc
    for doc in ('{"name:en":3}', '{"size:x":"a"}', '{"name:fr":"a"}'):
        assert not _accepts(g, tokenizer, doc), doc
    with pytest.raises(GrammarError, match="match together"):
        to_program(GrammarSpec.json_schema({"type": "object", "additionalProperties": False,
                                            "patternProperties": {"^a": {"type": "string"}, "b$": {}}}))


def test_not_pattern_is_a_complement_of_a_superset(real_compilers, tokenizer):
    _, lazy = real_compilers
    schema = {"type": "string", "minLength": 1, "not": {"pattern": "^[.,*\\-\\s{}()]+$"}}
    prog = to_program(GrammarSpec.json_schema(schema))
    assert not prog.regular and "&~(" in prog.lark()
    g = lazy.compile(GrammarSpec.json_schema(schema))
    for doc in ('"abc"', '"a."', '".a"'):
        assert _accepts(g, tokenizer, doc), doc
    for doc in ('""', '"..."', '" "', '"\u2003"', '"-(*)"'):
        assert not _accepts(g, tokenizer, doc), doc
    # \d taken at its widest (every Unicode digit), so the complement never admits a match.
    g = lazy.compile(GrammarSpec.json_schema({"type": ["string", "integer"],
                                              "not": {"type": "string", "pattern": "\\d"}}))
    for doc, ok in (('"abc"', True), ('5', True), ('"a1"', False), ('"a\u0663"', False)):
        assert _accepts(g, tokenizer, doc) is ok, doc
    with pytest.raises(GrammarError, match="not"):  # a regex alone cannot say it
        to_program(GrammarSpec.json_schema(schema), grammar=False)


def test_flexible_whitespace_inside_enum_object_literals(real_compilers, tokenizer):
    _, lazy = real_compilers
    spec = GrammarSpec.json_schema({"enum": [{"a": True, "b": [1, 2]}, "x"]}, whitespace="flexible")
    g = lazy.compile(spec)
    for doc in ('{"a": true, "b": [1, 2]}', '{"a":true,"b":[1,2]}', '"x"'):
        assert _accepts(g, tokenizer, doc), doc
    assert not _accepts(g, tokenizer, '{"b": [1, 2], "a": true}')


@pytest.mark.parametrize("flat", [True, False])
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_lark_writers_keep_the_language_of_terminal_texts(both_backends, flat, data, monkeypatch):
    """Texts with terminal references, empty alternatives, quantified groups and intersections:
    the Lark terminal (token-level writer, or the tree writer it falls back to) admits exactly
    the strings Python's re admits on the text written out."""
    from stencil.grammar import program as rules

    _, lazy = both_backends
    terminals = ["a(?:b|c)", "[0-9]{1,2}", rules.term_ref(0) + "x?"]
    pieces = [rules.term_ref(0), rules.term_ref(1), rules.term_ref(2), "d", "(?:y|z)", ".", "-?"]
    rng = random.Random(data.draw(st.integers(0, 10 ** 6)))

    def gen(depth: int) -> str:
        k = rng.random()
        if depth > 2 or k < 0.35:
            return rng.choice(pieces)
        if k < 0.6:
            branches = [gen(depth + 1) if rng.random() < 0.8 else "" for _ in range(rng.randint(1, 3))]
            return "(?:" + "|".join(branches) + ")" + rng.choice(["", "?", "*", "{1,2}", "+"])
        return gen(depth + 1) + gen(depth + 1)

    def written_out(text: str):
        """The text as an automaton: a backtracking matcher (Python's re) takes exponential
        time on nested quantifiers such as ((a?)*)* and hung CI on one of them."""
        for n in (2, 1, 0):  # terminal 2 refers to 0
            text = text.replace(rules.term_ref(n), "(?:" + terminals[n] + ")")
        return interegular.parse_pattern(text).to_fsm()

    left, right = gen(0), gen(0)
    kind = data.draw(st.sampled_from(["plain", "and", "minus"]))
    text = {"plain": left, "and": rules.both(left, right), "minus": rules.minus(left, right)}[kind]
    rx_left, rx_right = written_out(left), written_out(right)

    def admitted(s: str) -> bool:
        a, b = rx_left.accepts(s), rx_right.accepts(s)
        return a if kind == "plain" else (a and b if kind == "and" else a and not b)

    if not flat:
        monkeypatch.setattr(rules._Writer, "_flat", lambda self, t: None)
    alphabet = "abcdxyz0123456789.-"
    samples = {"".join(rng.choice(alphabet) for _ in range(rng.randint(0, 6))) for _ in range(60)}
    samples |= {"".join(rng.choice("abcdxyz01.-") for _ in range(rng.randint(0, 4))) for _ in range(200)}
    try:
        g = lazy.build(Program("regex", text, (), tuple(terminals)))
    except GrammarError:  # an empty intersection: nothing can start it
        assert kind != "plain" and not any(admitted(s) for s in samples)
        return
    for sample in samples:
        m = g.matcher()
        ok = m.accept_tokens([ID[ch] for ch in sample]) and m.is_accepting()
        assert ok == admitted(sample), (text, sample)


def test_lark_writer_names_pieces_nested_deeper_than_llguidance_reads(both_backends):
    from stencil.grammar import program as rules

    _, lazy = both_backends
    text = rules.term_ref(0)
    for _ in range(40):  # 40 groups around a terminal: llguidance refuses about 30
        text = "(?:" + text + "a?)"
    lark = rules.to_lark(text, {}, ["b"])
    assert "N0" in lark  # a named piece
    g = lazy.build(Program("regex", text, (), ("b",)))  # llguidance reads it (too deep: an error)
    for sample, ok in (("b", True), ("b" + "a" * 40, True), ("ba" * 2, False), ("a", False)):
        m = g.matcher()
        assert (m.accept_tokens([ID[ch] for ch in sample]) and m.is_accepting()) is ok, sample


def test_shared_terminals_write_the_same_regex():
    """A served program names repeated pieces once; written out, it is the regex-mode text's
    language (checked with Python's re on both); its Lark form cuts lexemes at whole values
    (``tests/grammar/test_value_lexemes.py``)."""
    schema = {"type": "object", "properties": {k: {"type": "string"} for k in "abcdef"} |
              {"n": {"type": "array", "items": {"type": "object", "properties": {"x": {"type": "string"}}}}}}
    prog = to_program(GrammarSpec.json_schema(schema), handover=False)
    assert prog.regular and prog.terminals and len(prog.text) < prog.regex_size()
    rx = re.compile(prog.regex())
    for doc in ('{"a":"1","c":"x\\"y","n":[{"x":"q"},{}]}', '{}', '{"b":"","f":"z"}'):
        assert rx.fullmatch(doc), doc
    assert not rx.fullmatch('{"g":"1"}') and not rx.fullmatch('{"n":[{"x":1}]}')
    lark = prog.lark()
    assert lark.startswith("start: v") and "MAIN" not in lark and "T0:" in lark
    assert expand(prog.text, prog.terminals) == prog.regex()


def test_separators_are_shared_terminals_but_not_before_a_quantifier():
    """Flexible whitespace around ',' and ':' is one terminal each (a shorter Lark text, the same
    language); a quantifier right after ``W,W`` binds to the last W, so that piece stays."""
    from stencil.grammar import program as rules
    from stencil.grammar.json_schema.schema_compiler import FLEXIBLE_WS, SchemaCompiler, SchemaOptions

    schema = {"type": "object", "properties": {k: {"type": "integer"} for k in "abcd"}, "required": ["a"]}
    prog = to_program(GrammarSpec.json_schema(schema, whitespace="flexible"), handover=False)
    ws = prog.terminals.index(FLEXIBLE_WS)
    w = rules.term_ref(ws)
    assert w + "," + w in prog.terminals and w + ":" + w in prog.terminals
    rx = re.compile(prog.regex())
    for doc in ('{"a":1}', '{ "a" : 1 ,\n  "c":2}', '{"a":1,"b":2,"c":3,"d":4}'):
        assert rx.fullmatch(doc), doc
    for doc in ('{"a":1,,"b":2}', '{"b":2}', '{"a"::1}'):
        assert not rx.fullmatch(doc), doc
    lark = prog.lark()
    assert f"T{ws}/,/T{ws}" in lark and f"T{ws}/:/T{ws}" in lark
    c = SchemaCompiler(schema, SchemaOptions("flexible", grammar=True))
    w = c._ws_term()
    out = c._separators(w + "," + w + "*x" + w + "," + w + "y")
    assert out.startswith(w + "," + w + "*x") and out.endswith("y") and out.count(",") == 1


def test_compact_lark_text_keeps_names_and_delimiters_apart():
    from stencil.grammar.program import _join

    assert _join(["T1", "T2", "/a/", "/b/", "(", "T3", ")", "?", '""', '""', "r0"]) == 'T1 T2/a/ /b/(T3)?"" ""r0'


def test_matchers_start_from_the_root_mask_without_sharing_it(both_backends):
    """Every matcher's first mask is the root state's, computed once at build; a matcher that
    moves on rewrites its own copy, never the root's (the next matcher starts right)."""
    eager, lazy = both_backends
    prog = Program("regex", r"ab(cd)?|x[0-9]")
    gl, ge = _grammar(lazy, prog), _grammar(eager, prog)
    first = _mask_rows(ge.matcher(), [])[0]
    m1 = gl.matcher()
    assert _mask_rows(m1, [ID["a"], ID["b"]])[0] == first
    m1.fill_bitmask(allocate_bitmask(1, SIZE), 0)  # computed in m1's buffer, after "ab"
    m2 = gl.matcher()
    assert _mask_rows(m2, [])[0] == first
    m1.rollback(2)
    assert _mask_rows(m1, [])[0] == first


def test_every_new_bitmask_is_checked_though_the_backend_remembers_the_last_one(both_backends):
    """A lazy backend remembers the last bitmask a cursor checked, so a new cursor writing into
    the same rows skips the checks; any other tensor, for any cursor, is still checked (dtype,
    width, row range), and the rows written are the mask whichever path the check took."""
    eager, lazy = both_backends
    prog = Program("regex", r"ab(cd)?|x[0-9]")
    gl = _grammar(lazy, prog)
    good = allocate_bitmask(3, SIZE)
    m1, m2 = gl.matcher(), gl.matcher()
    m1.fill_bitmask(good, 2)
    m2.fill_bitmask(good, 0)  # the backend's remembered bitmask: the same rows
    assert good[0].numpy().tobytes() == good[2].numpy().tobytes() == _mask_rows(_grammar(eager, prog).matcher(), [])[0]
    bad = [torch.zeros((1, good.shape[1]), dtype=torch.int64), torch.zeros((1, good.shape[1] + 1), dtype=torch.int32),
           torch.zeros((1, 2 * good.shape[1]), dtype=torch.int32)[:, ::2]]
    for m in (m1, m2, gl.matcher()):
        for b in bad:
            with pytest.raises(ValueError, match="bitmask must be"):
                m.fill_bitmask(b, 0)
        with pytest.raises(ValueError, match="outside"):
            m.fill_bitmask(good, 3)
        m.fill_bitmask(good, 1)
        assert good[1].numpy().tobytes() == good[0].numpy().tobytes()


JSON_TOKENS = {i: bytes([c]) for i, c in enumerate(b'{}[]":, abcxyz0123456789')} | {30: b'"a', 31: b'":', 32: b"12"}
JSON_TOKENS_ID = {b: i for i, b in JSON_TOKENS.items()}


@pytest.mark.parametrize("kind", ["regex", "json"])
def test_a_dropped_cursors_matcher_serves_the_next_cursor_reset(kind):
    """A cursor's llguidance matcher goes back to its grammar, reset, when the cursor is
    dropped; the next cursor takes it and sees exactly the masks a fresh grammar's cursor sees
    (the Python bindings' matcher for a regex, the C API's for a JSON program). The pool keeps
    at most ``MATCHER_POOL_SIZE``."""
    from stencil.grammar.backends.lazy import MATCHER_POOL_SIZE

    vocab = TokenVocabulary.from_token_bytes(JSON_TOKENS, 40, 48)
    lazy = LazyBackend(vocab)
    by_text = {b.decode(): i for i, b in JSON_TOKENS.items()}
    if kind == "regex":
        program = Program("regex", r'\{"a":(12|[0-9]{1,3}),"b":[a-c]+\}')
        text = '{"a":12,"b":cab}'
    else:
        schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}},
                  "required": ["a", "b"], "additionalProperties": False}
        program = Program("json", json.dumps({"x-guidance": {"whitespace_flexible": False}, **schema}))
        text = '{"a":12,"b":"cab"}'
    tokens = [by_text[c] for c in text] + [40]
    g, fresh = lazy.build(program), lazy.build(program)
    expected = _rows(fresh.matcher(), tokens, vocab)
    m1 = g.matcher()
    assert m1.accept_tokens(tokens[:7])
    inner = m1._m
    del m1
    assert g._pool == [inner]
    m2 = g.matcher()
    assert m2._m is inner and g._pool == []
    assert _rows(m2, tokens, vocab) == expected
    assert m2.is_terminated()
    cursors = [g.matcher() for _ in range(MATCHER_POOL_SIZE + 2)]
    for c in cursors:
        assert c.accept_tokens(tokens[:3])
    del c, cursors, m2
    assert len(g._pool) == MATCHER_POOL_SIZE
    assert all(_rows(g.matcher(), tokens, vocab) == expected for _ in range(MATCHER_POOL_SIZE + 1))


def _rows(matcher, tokens: list[int], vocab: TokenVocabulary) -> list[bytes]:
    bm = allocate_bitmask(1, vocab.model_vocab_size)
    rows = []
    for t in tokens:
        matcher.fill_bitmask(bm, 0)
        rows.append(bm.numpy().tobytes())
        assert matcher.accept_tokens([t])
    return rows


def test_to_lark_names_rules_and_lexemes():
    from stencil.grammar.program import ref

    lark = to_lark(r"\[" + ref(0) + r"(?:," + ref(0) + r")*\]", {0: "x|y" + ref(0)})
    assert lark.splitlines()[0] == r"start: /\[/r0(/,/r0)*/\]/"
    assert lark.splitlines()[1] == "r0: (/x/|/y/r0)"


# -- MaskBench dev instances on both backends ------------------------------------------------------

MASKBENCH = Path(__file__).resolve().parents[3] / "shared" / "corpora" / "maskbench-dev"


@pytest.mark.skipif(not MASKBENCH.exists(), reason="../shared/corpora/maskbench-dev is absent")
def test_maskbench_instances_get_the_same_verdicts_and_masks_on_both_backends(tokenizer):
    """40 schemas evenly spread over the corpus (those with a regex program the eager backend can
    index within its limits): every instance, valid or not, walks both matchers token by token
    with identical masks and the same verdict."""
    from stencil.grammar.backends.eager import EagerBackend as Eager
    from stencil.grammar.backends.lazy import LazyBackend as Lazy
    from stencil.grammar.vocab import build_vocabulary

    vocab = build_vocabulary(tokenizer, len(tokenizer))
    eager, lazy = Eager(vocab, timeout_s=5, max_regex_chars=20_000), Lazy(vocab)
    files = sorted(MASKBENCH.glob("*.json"))
    picked = [files[i * len(files) // 120] for i in range(120)]
    compared = 0
    bm_e = allocate_bitmask(1, vocab.model_vocab_size)
    bm_l = allocate_bitmask(1, vocab.model_vocab_size)
    try:
        for f in picked:
            if compared >= 40:
                break
            case = json.loads(f.read_text())
            try:
                prog = to_program(GrammarSpec.json_schema(case["schema"]), handover=False)
                if not prog.regular:
                    continue
                ge, gl = eager.build(prog), lazy.build(prog)
            except GrammarError:
                continue
            compared += 1
            for t in case["tests"][:4]:
                ids = tokenizer.encode(json.dumps(t["data"], separators=(",", ":")), add_special_tokens=False)
                me, ml = ge.matcher(), gl.matcher()
                for tid in ids:
                    me.fill_bitmask(bm_e, 0)
                    ml.fill_bitmask(bm_l, 0)
                    assert torch.equal(bm_e, bm_l), f.name
                    a, b = me.accept_tokens([tid]), ml.accept_tokens([tid])
                    assert a == b, f.name
                    if not a:
                        break
                assert me.is_accepting() == ml.is_accepting(), f.name
    finally:
        eager.close()
    assert compared >= 30


def test_the_public_grammar_api_as_the_readme_shows_it(tokenizer):
    """The names external harnesses drive (docs/api.md, "The grammar API (Python)"), used exactly that way."""
    from stencil.grammar import GrammarCompiler as PublicCompiler
    from stencil.grammar import GrammarSpec as PublicSpec

    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    with PublicCompiler(tokenizer, len(tokenizer), max_workers=2, timeout_s=10.0, cache_size=256) as compiler:
        for spec, text in ((PublicSpec.json_schema(schema, whitespace="flexible"), '{"a": 7}'),
                           (PublicSpec.regex(r"[0-9]{3}-x"), "123-x"),
                           (PublicSpec.choice(["yes", "no"]), "no"),
                           (PublicSpec.grammar('start: "(" start ")" | "x"'), "((x))")):
            compiled = compiler.compile(spec)
            m = compiled.matcher()
            bitmask = allocate_bitmask(1, len(tokenizer))
            for t in tokenizer.encode(text, add_special_tokens=False):
                m.fill_bitmask(bitmask, 0)
                assert (int(bitmask[0, t >> 5]) >> (t & 31)) & 1
                assert m.accept_tokens([t])
            assert m.is_accepting(), text


def test_a_cursor_dropped_while_its_grammar_is_locked_is_freed_not_waited_for():
    """``_give_back`` runs from ``__del__``, which the garbage collector may call on a thread that
    holds the grammar's lock: it must not wait for it (the matcher is then simply not kept)."""
    vocab = TokenVocabulary.from_token_bytes(JSON_TOKENS, 40, 48)
    g = LazyBackend(vocab).build(Program("regex", r"[a-c]+"))
    g.matcher()  # the first cursor shares the root; the next ones own a matcher
    m = g.matcher()
    assert m.accept_tokens([JSON_TOKENS_ID[b"a"]])
    with g._root_lock:
        del m  # would deadlock if it waited for the lock
        assert g._pool == []
    m2 = g.matcher()
    assert m2.accept_tokens([JSON_TOKENS_ID[b"b"]])
    del m2
    assert len(g._pool) == 1


@pytest.fixture
def freed(monkeypatch) -> list[int]:
    """The pointers the C API's matchers hand to the freeing thread (``llg_c._FREE``, stubbed to
    record them instead); skips where llguidance is not the release the C API binding is for."""
    import gc

    from stencil.grammar.backends import llg_c

    if llg_c.library() is None:
        pytest.skip("llguidance is not the release the C API binding is for")
    # Earlier tests' matchers caught in unreachable cycles are freed now, for real: a collection
    # during the test would otherwise record their pointers too (seen once in a loaded make test).
    gc.collect()
    freed: list[int] = []
    monkeypatch.setattr(llg_c, "_FREE", lambda lib, ptr: freed.append(ptr))
    return freed


def test_a_matcher_finalized_before_its_cursor_is_not_kept_for_the_next_one(freed):
    """The garbage collector finalizes every object of an unreachable cycle in no set order: a
    cursor caught in one (a traceback holds it) may give back a C matcher whose own ``__del__``
    already ran. Kept, it crashed the next cursor's reset (a NULL matcher), as the service did
    under load after a request's fault; it must be dropped, and the next cursor must work."""
    import gc

    vocab = TokenVocabulary.from_token_bytes(JSON_TOKENS, 40, 48)
    g = LazyBackend(vocab).build(Program("json", '{"type": "integer"}'))
    g.matcher()  # the first cursor shares the root; the next ones own a matcher
    cursor = g.matcher()
    assert cursor.accept_tokens([JSON_TOKENS_ID[b"1"]])
    inner = cursor._m
    ptr = inner._ptr
    inner.__del__()  # the collector finalizes the matcher first ...
    assert freed == [ptr] and inner.freed
    cursor.__del__()  # ... then the cursor, which gives it back
    assert g._pool == []
    # The other order in one collection: given back first, then finalized in the pool.
    cursor = g.matcher()
    assert cursor.accept_tokens([JSON_TOKENS_ID[b"1"]])
    inner = cursor._m
    cursor.__del__()
    assert g._pool == [inner]
    inner.__del__()
    taken = g.matcher()
    assert taken._m is not inner and not taken._m.freed and g._pool == []
    # The same through a real cycle, many times: whatever order the collector takes, the pool
    # keeps only live matchers.
    for _ in range(50):
        holder: list = []
        holder.append(holder)
        holder.append(g.matcher())
        assert holder[1].accept_tokens([JSON_TOKENS_ID[b"2"]])
        del holder
        gc.collect(1)  # the young generations hold the new cycle (a full collection costs ~0.4 s here)
    assert not any(m.freed for m in g._pool)
    fresh = g.matcher()
    assert fresh.accept_tokens([JSON_TOKENS_ID[b"3"]]) and fresh.is_accepting()


def test_every_c_matcher_is_freed_once_when_its_last_reference_goes(freed):
    """A C API matcher (``llg_c.CMatcher``) hands its pointer to the freeing thread exactly once,
    when it is dropped: the root and the copies of a grammar, and the matchers its cursors gave
    back to its pool, all with the grammar; none before."""
    vocab = TokenVocabulary.from_token_bytes(JSON_TOKENS, 40, 48)
    g = LazyBackend(vocab).build(Program("json", '{"type": "integer"}'))
    cursors = [g.matcher() for _ in range(3)]  # each owns a copy of the root from its first step
    for m in cursors:
        assert m.accept_tokens([JSON_TOKENS_ID[b"1"]])
    ptrs = {g._root._ptr} | {m._m._ptr for m in cursors}
    assert len(ptrs) == 4 and 0 not in ptrs
    extra = g._root.deep_copy()
    extra_ptr = extra._ptr
    del extra
    assert freed == [extra_ptr]
    del cursors, m  # their matchers go back to the grammar's pool, not freed
    assert freed == [extra_ptr] and len(g._pool) == 3
    del g
    assert sorted(freed) == sorted(ptrs | {extra_ptr})


def test_dropped_matchers_reach_the_freeing_thread_in_batches():
    """``_Freer`` hands dropped matchers to its thread ``FREE_BATCH`` at a time, each exactly
    once and in order; the rest wait for the next batch; the thread frees what it is handed."""
    from stencil.grammar.backends import llg_c

    freed: list[int] = []

    class Lib:
        @staticmethod
        def llg_free_matcher(ptr):
            freed.append(ptr)

    freer = llg_c._Freer()
    freer._thread = "held"  # no thread: the batches stay in the queue, to be read here
    n = 2 * llg_c.FREE_BATCH + 3
    for ptr in range(1, n + 1):
        freer(Lib, ptr)
    batches = []
    while not freer._queue.empty():
        batches.append([p for _, p in freer._queue.get_nowait()])
    b = llg_c.FREE_BATCH
    assert batches == [list(range(1, b + 1)), list(range(b + 1, 2 * b + 1))]
    assert [p for _, p in freer._pending] == list(range(2 * b + 1, n + 1))
    freer._queue.put([(Lib, 7), (Lib, 9)])
    freer._queue.put([])
    freer._queue.put(None)  # (ends the loop below: not a batch)
    try:
        freer._run()
    except TypeError:
        pass
    assert freed == [7, 9]


def test_a_lone_surrogate_in_a_program_is_a_grammar_error():
    """A Python schema may hold a lone surrogate, which no UTF-8 text spells: the C API's
    matcher refuses it with a GrammarError, not a UnicodeEncodeError."""
    from stencil.grammar.backends import llg_c

    if llg_c.library() is None:
        pytest.skip("llguidance is not the release the C API binding is for")
    vocab = TokenVocabulary.from_token_bytes(JSON_TOKENS, 40, 48)
    with pytest.raises(GrammarError, match="surrogate"):
        LazyBackend(vocab).build(Program("json", json.dumps({"enum": ["a\ud800"]}, ensure_ascii=False)))


def test_backend_names_are_the_registrys_everywhere_they_are_chosen(vocab):
    """``stencil.grammar.backends.backend_registry`` is the names' one home: the wire ``Literal``
    (written out for the OpenAPI schema), the compiler's policies, the CLI's choices and the engine
    config's check all take its names, and each name builds the backend of that name."""
    import typing

    from stencil.engine.config import ConfigError, EngineConfig
    from stencil.grammar import compiler
    from stencil.grammar.backends import backend_registry
    from stencil.schemas.generate import GenerateRequest
    from stencil.service.cli import build_parser

    assert backend_registry.POLICIES == ("auto", "eager", "lazy")
    assert backend_registry.POLICIES == ("auto", *backend_registry.names())
    wire = typing.get_type_hints(GenerateRequest)["grammar_backend"]
    literal = next(a for a in typing.get_args(wire) if typing.get_origin(a) is typing.Literal)
    assert typing.get_args(literal) == backend_registry.POLICIES
    assert compiler.POLICIES == backend_registry.POLICIES
    assert build_parser().parse_args(["serve", "--grammar-backend", "lazy"]).grammar_backend == "lazy"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--grammar-backend", "fast"])
    with pytest.raises(ConfigError, match="grammar_backend must be auto, eager or lazy, got 'fast'"):
        EngineConfig(model="m", grammar_backend="fast").validate()
    for name in backend_registry.names():
        backend = backend_registry.create(name, vocab)
        try:
            assert backend.name == name
        finally:
            backend.close()
