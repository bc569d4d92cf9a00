"""Draft proposers (token and text prompt lookup, span ends) and the per-step draft budget."""

from __future__ import annotations

import numpy as np
import pytest

from engine.spec_decode import (SpecConfig, SpecState, StepCost, TokenSplits, propose_ngram, propose_text,
                                propose_value, span_end)


def test_propose_ngram_takes_the_longest_most_recent_suffix_match():
    tokens = np.array([5, 6, 7, 8, 9, 1, 6, 7, 2, 3, 5, 6, 7], dtype=np.int64)
    # Suffix [5, 6, 7] (length 3) occurred at 0, followed by 8, 9, 1...
    assert propose_ngram(tokens, 3, 2, 4) == [8, 9, 1]
    # Only length-2 suffixes searched: [6, 7] last occurred at 6, followed by 2, 3.
    assert propose_ngram(tokens, 2, 2, 2) == [2, 3]
    assert propose_ngram(np.array([1, 2, 3, 4]), 3, 2, 3) == []


def test_propose_text_continues_the_source_after_the_copied_suffix():
    source = "Invoice INV-2231 was issued to Northwind Traders on 2017-08-07."
    assert propose_text(source, '{"customer":"Northwind') == " Traders on 2017-08-07."
    assert propose_text(source, '{"x":"zz') == ""
    assert propose_text(source, "abc Northw", max_out_chars=6) == "ind Tr"


def test_propose_value_looks_up_a_just_begun_value_without_its_quote():
    source = "Invoice INV-22773 was issued on 2017-08-07. Quote INV-22773 when paying. Total 51."
    # '"20' is not in the document, '20' is, once.
    assert propose_value(source, '{"date":"20', max_out_chars=8) == "17-08-07"
    # Two characters seen before different continuations: no guess; the same one: a guess.
    assert propose_value(source, '{"total":7') == ""
    assert propose_value(source, '{"total":5') == "1."  # once
    assert propose_value(source, '{"id":"IN', max_out_chars=6) == "V-2277"
    assert propose_value(source, '{"id":"') == ""  # nothing begun yet


class _ToyTokenizer:
    """Splits text into the longest pieces of a fixed vocabulary (ids are list positions)."""

    VOCAB = ['":"', '":', '"', ',"', '","', "age", "city", "a", "c", "e", "g", "i", "t", "y", ":", ","]

    def encode(self, text: str) -> list[int]:
        out, i = [], 0
        while i < len(text):
            best = max((p for p in self.VOCAB if text.startswith(p, i)), key=len)
            out.append(self.VOCAB.index(best))
            i += len(best)
        return out

    def decode(self, ids: list[int]) -> str:
        return "".join(self.VOCAB[i] for i in ids)


def test_token_splits_learn_the_models_spelling_per_request_over_the_engine_table():
    tok = _ToyTokenizer()
    ids = tok.VOCAB.index
    engine = TokenSplits(tok.decode, tok.encode)
    req = engine.child()
    # Canonical: '":"' whole; its last token may be a fragment, so nothing is known about it.
    assert req.tokenize('age":"') == ([ids("age"), ids('":"')], False)
    # The model wrote '":' where '":"' was drafted: from now on '":"' is '":' then '"', and the
    # lone quote is a piece the model writes on its own.
    req.learn(ids('":"'), ids('":'))
    assert req.tokenize('city":"') == ([ids("city"), ids('":'), ids('"')], True)
    # The engine table learned it too, so a new request starts with the lesson ...
    other = engine.child()
    assert other.tokenize('":"')[0] == [ids('":'), ids('"')]
    # ... until its own output shows the other style (a split piece rejected for the whole).
    other.learn(ids('":'), ids('":"'))
    assert other.tokenize('":"') == ([ids('":"')], False)
    assert req.tokenize('":"')[0] == [ids('":'), ids('"')]  # the first request keeps its own
    # A dropped last token the model then wrote exactly is drafted next time.
    req.learn(ids('","'), ids('","'), dropped=True)
    assert req.tokenize('age","') == ([ids("age"), ids('","')], True)


@pytest.mark.parametrize("text, end", [
    (" Wirth, who joined the team", 6),
    ("irth. She lives", 4),
    ("barbara.87@mail.test and more", 29),  # dots inside an address are not pauses
    ("3.5 kg (net)", 7),
    ("USD", 3),
    ('quoted" text', 6),
    ("Ave\nSpringfield", 3),
])
def test_span_end_finds_the_first_pause(text, end):
    assert span_end(text) == end


def test_spec_config_validates_fields():
    assert SpecConfig.from_dict({"method": "off"}) is None
    cfg = SpecConfig.from_dict({"method": "ngram", "max_draft_tokens_per_step": 3})
    assert cfg.max_draft_tokens_per_step == 3 and cfg.num_speculative_tokens == 4
    for bad in ({"method": "eagle"}, {"num_speculative_tokens": 0}, {"max_draft_tokens_per_step": -1},
                {"prompt_lookup_min": 3, "prompt_lookup_max": 2}, {"nope": 1}, {"max_batch_size": None},
                {"num_speculative_tokens": 4.5}, {"num_speculative_tokens": True}, {"cost_aware": "no"},
                {"min_acceptance": 1.5}, {"min_evidence": None}, {"method": 1}):
        with pytest.raises(ValueError):
            SpecConfig.from_dict({"method": "ngram", **bad} if "method" not in bad else bad)


def test_drafts_per_step_stay_within_the_shared_budget(tiny_model_dir):
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine
    from engine.request import SamplingParams

    eng = LLMEngine(EngineConfig(model=tiny_model_dir, num_kv_blocks=128))
    spec = {"method": "ngram", "num_speculative_tokens": 4, "max_batch_size": 64,
            "min_acceptance": 0.0, "max_draft_tokens_per_step": 5, "cost_aware": False}
    for i in range(4):
        eng.add_request(f"r{i}", [7 + i, 8, 9, 10, 11] * 3,
                        SamplingParams(max_tokens=40 if i == 0 else 8, temperature=0, ignore_eos=True,
                                       speculative=spec))
    # A proposer that always fills the room it is given, so only the budget limits drafts.
    eng._drafts = lambda req, cfg, room: [req.all_token_ids[-1]] * room
    per_step, per_request = [], []
    propose = eng._propose_drafts

    def counted():
        propose()
        per_step.append(sum(len(r.draft_token_ids) for r in eng.scheduler.running))
        per_request.extend(len(r.draft_token_ids) for r in eng.scheduler.running)

    eng._propose_drafts = counted
    while eng.has_unfinished():
        eng.step()
    # Four requests decoding take 3 rows of the 5 beyond the first: 2 are left for drafts (they
    # could take 16). Alone, the long request gets num_speculative_tokens, never more.
    assert per_step[:3] == [2, 2, 2]
    assert max(per_step) == 4 and max(per_request) == 4


def test_drafts_do_not_spill_a_row_or_two_into_a_new_kernel_tile():
    from engine.llm_engine import _trim_to_tile

    class R:
        def __init__(self, n):
            self.draft_token_ids = list(range(n))

    a, b = R(4), R(1)
    _trim_to_tile([a, b], 1, 4)  # 1 + 5 rows = 6: two spill into the second tile
    assert (len(a.draft_token_ids), len(b.draft_token_ids)) == (2, 1)
    a, b = R(4), R(2)
    _trim_to_tile([a, b], 1, 4)  # 7 rows: three of four in the new tile are worth keeping
    assert (len(a.draft_token_ids), len(b.draft_token_ids)) == (4, 2)
    a = R(3)
    _trim_to_tile([a], 8, 4)  # 11 rows: kept; 9 would not be
    assert len(a.draft_token_ids) == 3
    a = R(1)
    _trim_to_tile([a], 8, 4)
    assert a.draft_token_ids == []


def test_spec_benchmark_mode_reports_steps_drafts_and_proposer_cost(tiny_model_dir):
    from benchmarks.spec import run_mode
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine

    eng = LLMEngine(EngineConfig(model=tiny_model_dir, num_kv_blocks=128))
    prompts = [[7, 8, 9, 10, 11] * 4, [12, 13, 14, 15] * 5]
    spec = {"method": "ngram", "num_speculative_tokens": 4, "max_batch_size": 64, "min_acceptance": 0.0}
    # A random model repeats itself, so "the last token again" is a draft that is often right.
    eng._drafts = lambda req, cfg, room: [req.all_token_ids[-1]] * room
    off = run_mode(eng, prompts, None, 2, 12, False, spec)
    on = run_mode(eng, prompts, None, 2, 12, True, spec)
    assert on["token_ids"] == off["token_ids"] and all(on["token_ids"])
    assert off["draft_tokens"] == 0 and on["draft_tokens"] > 0
    assert on["accepted_tokens"] > 0 and on["steps"] < off["steps"]
    assert off["steps_per_token"] >= 1.0 / 2 - 1e-9  # two requests per step at most, one token each
    assert 0.0 < on["propose_ms_per_step"] < on["step_ms"]
    assert on["decode_only_tokens_per_s"] > 0 and 0 < off["decode_only_time_share"] < 1
    assert not {"_propose_drafts", "step"} & set(vars(eng)) and "schedule" not in vars(eng.scheduler)


def test_step_cost_fits_fixed_and_per_row_time_and_prices_a_draft_row():
    rng = np.random.default_rng(0)
    cost = StepCost(min_steps=16)
    assert cost.threshold(8) == 0.0  # nothing known yet: every draft is kept
    for i in range(15):
        cost.observe(8, 12.0 + 1.3 * 8)
    assert cost.fit() is None  # too few steps, and all of one size
    for i in range(200):
        rows = int(rng.integers(1, 22))
        cost.observe(rows, 12.0 + 1.3 * rows + float(rng.normal(0, 0.3)))
    fixed, per_row = cost.fit()
    assert abs(fixed - 12.0) < 0.5 and abs(per_row - 1.3) < 0.05
    # 8 rows: a token costs 12 / 8 + 1.3 ms, a draft row 1.3 ms
    assert abs(cost.threshold(8) - 1.3 / (12.0 / 8 + 1.3)) < 0.02
    assert cost.threshold(1) < 0.12 < cost.threshold(8)  # a lone request drafts far more freely
    flat = StepCost(min_steps=4)
    for _ in range(10):
        flat.observe(5, 9.0)
    assert flat.fit() is None and flat.threshold(5) == 0.0


def test_token_acceptance_is_accepted_over_accepted_plus_rejections():
    st = SpecState()
    assert st.token_acceptance() == pytest.approx(0.8)  # the prior alone
    for _ in range(30):
        st.record(4, 1)  # one accepted, then a rejection: p = 1 / (1 + 1), as evidence
    # decayed by 0.7 per verification (about 3.3 of each), shrunk towards 0.8 by 2 pseudo-drafts
    a = 1 / (1 - 0.7)
    assert st.token_acceptance() == pytest.approx((a + 0.8 * 2) / (2 * a + 2), abs=1e-3)
    assert st.token_acceptance() < 0.6
    st = SpecState()
    for _ in range(30):
        st.record(4, 4)  # never rejected
    assert st.token_acceptance() > 0.95


def test_expensive_rows_cut_drafts_and_outputs_stay_the_same(tiny_model_dir):
    """With a step cost that makes rows dear (threshold 0.7) and the prior acceptance 0.8, a
    request keeps one draft of four (0.8 >= 0.7 > 0.64); greedy outputs do not change."""
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine
    from engine.request import SamplingParams

    def run(spec, threshold):
        eng = LLMEngine(EngineConfig(model=tiny_model_dir, num_kv_blocks=128))
        eng.step_cost.threshold = lambda rows: threshold
        eng._drafts = lambda req, cfg, room: [req.all_token_ids[-1]] * room
        seen = []
        propose = eng._propose_drafts

        def counted():
            propose()
            seen.extend(len(r.draft_token_ids) for r in eng.scheduler.running)

        eng._propose_drafts = counted
        for i in range(2):
            eng.add_request(f"r{i}", [7 + i, 8, 9, 10] * 3,
                            SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, speculative=spec))
        outs = {}
        while eng.has_unfinished():
            for o in eng.step():
                outs.setdefault(o.request_id, []).extend(o.new_token_ids)
        return outs, seen

    spec = {"method": "ngram", "num_speculative_tokens": 4, "max_batch_size": 64, "min_acceptance": 0.0}
    base, _ = run({"method": "off"}, 0.0)
    cut, seen_cut = run(spec, 0.7)
    full, seen_full = run(spec, 0.0)
    assert cut == base == full
    assert max(seen_cut) == 1 and max(seen_full) == 4
