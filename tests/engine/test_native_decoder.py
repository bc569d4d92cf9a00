"""The C decoder (``kernels/csrc/decoder.c``, ``stencil.engine.models.native_decoder``) gives every row
the bits of the torch-driven layers it replaces, on every architecture and weight kind it takes:
a greedy output cannot depend on which of the two ran.

Tiny random GGUF models (hidden 256: whole k-quant super-blocks) in two weight mixes: the
k-quant mix of a Q4_K_M file (Q4_K, Q5_0, Q5_K, Q6_K; the GGUF block kernel) and Q4_1 / Q8_0
(the VNNI int4 kernel; a fused layer mixing Q4_1 and Q8_0 takes the bf16 int4 kernel, which the C
decoder does not run). Each step runs on two identical caches, once through the C decoder and
once through the torch layers, and the logits must be equal bit for bit: prefill chunks, two
sequences in one flat batch, decode rows, Gemma's sliding window (8 tokens) passed, and bf16 and
fp16 caches.
"""

from __future__ import annotations

import random

import pytest
import torch

from stencil.engine.models import registry
from stencil.engine.models.loader import load_model
from stencil.engine.models.native_decoder import DecoderPlan
from gguf_testing import smol_vocab, write_tiny_gguf
from stencil.kernels import decoder, ggml_blocks, native
from stencil.kernels.cpu import CpuAttentionBackend
from test_model_forward import PagedBatch

KQUANT = {"attn_q.weight": "Q4_K", "attn_k.weight": "Q5_0", "attn_v.weight": "Q6_K", "attn_output.weight": "Q5_K",
          "ffn_gate.weight": "Q4_K", "ffn_up.weight": "Q5_0", "ffn_down.weight": "Q6_K",
          "token_embd.weight": "Q8_0", "output.weight": "Q6_K"}
INT4 = {"attn_q.weight": "Q4_1", "attn_k.weight": "Q4_1", "attn_v.weight": "Q4_1", "attn_output.weight": "Q4_1",
        "ffn_gate.weight": "Q4_1", "ffn_up.weight": "Q4_1", "ffn_down.weight": "Q8_0",
        "token_embd.weight": "Q8_0", "output.weight": "Q8_0"}
MIXES = {"kquant": KQUANT, "int4": INT4}
SIZES = dict(hidden_size=256, intermediate_size=512)
WIDE_HEADS = dict(head_dim=64)  # q and attention output 4 x 64 = 256 wide (k-quant rows)

pytestmark = pytest.mark.skipif(decoder.library() is None or not ggml_blocks.available(),
                                reason="the C decoder or the GGUF block kernel does not build here")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from stencil.engine.models.default_model import fetch_gguf

    vocab = smol_vocab(fetch_gguf())
    cache = {}

    def factory(arch: str, mix: str):
        if (arch, mix) not in cache:
            extra = dict(WIDE_HEADS, query_pre_attn_scalar=64) if arch == "gemma3" else (
                WIDE_HEADS if arch == "qwen3" else {})
            out = tmp_path_factory.mktemp(f"nd-{arch}-{mix}") / f"{arch}-{mix}.gguf"
            cache[arch, mix] = write_tiny_gguf(out, arch, vocab, seed=11, quant=MIXES[mix], **SIZES, **extra)[0]
        return cache[arch, mix]

    return factory


def _step(batch: PagedBatch, work, c_decoder: bool, monkeypatch) -> torch.Tensor:
    """One step of ``batch`` through the C decoder or the torch layers (asserting which ran)."""
    model = batch.model
    if c_decoder:
        monkeypatch.delenv("STENCIL_DECODER", raising=False)
    else:
        monkeypatch.setenv("STENCIL_DECODER", "0")
    model.drop_decoder_plan()
    logits = batch.step(work)
    plan = model.decoder_plan(batch.caches, batch.backend)
    assert (plan is not None) == c_decoder, DecoderPlan.last_refusal
    return logits


def _steps(vocab: int, seed: int):
    """Prefill chunks of two sequences in one batch, then decode rows of both (tokens fixed by
    ``seed``, not by either run's outputs, so both runs see the same steps)."""
    rng = random.Random(seed)
    a = [rng.randrange(vocab) for _ in range(30)]
    b = [rng.randrange(vocab) for _ in range(21)]
    steps = [[(0, a[:13])], [(0, a[13:]), (1, b[:9])], [(1, b[9:]), (0, [rng.randrange(vocab)])]]
    steps += [[(0, [rng.randrange(vocab)]), (1, [rng.randrange(vocab)])] for _ in range(4)]
    return steps


@pytest.mark.parametrize("arch", registry.names())  # every architecture served
@pytest.mark.parametrize("mix", ["kquant", "int4"])
def test_c_decoder_gives_the_bits_of_the_torch_layers(arch, mix, tiny, monkeypatch):
    if mix == "int4" and not native.vnni_available():
        pytest.skip("the VNNI int4 kernel does not run here")
    model, _ = load_model(tiny(arch, mix), weights="auto")
    backend = CpuAttentionBackend()
    on, off = PagedBatch(model, seed=3, backend=backend), PagedBatch(model, seed=3, backend=backend)
    for batch in (on, off):
        batch.add(), batch.add()
    for work in _steps(model.vocab_size, seed=7):
        ours = _step(on, work, True, monkeypatch)
        want = _step(off, work, False, monkeypatch)
        assert torch.isfinite(ours).all()
        assert torch.equal(ours, want), (arch, mix, work)
    for (k1, v1), (k2, v2) in zip(on.caches, off.caches):  # the same cache writes
        assert torch.equal(k1, k2) and torch.equal(v1, v2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_c_decoder_with_a_half_cache(dtype, tiny, monkeypatch):
    model, _ = load_model(tiny("gemma3", "kquant"), weights="auto")
    backend = CpuAttentionBackend()
    on, off = (PagedBatch(model, seed=4, backend=backend, kv_dtype=dtype) for _ in range(2))
    for batch in (on, off):
        batch.add(), batch.add()
    for work in _steps(model.vocab_size, seed=8):
        assert torch.equal(_step(on, work, True, monkeypatch), _step(off, work, False, monkeypatch))


def test_models_the_c_decoder_does_not_take_keep_the_torch_layers(tiny, monkeypatch):
    model, _ = load_model(tiny("llama", "kquant"), weights="auto")
    batch = PagedBatch(model, seed=3)  # the torch attention backend
    assert model.decoder_plan(batch.caches, batch.backend) is None
    assert "attention backend 'torch'" in DecoderPlan.last_refusal
    dense, _ = load_model(tiny("llama", "kquant"), weights="fp32")
    backend = CpuAttentionBackend()
    batch = PagedBatch(dense, seed=3, backend=backend)
    logits = batch.step([(batch.add(), [5, 6, 7])])
    assert torch.isfinite(logits).all()
    assert dense.decoder_plan(batch.caches, backend) is None
    assert DecoderPlan.last_refusal.startswith("layers.0.qkv is a DenseLinear")
    monkeypatch.setenv("STENCIL_DECODER", "0")
    model.drop_decoder_plan()
    assert model.decoder_plan(PagedBatch(model, backend=backend).caches, backend) is None
    assert DecoderPlan.last_refusal == "STENCIL_DECODER=0"


def test_bench_overhead_runs_each_level_with_both_decoders(tiny, tmp_path):
    """``stencil bench overhead --decoder both``: the same engine steps through the C decoder,
    then through the torch layers, and says which ran (the ratio is a timing: not asserted)."""
    import argparse
    import json

    from stencil.benchmarks import overhead

    parser = argparse.ArgumentParser()
    overhead.add_arguments(parser)
    out = tmp_path / "overhead.json"
    args = parser.parse_args(["--model", str(tiny("llama", "kquant")), "--running", "2", "--steps", "2",
                              "--warmup", "1", "--constrained", "0", "--sampled", "0", "--decoder", "both",
                              "--json", str(out)])
    assert overhead.main(args) == 0
    level = json.loads(out.read_text())["levels"][0]
    assert level["c_decoder"] is True and level["torch_layers"]["c_decoder"] is False
    assert level["steps"] == level["torch_layers"]["steps"] == 2
    assert level["step_ratio_c_over_torch"] > 0
