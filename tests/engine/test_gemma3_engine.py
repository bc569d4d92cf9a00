"""The engine invariant on a tiny Gemma 3 served from its GGUF (local layers with a window of 8
tokens, prompts up to 60): greedy outputs do not change when batching, prefix caching, chunked
prefill and preemption are switched on; a base model without a chat template refuses chat."""

from __future__ import annotations


import pytest

from stencil.engine.config import EngineConfig
from stencil.engine.llm_engine import LLMEngine
from stencil.engine.request import SamplingParams
from gguf_testing import smol_vocab, write_tiny_gguf
from test_engine import random_prompts


@pytest.fixture(scope="module")
def gemma_gguf(tmp_path_factory):
    from stencil.engine.models.default_model import fetch_gguf

    out = tmp_path_factory.mktemp("gemma3-engine") / "tiny-gemma3.gguf"
    # A base model: no chat template.
    return write_tiny_gguf(out, "gemma3", smol_vocab(fetch_gguf()), seed=3, chat_template=None,
                           quant={"ffn_down.weight": "Q8_0"})[0]


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(1, 8, 35, (3, 26), lambda i, shared: shared if i % 2 else [])


def test_gemma3_greedy_outputs_do_not_depend_on_batching_caching_chunking_preemption(gemma_gguf, prompts):
    params = [SamplingParams(max_tokens=8 + i % 4, temperature=0, ignore_eos=True) for i in range(len(prompts))]
    alone = LLMEngine(EngineConfig(model=gemma_gguf, enable_prefix_caching=False, num_kv_blocks=64,
                                   max_prefill_chunk=4096, max_num_batched_tokens=4096))
    alone.scheduler.enable_forced_tokens = False
    ref = [alone.generate([p], params[i])[0]["token_ids"] for i, p in enumerate(prompts)]
    eng = LLMEngine(EngineConfig(model=gemma_gguf, num_kv_blocks=10, max_num_seqs=8, max_prefill_chunk=13,
                                 max_num_batched_tokens=40))
    results = eng.generate(prompts, params)
    assert [r["token_ids"] for r in results] == ref
    st = eng.stats()
    assert st["num_preemptions"] > 0 and st["prefix_cache_hits"] > 0
    assert st["kv_blocks_free"] == st["kv_blocks_total"]
    assert st["kv_sliding_blocks_free"] == st["kv_sliding_blocks_total"] > 0  # the local layers' own pool


def test_gemma3_engine_limits_and_stops_come_from_the_gguf(gemma_gguf):
    from stencil.service.errors import InputError
    from stencil.service.prompts import render_messages

    eng = LLMEngine(EngineConfig(model=gemma_gguf, num_kv_blocks=32))
    assert eng.max_model_len == 256  # context_length: the window caps nothing
    assert eng.eos_token_id == 2 and eng.extra_stop_token_ids == frozenset({0})
    assert eng.grammar.vocab.eos_token_ids == (2, 0)
    with pytest.raises(InputError, match="no chat template") as info:
        render_messages(eng.tokenizer, [{"role": "user", "content": "hi"}])
    assert info.value.field == "messages" and info.value.status == 400
