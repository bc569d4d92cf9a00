"""GrammarCompiler: caches, errors with positions, backends and the auto policy, time limit in a
killable eager worker, spec kinds (regex, choice, JSON Schema, Lark)."""

from __future__ import annotations

import json
import time

import jsonschema
import pytest
import torch

from grammar.base import GrammarError, GrammarSpec, GrammarTimeout
from grammar.compiler import GrammarCompiler
from grammar.vocab import TokenVocabulary

EOS = 40
CHARS = "abcdxyz0123456789.-()[]^$\\ "
TOKENS = {i: ch.encode() for i, ch in enumerate(CHARS)}
ID = {b.decode(): i for i, b in TOKENS.items()}
# A DFA with ~2^20 states: far beyond any small time limit.
EXPLOSIVE = "(a|b)*a" + "[ab]" * 20


@pytest.fixture(scope="module")
def vocab() -> TokenVocabulary:
    return TokenVocabulary.from_token_bytes(TOKENS, EOS, 48)


@pytest.fixture(scope="module", params=["eager", "lazy"])
def compiler(vocab, request):
    """One compiler per backend: every test that takes it runs on both."""
    with GrammarCompiler(vocab, 48, max_workers=1, timeout_s=0.5, backend=request.param) as c:
        yield c


@pytest.fixture(scope="module")
def eager(vocab):
    with GrammarCompiler(vocab, 48, max_workers=1, timeout_s=0.5, backend="eager") as c:
        yield c


def accepts_text(grammar, text: str) -> bool:
    m = grammar.matcher()
    return m.accept_tokens([ID[ch] for ch in text]) and m.accept_tokens([EOS])


def test_second_compile_is_a_cache_hit(vocab):
    with GrammarCompiler(vocab, 48, backend="lazy") as c:
        g1 = c.compile(GrammarSpec("regex", "ab+"))
        g2 = c.compile(GrammarSpec("regex", "ab+"))
        assert g1 is g2
        assert (c.stats.compiles, c.stats.cache_hits) == (1, 1)
        c.compile(GrammarSpec("regex", "ab*"))
        assert c.stats.compiles == 2 and c.stats.compile_ms_count == 2 and c.stats.compile_ms_sum > 0


def test_lru_evicts_the_least_recently_used(vocab):
    with GrammarCompiler(vocab, 48, cache_size=2) as c:
        a, b, d = (GrammarSpec("regex", p) for p in ("a", "b", "d"))
        c.compile(a), c.compile(b), c.compile(a), c.compile(d)  # b is now the oldest
        c.compile(a)
        assert c.stats.cache_hits == 2
        c.compile(b)
        assert c.stats.compiles == 4


@pytest.mark.parametrize("pattern, position, words", [
    ("ab[", 2, "unterminated character class"),
    ("a)", 1, "unbalanced"),
    ("*a", 0, "invalid regex"),          # Rust refuses; Python's parser gives the position
    ("ab(?Q)", 3, "invalid regex"),
    ("a(?=b)", 1, "lookaround"),
    ("a(?!b)", 1, "lookaround"),
    ("(?<=x)a", 0, "lookaround"),
    ("x(?<!x)a", 1, "lookaround"),
    (r"(a)\1", 3, "backreference"),
    ("(?P<n>a)(?P=n)", 8, "backreference"),
    ("(?>a)b", 0, "atomic"),
    ("a^b", 1, "anchor"),
    ("^a$b", 2, "anchor"),
    (r"x\bfoo", 1, "anchor"),
    ("x)|(y", 1, "unbalanced"),          # would parse once wrapped as (?:x)|(y)\x01
    ("(a|(b)", 0, "unterminated group"),
    ("ab\\", 2, "trailing backslash"),
])
def test_invalid_or_unsupported_regex_reports_its_position(compiler, pattern, position, words):
    with pytest.raises(GrammarError) as info:
        compiler.compile(GrammarSpec("regex", pattern))
    assert not isinstance(info.value, GrammarTimeout)
    assert info.value.position == position
    assert words in str(info.value)


@pytest.mark.parametrize("pattern, good, bad", [
    ("^ab$", "ab", "a"),                 # outer anchors are dropped
    (r"a\$", "a$", "a"),                 # an escaped $ stays
    ("[^]a]b", "cb", "ab"),              # ] first in a class is literal
    ("[(?=]x", "(x", "x"),               # lookaround syntax inside a class is just characters
    (r"\(\d\)", "(7)", "7"),
])
def test_tricky_but_supported_regexes(compiler, pattern, good, bad):
    g = compiler.compile(GrammarSpec("regex", pattern))
    assert accepts_text(g, good) and not accepts_text(g, bad)


def test_regex_the_vocabulary_cannot_spell_is_an_error(eager, vocab):
    with pytest.raises(GrammarError, match="no token sequence"):
        eager.compile(GrammarSpec("regex", "ab#"))
    with GrammarCompiler(vocab, 48, backend="lazy") as lazy:
        with pytest.raises(GrammarError, match="no token sequence"):
            lazy.compile(GrammarSpec("regex", "#ab"))  # dead at the start: found at compile time
        m = lazy.compile(GrammarSpec("regex", "ab#")).matcher()  # dead later: found when reached
        assert m.accept_tokens([ID["a"], ID["b"]])
        with pytest.raises(RuntimeError, match="cannot spell"):
            m.fill_bitmask(torch.zeros((1, 2), dtype=torch.int32), 0)


def test_timeout_kills_the_build_and_the_worker_is_free_afterwards(eager):
    before = eager.stats.timeouts
    t = time.perf_counter()
    with pytest.raises(GrammarTimeout):
        eager.compile(GrammarSpec("regex", EXPLOSIVE))
    assert time.perf_counter() - t < 3.0
    # One worker only: had the runaway build kept running, this compile would queue behind it.
    t = time.perf_counter()
    g = eager.compile(GrammarSpec("regex", "x(yz)?"))
    assert time.perf_counter() - t < 3.0
    assert accepts_text(g, "xyz") and not accepts_text(g, "xy")
    assert eager.stats.timeouts == before + 1


def _wait(cond, timeout_s: float = 20.0) -> None:
    """Poll ``cond`` (a background build) until it holds; the test fails after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.02)


def test_the_lazy_backend_takes_what_the_eager_one_cannot_build(vocab):
    """A regex whose DFA has ~2^20 states times out as an eager index; under ``auto`` it is served
    lazily at once, and its background eager build failing leaves it lazy."""
    with GrammarCompiler(vocab, 48, timeout_s=0.3) as c:
        g = c.compile(GrammarSpec("regex", EXPLOSIVE), hot=True)
        assert g.backend == "lazy"
        text = "ab" * 5 + "a" + "b" * 20
        assert accepts_text(g, text) and not accepts_text(g, "b" * 21)
        _wait(lambda: g.error("eager") is not None)
        assert isinstance(g.error("eager"), GrammarTimeout) and c.stats.eager_failures == 1
        assert c.compile(GrammarSpec("regex", EXPLOSIVE)).backend == "lazy"
        with pytest.raises(GrammarTimeout):  # insisting on eager gets the remembered failure
            c.compile(GrammarSpec("regex", EXPLOSIVE), "eager")


def test_auto_builds_the_eager_index_at_the_second_sighting(vocab):
    with GrammarCompiler(vocab, 48) as c:
        spec = GrammarSpec("regex", "a[bc]+d")
        g = c.compile(spec)
        assert g.backend == "lazy" and not g.has("eager")
        assert c.stats.eager_builds == 0  # seen once: no index
        assert c.compile(spec) is g
        _wait(lambda: g.has("eager"))
        assert g.backend == "eager" and c.stats.eager_builds == 1
        assert g.matcher().backend == "eager" and accepts_text(g, "abcd")
        pinned = c.compile(spec, "lazy")  # a per-request choice
        assert pinned.matcher().backend == "lazy" and accepts_text(pinned, "abcbd")
        assert c.compile(GrammarSpec("regex", "xy+"), "eager").matcher().backend == "eager"


def test_a_lark_grammar_is_lazy_only_and_its_errors_name_line_and_column(vocab):
    with GrammarCompiler(vocab, 48) as c:
        g = c.compile(GrammarSpec.grammar('start: expr\nexpr: term ("-" term)*\n'
                                          'term: NUM | "(" expr ")"\nNUM: /[0-9]+/'))
        assert accepts_text(g, "(1-(2-3))-45") and not accepts_text(g, "(1-2")
        assert not accepts_text(g, "1--2")
        with pytest.raises(GrammarError) as info:
            c.compile(GrammarSpec.grammar('start: a\na: ("x"\n'))
        assert info.value.line == 2 and info.value.column is not None
        assert "line 2" in str(info.value)
        with pytest.raises(GrammarError, match="unknown name"):
            c.compile(GrammarSpec.grammar("start: missing"))
        with pytest.raises(GrammarError, match="eager"):
            c.compile(GrammarSpec.grammar('start: "a"'), "eager")


def test_failures_are_remembered(vocab):
    with GrammarCompiler(vocab, 48, timeout_s=0.3, failure_ttl_s=0.0, backend="eager") as c:
        for _ in range(2):
            with pytest.raises(GrammarError) as info:
                c.compile(GrammarSpec("regex", "a(?=b)"))
            assert info.value.position == 1
        assert (c.stats.errors, c.stats.cache_hits) == (1, 1)
        with pytest.raises(GrammarTimeout):
            c.compile(GrammarSpec("regex", EXPLOSIVE))
        with pytest.raises(GrammarTimeout):  # TTL 0: a timed-out spec is tried again
            c.compile(GrammarSpec("regex", EXPLOSIVE))
        assert c.stats.timeouts == 2
    with GrammarCompiler(vocab, 48, timeout_s=0.3, backend="eager") as c:
        with pytest.raises(GrammarTimeout):
            c.compile(GrammarSpec("regex", EXPLOSIVE))
        t = time.perf_counter()
        with pytest.raises(GrammarTimeout):
            c.compile(GrammarSpec("regex", EXPLOSIVE))
        assert time.perf_counter() - t < 0.1 and c.stats.timeouts == 1


def test_worker_memory_limit_turns_a_huge_build_into_an_error(vocab):
    with GrammarCompiler(vocab, 48, timeout_s=30, worker_memory_bytes=150 << 20, backend="eager") as c:
        with pytest.raises(GrammarError, match="too large") as info:
            c.compile(GrammarSpec("regex", EXPLOSIVE + "[ab]"))
        assert not isinstance(info.value, GrammarTimeout)
        assert accepts_text(c.compile(GrammarSpec("regex", "ab")), "ab")  # a fresh worker


def test_submit_returns_at_once_and_shares_inflight_compiles(eager):
    spec = GrammarSpec("regex", EXPLOSIVE + "c")
    before = eager.stats.timeouts
    t = time.perf_counter()
    f1 = eager.submit(spec)
    f2 = eager.submit(spec)
    assert time.perf_counter() - t < 0.1
    assert isinstance(f1.exception(timeout=10), GrammarTimeout)
    assert isinstance(f2.exception(timeout=10), GrammarTimeout)
    assert eager.stats.timeouts == before + 1  # one build answered both


def test_size_limits(vocab):
    with GrammarCompiler(vocab, 48, max_index_bytes=64, backend="eager") as c:
        with pytest.raises(GrammarError, match="too large"):
            c.compile(GrammarSpec("regex", "[a-d]{1,8}"))
    with GrammarCompiler(vocab, 48, max_regex_chars=5, backend="eager") as c:
        with pytest.raises(GrammarError, match="limit"):
            c.compile(GrammarSpec("regex", "abcdabcd"))


def test_choice_is_an_alternation_of_literals(compiler):
    g = compiler.compile(GrammarSpec("choice", json.dumps(["a.c", "(x)", "a^$", "b"])))
    for text in ("a.c", "(x)", "a^$", "b"):
        assert accepts_text(g, text), text
    for text in ("abc", "x", "a", "a.cb", ""):
        assert not accepts_text(g, text), text
    with pytest.raises(GrammarError):
        compiler.compile(GrammarSpec("choice", "[]"))
    with pytest.raises(GrammarError):
        compiler.compile(GrammarSpec("choice", '["a", 3]'))


def test_disk_cache_survives_a_new_compiler(vocab, tmp_path):
    spec = GrammarSpec("regex", r"-?\d+(\.\d+)?")
    with GrammarCompiler(vocab, 48, disk_cache_dir=tmp_path, backend="eager") as c1:
        g1 = c1.compile(spec)
    files = list(tmp_path.glob("*.idx"))
    assert len(files) == 1
    with GrammarCompiler(vocab, 48, disk_cache_dir=tmp_path, backend="eager") as c2:
        g2 = c2.compile(spec)
        assert c2.stats.disk_hits == 1
    def index(g):
        return g.matcher().grammar.index
    assert index(g2).get_transitions() == index(g1).get_transitions()
    assert accepts_text(g2, "-12.5") and not accepts_text(g2, "12.")
    files[0].write_bytes(files[0].read_bytes()[:-3])  # torn file: rebuilt, not trusted
    with GrammarCompiler(vocab, 48, disk_cache_dir=tmp_path, backend="eager") as c3:
        c3.compile(spec)
        assert c3.stats.disk_hits == 0


def test_closed_compiler_refuses_work(vocab):
    c = GrammarCompiler(vocab, 48)
    c.close()
    with pytest.raises(RuntimeError):
        c.submit(GrammarSpec("regex", "a"))


# -- JSON Schema on the real tokenizer ------------------------------------------------------------

PERSON = {"type": "object",
          "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"]}


@pytest.fixture(scope="module", params=["eager", "lazy"])
def real_compiler(tokenizer, request):
    with GrammarCompiler(tokenizer, len(tokenizer), backend=request.param) as c:
        yield c


def test_json_schema_on_the_real_vocabulary(real_compiler, tokenizer):
    g = real_compiler.compile(GrammarSpec.json_schema(PERSON))
    assert isinstance(g.warnings, tuple)
    validator = jsonschema.Draft202012Validator(PERSON)
    good = '{"name":"Ada Lovelace","age":36}'
    assert validator.is_valid(json.loads(good))
    m = g.matcher()
    ids = tokenizer.encode(good, add_special_tokens=False)
    assert m.accept_tokens(ids)
    assert m.is_accepting() and m.accept_tokens([tokenizer.eos_token_id])
    invalid = ['{"name":"Ada"}', '{"name":"Ada","age":3.5}', '{"name":7,"age":3}']
    reordered = '{"age":36,"name":"Ada"}'  # valid, but properties follow the schema's order
    assert not any(validator.is_valid(json.loads(doc)) for doc in invalid)
    for doc in [*invalid, reordered]:
        m = g.matcher()
        ids = tokenizer.encode(doc, add_special_tokens=False)
        assert not (m.accept_tokens(ids) and m.is_accepting()), doc
