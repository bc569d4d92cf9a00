"""Reasoning then a structured answer in one ``max_tokens`` (``SamplingParams.reasoning``,
``stencil.grammar.reasoning``), served by the engine on tiny models carrying the real Qwen3 and
DeepSeek-R1-distill templates and their ``<think>`` / ``</think>`` tokens: at every budget from the minimum up, the
answer is complete and valid, the reasoning never holds the end marker, and the output splits
where the matcher put the marker; speculation keeps greedy outputs; a cap of 0 gives an empty
region; admission refuses below the minimum."""

from __future__ import annotations

import json
import random

import jsonschema
import pytest

from stencil.engine.config import EngineConfig
from stencil.engine.llm_engine import EngineError, LLMEngine
from stencil.engine.request import ReasoningParams, SamplingParams
from stencil.grammar.base import GrammarSpec

SCHEMA = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 12},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}},
          "required": ["name", "age"], "additionalProperties": False}
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
        "max_batch_size": 64, "min_acceptance": 0.0}


def flat_cost(shape) -> float:
    return 10.0  # every step costs the same: drafting always pays (test_engine.flat_cost)


# (template, its special tokens, eos, bos): Qwen3's generation prompt leaves the region to the model
# (the engine forces "<think>\n"); the R1 distill's opens it ("<think>\n" ends the prompt).
FAMILIES = {
    "qwen3": ("Qwen-Qwen3-0.6B", ["<think>", "</think>", "<tool_call>", "</tool_call>"], None, None),
    "deepseek_r1": ("deepseek-ai-DeepSeek-R1-Distill-Qwen-32B",
                    ["<｜begin▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>", "<think>", "</think>"],
                    "<｜end▁of▁sentence｜>", "<｜begin▁of▁sentence｜>"),
}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def qwen3(family_model_factory, request):
    """(engine, tokenizer, ReasoningParams, prompt ids) of a tiny model carrying the family's real
    template (named for the first family; the R1 distill's runs the same tests)."""
    from transformers import AutoTokenizer

    template, special, eos, bos = FAMILIES[request.param]
    model = family_model_factory(template, special, eos_token=eos, bos_token=bos)
    tok = AutoTokenizer.from_pretrained(str(model))
    eng = LLMEngine(EngineConfig(model=str(model), num_kv_blocks=512, max_num_seqs=32,
                                 max_num_batched_tokens=2048, max_prefill_chunk=2048, speculative=SPEC),
                    cost_model=flat_cost)
    end_id = tok.convert_tokens_to_ids("</think>")
    # (llama.cpp's copy of the R1 template closes the region unless enable_thinking is set)
    prompt = tok.apply_chat_template([{"role": "user", "content": "Who is Ada? Answer in JSON."}],
                                     add_generation_prompt=True, tokenize=True, enable_thinking=True)
    if not isinstance(prompt, list):
        prompt = prompt["input_ids"]
    opened = tok.decode(prompt).endswith("<think>\n")
    assert opened == (request.param == "deepseek_r1")
    start = () if opened else tuple(tok.encode("<think>\n", add_special_tokens=False))
    rp = ReasoningParams("</think>", (end_id,), start_ids=start,
                         after_ids=tuple(tok.encode("\n\n", add_special_tokens=False)))
    return eng, tok, rp, list(prompt)


def _run(eng, prompts, params, grammars):
    """generate(), keeping each request's reasoning text, its outputs and its matcher's split."""
    ids = [eng.add_request(None, p, params[i], grammars[i]) for i, p in enumerate(prompts)]
    res = {rid: {"token_ids": [], "text": "", "reasoning": "", "last": None} for rid in ids}
    reqs = {rid: eng.scheduler.requests[rid] for rid in ids}
    while eng.has_unfinished():
        for out in eng.step():
            r = res[out.request_id]
            r["token_ids"] += out.new_token_ids
            r["text"] += out.new_text
            r["reasoning"] += out.new_reasoning_text
            r["last"] = out
            if not out.finished:
                m = reqs[out.request_id].matcher
                want = len(r["token_ids"]) if m.answer_start is None else m.answer_start
                assert out.num_reasoning_tokens == want
    for rid in ids:
        res[rid]["matcher"] = reqs[rid].matcher
    return [res[rid] for rid in ids]


def _check_split(tok, rp: ReasoningParams, r: dict, max_tokens: int, structured: bool = True) -> str:
    """The output's parts where the matcher put them; returns how the reasoning ended."""
    ids, out, m = r["token_ids"], r["last"], r["matcher"]
    assert out.finished and len(ids) <= max_tokens
    assert ids[:len(rp.start_ids)] == list(rp.start_ids)
    a = m.answer_start
    assert a is not None and out.num_reasoning_tokens == a
    end = m.reasoning_end
    if ids[end] == rp.end_ids[0]:
        assert ids[end:a] == list(rp.end_ids + rp.after_ids)
        # (a character the cut left unfinished is dropped, as the detokenizer's finish() does)
        want = tok.decode(ids[len(rp.start_ids):end], skip_special_tokens=True).rstrip("\ufffd")
        kind = "cut" if out.reasoning_cut else "model"
    else:  # the reasoning's own text spelled the marker (not forced: the cut forces the token)
        assert not out.reasoning_cut and ids[end:a] == list(rp.after_ids)
        want = tok.decode(ids[len(rp.start_ids):end], skip_special_tokens=True)
        assert want.endswith(rp.end_text)
        want, kind = want[:-len(rp.end_text)], "text"
    assert "</think>" not in r["reasoning"] and r["reasoning"] == want
    if rp.max_reasoning_tokens is not None:
        assert end - len(rp.start_ids) <= rp.max_reasoning_tokens
    assert r["text"] == tok.decode(ids[a:], skip_special_tokens=True)
    if structured:
        assert out.finish_reason == "stop", (out.finish_reason, r["text"])
        jsonschema.validate(json.loads(r["text"]), SCHEMA)
    return kind


def test_every_budget_ends_with_a_valid_answer_and_a_clean_split(qwen3):
    eng, tok, rp, prompt = qwen3
    g = eng.grammar.compile(GrammarSpec.json_schema(SCHEMA))
    # admission: the minimum is the region's forced tokens and the answer's shortest output
    low = rp.fixed_tokens
    while True:
        try:
            eng.check_budget(g, SamplingParams(max_tokens=low, reasoning=rp))
            break
        except EngineError as e:
            assert e.field == "max_tokens" and f"max_tokens {low} " in str(e)
            low += 1
    assert low > rp.fixed_tokens + 5  # '{"name":"","age":0}' takes tokens
    with pytest.raises(EngineError, match=f"at least {low} tokens"):
        eng.add_request(None, prompt, SamplingParams(max_tokens=low - 1, reasoning=rp), g)
    rng = random.Random(0)
    end_id = rp.end_ids[0]
    params = []
    budgets = [low, low + 1, low + 2] + sorted(rng.randint(low, 400) for _ in range(56))
    for i, mt in enumerate(budgets):
        # a random model rarely chooses the marker: a bias makes some of them end by choice
        bias = {end_id: rng.choice([0.0, 4.0, 7.0])}
        cap = rng.choice([None, None, 0, rng.randint(1, 40)])
        params.append(SamplingParams(max_tokens=mt, temperature=1.0, seed=i, logit_bias=bias, speculative=False,
                                     reasoning=ReasoningParams(rp.end_text, rp.end_ids, rp.start_ids, rp.after_ids,
                                                               cap, rng.randint(0, 40))))
    # one long budget: the cap ends the reasoning, the schema's bounds the answer
    params.append(SamplingParams(max_tokens=4096, temperature=1.0, seed=99, speculative=False,
                                 reasoning=ReasoningParams(rp.end_text, rp.end_ids, rp.start_ids, rp.after_ids, 60)))
    results = _run(eng, [prompt] * len(params), params, [g] * len(params))
    kinds = [_check_split(tok, p.reasoning, r, p.max_tokens) for p, r in zip(params, results)]
    assert len(kinds) == 60 and {"cut", "model"} <= set(kinds), kinds
    for p, r in zip(params, results):
        if p.reasoning.max_reasoning_tokens == 0:
            assert r["reasoning"] == "" and r["last"].reasoning_cut
            assert r["token_ids"][:r["last"].num_reasoning_tokens] == list(rp.start_ids + rp.end_ids + rp.after_ids)
    assert results[0]["last"].reasoning_cut  # at the minimum the marker comes at once
    assert results[0]["last"].num_reasoning_tokens == rp.fixed_tokens
    assert eng.stats()["kv_blocks_free"] == eng.stats()["kv_blocks_total"]


def test_speculation_keeps_greedy_outputs_across_the_marker(qwen3):
    eng, tok, rp, prompt = qwen3
    g = eng.grammar.compile(GrammarSpec.json_schema(SCHEMA))
    end_id = rp.end_ids[0]

    def run(on: bool):
        eng.scheduler.enable_forced_tokens = on
        params = [SamplingParams(max_tokens=mt, temperature=0, logit_bias={end_id: bias},
                                 speculative=None if on else {"method": "off"},
                                 reasoning=ReasoningParams(rp.end_text, rp.end_ids, rp.start_ids, rp.after_ids, cap))
                  for mt, bias, cap in [(40, 0.0, None), (90, 0.0, None), (140, 0.0, 50), (120, 6.0, None),
                                        (150, 0.0, 0), (70, 0.0, 7)]]
        return params, _run(eng, [prompt] * len(params), params, [g] * len(params))

    params, off = run(False)
    _, on = run(True)
    assert [r["token_ids"] for r in on] == [r["token_ids"] for r in off]
    assert [(r["reasoning"], r["text"]) for r in on] == [(r["reasoning"], r["text"]) for r in off]
    assert sum(r["last"].num_accepted_tokens for r in on) > 0
    for p, r in zip(params, on):
        _check_split(tok, p.reasoning, r, p.max_tokens)


def test_free_answer_after_reasoning_and_stop_strings_on_the_answer_only(qwen3):
    eng, tok, rp, prompt = qwen3
    with pytest.raises(EngineError, match="max_tokens") as e:
        eng.check_budget(None, SamplingParams(max_tokens=rp.fixed_tokens - 1, reasoning=rp))
    assert e.value.field == "max_tokens"
    params = [SamplingParams(max_tokens=mt, temperature=0, reasoning=ReasoningParams(
        rp.end_text, rp.end_ids, rp.start_ids, rp.after_ids, cap, margin=10)) for mt, cap in [(60, None), (60, 5)]]
    results = _run(eng, [prompt] * 2, params, [None, None])
    for p, r in zip(params, results):
        _check_split(tok, p.reasoning, r, p.max_tokens, structured=False)
        assert r["last"].reasoning_cut and r["last"].finish_reason == "length"
    uncapped, capped = results
    assert len(uncapped["token_ids"]) - uncapped["last"].num_reasoning_tokens == 10  # the margin
    assert capped["last"].num_reasoning_tokens == rp.fixed_tokens + 5
    # a stop string found in the reasoning does not end the request; in the answer it does
    piece = uncapped["reasoning"][3:6]
    later = uncapped["text"][2:5]
    assert piece and later
    stop = [SamplingParams(max_tokens=60, temperature=0, stop=[s], reasoning=params[0].reasoning)
            for s in (piece, later)]
    in_reasoning, in_answer = _run(eng, [prompt] * 2, stop, [None, None])
    if piece not in uncapped["text"]:
        assert in_reasoning["token_ids"] == uncapped["token_ids"] and in_reasoning["reasoning"] == uncapped["reasoning"]
    assert in_answer["last"].finish_reason == "stop" and later not in in_answer["text"]
    assert in_answer["reasoning"] == uncapped["reasoning"]
    assert uncapped["text"].startswith(in_answer["text"])
