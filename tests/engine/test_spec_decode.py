"""Speculation: proposers (token and text prompt lookup, span ends), the draft budget and its
price, and the goodput off-switch, driven by synthetic step costs (no test reads a clock)."""

from __future__ import annotations

import numpy as np
import pytest

from stencil.engine.request import Request, SamplingParams
from stencil.engine.speculative import DraftBudget, Drafter, Goodput, SpecConfig, SpecState, StepShape, TokenSplits
from stencil.engine.speculative.drafter import trim_to_tile
from stencil.engine.speculative.layout import JsonLayout, Position, position
from stencil.engine.speculative.goodput import LinearFit
from stencil.engine.speculative.lookup import propose_ngram, propose_text, propose_value, span_end


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


def test_linear_fit_reads_fixed_and_per_row_time_and_stays_flat_without_spread():
    rng = np.random.default_rng(0)
    fit = LinearFit(decay=0.98)
    assert fit.line() is None and fit.at(3) is None
    for _ in range(200):
        rows = int(rng.integers(1, 22))
        fit.observe(rows, 12.0 + 1.3 * rows + float(rng.normal(0, 0.3)))
    a, b = fit.line()
    assert abs(a - 12.0) < 0.5 and abs(b - 1.3) < 0.05
    assert abs(fit.at(8) - (12.0 + 1.3 * 8)) < 0.3
    flat = LinearFit(decay=0.9)
    for _ in range(10):
        flat.observe(5, 9.0)
    assert flat.line() == pytest.approx((9.0, 0.0))  # no spread in rows: the mean, no slope
    assert flat.line(flat_through_origin=True) == pytest.approx((0.0, 9.0 / 5))  # or all of it per row
    falling = LinearFit(decay=0.9)
    for rows, ms in ((1, 10.0), (5, 8.0), (1, 10.0), (5, 8.0)):
        falling.observe(rows, ms)
    assert falling.line()[1] == 0.0  # noise that makes rows look cheaper than none reads as free


def test_acceptance_per_token_is_accepted_over_accepted_plus_rejections():
    st = SpecState(SpecConfig())
    assert st.ngram.per_token() == pytest.approx(0.8)  # the prior alone
    for _ in range(30):
        st.record(4, 1)  # one accepted, then a rejection: p = 1 / (1 + 1), as evidence
    # decayed by 0.7 per verification (about 3.3 of each), shrunk towards 0.8 by 2 pseudo-drafts
    a = 1 / (1 - 0.7)
    assert st.ngram.per_token() == pytest.approx((a + 0.8 * 2) / (2 * a + 2), abs=1e-3)
    assert st.ngram.per_token() < 0.6 and st.grammar.per_token() == pytest.approx(0.9)  # kinds apart
    st.ngram.forget(0.5)  # fading evidence moves the estimate back towards the prior
    assert (a / 2 + 1.6) / (a + 2) == pytest.approx(st.ngram.per_token(), abs=1e-3)
    st = SpecState(SpecConfig(), from_grammar=True)
    for _ in range(30):
        st.record(4, 4)  # never rejected
    assert st.grammar.per_token() > 0.95 and st.ngram.proposed == 0


# -- Goodput on synthetic batches: base rows, drafts, accepted tokens and a cost model in ms -------
def drive(g: Goodput, cost, steps: int, *, base: int = 8, p: float = 0.8, k: int = 4) -> list:
    """Run ``steps`` decode steps of a batch of ``base`` requests against ``g``. A drafting step
    gives every request the draft positions whose chance ``p ** j`` clears the plan's threshold
    (at most ``k``) and accepts the expected number of them; ``cost(shape)`` is its time (ms).
    Returns the plans, in order."""
    plans = []
    for _ in range(steps):
        plan = g.plan(base)
        plans.append(plan)
        if plan.draft:
            per = min(sum(1 for j in range(1, k + 1) if p ** j >= plan.threshold), plan.max_drafts or k)
            accepted = round(base * sum(p ** j for j in range(1, per + 1)))
            shape = StepShape(base, per * base, base + accepted, accepted, proposed=base)
        else:
            shape = StepShape(base, tokens=base)
        g.observe(shape, cost(shape))
    return plans


def cost_of(fixed: float, per_row: float, per_draft: float, per_proposed: float = 0.0):
    return lambda s: fixed + per_row * s.base_rows + per_draft * s.draft_rows + per_proposed * s.proposed


def test_goodput_keeps_drafting_where_rows_are_cheap_and_prices_them():
    g = Goodput()
    plans = drive(g, cost_of(30.0, 0.5, 0.3, 0.05), 400)
    assert g.stops == 0 and all(pl.reason != "off" for pl in plans)
    # A one-step probe every second drafting step until the baseline has 3 plain steps; one
    # unpriced draft per request until 4 drafting steps have priced a row; then a probe spaced
    # to cost 2% of the throughput: (gain - 1) / gain / 0.02 drafting steps apart.
    assert [pl.reason for pl in plans[:13]] == ["explore", "explore", "probe"] * 3 + ["explore"] * 4
    assert all(pl.max_drafts == 1 and pl.threshold == 0 for pl in plans[:13] if pl.draft)
    assert all(pl.max_drafts is None for pl in plans[13:])
    probes = [i for i, pl in enumerate(plans) if pl.reason == "probe"]
    spacing = int((g.gain - 1) / g.gain / 0.02)
    assert spacing == 30 and all(b - a == spacing + 1 for a, b in zip(probes[-6:], probes[-5:]))
    # tokens/s with drafts over without: 8 + 19 tokens in 43.6 ms against 8 in 34 ms
    assert g.gain == pytest.approx((27 / 43.6) / (8 / 34.0), rel=0.02)
    # a draft row costs 0.3 ms, a plain token 34 / 8 ms
    assert plans[-1].threshold == pytest.approx(0.3 / (34.0 / 8), rel=0.05)


def test_goodput_stops_drafting_where_it_loses_and_backs_off_longer_each_failed_trial():
    g = Goodput()
    # Rows dear: 6 ms a draft row against 34 ms for a plain step of 8 (4.25 ms a token), and
    # proposing costs 0.3 ms a request, so even priced drafting loses.
    plans = drive(g, cost_of(30.0, 0.5, 6.0, 0.3), 700, p=0.6)
    assert g.stops >= 5 and g.trials in (g.stops - 1, g.stops)  # a trial after each stretch off
    reasons = [pl.reason for pl in plans]
    # The off stretches: 16, 32, 64, 128, 256, 256 plain steps, then a trial each time.
    runs, n = [], 0
    for r in reasons:
        if r == "off":
            n += 1
        elif n:
            runs.append(n)
            n = 0
    assert runs[:5] == [16, 32, 64, 128, 256]
    drafting = sum(r == "draft" for r in reasons[200:])
    assert drafting / len(reasons[200:]) < 0.1  # once it knows, the batch barely drafts
    # Priced, a request with p = 0.6 drafts nothing: 6 / 4.25 is above any chance.
    assert max(pl.threshold for pl in plans) > 1.0


def test_goodput_recovers_when_rows_get_cheap_and_stops_when_they_get_dear():
    class Shifting:
        """Rows dear for the first ``change`` steps, cheap after (or the other way round)."""

        def __init__(self, first, then, change):
            self.first, self.then, self.change, self.n = first, then, change, 0

        def __call__(self, shape):
            self.n += 1
            return (self.first if self.n <= self.change else self.then)(shape)

    dear, cheap = cost_of(30.0, 0.5, 6.0, 0.3), cost_of(30.0, 0.5, 0.3, 0.05)
    g = Goodput()
    plans = drive(g, Shifting(dear, cheap, 300), 900, p=0.8)
    before, after = plans[:300], plans[300:]
    assert any(pl.reason == "off" for pl in before)
    # Back on within the longest backoff (256 steps) and a trial or two; then drafting holds,
    # every draft kept (a draft row is cheap now).
    last_off = max(i for i, pl in enumerate(after) if pl.reason == "off")
    assert last_off < 256 + 32
    tail = after[last_off + 1:]
    assert len(tail) > 300 and sum(pl.draft for pl in tail) / len(tail) > 0.95
    assert max(pl.threshold for pl in tail[16:]) < 0.1
    g = Goodput()
    plans = drive(g, Shifting(cheap, dear, 300), 400, p=0.8)
    assert all(pl.reason != "off" for pl in plans[:300])
    assert any(pl.reason == "off" for pl in plans[300:340])  # found within a few dozen steps


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_goodput_holds_up_when_step_times_are_noisy(seed):
    """Every step time off by a random factor (lognormal, sigma 0.35: a machine shared with
    other work). Where drafting wins 2.6x it keeps nearly all of it; where even priced drafting
    loses (rows dearer than the tokens they bring), what the trials cost stays under 7%."""
    rng = np.random.default_rng(seed)

    def realized(cost, p):
        g, made, spent = Goodput(), [], []

        def noisy(shape):
            made.append(shape.tokens)
            spent.append(cost(shape))  # the true cost, to score the decisions by
            return spent[-1] * float(np.exp(rng.normal(0.0, 0.35)))

        drive(g, noisy, 1000, p=p)
        return (sum(made) / sum(spent)) / (8 / cost(StepShape(8)))  # over plain decoding's rate

    assert realized(cost_of(30.0, 0.5, 0.3, 0.05), 0.8) > 2.5
    assert realized(cost_of(30.0, 0.5, 6.0, 0.3), 0.6) > 0.93


class _Spell:
    """``normal`` step costs, but ``spell`` for decode steps ``start`` .. ``end - 1`` (counted
    by the calls: the cost model is the machine, its step count the clock)."""

    def __init__(self, normal, spell, start: int, end: int):
        self.normal, self.spell, self.start, self.end, self.n = normal, spell, start, end, 0

    def __call__(self, shape):
        self.n += 1
        return (self.spell if self.start <= self.n < self.end else self.normal)(shape)


@pytest.mark.parametrize("spell_draft_row_ms, pays", [(12.0, False), (0.6, True)])
def test_goodput_stops_in_a_slow_spell_where_drafting_stops_paying_and_resumes_after(spell_draft_row_ms, pays):
    """Plain steps double for steps 300-699 (34 -> 68 ms for 8 rows). With draft rows at 12 ms
    in the spell (over the 8.5 ms a plain token takes then: no draft pays), the switch sees the
    slowdown, re-measures, stops, and drafts again soon after the spell; with draft rows at
    0.6 ms (everything twice as slow: drafting pays as before) it never stops."""
    normal = cost_of(30.0, 0.5, 0.3, 0.05)

    def spell(s):
        return 2 * (30.0 + 0.5 * s.base_rows) + spell_draft_row_ms * s.draft_rows + 0.1 * s.proposed

    g = Goodput(row_floor_ms=0.2)
    plans = drive(g, _Spell(normal, spell, 300, 700), 1100)
    before, during, after = plans[:299], plans[299:699], plans[699:]  # plans[i] is for step i + 1
    assert g.remeasures >= 2  # slower at the start of the spell, faster at its end: confirmed, measured afresh
    assert all(pl.reason != "off" for pl in before) and sum(pl.draft for pl in before) / len(before) > 0.9
    if pays:
        assert g.stops == 0 and sum(pl.draft for pl in during) / len(during) > 0.9
        return
    first_off = next(i for i, pl in enumerate(during) if pl.reason == "off")
    # The first probe in the spell (probes are 31 steps apart at a gain of 2.6), three more to
    # confirm the slowdown, then the price and the gain measured afresh (about 15 steps).
    assert first_off < 64
    assert sum(pl.draft for pl in during[first_off:]) / len(during[first_off:]) < 0.15  # trials only
    # The spell's end is a confirmed speed-up while off: a trial at once, not after the backoff.
    last_off = max((i for i, pl in enumerate(after) if pl.reason == "off"), default=-1)
    assert last_off < 8
    assert sum(pl.draft for pl in after[last_off + 1:]) / len(after[last_off + 1:]) > 0.9
    assert plans[-1].threshold == pytest.approx(0.3 / (34.0 / 8), rel=0.1)  # priced as before the spell


def test_goodput_never_reads_draft_rows_as_free_once_drafts_ran():
    """Drafting steps no dearer than plain ones (the step-time fit reads a row at 0 ms): the
    price stays at the floor measured on the model's kernels, and so does the threshold."""
    def rows_free(s):
        return 34.0

    g = Goodput(row_floor_ms=0.4)
    assert g.stats()["draft_row_ms"] is None  # before any draft
    plans = drive(g, rows_free, 200)
    assert g.excess.line(flat_through_origin=True)[1] < 0.01  # what the steps alone say
    assert g.row_ms == g.stats()["draft_row_ms"] == 0.4 and g.stats()["row_floor_ms"] == 0.4
    assert plans[-1].threshold == pytest.approx(0.4 * 8 / 34.0, rel=1e-6)
    unfloored = Goodput(row_floor_ms=0.0)
    drive(unfloored, rows_free, 200)
    assert unfloored.row_ms < 0.01  # without a floor it would read them free


def test_plain_steps_judge_near_in_time_and_confirm_a_change_of_speed():
    from stencil.engine.speculative.plain_steps import PlainStep, PlainSteps

    rec = PlainSteps(confirm=3, horizon=20, nearest=3)
    for t, requests, ms in ((1, 8, 40.0), (2, 8, 41.0), (3, 4, 20.0), (4, 8, 39.0), (31, 8, 42.0)):
        assert rec.add(PlainStep(t, requests, 8, ms)) == "kept"
    # Around step 10: step 31 is beyond the horizon; of the rest, those of 8 requests.
    assert rec.near(10, 8, 8) == [40.0, 41.0, 39.0]
    assert rec.near(10, 4, 8) == [20.0]  # another composition: its own
    assert rec.near(29, 8, 8) == [42.0]  # the probe after it, the rest too far back
    # A step 1.5x off the median is held back; back to normal, it was noise and joins the record.
    assert rec.add(PlainStep(32, 8, 8, 70.0)) == "suspect" and rec.suspect
    assert rec.add(PlainStep(33, 8, 8, 40.0)) == "kept" and [s.ms for s in rec.steps][-2:] == [70.0, 40.0]
    # Three in a row, all slower: a change of speed; the record restarts from them.
    assert [rec.add(PlainStep(t, 8, 8, 80.0 + t)) for t in (34, 35, 36)] == ["suspect", "suspect", "changed"]
    assert [s.ms for s in rec.steps] == [114.0, 115.0, 116.0] and rec.count == 3
    assert rec.typical(8, 8) == 115.0


def test_decoder_row_floor_is_the_projections_cost_of_one_more_row(monkeypatch):
    """On a fake model whose projections advance a fake clock by 0.1 ms a call plus 0.02 ms a
    row (no clock is read): 4 projections a layer, 3 layers, so one more row costs 0.24 ms."""
    import torch

    from stencil.engine.speculative import row_cost

    now = [0.0]

    class Proj(torch.nn.Module):
        in_features = 8

        def forward(self, x):
            now[0] += (0.1 + 0.02 * x.shape[0]) / 1e3
            return x

    class Model:
        def __init__(self):
            self.projs = [(f"layers.{i}.{n}", Proj()) for i in range(3) for n in "abcd"]

        def linear_layers(self):
            return iter(self.projs)

    monkeypatch.setattr(row_cost.time, "perf_counter", lambda: now[0])
    assert row_cost.decoder_row_ms(Model()) == pytest.approx(0.24)
    assert row_cost.decoder_row_ms(object()) == 0.0  # no projections to time: no floor
    with pytest.raises(ValueError):
        row_cost.decoder_row_ms(Model(), small=8, large=8)


# -- Drafter.propose: the step's rows shared by expected value, priced -----------------------------
class _Tok:
    def encode(self, text, add_special_tokens=False):
        return [ord(c) for c in text]

    def decode(self, ids, skip_special_tokens=False):
        return "".join(map(chr, ids))


def _decoding(rid: str, accepted: float, rejected: float, **spec) -> Request:
    req = Request(rid, [5, 6, 7], SamplingParams(max_tokens=50, temperature=0), eos_token_id=2)
    req.append_output([8])
    req.num_computed_tokens = req.num_tokens - 1  # one sampled token to feed: a decode row
    req.spec_state = SpecState(SpecConfig(**spec))
    req.spec_state.ngram.accepted, req.spec_state.ngram.rejected = accepted, rejected
    return req


def test_propose_shares_rows_by_expected_value_and_prices_drafts():
    drafter = Drafter(_Tok(), lambda req: "", lambda req: True, max_model_len=1000)
    drafter.draft = lambda req, room: [9] * room  # every request could fill its room
    sure, prior, poor = _decoding("sure", 10, 0), _decoding("prior", 0, 0), _decoding("poor", 1, 5)
    batch = [sure, prior, poor]  # p = 0.97, 0.8, 0.33
    free = drafter.propose(batch, DraftBudget(threshold=0.0))
    assert {rid: len(d) for rid, d in free.tokens.items()} == {"sure": 4, "prior": 4, "poor": 4}
    assert free.proposed == 3 and not free.failed
    # At threshold 0.5: 0.97^4, but only 0.8^3 (0.51, not 0.41), and nothing of 0.33.
    poor_before = poor.spec_state.ngram.accepted
    priced = drafter.propose(batch, DraftBudget(threshold=0.5))
    assert {rid: len(d) for rid, d in priced.tokens.items()} == {"sure": 4, "prior": 3}
    assert poor.spec_state.ngram.accepted < poor_before  # priced out: its record fades
    # Six rows beyond the first (3 decode rows take 2 of 8): the best six chances, wherever they sit.
    for r in batch:
        r.spec_state.config.max_draft_tokens_per_step = 8
    shared = drafter.propose([poor, prior, sure], DraftBudget())
    assert {rid: len(d) for rid, d in shared.tokens.items()} == {"sure": 4, "prior": 2}
    # Not cost aware: the price does not apply to that request.
    blind = _decoding("blind", 1, 5, cost_aware=False)
    assert len(drafter.propose([blind], DraftBudget(threshold=0.9)).tokens["blind"]) == 4
    # A proposer that raises fails its request alone.
    drafter.draft = lambda req, room: 1 / 0 if req.request_id == "poor" else [9]
    faulty = drafter.propose(batch, DraftBudget())
    assert [r.request_id for r, _ in faulty.failed] == ["poor"] and set(faulty.tokens) == {"sure", "prior"}


def test_drafts_do_not_spill_a_row_or_two_into_a_new_kernel_tile():
    d = {"a": [0] * 4, "b": [0]}
    trim_to_tile(d, 1, 4)  # 1 + 5 rows = 6: two spill into the second tile
    assert (len(d["a"]), len(d["b"])) == (2, 1)
    d = {"a": [0] * 4, "b": [0] * 2}
    trim_to_tile(d, 1, 4)  # 7 rows: three of four in the new tile are worth keeping
    assert (len(d["a"]), len(d["b"])) == (4, 2)
    d = {"a": [0] * 3}
    trim_to_tile(d, 8, 4)  # 11 rows: kept; 9 would not be
    assert len(d["a"]) == 3
    d = {"a": [0]}
    trim_to_tile(d, 8, 4)
    assert d["a"] == []


# -- the engine on the tiny model, with injected step costs ----------------------------------------
def flat_cost(shape: StepShape) -> float:
    return 10.0  # drafts are free


def _engine(tiny_model_dir, cost_model, **cfg):
    from stencil.engine.config import EngineConfig
    from stencil.engine.llm_engine import LLMEngine

    eng = LLMEngine(EngineConfig(model=tiny_model_dir, num_kv_blocks=128, **cfg), cost_model=cost_model)
    # A random model repeats itself, so "the last token again" is a draft that is often right.
    eng.drafter.draft = lambda req, room: [req.all_token_ids[-1]] * room
    return eng


def _run(eng, n: int, max_tokens: int, spec: dict, on_step=None) -> dict[str, list[int]]:
    for i in range(n):
        eng.add_request(f"r{i}", [7 + i, 8, 9, 10, 11] * 3,
                        SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, speculative=spec))
    outs: dict[str, list[int]] = {}
    while eng.has_unfinished():
        for o in eng.step():
            outs.setdefault(o.request_id, []).extend(o.new_token_ids)
        if on_step is not None:
            on_step(eng)
    return outs


SPEC = {"method": "ngram", "num_speculative_tokens": 4, "max_batch_size": 64, "min_acceptance": 0.0}


def test_drafts_per_step_stay_within_the_shared_budget(tiny_model_dir):
    eng = _engine(tiny_model_dir, flat_cost)
    per_step, per_request = [], []
    propose = eng.drafter.propose

    def counted(requests, budget):
        out = propose(requests, budget)
        per_step.append(sum(len(d) for d in out.tokens.values()))
        per_request.extend(len(d) for d in out.tokens.values())
        return out

    eng.drafter.propose = counted
    spec = {**SPEC, "max_draft_tokens_per_step": 5, "cost_aware": False}
    for i in range(4):
        eng.add_request(f"r{i}", [7 + i, 8, 9, 10, 11] * 3,
                        SamplingParams(max_tokens=40 if i == 0 else 8, temperature=0, ignore_eos=True,
                                       speculative=spec))
    while eng.has_unfinished():
        eng.step()
    # Four requests decoding take 3 rows of the 5 beyond the first: 2 are left for drafts (they
    # could take 16). Alone, the long request gets num_speculative_tokens, never more.
    assert per_step[:3] == [2, 2, 2]
    assert max(per_step) == 4 and max(per_request) == 4


def _oracle(eng, reference: dict[str, list[int]]) -> None:
    """Draft the reference output's next tokens: every draft is right, so only the price of a
    row decides whether drafting pays."""
    eng.drafter.draft = lambda req, room: reference[req.request_id][req.num_output_tokens:req.num_output_tokens + room]


def test_engine_drafts_on_cheap_rows_stops_on_dear_ones_and_outputs_never_change(tiny_model_dir):
    plain_eng = _engine(tiny_model_dir, flat_cost)
    off = _run(plain_eng, 3, 200, {"method": "off"})
    cheap_eng = _engine(tiny_model_dir, lambda s: 10.0 + 0.5 * s.base_rows + 0.1 * s.draft_rows)
    _oracle(cheap_eng, off)
    cheap = _run(cheap_eng, 3, 200, SPEC)
    # 8 ms a draft row against 11.5 ms for a plain step of three rows (3.8 ms a token): no
    # draft can pay for its row, however right, and proposing costs 0.2 ms a request.
    dear_eng = _engine(tiny_model_dir, lambda s: 10.0 + 0.5 * s.base_rows + 8.0 * s.draft_rows + 0.2 * s.proposed)
    _oracle(dear_eng, off)
    drafting: list[bool] = []  # per step after the first stop: did the next step get drafts?
    dear = _run(dear_eng, 3, 200, SPEC, on_step=lambda e: e.goodput.stops and drafting.append(
        any(r.draft_token_ids for r in e.scheduler.running)))
    assert cheap == off == dear
    assert cheap_eng.goodput.stops == 0 and cheap_eng.goodput.gain > 2.0
    assert cheap_eng.num_steps < 0.3 * plain_eng.num_steps  # 4 drafts and a bonus token a step
    g = dear_eng.goodput
    assert g.stops >= 2 and g.backoff > g.min_backoff  # each failed trial backs off longer
    assert dear_eng.stats()["speculation"]["stops"] == g.stops
    assert sum(drafting) < 0.2 * len(drafting)  # trials only
    assert g.threshold(3) > 1.0  # priced: no chance of acceptance is worth a row


def test_engine_recovers_when_rows_get_cheap_mid_run(tiny_model_dir):
    class Shifting:
        """Draft rows dear for the first 60 decode steps, cheap after."""

        def __init__(self):
            self.n = 0

        def __call__(self, s):
            self.n += 1
            per_draft = 8.0 if self.n <= 60 else 0.1
            return 10.0 + 0.5 * s.base_rows + per_draft * s.draft_rows + 0.2 * s.proposed

    off = _run(_engine(tiny_model_dir, flat_cost), 2, 600, {"method": "off"})
    eng = _engine(tiny_model_dir, Shifting())
    _oracle(eng, off)
    stopped_at: list[int] = []  # decode steps costed when drafting was found to lose
    drafts_per_step: list[int] = []

    def watch(e):
        if e.goodput.stops > len(stopped_at):
            stopped_at.append(e.cost_model.n)
        drafts_per_step.append(sum(len(r.draft_token_ids) for r in e.scheduler.running))

    on = _run(eng, 2, 600, SPEC, on_step=watch)
    assert on == off
    g = eng.goodput
    assert stopped_at and stopped_at[0] <= 60 and g.trials >= 1 and g.gain > 2.0
    assert sum(drafts_per_step[-20:]) >= 4 * 2 * 15  # back to full drafts (probes aside)


def test_spec_benchmark_mode_reports_steps_drafts_and_proposer_cost(tiny_model_dir):
    from stencil.benchmarks.spec import run_mode

    eng = _engine(tiny_model_dir, flat_cost)  # drafting never loses: the drafts do not hang on the clock
    prompts = [[7, 8, 9, 10, 11] * 4, [12, 13, 14, 15] * 5]
    spec = {**SPEC, "max_batch_size": 64}
    off = run_mode(eng, prompts, None, 2, 12, False, spec)
    on = run_mode(eng, prompts, None, 2, 12, True, spec)
    assert on["token_ids"] == off["token_ids"] and all(on["token_ids"])
    assert off["draft_tokens"] == 0 and on["draft_tokens"] > 0
    assert on["accepted_tokens"] > 0 and on["steps"] < off["steps"]
    assert off["drafting_steps"] == 0 < on["drafting_steps"] < on["steps"]
    assert off["steps_per_token"] >= 1.0 / 2 - 1e-9  # two requests per step at most, one token each
    assert on["goodput"]["stops"] == 0
    # Structural, not timing: proposing is part of a step, and some steps read no prompt.
    assert 0.0 < on["propose_ms_per_step"] < on["step_ms"]
    assert on["decode_only_tokens_per_s"] > 0 and 0 < off["decode_only_time_share"] < 1
    assert not {"step"} & set(vars(eng)) and "propose" not in vars(eng.drafter)
    assert "schedule" not in vars(eng.scheduler)


def test_spec_benchmark_repeats_and_reports_the_spread_under_background_load(tiny_model_dir, tmp_path):
    import argparse

    from stencil.benchmarks import spec as bench

    p = argparse.ArgumentParser()
    bench.add_arguments(p)
    out = tmp_path / "spec.json"
    args = p.parse_args(["--json", str(out), "--model", str(tiny_model_dir), "--requests", "2", "--max-tokens", "6",
                         "--concurrency", "1", "--workloads", "copy", "--repeat", "2", "--background-load", "--no-warmup"])
    assert bench.main(args) == 0
    import json

    report = json.loads(out.read_text())
    row = report["copy"]["1"]
    pairs = row["pairs"]
    assert len(pairs) == 2 and row["identical"] is True and report["background_load"] is True
    assert [p["order"] for p in pairs] == ["on,off", "off,on"]  # interleaved: on, off, off, on
    for key in ("speedup", "speedup_end_to_end"):
        values = sorted(p[key] for p in pairs)
        assert row[key] == {"min": values[0], "median": (values[0] + values[1]) / 2, "max": values[1]}
    assert row["noisy"] == (row["plain_step_variation"] > bench.NOISE_LIMIT) and report["noisy"] == row["noisy"]
    assert all(len(p["plain_segments_ms_off"]) >= 1 and p["plain_batch_off"] == 1 for p in pairs)
    switch = row["switch"]
    assert switch["stops"] == [p["goodput"]["stops"] for p in pairs] and len(switch["trials"]) == 2
    assert switch["drafting_share"]["max"] == max(p["drafting_share"] for p in pairs)
    assert report["cpu"] and "row_floor_ms" in report
    assert not _children_running(bench._BUSY_LOOP)  # the load process is gone


def test_spec_benchmark_flags_a_row_whose_plain_steps_varied_by_more_than_a_fifth():
    from stencil.benchmarks import spec as bench

    # (requests, ms) of decode steps: the most common batch size (8) counts, by quarter.
    steps = [(8, 20.0)] * 4 + [(7, 90.0)] + [(8, 22.0)] * 4 + [(8, 21.0)] * 4 + [(8, 30.0)] * 4
    assert bench.segment_medians(steps) == {"plain_batch": 8, "plain_segments_ms": [20.0, 22.0, 21.0, 30.0]}
    assert bench.segment_medians([(1, 5.0)]) == {"plain_batch": 1, "plain_segments_ms": [5.0]}

    def pair(speedup, segments):
        return {"speedup": speedup, "speedup_end_to_end": speedup, "decode_only_speedup": None, "identical": True,
                "plain_segments_ms_off": segments, "drafting_share": 0.5,
                "goodput": {"stops": 1, "trials": 1, "remeasures": 0, "draft_row_ms_at_end": 2.0,
                            "gain_at_end": 1.3}}

    steady = bench.spread([pair(1.5, [20.0, 21.0]), pair(1.6, [23.0, 22.0])])  # 15% apart
    assert steady["noisy"] is False and steady["plain_step_variation"] == pytest.approx(0.15)
    assert steady["speedup"] == {"min": 1.5, "median": 1.55, "max": 1.6} and "decode_only_speedup" not in steady
    assert steady["switch"]["stops"] == [1, 1] and steady["switch"]["draft_row_ms"]["median"] == 2.0
    noisy = bench.spread([pair(0.87, [45.0, 44.0]), pair(1.5, [22.0, 23.0])])  # the slow spell of issue 35
    assert noisy["noisy"] is True and noisy["plain_step_variation"] == pytest.approx(45 / 22 - 1)
    # quarters that differ alike in every pair are the workload, not the machine
    shaped = bench.spread([pair(1.1, [18.9, 22.7, 19.4, 22.1]), pair(1.2, [19.3, 23.1, 19.9, 22.5])])
    assert shaped["noisy"] is False and shaped["plain_step_variation"] == pytest.approx(19.9 / 19.4 - 1)
    one = bench.spread([pair(1.1, [18.0, 23.0])])  # one pair: its quarters against each other
    assert one["noisy"] is True and one["plain_step_variation"] == pytest.approx(23 / 18 - 1)


def _children_running(cmd: str) -> list[int]:
    import os
    from pathlib import Path

    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            stat = (proc / "stat").read_text()
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == os.getpid() and cmd in cmdline:
            found.append(int(proc.name))
    return found


# -- the layout of JSON answers (drafts where the grammar leaves whitespace free) -----------------

@pytest.mark.parametrize("text, layout", [
    ("", JsonLayout()),
    ('{\n  "a": 1,', JsonLayout(newline=True, indent="  ", colon_space=True)),
    ('{\n    "a": {\n        "b"', JsonLayout(newline=True, indent="    ", colon_space=True)),
    ('{\n\t"a":1', JsonLayout(newline=True, indent="\t", colon_space=False)),
    ('{"a": 1, "b"', JsonLayout(newline=False, colon_space=True, comma_space=True)),
    ('{"a":"x: {, y","b"', JsonLayout(newline=False, colon_space=False, comma_space=False)),
])
def test_json_layout_reads_line_breaks_indent_and_spaces_outside_strings(text, layout):
    assert JsonLayout.of(text) == layout


def test_json_layout_guesses_the_next_whitespace_from_the_position():
    pretty, compact = JsonLayout(), JsonLayout(newline=False, colon_space=False)
    assert position('{"a": {"b": "x}"') == Position(False, 2, '"', "")
    assert position('{"a": "x') .in_string
    assert position('{\n  ').trailing_ws == "\n  "
    assert pretty.after(position('{"a": {')) == "\n    "
    assert pretty.after(position('{\n  "a":')) == " "
    assert pretty.after(position('{\n  "a": 1,')) == "\n  "
    assert pretty.after(position('{\n  "a": 1')) == ""
    assert pretty.before_close(position('{\n  "a": {\n    "b": 1')) == "\n  "
    assert compact.after(position('{"a":1,')) == "" and compact.before_close(position('{"a":1')) == ""
    assert pretty.after(position('{"a": "x')) is None and pretty.after(position("")) is None


@pytest.fixture(scope="module")
def person_grammars(tokenizer):
    from stencil.grammar.base import GrammarSpec
    from stencil.grammar.compiler import GrammarCompiler

    schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                               "city": {"type": "string"}}, "required": ["name", "age", "city"]}
    with GrammarCompiler(tokenizer, len(tokenizer), backend="lazy") as c:
        yield {ws: c.compile(GrammarSpec.json_schema(schema, whitespace=ws)) for ws in ("compact", "flexible")}


def _matcher_after(grammar, tokenizer, text):
    m = grammar.matcher()
    assert m.accept_tokens(tokenizer.encode(text, add_special_tokens=False)) if text else True
    return m


@pytest.mark.parametrize("written, draft, expected", [
    ("", "", '{\n  "name": "'),  # before the answer shows a layout: the pretty-printed one
    ("{", "", '{\n  "name": "'),
    ('{\n  "name": "Ada",', "", '{\n  "name": "Ada",\n  "age": '),
    ('{\n  "name": "Ada",\n ', "", '{\n  "name": "Ada",\n  "age": '),  # "\n " already written
    ('{\n  "name": "Ada",\n  "age": 3', "", '{\n  "name": "Ada",\n  "age": 3'),  # more digits may come
    ('{\n  "name": "Ada",\n  "age": 3', ",", '{\n  "name": "Ada",\n  "age": 3,\n  "city": "'),
    ('{\n  "name": "Ada",\n  "age": 3,\n  "city": "Oslo', '"',
     '{\n  "name": "Ada",\n  "age": 3,\n  "city": "Oslo"\n}'),
    ('{"name":"Ada",', "", '{"name":"Ada","age":'),  # a compact writer under the flexible grammar
])
def test_drafter_forced_text_goes_on_across_free_whitespace_in_the_answers_layout(
        tokenizer, person_grammars, written, draft, expected):
    drafter = Drafter(tokenizer, lambda r: "", lambda r: True, 4096)
    m = _matcher_after(person_grammars["flexible"], tokenizer, written)
    got = drafter.forced_text(m, written, draft)
    assert written + got == expected


def test_drafter_forced_text_in_compact_json_is_the_grammars_forced_text(tokenizer, person_grammars):
    drafter = Drafter(tokenizer, lambda r: "", lambda r: True, 4096)
    m = _matcher_after(person_grammars["compact"], tokenizer, '{"name":"Ada"')
    assert drafter.forced_text(m, '{"name":"Ada"') == m.forced_text().decode() == ',"age":'
    assert drafter.forced_text(m, '{"name":"Ada"', "x") is None  # the grammar refuses the draft


from hypothesis import given, settings, strategies as st  # noqa: E402


class _Recording:
    """A tokenizer without a Rust backend: ``plain_encoder`` must call its own ``encode``."""

    def __init__(self, inner):
        self.inner, self.calls = inner, 0

    def encode(self, text, add_special_tokens=True):
        self.calls += 1
        return self.inner.encode(text, add_special_tokens=add_special_tokens)


@settings(max_examples=300, deadline=None)
@given(text=st.text(st.characters(codec="utf-8"), max_size=40)
       | st.lists(st.sampled_from(['"', ",", ":", " ", "\n", "  ", "{", "}", "<|im_end|>", "é", "12", "Ab"]),
                  max_size=12).map("".join))
def test_plain_encoder_spells_every_text_as_the_tokenizers_encode(tokenizer, text):
    from stencil.engine.speculative.drafter import plain_encoder

    fast = plain_encoder(tokenizer)
    assert fast.__name__ == "fast"  # SmolLM2's fast tokenizer takes the shortcut
    assert fast(text) == tokenizer.encode(text, add_special_tokens=False)
    plain = _Recording(tokenizer)
    slow = plain_encoder(plain)
    assert slow(text) == tokenizer.encode(text, add_special_tokens=False) and plain.calls >= 1
