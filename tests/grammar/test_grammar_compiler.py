"""GrammarCompiler: caches, errors with positions, backends and the auto policy, time limit in a
killable eager worker, spec kinds (regex, choice, JSON Schema, Lark)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
import time

import jsonschema
import pytest
import torch

from stencil.grammar.background import DaemonPool
from stencil.grammar.base import GrammarError, GrammarSpec, GrammarTimeout
from stencil.grammar.compiler import GrammarCompiler
from stencil.grammar.vocab import TokenVocabulary

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


def test_timeout_kills_the_build_and_the_worker_is_free_afterwards(eager, monkeypatch):
    from stencil.grammar.backends.index_worker import IndexWorker

    used = []
    build = IndexWorker.build

    def recorded(self, *a, **k):
        used.append(self)
        return build(self, *a, **k)

    monkeypatch.setattr(IndexWorker, "build", recorded)
    before = eager.stats.timeouts
    with pytest.raises(GrammarTimeout):
        eager.compile(GrammarSpec("regex", EXPLOSIVE))
    backend = eager.backend("eager")
    assert len(used) == 1 and not used[0].alive  # the runaway build's process was killed
    assert not backend._busy
    g = eager.compile(GrammarSpec("regex", "x(yz)?"))  # on a fresh worker
    assert len(used) == 2 and used[1] is not used[0] and used[1].alive
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
        with pytest.raises(GrammarError, match="regex parse error: unclosed character class") as info:
            c.compile(GrammarSpec.grammar("start: A\nA: /[0-9+/\n"))  # the reason, not only the place
        assert (info.value.line, info.value.column) == (2, 4)
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
        hits = c.stats.cache_hits
        with pytest.raises(GrammarTimeout):  # remembered: no second build
            c.compile(GrammarSpec("regex", EXPLOSIVE))
        assert c.stats.timeouts == 1 and c.stats.cache_hits == hits + 1


def test_worker_memory_limit_turns_a_huge_build_into_an_error(vocab):
    # (the build meets the limit in ~1.5 s idle; the worker runs niced, so on a loaded machine it
    # took over 30 s: the deadline is there to end a hang, not to time the build)
    with GrammarCompiler(vocab, 48, timeout_s=300, worker_memory_bytes=150 << 20, backend="eager") as c:
        with pytest.raises(GrammarError, match="too large") as info:
            c.compile(GrammarSpec("regex", EXPLOSIVE + "[ab]"))
        assert not isinstance(info.value, GrammarTimeout)
        assert accepts_text(c.compile(GrammarSpec("regex", "ab")), "ab")  # a fresh worker


def test_submit_returns_at_once_and_shares_inflight_compiles(eager, monkeypatch):
    from stencil.grammar.backends.index_worker import IndexWorker

    gate = threading.Event()
    build = IndexWorker.build

    def held(self, *a, **k):  # the build starts only when the test lets it
        gate.wait(60)  # (a guard: were submit to wait for the build, the test fails, not hangs)
        return build(self, *a, **k)

    monkeypatch.setattr(IndexWorker, "build", held)
    spec = GrammarSpec("regex", EXPLOSIVE + "c")
    before = eager.stats.timeouts
    f1 = eager.submit(spec)
    f2 = eager.submit(spec)
    assert not f1.done() and not f2.done()  # a submit that waited for the build could not return
    gate.set()
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


# -- close() waits for no background build (a server's exit on SIGTERM) --------------------------
# EXPLOSIVE takes minutes as an index (no time limit here ends it), so a build that ends at once
# was ended by close(). The waits below are hang guards, never timing assertions.

def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_close_kills_a_running_eager_build_and_cancels_the_queued_one(vocab):
    c = GrammarCompiler(vocab, 48, timeout_s=600, eager_workers=1)
    running = c.compile(GrammarSpec("regex", EXPLOSIVE), hot=True)  # served lazily; index in the background
    queued = c.compile(GrammarSpec("regex", EXPLOSIVE + "b"), hot=True)  # behind it: one eager worker
    assert running.backend == queued.backend == "lazy"
    eager = c.backend("eager")
    _wait(lambda: eager.busy_workers(), 30)
    (worker,) = eager.busy_workers()
    assert worker.alive
    c.close()
    _wait(lambda: running.error("eager") is not None, 30)
    error = running.error("eager")
    assert not isinstance(error, GrammarTimeout) and "closed before the index was built" in str(error)
    assert not worker.alive and _gone(worker.pid)  # killed and reaped
    assert eager.busy_workers() == []
    # The queued build never started (cancelled): no index, no failure, no new child.
    assert not queued.has("eager") and queued.error("eager") is None
    assert (c.stats.eager_builds, c.stats.eager_failures) == (0, 1)
    _wait(lambda: not any(t.name.startswith("grammar-eager") for t in threading.enumerate()), 30)
    assert not any(t.name.startswith("grammar-eager") for t in threading.enumerate())
    assert running.matcher().backend == "lazy"  # what was served still serves


def test_the_interpreter_exits_without_waiting_for_an_eager_build(tmp_path):
    """The server's case: close(), then the process exits; before, the exit joined the pool
    thread that waited minutes on the child."""
    script = textwrap.dedent(f"""
        import time
        from stencil.grammar.base import GrammarSpec
        from stencil.grammar.compiler import GrammarCompiler
        from stencil.grammar.vocab import TokenVocabulary
        vocab = TokenVocabulary.from_token_bytes({TOKENS!r}, {EOS}, 48)
        c = GrammarCompiler(vocab, 48, timeout_s=600)
        g = c.compile(GrammarSpec("regex", {EXPLOSIVE!r}), hot=True)
        eager = c.backend("eager")
        while not eager.busy_workers():
            time.sleep(0.02)
        print(eager.busy_workers()[0].pid, flush=True)
        c.close()
    """)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    proc = subprocess.run([sys.executable, "-c", script], cwd=root, capture_output=True, text=True,
                          timeout=120)  # a hang guard: unfixed, the exit waited for the build
    assert proc.returncode == 0, proc.stderr
    assert _gone(int(proc.stdout.split()[0]))


def test_closing_automata_are_built_on_daemon_threads(vocab):
    """A closing automaton cannot be interrupted (pure Python): its thread is a daemon, which the
    interpreter's exit does not join."""
    with GrammarCompiler(vocab, 48) as c:
        g = c.compile(GrammarSpec("regex", "a[bc]+d"))
        g.closing().result(timeout=30)
        threads = [t for t in threading.enumerate() if t.name.startswith("grammar-closing")]
        assert threads and all(t.daemon for t in threads)


def test_daemon_pool_cancels_queued_work_and_abandons_what_runs():
    pool = DaemonPool(1, "test-pool")
    started, release = threading.Event(), threading.Event()

    def block():
        started.set()
        release.wait(30)
        return "done"

    running, queued = pool.submit(block), pool.submit(lambda: "never")
    assert started.wait(30)
    pool.shutdown(wait=False, cancel_futures=True)
    assert queued.cancelled() and running.running()
    (thread,) = pool.threads
    assert thread.daemon and thread.is_alive()
    with pytest.raises(RuntimeError):
        pool.submit(block)
    release.set()
    assert running.result(timeout=30) == "done"
    thread.join(30)
    assert not thread.is_alive()  # the stop mark ended it
    failing = DaemonPool(2, "test-fail")
    assert isinstance(failing.submit(lambda: 1 // 0).exception(timeout=30), ZeroDivisionError)
    failing.shutdown()
    assert not any(t.is_alive() for t in failing.threads)


def test_the_interpreter_exits_while_a_daemon_pool_job_runs():
    script = ("import threading\nfrom stencil.grammar.background import DaemonPool\n"
              "pool = DaemonPool(1, 'forever')\nstarted = threading.Event()\n"
              "pool.submit(lambda: (started.set(), threading.Event().wait()))\nstarted.wait()\n"
              "pool.shutdown(wait=False, cancel_futures=True)\n")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    proc = subprocess.run([sys.executable, "-c", script], cwd=root, capture_output=True, text=True,
                          timeout=60)  # a hang guard: the job never ends
    assert proc.returncode == 0, proc.stderr


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


def test_one_clients_slow_compiles_never_hold_every_worker(vocab, monkeypatch):
    """Two workers: a client whose three compiles hang (until released) holds one worker at a
    time; a second client's compile is answered while all three still hang."""
    import threading

    import stencil.grammar.compiler as gc_module

    release = threading.Event()
    original = gc_module.to_program

    def slow_for_greedy(spec, **kw):
        if spec.value.startswith("(a|b)*"):
            assert release.wait(timeout=60)
        return original(spec, **kw)

    monkeypatch.setattr(gc_module, "to_program", slow_for_greedy)
    with GrammarCompiler(vocab, 48, max_workers=2, backend="lazy") as c:
        slow = [c.submit(GrammarSpec("regex", "(a|b)*" + s), client="greedy") for s in ("a", "b", "c")]
        g = c.submit(GrammarSpec("regex", "x(yz)?"), client="polite").result(timeout=60)
        assert accepts_text(g, "xyz")
        assert not any(f.done() for f in slow)  # answered while the other client's work hangs
        release.set()
        assert all(accepts_text(f.result(timeout=60), "ab" + s) for f, s in zip(slow, "abc"))


def test_a_third_backend_is_a_registry_entry(vocab, monkeypatch):
    """A backend added to ``backend_registry`` serves as the compiler's policy and as a
    per-request choice with no other change to the compiler (here the lazy backend's class,
    registered under a third name)."""
    from stencil.grammar import compiler as compiler_module
    from stencil.grammar.backends import backend_registry

    entries = {**backend_registry._BACKENDS,
               "third": ("stencil.grammar.backends.lazy", "LazyBackend", frozenset({"regex", "lark"}))}
    monkeypatch.setattr(backend_registry, "_BACKENDS", entries)
    monkeypatch.setattr(compiler_module, "POLICIES", (backend_registry.AUTO, *entries))
    with GrammarCompiler(vocab, 48, max_workers=1, backend="third") as c:
        g = c.compile(GrammarSpec("regex", "ab+"))
        assert (g.has("third"), g.has("lazy"), g.has("eager"), g.backend) == (True, False, False, "third")
        assert accepts_text(g, "abb") and not accepts_text(g, "ba")
    with GrammarCompiler(vocab, 48, max_workers=1, backend="lazy") as c:
        pinned = c.compile(GrammarSpec("regex", "cd+"), backend="third")
        assert pinned.backend == "third" and accepts_text(pinned, "cdd") and not accepts_text(pinned, "c")
