"""Models served straight from GGUF files: each architecture on a tiny random model written as
GGUF against transformers' forward on the same dequantized weights; the metadata reader, the
tokenizer conversion and its cache, end-of-turn tokens, and the errors for what is not served.

Bound: fp32 on both sides, ``max|ours - ref| / max|ref| <= 1e-4`` at every position (as
``test_model_forward``), and greedy tokens identical over a prompt longer than Gemma's tiny
window and 16 decode steps.
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch

from stencil.engine.models import registry
from stencil.engine.models.gguf_config import UnsupportedModelError, read_gguf_info
from stencil.engine.models.gguf_file import GgufFile
from stencil.engine.models.loader import check_model, load_model
from stencil.engine.models.source import ModelPathError, resolve_model_path
from gguf_testing import smol_vocab, write_tiny_gguf
from test_model_forward import PagedBatch, assert_close_rel, hf_logits, random_prompt

QUANT = {"attn_v.weight": "Q8_0", "ffn_down.weight": "Q8_0", "ffn_gate.weight": "Q4_0", "ffn_up.weight": "Q4_0",
         "token_embd.weight": "F16"}


@pytest.fixture(scope="session")
def vocab():
    from stencil.engine.models.default_model import fetch_gguf

    return smol_vocab(fetch_gguf())


@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory, vocab):
    """``factory(arch, **kw) -> (path, transformers model)``, each built once."""
    cache = {}

    def factory(arch: str, **kw):
        key = (arch, tuple(sorted(kw.items(), key=str)))
        if key not in cache:
            out = tmp_path_factory.mktemp(f"gguf-{arch}") / f"tiny-{arch}.gguf"
            cache[key] = write_tiny_gguf(out, arch, vocab, quant=QUANT, **kw)
        return cache[key]

    return factory


@pytest.mark.parametrize("arch", registry.names())  # every architecture served
def test_gguf_model_matches_transformers_over_prefill_chunks_and_greedy_decode(arch, tiny_gguf):
    path, ref = tiny_gguf(arch)
    ours, info = load_model(path, weights="fp32")
    assert info.architecture == arch and ours.spec.num_layers == ref.config.num_hidden_layers
    batch = PagedBatch(ours, num_blocks=64, seed=len(arch))
    prompt = random_prompt(40, 7, ours.vocab_size)  # 5x the tiny Gemma's window of 8
    seq = batch.add()
    # chunked prefill (17 + 23 tokens, not block aligned), then 16 greedy steps
    logits = torch.cat([batch.step([(seq, prompt[:17])]), batch.step([(seq, prompt[17:])])])
    assert_close_rel(logits, hf_logits(ref, prompt))
    for _ in range(16):
        nxt = int(logits[-1].argmax())
        ref_logits = hf_logits(ref, batch.tokens[seq] + [nxt])
        assert nxt == int(hf_logits(ref, batch.tokens[seq])[-1].argmax())
        logits = batch.step([(seq, [nxt])])
        assert_close_rel(logits, ref_logits[-1:])
    # the window matters: attending to every position would give other logits
    if arch == "gemma3":
        for layer in ours.layers:
            layer.attn.window = None
        full = PagedBatch(ours, num_blocks=64)
        s = full.add()
        assert float((full.step([(s, prompt)]) - hf_logits(ref, prompt)).abs().max()) > 1e-2


def test_quantized_layers_from_the_gguf_follow_the_kernel_rule_and_stay_close(tiny_gguf):
    """With quantized weights, a projection with a quantized part is a quantized layer (int4 planes
    where the AVX512 int4 kernels build and every part is Q4_0/Q4_1/Q8_0, else the blocks as they
    are), a float one stays dense; an F16 embedding is no quantized type: dense, and the tied head
    shares its matrix."""
    from stencil.engine.models.kernel_policy import layer_kind
    from stencil.engine.models.llama import DenseLinear

    path, ref = tiny_gguf("llama")
    ours, _ = load_model(path, weights="int4")
    kind = {"int4": "Int4Linear", "blocks": "QuantLinear", "dense": "DenseLinear"}
    kinds = {name: type(m).__name__ for name, m in ours.linear_layers()}
    assert kinds["layers.0.mlp.gate_up_proj"] == kind[layer_kind(["Q4_0", "Q4_0"])]
    assert kinds["layers.0.mlp.down_proj"] == kind[layer_kind(["Q8_0"])]
    assert kinds["layers.0.attn.qkv_proj"] == kind[layer_kind(["F32", "F32", "Q8_0"])] == "QuantLinear"
    assert kinds["layers.0.attn.o_proj"] == "DenseLinear"  # F32
    assert isinstance(ours.lm_head, DenseLinear) and ours.lm_head.weight is ours.embed_tokens.weight
    prompt = random_prompt(30, 3, ours.vocab_size)
    batch = PagedBatch(ours)
    got, want = batch.step([(batch.add(), prompt)]), hf_logits(ref, prompt)
    # bf16 activations (int4_gemm.c), or one int8 term per activation (the block kernel's default):
    # both round each input to about 2^-8 of its group's scale
    assert float((got - want).abs().max() / want.abs().max()) < 6e-2


def test_metadata_gives_the_spec_transformers_has(tiny_gguf):
    path, ref = tiny_gguf("gemma3")
    info = read_gguf_info(path)
    spec, cfg = info.spec, ref.config
    assert (spec.hidden_size, spec.num_layers, spec.num_heads, spec.num_kv_heads, spec.head_dim) == (
        cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim)
    assert spec.layer_types == tuple(cfg.layer_types) and spec.sliding_window == 8
    assert spec.rope.theta == 1e6 and spec.local_rope.theta == 1e4 and spec.query_pre_attn_scalar == 32
    assert info.chat_template is not None and info.bos_token_id == 1 and info.eos_token_id == 2
    # EOS first, then SmolLM2's other control token that ends a generation (<|endoftext|>, id 0)
    assert info.stop_token_ids == (2, 0)
    qwen2 = read_gguf_info(tiny_gguf("qwen2")[0]).spec
    assert qwen2.qkv_bias and not qwen2.o_bias and not qwen2.tie_word_embeddings
    assert read_gguf_info(tiny_gguf("qwen3")[0]).spec.qk_norm


def test_fast_reader_agrees_with_gguf_reader(tiny_gguf):
    from gguf import GGUFReader

    path, _ = tiny_gguf("qwen2")
    ours, theirs = GgufFile(path), GGUFReader(str(path))
    assert list(ours.tensors) == [t.name for t in theirs.tensors]
    assert ours.header_bytes == theirs.data_offset
    for t in theirs.tensors:
        mine = ours.tensors[t.name]
        assert mine.tensor_type == t.tensor_type and np.array_equal(mine.shape, t.shape)
        assert mine.data.dtype == t.data.dtype and np.array_equal(mine.data, t.data), t.name
    for key, field in theirs.fields.items():
        if not key.startswith("GGUF."):
            value = field.contents()
            assert (np.array_equal(ours.metadata[key], value) if isinstance(value, list) and value
                    and not isinstance(value[0], str) else ours.metadata[key] == pytest.approx(value)), key


def test_tokenizer_is_transformers_conversion_and_is_cached(tiny_gguf, tmp_path, monkeypatch):
    from transformers import AutoTokenizer

    from stencil.engine.models import tokenizer as tokmod

    monkeypatch.setenv("STENCIL_CACHE_DIR", str(tmp_path))
    path, _ = tiny_gguf("llama")
    calls = []
    real = tokmod.convert_gguf_tokenizer
    monkeypatch.setattr(tokmod, "convert_gguf_tokenizer", lambda p: calls.append(p) or real(p))
    first = tokmod.load_tokenizer(path)
    second = tokmod.load_tokenizer(path.parent)  # a directory holding one .gguf
    assert len(calls) == 1 and tokmod.tokenizer_cache_dir(GgufFile(path)).is_dir()
    reference = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    texts = ["Hello world", "  two spaces\n\nnewlines\ttab", '{"name": "Maria López", "age": 34}',
             "<|im_start|>user\nhi<|im_end|>", "naïve café 東京 🚀 1234567"]
    for text in texts:
        assert first.encode(text) == second.encode(text) == reference.encode(text)
    assert first.eos_token_id == reference.eos_token_id == 2
    msgs = [{"role": "user", "content": "hi"}]
    assert first.apply_chat_template(msgs, tokenize=False) == reference.apply_chat_template(msgs, tokenize=False)


def test_paths_resolve_or_fail_in_one_line(tiny_gguf, tmp_path, default_model_dir):
    path, _ = tiny_gguf("llama")
    assert resolve_model_path(path).kind == "gguf" and resolve_model_path(path.parent).path == path.resolve()
    assert resolve_model_path(path).name == "tiny-llama"
    assert resolve_model_path(default_model_dir).kind == "hf"  # config.json wins over a GGUF beside it
    with pytest.raises(ModelPathError, match="no such file"):
        resolve_model_path(tmp_path / "missing.gguf")
    with pytest.raises(ModelPathError, match="neither config.json"):
        resolve_model_path(tmp_path)
    (tmp_path / "a.gguf").write_bytes(b"GGUF")
    (tmp_path / "b.gguf").write_bytes(b"GGUF")
    with pytest.raises(ModelPathError, match=r"2 \.gguf files \(a\.gguf, b\.gguf\); name one"):
        resolve_model_path(tmp_path)
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(ModelPathError, match="not a .gguf"):
        resolve_model_path(tmp_path / "notes.txt")


def test_a_gguf_model_keeps_a_float16_kv_cache_by_default_on_cpu(tiny_gguf, default_model_dir):
    """kv_cache_dtype "auto": float16 for a GGUF file or a directory of one on CPU (llama.cpp's
    cache for the same file), the activations' dtype for an HF directory; a stated dtype wins."""
    from stencil.engine.config import EngineConfig

    path, _ = tiny_gguf("llama")
    assert EngineConfig(model=path).validate().kv_cache_dtype == "float16"
    assert EngineConfig(model=path.parent).validate().kv_cache_dtype == "float16"
    assert EngineConfig(model=default_model_dir).validate().kv_cache_dtype == "float32"
    assert EngineConfig(model=path, kv_cache_dtype="float32").validate().kv_cache_dtype == "float32"
    assert EngineConfig(model=path, device="cuda").validate().kv_cache_dtype == "bfloat16"
    assert EngineConfig(model=path.parent / "missing.gguf").validate().kv_cache_dtype == "float32"


def test_unsupported_architecture_and_tensor_type_are_named(vocab, tmp_path):
    import gguf

    bad = tmp_path / "phi.gguf"
    w = gguf.GGUFWriter(str(bad), "phi3")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((8, 32), np.float32))
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    with pytest.raises(UnsupportedModelError, match=r"architecture 'phi3'.*supported: llama, qwen2, qwen3, gemma3"):
        check_model(bad)

    path, _ = write_tiny_gguf(tmp_path / "iq.gguf", "llama", vocab, num_hidden_layers=1,
                              quant={"ffn_down.weight": "Q4_0"})
    # Rewrite one tensor's type in the directory to IQ4_NL (the same 18 bytes per 32 weights as Q4_0)
    raw = bytearray(path.read_bytes())
    name = b"blk.0.ffn_down.weight"
    at = raw.index(name) + len(name)
    n_dims = int.from_bytes(raw[at:at + 4], "little")
    type_at = at + 4 + 8 * n_dims
    assert int.from_bytes(raw[type_at:type_at + 4], "little") == gguf.GGMLQuantizationType.Q4_0
    raw[type_at:type_at + 4] = int(gguf.GGMLQuantizationType.IQ4_NL).to_bytes(4, "little")
    odd = tmp_path / "odd.gguf"
    odd.write_bytes(bytes(raw))
    with pytest.raises(UnsupportedModelError, match=r"tensor type IQ4_NL in odd.gguf \(blk.0.ffn_down.weight\); "
                                                    r"supported: F32, F16, BF16, Q4_0"):
        check_model(odd)
    (tmp_path / "cut.gguf").write_bytes(path.read_bytes()[:5000])
    with pytest.raises(UnsupportedModelError, match="truncated"):
        check_model(tmp_path / "cut.gguf")


def test_cli_exits_non_zero_with_one_line_for_an_unsupported_model(tmp_path):
    import gguf

    bad = tmp_path / "mamba.gguf"
    w = gguf.GGUFWriter(str(bad), "mamba")
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    proc = subprocess.run([sys.executable, "-m", "stencil.service.cli", "generate", "hi", "--model", str(bad)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert lines == ["stencil generate: unsupported GGUF architecture 'mamba' in mamba.gguf; supported: llama, "
                     "qwen2, qwen3, gemma3 (Mistral and SmolLM files are llama)"], proc.stderr


def test_an_hf_gemma3_directory_loads_the_same_forward(tiny_gguf, tmp_path):
    """A transformers ``gemma3_text`` checkpoint (norms stored as w) gives the GGUF's logits."""
    _, ref = tiny_gguf("gemma3")
    ref.save_pretrained(str(tmp_path))
    ours, config = load_model(tmp_path)
    assert config.model_type == "gemma3_text" and ours.spec.layer_types == tuple(ref.config.layer_types)
    prompt = random_prompt(30, 11, ours.vocab_size)
    batch = PagedBatch(ours)
    assert_close_rel(batch.step([(batch.add(), prompt)]), hf_logits(ref, prompt))


@pytest.mark.parametrize("content", [b"", b"GGUF\x03\x00"])
def test_cli_names_an_empty_or_cut_gguf_in_one_line(tmp_path, content):
    bad = tmp_path / "empty.gguf"
    bad.write_bytes(content)
    proc = subprocess.run([sys.executable, "-m", "stencil.service.cli", "generate", "hi", "--model", str(bad)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        f"stencil generate: {bad} is not a GGUF file ({len(content)} bytes, shorter than a GGUF header)"], proc.stderr
