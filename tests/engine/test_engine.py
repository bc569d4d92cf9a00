"""The engine invariant: greedy outputs do not change when batching, prefix caching, chunked
prefill, preemption, aborts of other requests or speculation are switched on (tiny model)."""

from __future__ import annotations

import random

import pytest
import torch

from stencil.engine.config import EngineConfig
from stencil.engine.llm_engine import EngineError, LLMEngine
from stencil.engine.request import SamplingParams
from stencil.engine.speculative.spec_config import SpecConfigError


def random_prompts(seed: int, count: int, shared_len: int, body_lens: tuple[int, int], prefix) -> list[list[int]]:
    """``count`` prompts of random token ids: ``prefix(i, shared)`` (a part of ``shared_len``
    random ids common to all, or none) then a body of a random length in ``range(*body_lens)``."""
    rng = random.Random(seed)
    shared = [rng.randrange(20, 49000) for _ in range(shared_len)]
    out = []
    for i in range(count):
        body = [rng.randrange(20, 49000) for _ in range(rng.randrange(*body_lens))]
        out.append(prefix(i, shared) + body)
    return out


@pytest.fixture(scope="module")
def prompts():
    out = random_prompts(0, 16, 40, (3, 50), lambda i, shared: (shared if i % 2 else shared[:17]) if i % 3 else [])
    # A prompt that repeats itself, so n-gram drafts get proposed and accepted.
    out.append([101, 202, 303, 404, 505] * 8)
    return out


@pytest.fixture(scope="module")
def reference(tiny_model_dir, prompts):
    """Each request alone, everything off."""
    eng = LLMEngine(EngineConfig(model=tiny_model_dir, enable_prefix_caching=False, num_kv_blocks=64,
                                 max_prefill_chunk=4096, max_num_batched_tokens=4096))
    eng.scheduler.enable_forced_tokens = False
    params = [SamplingParams(max_tokens=12 + i % 7, temperature=0, ignore_eos=True) for i in range(len(prompts))]
    return [eng.generate([p], params[i])[0]["token_ids"] for i, p in enumerate(prompts)], params


def test_batched_chunked_cached_preempted_equals_alone(tiny_model_dir, prompts, reference):
    ref, params = reference
    eng = LLMEngine(EngineConfig(model=tiny_model_dir, num_kv_blocks=24, max_num_seqs=8,
                                 max_prefill_chunk=16, max_num_batched_tokens=48))
    results = eng.generate(prompts, params)
    assert [r["token_ids"] for r in results] == ref
    assert all(r["finish_reason"] == "length" for r in results)
    st = eng.stats()
    assert st["num_preemptions"] > 0
    assert st["prefix_cache_hits"] > 0
    assert st["kv_blocks_free"] == st["kv_blocks_total"]


def test_second_pass_hits_prefix_cache_and_matches(tiny_model_dir, prompts, reference):
    ref, params = reference
    eng = LLMEngine(EngineConfig(model=tiny_model_dir, num_kv_blocks=512))
    first = eng.generate(prompts, params)
    hits_before = eng.kv.prefix_hits
    second = eng.generate(prompts, params)
    assert [r["token_ids"] for r in first] == ref
    assert [r["token_ids"] for r in second] == ref
    # Every full block of every prompt (but the last token's) was cached by the first pass.
    expected_hits = sum(((len(p) - 1) // 16) * 16 for p in prompts)
    assert eng.kv.prefix_hits - hits_before == expected_hits


def flat_cost(shape) -> float:
    """Every decode step costs the same, drafts or not (rows are free): drafting never loses,
    so whether drafts ride does not hang on this machine's speed (``LLMEngine(cost_model=)``)."""
    return 10.0


def test_speculation_keeps_greedy_outputs(tiny_model_dir, prompts, reference):
    ref, params = reference
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
            "max_batch_size": 64, "min_acceptance": 0.0}
    eng = LLMEngine(EngineConfig(model=tiny_model_dir, num_kv_blocks=64, speculative=spec,
                                 max_prefill_chunk=16, max_num_batched_tokens=64), cost_model=flat_cost)
    results = eng.generate(prompts, params)
    assert [r["token_ids"] for r in results] == ref
    drafted = sum(r["output"].num_draft_tokens for r in results)
    accepted = sum(r["output"].num_accepted_tokens for r in results)
    assert drafted > 0 and accepted > 0
    assert eng.stats()["kv_blocks_free"] == eng.stats()["kv_blocks_total"]


def test_aborts_do_not_disturb_others(tiny_model_dir, prompts, reference):
    ref, params = reference
    eng = LLMEngine(EngineConfig(model=tiny_model_dir, num_kv_blocks=40, max_num_batched_tokens=64))
    ids = [eng.add_request(f"r{i}", p, params[i]) for i, p in enumerate(prompts)]
    extra = [eng.add_request(f"x{i}", p, SamplingParams(max_tokens=50, temperature=0, ignore_eos=True))
             for i, p in enumerate(prompts[:6])]
    tokens = {rid: [] for rid in ids + extra}
    finished = {}
    step = 0
    while eng.has_unfinished():
        if step == 3:
            for rid in extra:
                assert eng.abort(rid)
        for out in eng.step():
            tokens[out.request_id].extend(out.new_token_ids)
            if out.finished:
                finished[out.request_id] = out.finish_reason
        step += 1
    assert [tokens[r] for r in ids] == ref
    assert all(finished[r] == "abort" for r in extra)
    assert eng.kv.num_free_blocks == eng.kv.num_blocks


def test_stop_strings_and_eos(tiny_model_dir, prompts, reference):
    ref, params = reference
    eng = LLMEngine(EngineConfig(model=tiny_model_dir, num_kv_blocks=64))
    full = eng.generate([prompts[0]], params[0])[0]
    text = full["text"]
    assert len(text) > 4
    stop = text[2:4]
    r = eng.generate([prompts[0]], SamplingParams(max_tokens=params[0].max_tokens, temperature=0,
                                                   ignore_eos=True, stop=[stop]))[0]
    assert r["finish_reason"] == "stop"
    assert r["text"] == text[:text.find(stop)]
    # EOS: make a later reference token the engine's EOS id; output must end right there.
    j = next(i for i in range(1, len(ref[0])) if ref[0][i] not in ref[0][:i])
    eng.eos_token_id = ref[0][j]
    r = eng.generate([prompts[0]], SamplingParams(max_tokens=20, temperature=0))[0]
    assert r["finish_reason"] == "stop"
    assert r["token_ids"] == ref[0][:j + 1]


def test_seeded_sampling_is_reproducible_and_batch_independent(tiny_model_dir, prompts):
    eng = LLMEngine(EngineConfig(model=tiny_model_dir, num_kv_blocks=128))
    p = SamplingParams(max_tokens=10, temperature=1.0, top_p=0.9, top_k=50, seed=1234, ignore_eos=True)
    alone = eng.generate([prompts[1]], p)[0]["token_ids"]
    together = eng.generate(prompts[:5], p)[1]["token_ids"]
    assert alone == together
    other = eng.generate([prompts[1]], SamplingParams(max_tokens=10, temperature=1.0, seed=99, ignore_eos=True))
    assert other[0]["token_ids"] != alone


def test_bad_requests_are_refused_with_named_fields(tiny_model_dir):
    eng = LLMEngine(EngineConfig(model=tiny_model_dir, num_kv_blocks=16, max_model_len=64))
    with pytest.raises(EngineError, match="empty"):
        eng.add_request(None, [], SamplingParams())
    with pytest.raises(EngineError, match="max_model_len 64"):
        eng.add_request(None, [5] * 64, SamplingParams())
    with pytest.raises(EngineError, match="max_tokens"):
        eng.add_request(None, [5, 6], SamplingParams(max_tokens=0))
    with pytest.raises(EngineError, match="top_p"):
        eng.add_request(None, [5, 6], SamplingParams(top_p=0))
    with pytest.raises(SpecConfigError, match="speculative"):  # parsed when the params are made
        SamplingParams(speculative={"method": "medusa"})
    # Output stops at max_model_len.
    r = eng.generate([[5] * 60], SamplingParams(max_tokens=100, temperature=0, ignore_eos=True))[0]
    assert r["finish_reason"] == "length" and len(r["token_ids"]) == 4


CONSTRAINED_SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12}, "age": {"type": "integer", "minimum": 0, "maximum": 99},
    "tags": {"type": "array", "items": {"enum": ["a", "bb", "ccc"]}, "maxItems": 3},
    "ok": {"type": "boolean"}}, "required": ["name", "age", "tags", "ok"]}
TREE_SCHEMA = {"$defs": {"node": {"type": "object", "properties": {
    "v": {"type": "integer", "minimum": 0, "maximum": 9},
    "kids": {"type": "array", "items": {"$ref": "#/$defs/node"}, "maxItems": 2}}, "required": ["v", "kids"]}},
    "$ref": "#/$defs/node"}
ARITH = 'start: expr\nexpr: term (("+" | "-") term)*\nterm: NUM | "(" expr ")"\nNUM: /[0-9]{1,3}/\n'


def _constrained_specs(backend: str):
    from stencil.grammar.base import GrammarSpec

    specs = [GrammarSpec.json_schema(CONSTRAINED_SCHEMA), GrammarSpec("regex", r"(ab|cd){2,4}-[0-9]{3}"),
             GrammarSpec("choice", '["alpha", "beta", "gamma delta"]')]
    if backend == "lazy":  # grammars only the lazy backend serves: exact recursion, Lark
        specs += [GrammarSpec.json_schema(TREE_SCHEMA), GrammarSpec.grammar(ARITH)]
    return specs


@pytest.mark.parametrize("backend", ["eager", "lazy"])
def test_constrained_speculation_and_forcing_keep_greedy_outputs(tiny_model_dir, prompts, backend):
    """Grammar drafts + n-gram drafts + forced tokens vs all off, on constrained requests, on each
    grammar backend."""
    eng = LLMEngine(EngineConfig(model=tiny_model_dir, num_kv_blocks=128, grammar_backend=backend),
                    cost_model=flat_cost)
    specs = _constrained_specs(backend)
    grammars = [eng.grammar.compile(specs[i % len(specs)]) for i in range(len(prompts))]
    spec = {"method": "ngram", "num_speculative_tokens": 6, "max_batch_size": 64, "min_acceptance": 0.0}

    def run(on: bool):
        eng.scheduler.enable_forced_tokens = on
        params = SamplingParams(max_tokens=60, temperature=0, speculative=spec if on else {"method": "off"})
        return eng.generate(prompts, params, grammars)

    behind_forced = []  # steps where drafts ride behind a request's pending grammar-forced tokens
    schedule = eng.scheduler.schedule

    def recorded():
        out = schedule()
        behind_forced.extend(sr for sr in out.scheduled if sr.num_drafts and sr.num_new_tokens > sr.num_drafts + 1)
        return out

    eng.scheduler.schedule = recorded
    off, on = run(False), run(True)
    assert behind_forced
    assert [r["token_ids"] for r in on] == [r["token_ids"] for r in off]
    assert [r["text"] for r in on] == [r["text"] for r in off]
    assert sum(r["output"].num_accepted_tokens for r in on) > 0
    assert sum(r["output"].num_steps for r in on) < sum(r["output"].num_steps for r in off)
    for r, g in zip(on, grammars):
        if r["finish_reason"] == "stop" and g.program.regular:
            import re
            assert re.fullmatch(g.program.regex(), r["text"], flags=re.DOTALL), r["text"]
        if r["finish_reason"] == "stop":  # every output replays through a fresh matcher
            m = g.matcher()
            assert m.accept_tokens(r["token_ids"]) and (m.is_terminated() or m.is_accepting())


def test_greedy_outputs_are_the_same_on_either_backend(tiny_model_dir, prompts):
    """The same programs on outlines-core's index and on llguidance: the same masks, so the same
    greedy outputs, batched and with speculation."""
    outs = {}
    for backend in ("eager", "lazy"):
        eng = LLMEngine(EngineConfig(model=tiny_model_dir, num_kv_blocks=128, grammar_backend=backend),
                        cost_model=flat_cost)
        specs = _constrained_specs("eager")
        grammars = [eng.grammar.compile(specs[i % len(specs)]) for i in range(len(prompts))]
        assert all(g.backend == backend for g in grammars)
        params = SamplingParams(max_tokens=40, temperature=0, speculative={"method": "ngram", "max_batch_size": 64})
        outs[backend] = [r["token_ids"] for r in eng.generate(prompts, params, grammars)]
        eng.grammar.close()
    assert outs["eager"] == outs["lazy"]


def test_a_request_prefills_while_its_grammar_compiles(tiny_model_dir, prompts):
    """A request whose grammar is still compiling reads all but its last prompt token while others
    decode, holds no matcher meanwhile, and samples once the compile ends; its output is the one
    it gets with the grammar compiled first."""
    from concurrent.futures import Future

    from stencil.engine.request import RequestStatus
    from stencil.grammar.base import GrammarSpec

    eng = LLMEngine(EngineConfig(model=tiny_model_dir, num_kv_blocks=64, max_prefill_chunk=8))
    compiled = eng.grammar.compile(GrammarSpec("regex", "(yes|no)( indeed)?"))
    params = SamplingParams(max_tokens=5, temperature=0)
    first = eng.generate([prompts[3]], params, [compiled])[0]["token_ids"]
    eng = LLMEngine(EngineConfig(model=tiny_model_dir, num_kv_blocks=64, max_prefill_chunk=8,
                                 enable_prefix_caching=False))
    pending: Future = Future()
    for i in range(3):
        eng.add_request(f"d{i}", prompts[i], SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))
    eng.add_request("slow", prompts[3], params, pending)
    slow = eng.scheduler.requests["slow"]
    assert slow.matcher is None and slow.status == RequestStatus.WAITING_FOR_GRAMMAR
    produced = {f"d{i}": 0 for i in range(3)}
    for _ in range(16):
        for out in eng.step():
            assert out.request_id != "slow"
            produced[out.request_id] += len(out.new_token_ids)
    assert all(n >= 5 for n in produced.values()), produced
    # Prefilled in chunks of 8 up to the last prompt token, then it waits: no matcher yet.
    assert slow.status == RequestStatus.RUNNING and slow.num_computed_tokens == len(prompts[3]) - 1
    assert slow.matcher is None and slow.num_output_tokens == 0
    pending.set_result(compiled)  # the compile finishes: the last prompt token and the sample follow
    slow_ids = []
    while eng.has_unfinished():
        for out in eng.step():
            if out.request_id == "slow":
                slow_ids += out.new_token_ids
    assert slow_ids == first and eng.tokenizer.decode(slow_ids).startswith(("yes", "no"))
    assert eng.kv.num_free_blocks == eng.kv.num_blocks


def test_a_failed_or_aborted_compile_frees_every_block(tiny_model_dir, prompts):
    """A compile that fails ends that request alone, with the compiler's message; one aborted
    while compiling (after its prefill began) frees its blocks at once."""
    from concurrent.futures import Future

    eng = LLMEngine(EngineConfig(model=tiny_model_dir, num_kv_blocks=64, max_prefill_chunk=4))
    failing: Future = Future()
    eng.add_request("bad", prompts[4], SamplingParams(max_tokens=5), failing)
    eng.add_request("ok", prompts[5], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    eng.step()
    assert eng.scheduler.requests["bad"].num_computed_tokens > 0  # it began to prefill
    failing.set_exception(ValueError("schema keyword 'foo' is not supported"))
    outs = {}
    while eng.has_unfinished():
        for out in eng.step():
            outs.setdefault(out.request_id, []).append(out)
    assert outs["bad"][-1].finish_reason == "error" and "foo" in outs["bad"][-1].error
    assert outs["ok"][-1].finish_reason == "length"
    assert eng.kv.num_free_blocks == eng.kv.num_blocks
    never: Future = Future()
    eng.add_request("gone", prompts[2], SamplingParams(max_tokens=5), never)
    eng.step()
    assert eng.kv.num_free_blocks < eng.kv.num_blocks
    eng.abort("gone")
    out = eng.step()
    assert [o.finish_reason for o in out if o.request_id == "gone"] == ["abort"]
    assert eng.kv.num_free_blocks == eng.kv.num_blocks and not eng.has_unfinished()
    cancelled: Future = Future()
    eng.add_request("cancelled", prompts[2], SamplingParams(max_tokens=5), cancelled)
    cancelled.cancel()
    assert [o.finish_reason for o in eng.step() if o.request_id == "cancelled"] == ["error"]


def test_bf16_kv_cache_keeps_the_invariant_at_half_the_bytes(tiny_model_dir, prompts):
    """kv_cache_dtype bfloat16: K/V rounded once as they are stored, so batching, chunking,
    prefix caching, preemption and speculation still leave greedy outputs unchanged."""
    params = [SamplingParams(max_tokens=10, temperature=0, ignore_eos=True) for _ in prompts]
    alone_eng = LLMEngine(EngineConfig(model=tiny_model_dir, kv_cache_dtype="bfloat16", enable_prefix_caching=False,
                                       num_kv_blocks=64, max_prefill_chunk=4096, max_num_batched_tokens=4096))
    alone_eng.scheduler.enable_forced_tokens = False
    alone = [alone_eng.generate([p], params[i])[0]["token_ids"] for i, p in enumerate(prompts)]
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
            "max_batch_size": 64, "min_acceptance": 0.0}
    eng = LLMEngine(EngineConfig(model=tiny_model_dir, kv_cache_dtype="bfloat16", num_kv_blocks=24, max_num_seqs=8,
                                 max_prefill_chunk=16, max_num_batched_tokens=48, speculative=spec))
    assert all(c.dtype == torch.bfloat16 for pair in eng.runner.kv_caches for c in pair)
    fp32 = LLMEngine(EngineConfig(model=tiny_model_dir, kv_cache_dtype="float32", num_kv_blocks=24))
    assert eng.runner.bytes_per_block * 2 == fp32.runner.bytes_per_block
    results = eng.generate(prompts, params)
    assert [r["token_ids"] for r in results] == alone
    assert eng.stats()["num_preemptions"] > 0 and eng.stats()["kv_blocks_free"] == eng.stats()["kv_blocks_total"]


def test_a_request_longer_than_the_kv_cache_is_capped_not_left_to_preempt_itself(tiny_model_dir):
    """A KV cache smaller than the context caps ``max_model_len`` (one request must fit it whole):
    an answer that would outgrow the cache ends at its room with ``length``, and a prompt past it
    is refused naming the KV cache, where it used to preempt itself forever."""
    eng = LLMEngine(EngineConfig(model=tiny_model_dir, num_kv_blocks=4, max_model_len=512, speculative=None))
    assert eng.kv_bound and eng.max_model_len == 4 * 16
    r = eng.generate([[5] * 40], SamplingParams(max_tokens=100, temperature=0, ignore_eos=True))[0]
    assert r["finish_reason"] == "length" and len(r["token_ids"]) == 64 - 40
    st = eng.stats()
    assert st["num_preemptions"] == 0 and st["kv_blocks_free"] == st["kv_blocks_total"]
    with pytest.raises(EngineError, match="does not fit in the KV cache") as e:
        eng.add_request(None, [5] * 64, SamplingParams(max_tokens=1))
    assert e.value.field == "prompt"
    roomy = LLMEngine(EngineConfig(model=tiny_model_dir, num_kv_blocks=64, max_model_len=512, speculative=None))
    assert not roomy.kv_bound and roomy.max_model_len == 512
