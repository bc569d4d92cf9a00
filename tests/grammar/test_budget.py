"""Valid within the budget: the closing automaton's distances, budget-aware masks, admission, and
the engine ending every admitted structured request complete and valid (issue 17)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stencil.engine.config import EngineConfig
from stencil.engine.llm_engine import EngineError, LLMEngine
from stencil.engine.request import SamplingParams
from stencil.grammar.base import GrammarSpec
from stencil.grammar.bitmask import allocate_bitmask, bitmask_to_bool
from stencil.grammar.closing import INF, ClosingAutomaton, _utf8_ranges
from stencil.grammar.compiler import GrammarCompiler
from stencil.grammar.frontend import to_program
from stencil.grammar.vocab import TokenVocabulary
from stencil.service.json_paths import shortened_paths

EOS = 36
CHARS = "abcdxyz0123456789.-\",:{}[]"
MULTI = ["ab", "xyz", '":', '","', "12"]
TOKENS = {i: ch.encode() for i, ch in enumerate(CHARS)} | {
    len(CHARS) + k: s.encode() for k, s in enumerate(MULTI)}
SIZE = 40
SHARED = Path(__file__).resolve().parents[3] / "shared"


@pytest.fixture(scope="module")
def vocab() -> TokenVocabulary:
    return TokenVocabulary.from_token_bytes(TOKENS, EOS, SIZE)


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 0x10FFFF), st.integers(0, 0x3FF))
def test_utf8_ranges_encode_exactly_the_code_points(lo, width):
    hi = min(lo + width, 0x10FFFF)
    seqs = _utf8_ranges(lo, hi)
    want = {chr(c).encode() for c in range(lo, hi + 1) if not 0xD800 <= c <= 0xDFFF}
    got = set()
    for seq in seqs:
        prefixes = [b""]
        for blo, bhi in seq:
            prefixes = [p + bytes([b]) for p in prefixes for b in range(blo, bhi + 1)]
        got.update(prefixes)
    assert got == want


def _brute_distance(matcher, tokens: list[int], depth: int) -> int:
    """Fewest tokens to an accepting state from ``matcher`` (BFS over the tiny vocabulary)."""
    frontier = [[]]
    for d in range(depth + 1):
        nxt = []
        for path in frontier:
            if matcher.validate_tokens(path + [EOS]) == len(path) + 1:
                return d
            for t in tokens:
                if matcher.validate_tokens(path + [t]) == len(path) + 1:
                    nxt.append(path + [t])
        frontier = nxt[:400]
    return INF


@pytest.mark.parametrize("pattern", [r"ab(cd)?", r"x(yz)*\.[0-9]{2,3}", r"(ab|xyz){2,4}-1", r"[a-d]+\"12\""])
def test_token_distance_is_an_upper_bound_met_by_a_real_sequence(vocab, pattern):
    with GrammarCompiler(vocab, SIZE, backend="lazy") as c:
        g = c.compile(GrammarSpec.regex(pattern))
        ca = ClosingAutomaton(g.program, vocab)
        rng = random.Random(0)
        for _ in range(25):
            m = g.matcher()
            s = ca.start
            for _ in range(rng.randint(0, 6)):
                bm = allocate_bitmask(1, SIZE)
                m.fill_bitmask(bm, 0)
                allowed = [t for t in bitmask_to_bool(bm, SIZE)[0].nonzero().flatten().tolist() if t != EOS]
                if not allowed:
                    break
                t = rng.choice(allowed)
                assert m.accept_tokens([t])
                s = ca.step(s, TOKENS[t])
            d = ca.token_distance(s)
            plan = ca.plan(s)
            assert len(plan) == d
            assert m.validate_tokens(plan + [EOS]) == d + 1  # the plan is real
            brute = _brute_distance(m, list(TOKENS), d)
            assert brute <= d  # an upper bound of the true least number of tokens
            assert ca.byte_distance(s) >= d  # tokens never exceed bytes


def test_a_distance_beyond_the_budget_is_known_without_writing_the_witness(vocab):
    """``limit``: where a state's bytes alone need more tokens than the budget has, the distance
    reads ``limit + 1`` without the witness being written or tokenized (work in proportion to
    the witness: seconds a step for a grammar whose end is 100,000 bytes away); below the
    bound, the exact distance."""
    with GrammarCompiler(vocab, SIZE, backend="lazy") as c:
        g = c.compile(GrammarSpec.regex("x[0-9]{3000}"))
        ca = ClosingAutomaton(g.program, vocab)
        longest = max(len(b) for b in TOKENS.values())
        assert ca.token_distance(ca.start, limit=10) == 11
        assert ca.plan(ca.start, limit=10) is None
        assert ca._witness[ca.start] is None and ca._tdist[ca.start] is None  # nothing written
        exact = ca.token_distance(ca.start)
        assert exact >= 3001 // longest and ca.token_distance(ca.start, limit=10) == exact  # then cached
        assert len(ca.plan(ca.start, limit=exact)) == exact
        nd = ca.next_token_distances(ca.start, limit=5)
        assert int(nd.min()) == 6 and ca._next_tdist.get(ca.start) is None  # capped: not cached


@settings(max_examples=200, deadline=None)
@given(st.lists(st.text(alphabet="abxyz12\":,", min_size=0, max_size=40), min_size=1, max_size=6))
def test_token_counts_of_suffixes_are_the_least_tokenizations(vocab, texts):
    """``count`` (one backward pass, every suffix's count kept for the next call) equals the
    length of ``tokenize``'s least tokenization, for a string, its suffixes (read from the kept
    counts) and unrelated strings; ``INF`` where the vocabulary cannot spell it."""
    from stencil.grammar.closing import token_matrix

    tm = token_matrix(vocab)
    for text in texts:
        data = text.encode()
        for cut in range(len(data), -1, -1):
            for piece in (data[cut:], data[:cut]):
                tokens = tm.tokenize(piece)
                assert tm.count(piece) == (INF if tokens is None else len(tokens)), piece
    assert tm.count(b"a\x00b") == INF and tm.tokenize(b"a\x00b") is None


def test_a_long_run_costs_one_tokenization_not_one_a_step(vocab, monkeypatch):
    """A long run (``a{5000}``, here ``b{1000}``): the states after each token have the witness before it
    less that token's bytes, so their distances come from the first tokenization's kept counts
    (each step re-tokenizing 5,000 bytes in Python took a 4,096-token answer 169 s)."""
    from stencil.grammar.closing import token_matrix

    with GrammarCompiler(vocab, SIZE, backend="lazy") as c:
        c.warm_up()  # its background compile counts tokens with the same matrix: done before counting here
        g = c.compile(GrammarSpec.regex("ab{1000}x"))
        ca = ClosingAutomaton(g.program, vocab)
        tm = token_matrix(vocab)
        passes = []
        real = tm.count.__func__

        def counted(self, data):
            last = self._last
            if not (last is not None and last[0].endswith(data)):
                passes.append(len(data))
            return real(self, data)

        monkeypatch.setattr(type(tm), "count", counted)
        state, dists, least = ca.start, [], []
        for piece in (b"a", b"b", b"b", b"b"):
            state = ca.step(state, piece)
            dists.append(ca.token_distance(state))
            least.append(len(tm.tokenize(ca.witness(state))))
        assert dists == least == [1001, 1000, 999, 998], (dists, least)
        assert passes == [1001], passes  # one pass over the first witness, the rest read from it


def test_an_admission_far_beyond_max_tokens_is_refused_without_writing_the_end(vocab):
    """Rules repeating rules (10,000 x 10,000 bytes) stay within the count limit of one rule;
    the admission check then reports the least tokens the end's bytes need, without writing or
    tokenizing the 10^8-byte end (that froze a server: the new-user trial)."""
    with GrammarCompiler(vocab, SIZE, backend="lazy") as c:
        g = c.compile(GrammarSpec("lark", 'start: x~10000\nx: "a"~10000'))
        longest = max(len(b) for b in TOKENS.values())
        assert g.min_output_tokens(24) == -(-10 ** 8 // longest)
        ca = g.closing().result()
        assert ca._tdist[ca.start] is None and ca._witness[ca.start] is None
        small = c.compile(GrammarSpec("lark", 'start: "ab"~30'))
        exact, sa = small.min_output_tokens(5), small.closing().result()
        assert exact is not None and exact >= 60 // longest and sa._tdist[sa.start] == exact  # short: exact


CLASS_TOKENS = {0: b" Rome", 1: "\u00e9".encode(), 2: b"\x03", 3: b"12", 4: b"\t", 5: "\u4e2d".encode(),
                7: b"!"}


@pytest.mark.parametrize("pattern, refused", [
    (r"[\s\S]*", set()), (r"(\s|\S)*", set()), (r"[\d\D]*", set()),
    # \w is read as ASCII and \W as ASCII non-word characters (a subset of every engine's Unicode
    # classes, and small automata): letters beyond ASCII are in neither.
    (r"[\w\W]*", {"\u00e9", "\u4e2d"}),
    (r"\S*", {" Rome", "\t"}), (r"\D*", {"12"}), (r"[^\S]*", {" Rome", "\u00e9", "\x03", "12", "\u4e2d", "!"}),
    (r"\W*", {" Rome", "\u00e9", "12", "\u4e2d"}),
])
def test_class_escapes_and_their_negations_keep_every_character_they_admit(pattern, refused):
    """The closing automaton reads ``\\S``, ``\\D``, ``\\W`` over all of Unicode (a subset of the
    backends' classes): ``\\S`` once meant control characters only, so ``[\\s\\S]*`` near its
    budget admitted whitespace alone and garbled free text (``tool_choice: "auto"``)."""
    vocab = TokenVocabulary.from_token_bytes(CLASS_TOKENS, 9, 10)
    ca = ClosingAutomaton(to_program(GrammarSpec.regex(pattern)), vocab)
    nd = ca.next_token_distances(ca.start)
    assert {CLASS_TOKENS[t].decode() for t in CLASS_TOKENS if nd[t] >= INF} == refused


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_budget_masks_always_close_within_the_budget(vocab, data):
    """Random walks under a random budget: every allowed token keeps the output closable in the
    tokens left (checked by brute force), one is always allowed, and the walk ends accepting."""
    pattern = data.draw(st.sampled_from([r"(ab|cd)+\.[0-9]+", r"\{\"a\":\[(1|12)(,(1|12))*\]\}",
                                         r"x(yz)*(\.[0-9]{1,3})?", r"[a-d]{3,}-[0-9]{2}"]))
    with GrammarCompiler(vocab, SIZE, backend="eager") as c:
        g = c.compile(GrammarSpec.regex(pattern))
        ca = ClosingAutomaton(g.program, vocab)
        need = ca.token_distance(ca.start)
        budget = data.draw(st.integers(need, need + 6))
        m = g.budget_matcher(budget)
        rng = random.Random(data.draw(st.integers(0, 10_000)))
        history: list[int] = []
        while not m.is_terminated():
            bm = allocate_bitmask(1, SIZE)
            m.fill_bitmask(bm, 0)
            allowed = bitmask_to_bool(bm, SIZE)[0].nonzero().flatten().tolist()
            assert allowed, "no token allowed"
            left = m.remaining
            for t in allowed:
                if t == EOS:
                    assert m.is_accepting()
                    continue
                probe = g.matcher()
                assert probe.accept_tokens(history + [t])
                assert _brute_distance(probe, list(TOKENS), left - 1) <= left - 1, (pattern, t)
            t = rng.choice(allowed)
            assert m.accept_tokens([t])
            history.append(t)
            if m.remaining == 0:
                break
        assert m.is_terminated() or m.is_accepting()


def test_shortened_paths_name_the_innermost_values():
    text = '{"name":"Ada","tags":["a","bb"],"note":"x"}'
    b = text.encode()
    assert shortened_paths(text, [b.index(b'"bb"') + 2]) == ["/tags/1"]
    assert shortened_paths(text, [b.index(b'"x"') + 2, len(b)]) == ["/note", ""]
    assert shortened_paths("not json", [1]) == []


# -- the engine --------------------------------------------------------------------------------------

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string"}, "tags": {"type": "array", "items": {"type": "string"}},
    "count": {"type": "integer"}, "note": {"type": "string"}}, "required": ["name", "tags", "count"]}


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    eng = LLMEngine(EngineConfig(model=tiny_model_dir, num_kv_blocks=256, max_num_seqs=8))
    yield eng
    eng.grammar.close()


def _validate(schema, text: str) -> bool:
    try:
        return jsonschema.Draft202012Validator(schema).is_valid(json.loads(text))
    except ValueError:
        return False


def test_every_budget_from_the_minimum_closes_valid_and_speculation_keeps_outputs(engine):
    g = engine.grammar.compile(GrammarSpec.json_schema(SCHEMA))
    need = g.closing().result().token_distance(g.closing().result().start)
    prompt = [5, 17, 300, 42, 9001]
    free = engine.generate([prompt], SamplingParams(max_tokens=200, temperature=0, close_on_budget=False), [g])[0]
    budgets = list(range(need, need + 12)) + [len(free["token_ids"]), 2 * len(free["token_ids"])]
    runs = {}
    for spec in ({"method": "off"}, {"method": "ngram", "max_batch_size": 64, "min_acceptance": 0.0}):
        params = [SamplingParams(max_tokens=b, temperature=0, speculative=spec) for b in budgets]
        runs[spec["method"]] = engine.generate([prompt] * len(budgets), params, [g] * len(budgets))
    for b, r in zip(budgets, runs["off"]):
        assert r["finish_reason"] == "stop", (b, r["text"])
        assert len(r["token_ids"]) <= b
        assert _validate(SCHEMA, r["text"]), (b, r["text"])
    assert [r["token_ids"] for r in runs["ngram"]] == [r["token_ids"] for r in runs["off"]]
    assert any(r["output"].closed_by_budget for r in runs["off"])
    assert engine.stats()["kv_blocks_free"] == engine.stats()["kv_blocks_total"]


def test_below_the_minimum_is_refused_naming_max_tokens(engine):
    g = engine.grammar.compile(GrammarSpec.json_schema(SCHEMA))
    need = g.closing().result().token_distance(g.closing().result().start)
    with pytest.raises(EngineError, match=f"max_tokens {need - 1} .* {need} tokens"):
        engine.add_request(None, [5, 6, 7], SamplingParams(max_tokens=need - 1, temperature=0), g)
    # close_on_budget false restores the cut: finish_reason "length", no refusal.
    r = engine.generate([[5, 6, 7]], SamplingParams(max_tokens=need - 1, temperature=0, close_on_budget=False), [g])[0]
    assert r["finish_reason"] == "length"


def test_an_output_the_budget_never_steered_is_a_cut_not_a_stop(engine):
    """Free text (every prefix accepted) or a run of digits cut at max_tokens is "length", as
    OpenAI reports a cut, and not closed by the budget: clients detect truncation by it."""
    cut = 0
    for spec in (GrammarSpec.regex(r"[\s\S]*"), GrammarSpec.regex("[0-9]+"), GrammarSpec.regex("[ab]*")):
        g = engine.grammar.compile(spec)
        r = engine.generate([[5, 17, 300]], SamplingParams(max_tokens=6, temperature=0), [g])[0]
        if r["token_ids"][-1] in engine.tokenizer.all_special_ids:
            continue  # the model ended it: a "stop" of its own
        cut += 1
        assert len(r["token_ids"]) == 6
        assert (r["finish_reason"], r["output"].closed_by_budget) == ("length", False), (spec, r["text"])
    assert cut >= 2  # the tiny model runs on under [\s\S]* and [ab]*


def test_a_budget_that_cannot_be_kept_says_why_when_the_answer_is_cut(engine):
    """Where no closing automaton can be built (a URI format under a length bound: an
    intersection too large to model), the output is cut at max_tokens as without the budget,
    and the last output says why the budget was not kept (the service turns it into a warning)."""
    schema = {"type": "object", "properties": {"u": {"type": "string", "format": "uri", "maxLength": 40}},
              "required": ["u"]}
    g = engine.grammar.compile(GrammarSpec.json_schema(schema))
    r = engine.generate([[5, 17, 300]], SamplingParams(max_tokens=8, temperature=0), [g])[0]
    assert (r["finish_reason"], len(r["token_ids"])) == ("length", 8)
    assert "closing automaton" in r["output"].budget_unenforced
    kept = engine.generate([[5, 17, 300]], SamplingParams(max_tokens=40, temperature=0),
                           [engine.grammar.compile(GrammarSpec.json_schema(SCHEMA))])[0]
    assert kept["output"].budget_unenforced is None


MASKBENCH = SHARED / "corpora" / "maskbench-dev"


@pytest.mark.skipif(not MASKBENCH.exists(), reason="../shared/corpora/maskbench-dev is absent")
@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                   HealthCheck.too_slow])
@given(data=st.data())
def test_random_corpus_schemas_close_valid_at_random_budgets(engine, data):
    """Random small MaskBench schemas and budgets from the minimum to twice the unbudgeted length:
    every answer validates, and every answer the budget had to steer ends with "stop". One the
    budget never steered may end with "length": a number the model would have gone on writing
    ("2.5" of "2.51"), cut at max_tokens where it happens to parse (the scheduler's rule)."""
    files = sorted(MASKBENCH.glob("*.json"))
    schema = None
    for _ in range(20):
        f = files[data.draw(st.integers(0, len(files) - 1))]
        cand = json.loads(f.read_text())["schema"]
        if len(json.dumps(cand)) > 1500:
            continue
        try:
            g = engine.grammar.compile(GrammarSpec.json_schema(cand))
            automaton = g.closing().result()
        except Exception:  # noqa: BLE001 - refused or not modelled: draw another
            continue
        schema = cand
        break
    if schema is None:
        return
    need = automaton.token_distance(automaton.start)
    if need > 150:
        return
    prompt = [data.draw(st.integers(20, 4000)) for _ in range(4)]
    free = engine.generate([prompt], SamplingParams(max_tokens=96, temperature=0, close_on_budget=False), [g])[0]
    budget = data.draw(st.integers(need, max(need, 2 * len(free["token_ids"]))))
    r = engine.generate([prompt], SamplingParams(max_tokens=budget, temperature=0), [g])[0]
    if r["finish_reason"] == "length":  # a cut the budget never steered: exactly max_tokens, every mask the model's
        assert not r["output"].closed_by_budget and len(r["token_ids"]) == budget, (budget, r["text"][:200])
    else:
        assert r["finish_reason"] == "stop", (budget, r["text"][:200])
    # The schema's own draft's format checker: a bare FormatChecker() mixes in draft 3's "time"
    # (HH:MM:SS, no offset), which refuses RFC 3339 times like "22:22:21Z".
    cls = jsonschema.validators.validator_for(schema)
    validator = cls(schema, format_checker=cls.FORMAT_CHECKER)
    assert validator.is_valid(json.loads(r["text"])), r["text"][:300]


RUNON = Path(__file__).resolve().parents[2] / "benchmarks" / "data" / "runon_cases.json"


@pytest.mark.slow
@pytest.mark.parametrize("max_tokens", [24, 128])
def test_run_on_cases_end_complete_and_valid_on_the_default_model(default_model_dir, max_tokens):
    """The run-ons of public bug reports (an emoji string, a repeated tag, an endless date-time
    fraction, repeated keys, a 100-digit number, an endless note): with the default model every
    one ends with "stop" and output that validates, at max_tokens 24 and 128."""
    cases = json.loads(RUNON.read_text())
    eng = LLMEngine(EngineConfig(model=default_model_dir, kv_cache_gib=0.5, max_num_seqs=8))
    try:
        tok = eng.tokenizer
        prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": c["prompt"]}],
                                                      add_generation_prompt=True, tokenize=False),
                              add_special_tokens=False) for c in cases]
        grammars = [eng.grammar.compile(GrammarSpec.json_schema(c["schema"])) for c in cases]
        outs = eng.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0), grammars)
        for c, r in zip(cases, outs):
            assert r["finish_reason"] == "stop", (c["name"], r["text"][:200])
            assert len(r["token_ids"]) <= max_tokens
            cls = jsonschema.validators.validator_for(c["schema"])
            v = cls(c["schema"], format_checker=cls.FORMAT_CHECKER)
            assert v.is_valid(json.loads(r["text"])), (c["name"], r["text"][:300])
    finally:
        eng.grammar.close()


def test_hand_written_lark_grammars_close_within_the_budget(engine):
    """A recursive grammar written by hand (nested parentheses) under a tight budget: the answer
    is complete, with balanced parentheses, and within max_tokens."""
    g = engine.grammar.compile(GrammarSpec.grammar('start: "(" start ")" | "x"'))
    outs = engine.generate([[5, 40, 40, 40]] * 3, [SamplingParams(max_tokens=b, temperature=0) for b in (3, 9, 30)],
                           [g] * 3)
    for b, r in zip((3, 9, 30), outs):
        t = r["text"]
        assert r["finish_reason"] == "stop" and len(r["token_ids"]) <= b, (b, t)
        assert t.strip("()") == "x" and t.count("(") == t.count(")") and t.index("x") == t.count("("), t


def test_lark_alternatives_with_a_shared_prefix_keep_the_closing_automaton_small(engine):
    """lark expands ``term (op term)*`` into ``term | term tail``; unfactored, both calls of
    ``term`` are live after every "(" and the stack configurations double per nesting level.
    Factored, a state holds a handful of configurations at any depth, and distances are exact."""
    arith = 'start: expr\nexpr: term (("+" | "-") term)*\nterm: NUM | "(" expr ")"\nNUM: /[0-9]{1,3}/\n'
    a = engine.grammar.compile(GrammarSpec.grammar(arith)).closing().result()
    sizes = {}
    for depth in (1, 4, 12):
        s = a.step(a.start, b"(" * depth + b"1")
        a.next_token_distances(s)
        sizes[depth] = len(a._sets[s])
        witness = a.witness(s)
        assert witness == b")" * depth and a.accepting(a.step(s, witness))
    assert sizes[12] == sizes[1] <= 8, sizes
    assert max(len(x) for x in a._sets) <= 8


def test_a_pattern_with_length_bounds_closes_within_the_budget(engine):
    """An intersection (pattern ∩ length) is a product automaton: budgets still close it."""
    schema = {"type": "object", "properties": {"slug": {"type": "string", "pattern": "^[a-z]+(-[a-z]+)*$",
                                                        "minLength": 3, "maxLength": 12}}, "required": ["slug"]}
    g = engine.grammar.compile(GrammarSpec.json_schema(schema))
    automaton = g.closing().result()
    need = automaton.token_distance(automaton.start)
    outs = engine.generate([[7, 8, 9]] * 3, [SamplingParams(max_tokens=b, temperature=0) for b in (need, need + 3, 40)],
                           [g] * 3)
    for r in outs:
        assert r["finish_reason"] == "stop" and _validate(schema, r["text"]), r["text"]


@pytest.mark.parametrize("schema", [
    # shared terminals: machines that call others (the strings, the whitespace)
    {"type": "object", "properties": {"a": {"type": "string"}, "b": {"type": "array", "items": {"type": "string"}}},
     "required": ["a"]},
    # recursion: a machine that calls itself (only the fixpoint serves it)
    {"$defs": {"n": {"type": "object", "properties": {"next": {"$ref": "#/$defs/n"}, "v": {"type": "integer"}}}},
     "$ref": "#/$defs/n"},
    {"type": "string", "pattern": "^(ab|xyz){2,4}-1$"},
])
def test_distances_by_machine_are_the_fixpoints(vocab, schema):
    """Machines solved callees first, one pass each, give the distances of the all-machines
    fixpoint; a recursive grammar is solved by the fixpoint."""
    import stencil.grammar.closing as closing

    program = to_program(GrammarSpec.json_schema(schema, whitespace="flexible"), handover=False)
    ca = ClosingAutomaton(program, vocab)
    order = closing._callees_first(ca.net)
    recursive = "$defs" in schema
    assert (order is None) == recursive
    if order is not None:
        assert sorted(order) == list(range(len(ca.net.starts)))
        assert any(ca.net.calls) == (len(ca.net.starts) > 1)
        assert ca._distances_by_machine(order) == ca._distances_fixpoint()
    assert (ca._d, ca._callee_len) == ca._distances_fixpoint()
    assert ca._callee_len[0] < INF


def test_an_escaped_backslash_before_a_quote_in_a_lark_regex_keeps_its_meaning_in_the_closing_automaton(engine):
    """``\\\\"`` in a Lark regex is a backslash, then a quote (llguidance's reading). The ``lark``
    library unescapes ``\\"`` inside regex literals to a bare quote, which had let the closing
    automaton read a JSON string's escape as its end and plan ends the grammar refused."""
    g = engine.grammar.compile(GrammarSpec.grammar('start: S ";"\nS: /"(?:[^"\\\\]|\\\\"|\\\\\\\\)*"/\n'))
    a = g.closing().result()
    assert a.accepting(a.step(a.start, b'"a\\"b";')) and not a.accepting(a.step(a.start, b'"a"b";'))
    s = a.step(a.start, b'"a')
    assert a.witness(s) == b'";'


def test_a_large_tool_answer_closes_within_the_budget_at_every_prefix(engine):
    """A tool-call answer past the Lark threshold (required, parallel calls; arguments with
    free-form values and strings): from every prefix of a valid answer the closing automaton's
    plan is accepted by the served grammar, so the budget stays on."""
    from stencil.grammar.call_syntax import HERMES
    from stencil.grammar.tool_calls import CallParts, ToolCalls, ToolFunction, tool_call_spec

    free = ToolFunction("log_event", {"type": "object", "properties": {"payload": {}, "note": {"type": "string"},
                                                                      "tags": {"type": "array"}},
                                      "required": ["payload"]})
    other = ToolFunction("store", {"type": "object", "properties": {"key": {"type": "string"}, "value": {}},
                                   "required": ["key"]})
    spec, _ = tool_call_spec(ToolCalls((free, other), required=True, parallel=True), parts=CallParts(),
                             lark_from_chars=0)
    assert spec.kind == "lark"
    g = engine.grammar.compile(spec)
    a = g.closing().result()
    text = HERMES.calls_text([("log_event", '{"payload":{"a":"x\\"y"},"note":"q\\\\","tags":[1,"s"]}'),
                              ("store", '{"key":"k"}')])
    ids = engine.tokenizer.encode(text, add_special_tokens=False)
    eos = g.vocab.eos_token_id
    s = a.start
    for i, t in enumerate(ids):
        plan = a.plan(s, limit=200)
        m = g.matcher()
        assert m.accept_tokens(ids[:i]) and plan is not None
        assert m.validate_tokens(plan + [eos]) == len(plan) + 1, (i, text[:40])
        s = a.step(s, g.vocab.token_bytes.get(t, b""))
    assert a.accepting(s)
