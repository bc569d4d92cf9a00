"""The hybrid KV cache in the engine (``stencil.engine.kv_cache_manager``): Gemma 3's local layers hold only
their window, and no greedy output changes.

A tiny random Gemma 3 (five local layers of window 32, one global, as the released models
interleave them) reads prompts of up to ~400 tokens, so every request crosses the window many
times. Against a run that keeps every position of every layer (``hybrid_kv_cache=False``), one
request at a time without prefix caching, the hybrid engine gives the same tokens batched, in
prefill chunks, with prefix-cache hits and with preemption, through the torch layers and through
the C decoder; the window group holds a bounded number of blocks while the full group grows; both
pools are checked after every step and empty at the end. A model whose layers all have a window
keeps one group with a window.
"""

from __future__ import annotations

import random

import pytest

from stencil.engine.config import EngineConfig
from stencil.engine.llm_engine import LLMEngine
from stencil.engine.request import SamplingParams
from gguf_testing import KQUANT, smol_gguf_factory, write_tiny_gguf

WINDOW = 32


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    """``"dense"``: F32 weights (the torch layers); ``"kquant"``: a Q4_K_M-like mix (the C decoder)."""
    def write(folder, kind: str, vocab):
        extra = (dict(quant=KQUANT, hidden_size=256, intermediate_size=512, head_dim=64, query_pre_attn_scalar=64)
                 if kind == "kquant" else dict(quant={"ffn_down.weight": "Q8_0"}))
        return write_tiny_gguf(folder / f"gemma3-{kind}.gguf", "gemma3", vocab, seed=4, chat_template=None,
                               sliding_window=WINDOW, max_position_embeddings=1024, **extra)[0]

    return smol_gguf_factory(tmp_path_factory, "hybrid", write)


def long_prompts(n: int = 6, seed: int = 2) -> list[list[int]]:
    """Prompts of ~40 to ~400 tokens, every other one behind a shared 150-token prefix."""
    rng = random.Random(seed)
    shared = [rng.randrange(20, 49000) for _ in range(150)]
    return [(shared if i % 2 else []) + [rng.randrange(20, 49000) for _ in range(rng.randrange(40, 250))]
            for i in range(n)]


def reference(path, prompts, params) -> list[list[int]]:
    """Every position of every layer kept, one request at a time, no prefix caching."""
    eng = LLMEngine(EngineConfig(model=path, hybrid_kv_cache=False, enable_prefix_caching=False, num_kv_blocks=64,
                                 max_prefill_chunk=4096, max_num_batched_tokens=4096))
    assert len(eng.kv.groups) == 1 and "kv_sliding_blocks_total" not in eng.stats()
    eng.scheduler.enable_forced_tokens = False
    return [eng.generate([p], params[i])[0]["token_ids"] for i, p in enumerate(prompts)]


def watch(eng: LLMEngine) -> list[list[int]]:
    """Check both pools against the requests' tables after every step; return the blocks each
    group holds after each step."""
    held: list[list[int]] = []
    step = eng.step

    def checked_step():
        outs = step()
        eng.kv.check_invariants(eng.scheduler.running + list(eng.scheduler.waiting))
        held.append([total - free for total, free in eng.kv.group_blocks()])
        return outs

    eng.step = checked_step
    return held


@pytest.mark.parametrize("kind", ["dense", "kquant"])
def test_greedy_outputs_do_not_change_and_the_window_group_stays_bounded(kind, gemma):
    path = gemma(kind)
    prompts = long_prompts()
    params = [SamplingParams(max_tokens=10 + i % 4, temperature=0, ignore_eos=True) for i in range(len(prompts))]
    ref = reference(path, prompts, params)
    eng = LLMEngine(EngineConfig(model=path, num_kv_blocks=48, max_num_seqs=4, max_prefill_chunk=48,
                                 max_num_batched_tokens=96))
    assert eng.kernels["attention"] == "cpu"
    assert eng.runner.model.decoder_plan(eng.runner.kv_caches, eng.runner.backend) is not None or kind == "dense"
    full, window = eng.kv.groups
    # 4 requests x (2 blocks of a 32-token window + 2) + 96 tokens a step: 22 blocks, not 48.
    assert (full.num_blocks, full.window, window.num_blocks, window.window) == (48, None, 22, WINDOW)
    caches = eng.runner.kv_caches
    assert [k.shape[0] for k, _ in caches] == [23] * 5 + [48]  # the local layers' tensors: 22 + the null block
    held = watch(eng)
    assert [r["token_ids"] for r in eng.generate(prompts, params)] == ref
    st = eng.stats()
    assert st["num_preemptions"] > 0 and st["prefix_cache_hits"] > 0
    assert st["kv_blocks_free"] == st["kv_blocks_total"] == 48
    assert st["kv_sliding_blocks_free"] == st["kv_sliding_blocks_total"] == 22
    most = [max(h[g] for h in held) for g in (0, 1)]
    assert most[0] == 48 and most[1] <= 22 and most[1] < most[0]


def test_one_long_request_holds_a_window_in_the_local_layers(gemma):
    """A 600-token prompt read in 64-token chunks, then 40 decode steps: the full group holds every
    position, the window group at most the window and one chunk."""
    path = gemma("dense")
    rng = random.Random(5)
    prompt = [rng.randrange(20, 49000) for _ in range(600)]
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    cfg = dict(model=path, num_kv_blocks=64, max_prefill_chunk=64, max_num_batched_tokens=64, max_num_seqs=1)
    off = LLMEngine(EngineConfig(hybrid_kv_cache=False, **cfg))
    want = off.generate([prompt], params)[0]["token_ids"]
    eng = LLMEngine(EngineConfig(**cfg))
    held = watch(eng)
    assert eng.generate([prompt], params)[0]["token_ids"] == want
    # Prefill steps: a chunk of 64 tokens from position p holds keys p - 31 .. p + 63: at most
    # 2 + 1 + 4 blocks. Decode steps: the window and the block being filled: at most 3.
    prefill, decode = held[:600 // 64 + 1], held[600 // 64 + 1:]
    assert max(h[1] for h in prefill) <= 7 and max(h[1] for h in decode) <= 3
    assert held[-2][0] == -(-639 // 16) == 40  # the full group: every position (the last step frees all)
    assert held[-1] == [0, 0]
    # Memory: the local layers' tensors hold 1 + min(64, 1 x 4 + 4) = 9 blocks, not 64.
    assert eng.kv.groups[1].num_blocks == 8
    assert eng.runner.kv_cache_bytes < 0.3 * off.runner.kv_cache_bytes


def test_a_model_whose_layers_all_have_a_window_keeps_one_windowed_group(tiny_model_factory):
    """Every layer windowed (Mistral's layout): one group with a window and the null block; the
    outputs are those of the cache that keeps every position."""
    path = tiny_model_factory("llama", sliding_window=WINDOW)
    prompts = long_prompts(4, seed=3)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    ref = reference(path, prompts, [params] * len(prompts))
    eng = LLMEngine(EngineConfig(model=path, num_kv_blocks=40, max_num_seqs=4, max_prefill_chunk=48,
                                 max_num_batched_tokens=96))
    assert [(g.num_blocks, g.window) for g in eng.kv.groups] == [(40, WINDOW)]
    held = watch(eng)
    assert [r["token_ids"] for r in eng.generate(prompts, params)] == ref
    st = eng.stats()
    assert st["kv_blocks_free"] == st["kv_blocks_total"] == 40 and "kv_sliding_blocks_total" not in st
    # 4 prompts of ~40 to ~400 tokens never hold more than 4 windows and a step's tokens.
    assert max(h[0] for h in held) <= 4 * 4 + 6


def test_metrics_report_the_window_group(gemma):
    from stencil.service.metrics import Metrics

    eng = LLMEngine(EngineConfig(model=gemma("dense"), num_kv_blocks=48, max_num_seqs=4))

    class Client:  # what the collector reads of an EngineClient
        is_alive = True
        grammar_stats = None

        def stats(self):
            return eng.stats()

        def replica_health(self):
            return None  # one engine, no replicas

    text = Metrics(lambda: Client()).render()[0].decode()
    assert f"stencil_kv_sliding_blocks_total {float(eng.kv.groups[1].num_blocks)}" in text
    assert "stencil_kv_sliding_blocks_used 0.0" in text and "stencil_kv_blocks_total 48.0" in text
