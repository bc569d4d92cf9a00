"""Penalties, logit_bias and top_logprobs: exact values on tiny logits, and the engine invariant
(greedy outputs unchanged by speculation and batching) with them switched on."""

from __future__ import annotations

import math
import random

import pytest
import torch

from stencil.engine.config import EngineConfig
from stencil.engine.llm_engine import EngineError, LLMEngine
from stencil.engine.logits_process import BAN, process_logits_, top_logprobs
from stencil.engine.request import Request, SamplingParams
from stencil.engine.sampler import Sampler


def _req(output: list[int], prompt=(9,), **kw) -> Request:
    r = Request("r", list(prompt), SamplingParams(temperature=0, **kw), eos_token_id=None)
    r.append_output(output)
    return r


def test_frequency_and_presence_count_output_and_earlier_drafts():
    logits = torch.zeros(3, 6)
    req = _req([1, 1, 2], frequency_penalty=0.5, presence_penalty=0.25)
    process_logits_(logits, [req], [[2, 4]])
    # row 0: output only; row 1: + draft 2; row 2: + drafts 2, 4
    assert logits[0].tolist() == [0, -1.25, -0.75, 0, 0, 0]
    assert logits[1].tolist() == [0, -1.25, -1.25, 0, 0, 0]
    assert logits[2].tolist() == [0, -1.25, -1.25, 0, -0.75, 0]


def test_repetition_penalty_covers_the_prompt_and_keeps_the_sign():
    logits = torch.tensor([[2.0, -2.0, 2.0, -2.0]])
    req = _req([1], prompt=[0], repetition_penalty=2.0)
    process_logits_(logits, [req], [[]])
    assert logits.tolist() == [[1.0, -4.0, 2.0, -2.0]]


def test_bias_adds_bans_and_forces_but_never_reallows_a_masked_token():
    ninf = float("-inf")
    logits = torch.tensor([[1.0, 2.0, ninf, 0.5]])
    req = _req([], logit_bias={0: 1.5, 1: -100, 2: 100})
    process_logits_(logits, [req], [[]])
    assert logits.tolist() == [[2.5, 2.0 - BAN, ninf, 0.5]]
    # The grammar leaves only a banned token: it is still picked (finite), never NaN.
    only = torch.tensor([[ninf, 3.0, ninf]])
    out = Sampler()(only, [_req([], logit_bias={1: -100})], [[]], want_logprobs=True)
    assert out.tokens == [[1]] and math.isfinite(out.logprobs[0][0])


def test_top_logprobs_are_sorted_and_skip_forbidden_tokens():
    logp = torch.log_softmax(torch.tensor([0.0, 3.0, float("-inf"), 1.0, 1.0]), dim=-1)
    top = top_logprobs(logp, 4)
    assert [t for t, _ in top] == [1, 3, 4, 0]  # ties: lower id first; -inf never listed
    assert all(a[1] >= b[1] for a, b in zip(top, top[1:]))
    assert top[1][1] == pytest.approx(float(logp[3]))
    assert top_logprobs(logp, 0) == []


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    return LLMEngine(EngineConfig(model=tiny_model_dir, num_kv_blocks=256, max_num_batched_tokens=256))


@pytest.fixture(scope="module")
def prompts():
    rng = random.Random(3)
    out = [[rng.randrange(20, 49000) for _ in range(rng.randrange(4, 30))] for _ in range(6)]
    out.append([101, 202, 303, 404, 505] * 8)  # repeats itself: n-gram drafts get proposed
    out.append([7, 8, 9, 10] * 10)
    return out


PENALTIES = dict(frequency_penalty=0.4, presence_penalty=0.3, repetition_penalty=1.2)
# Negative penalties reward repetition, so n-gram drafts get accepted and row j's counts matter.
REWARDS = dict(frequency_penalty=-0.4, presence_penalty=-0.3, repetition_penalty=0.9)
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
        "max_batch_size": 64, "min_acceptance": 0.0, "cost_aware": False}


def _params(spec: dict | None, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=24, temperature=0, ignore_eos=True,
                          speculative=spec or {"method": "off"}, **kw)


@pytest.mark.parametrize("penalties", [PENALTIES, REWARDS], ids=["penalties", "rewards"])
def test_penalties_and_bias_are_exact_under_speculation_and_batching(engine, prompts, penalties):
    bias = {101: 5.0, 202: -3.0, 7: 2.0}
    alone_plain = [engine.generate([p], _params(None))[0]["token_ids"] for p in prompts]
    alone = [engine.generate([p], _params(None, logit_bias=bias, **penalties))[0]["token_ids"] for p in prompts]
    assert alone != alone_plain  # they change what greedy decoding writes
    batched = engine.generate(prompts, _params(None, logit_bias=bias, **penalties))
    assert [r["token_ids"] for r in batched] == alone
    spec = engine.generate(prompts, _params(SPEC, logit_bias=bias, **penalties))
    assert [r["token_ids"] for r in spec] == alone
    assert sum(r["output"].num_draft_tokens for r in spec) > 0
    if penalties is REWARDS:
        assert sum(r["output"].num_accepted_tokens for r in spec) > 0
    else:  # and penalties make the outputs repeat less
        assert sum(len(set(t)) for t in alone) > sum(len(set(t)) for t in alone_plain)


def test_bias_of_minus_100_on_the_greedy_first_token_changes_it(engine, prompts):
    first = engine.generate([prompts[0]], _params(None))[0]["token_ids"][0]
    banned = engine.generate([prompts[0]], _params(None, logit_bias={first: -100}))[0]["token_ids"]
    assert banned[0] != first and first not in banned
    forced = engine.generate([prompts[0]], _params(None, logit_bias={42: 100}))[0]["token_ids"]
    assert set(forced) == {42}


def test_top_logprobs_come_with_every_token(engine, prompts):
    params = _params(SPEC, logprobs=True, top_logprobs=3)
    rid = engine.add_request(None, prompts[-1], params)
    tokens, lps, tops = [], [], []
    while engine.has_unfinished():
        for out in engine.step():
            assert out.request_id == rid
            tokens += out.new_token_ids
            lps += out.new_logprobs
            tops += out.new_top_logprobs
    assert tokens == engine.generate([prompts[-1]], _params(None))[0]["token_ids"]
    assert len(tops) == len(tokens) == len(lps) == 24
    for t, lp, top in zip(tokens, lps, tops):
        assert len(top) == 3 and [a[1] for a in top] == sorted((a[1] for a in top), reverse=True)
        assert top[0][0] == t  # greedy: the chosen token is the most likely one
        assert top[0][1] == pytest.approx(lp)


def test_out_of_range_values_are_refused_by_name(engine):
    for kw, name in (({"frequency_penalty": 2.5}, "frequency_penalty"),
                     ({"presence_penalty": float("nan")}, "presence_penalty"),
                     ({"repetition_penalty": 0.0}, "repetition_penalty"),
                     ({"repetition_penalty": 8e-258}, "repetition_penalty"),  # found by the API fuzzer
                     ({"top_logprobs": 21}, "top_logprobs"),
                     ({"logit_bias": {10**6: 1.0}}, "logit_bias"),
                     ({"logit_bias": {5: 101.0}}, "logit_bias")):
        with pytest.raises(EngineError, match=name):
            engine.add_request(None, [5, 6], SamplingParams(**kw))


def test_bias_works_inside_the_grammar_and_never_against_it(engine, prompts):
    from stencil.grammar.base import GrammarSpec

    tok = engine.tokenizer
    a, c = (tok.encode(ch, add_special_tokens=False)[0] for ch in "ac")
    grammar = engine.grammar.compile(GrammarSpec("regex", "[ab]{6}"))
    params = dict(max_tokens=10, temperature=0, speculative={"method": "off"})
    forced_c = engine.generate([prompts[2]], SamplingParams(logit_bias={c: 100}, **params), [grammar])[0]
    no_a = engine.generate([prompts[2]], SamplingParams(logit_bias={a: -100, c: 100}, **params), [grammar])[0]
    assert forced_c["finish_reason"] == "stop" and len(forced_c["text"]) == 6
    assert set(forced_c["text"]) <= {"a", "b"}
    assert no_a["finish_reason"] == "stop" and set(no_a["text"]) <= {"a", "b"} and len(no_a["text"]) == 6
    assert a not in no_a["token_ids"]  # ("aa" is a token of its own: only "a" is banned)
