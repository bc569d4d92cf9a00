"""Tiny random models written as GGUF files the way llama.cpp's converter writes them, with the
transformers model holding the very same (dequantized) weights as the reference.

``write_tiny_gguf`` builds a tiny transformers model of an architecture, turns each weight into
its GGUF tensor (llama.cpp's names; the ``llama`` architecture's Q/K rows permuted as
``convert_hf_to_gguf.py``'s ``LlamaModel.permute`` does; Gemma norms stored as ``1 + w``),
quantizes the chosen ones (``gguf.quants.quantize`` for the 32-weight types, ``kquant_writer``
for Q4_K / Q5_K / Q6_K, which gguf-py does not write), and copies the dequantized values back
into the transformers model, so both sides compute with identical weights. The file carries
SmolLM2's vocabulary (GPT-2 BPE: tokens, types, merges), so transformers converts a real
tokenizer from it.
"""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np
import torch

# GGUF architecture -> transformers model_type
HF_TYPE = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma3": "gemma3_text"}

SMOL_TEMPLATE = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] "
                 "+ '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
                 "{% endif %}")

# Every supported k-quant, a 32-block type in a fused layer, and a Q8_0 embedding / tied head: the
# mix of the tiny quantized models (hidden 256, so every matrix holds whole 256-weight super-blocks).
KQUANT = {"attn_q.weight": "Q4_K", "attn_k.weight": "Q5_0", "attn_v.weight": "Q6_K", "attn_output.weight": "Q5_K",
          "ffn_gate.weight": "Q4_K", "ffn_up.weight": "Q5_0", "ffn_down.weight": "Q6_K",
          "token_embd.weight": "Q8_0"}


def hf_config(arch: str, **overrides):
    """A tiny transformers config of ``arch`` (vocabulary of SmolLM2's 49,152 tokens)."""
    from transformers import AutoConfig

    common = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5,
                  bos_token_id=1, eos_token_id=2, pad_token_id=2, tie_word_embeddings=True)
    if arch == "llama":
        common.update(rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    elif arch == "qwen2":
        common.update(rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, tie_word_embeddings=False)
    elif arch == "qwen3":
        common.update(head_dim=32, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
    elif arch == "gemma3":
        # Six layers: five local ones (window 8) and a global one, as the released models interleave them.
        common.update(num_hidden_layers=6, num_key_value_heads=1, head_dim=32, query_pre_attn_scalar=32,
                      sliding_window=8, rms_norm_eps=1e-6, attn_implementation="eager")
    else:
        raise ValueError(arch)
    common.update(overrides)
    return AutoConfig.for_model(HF_TYPE[arch], **common)


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter's Q/K row order (``LlamaModel.permute``) for the ``llama`` architecture."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    return w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _gguf_name(hf: str, gemma: bool) -> str | None:
    if hf == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf == "model.norm.weight":
        return "output_norm.weight"
    if hf == "lm_head.weight":
        return "output.weight"
    parts = hf.split(".")
    i, rest = parts[2], ".".join(parts[3:])
    table = {
        "input_layernorm.weight": "attn_norm.weight",
        "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
        "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
        "self_attn.q_proj.bias": "attn_q.bias", "self_attn.k_proj.bias": "attn_k.bias",
        "self_attn.v_proj.bias": "attn_v.bias",
        "self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight",
        "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
        "mlp.down_proj.weight": "ffn_down.weight",
    }
    if gemma:
        table.update({"post_attention_layernorm.weight": "post_attention_norm.weight",
                      "pre_feedforward_layernorm.weight": "ffn_norm.weight",
                      "post_feedforward_layernorm.weight": "post_ffw_norm.weight"})
    else:
        table["post_attention_layernorm.weight"] = "ffn_norm.weight"
    return f"blk.{i}.{table[rest]}" if rest in table else None


def smol_vocab(smol_gguf: Path) -> dict:
    """SmolLM2's tokenizer metadata (tokens, token types, merges) from its GGUF."""
    from stencil.engine.models.gguf_file import GgufFile

    f = GgufFile(smol_gguf)
    return {k: f.metadata[f"tokenizer.ggml.{k}"] for k in ("tokens", "token_type", "merges")}


def write_tiny_gguf(out: Path, arch: str, vocab: dict, *, seed: int = 0, quant: dict[str, str] | None = None,
                    chat_template: str | None = SMOL_TEMPLATE, extra_kv=None, **overrides):
    """Write a tiny random ``arch`` model as GGUF; return ``(path, transformers model)``.

    Args:
        out: the ``.gguf`` path to write.
        arch: ``"llama"``, ``"qwen2"``, ``"qwen3"`` or ``"gemma3"``.
        vocab: ``smol_vocab(...)``.
        quant: GGUF tensor-name suffix -> type name (``{"ffn_down.weight": "Q8_0"}``); the rest F32.
            k-quants need rows of whole 256-weight super-blocks (``hidden_size=256``, say).
        chat_template: written as ``tokenizer.chat_template`` (None: a base model without one).
        extra_kv: ``f(writer)`` adding more metadata.
        overrides: config fields.
    """
    import gguf
    from gguf.quants import dequantize, quantize
    from transformers import AutoModelForCausalLM

    from kquant_writer import quantize_k

    config = hf_config(arch, **overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    gemma = arch == "gemma3"
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.3 if "embed" in name else 0.15)
            elif "bias" in name:
                p.normal_(0.0, 0.1)
            elif gemma and "norm" in name:
                p.normal_(0.0, 0.2)  # w of (1 + w): near 0
    state = model.state_dict()
    writer = gguf.GGUFWriter(str(out), arch)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    if gemma:
        writer.add_rope_freq_base(config.rope_parameters["full_attention"]["rope_theta"])
        writer.add_sliding_window(config.sliding_window)
    else:
        writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_vocab_size(config.vocab_size)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(vocab["tokens"])
    writer.add_token_types([int(t) for t in vocab["token_type"]])
    writer.add_token_merges(vocab["merges"])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    if chat_template is not None:
        writer.add_chat_template(chat_template)
    if extra_kv is not None:
        extra_kv(writer)
    quant = quant or {}
    new_state = {}
    for hf_name, t in state.items():
        if hf_name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        name = _gguf_name(hf_name, gemma)
        if name is None:
            continue
        w = t.numpy().astype(np.float32)
        if gemma and name.endswith("norm.weight"):
            w = w + 1  # llama.cpp's converter stores Gemma's norms as 1 + w
        heads = {"attn_q": config.num_attention_heads, "attn_k": config.num_key_value_heads}.get(
            name.split(".")[2] if name.startswith("blk.") else "")
        if arch == "llama" and heads:
            w = _permute(w, heads)
        qtype = next((q for suffix, q in quant.items() if name.endswith(suffix)), "F32")
        if qtype == "F32":
            writer.add_tensor(name, w)
            back = w
        else:
            kind = gguf.GGMLQuantizationType[qtype]
            data = quantize_k(w, qtype) if qtype in ("Q4_K", "Q5_K", "Q6_K") else quantize(w, kind)
            writer.add_tensor(name, data, raw_dtype=kind)
            back = np.asarray(dequantize(data, kind), np.float32).reshape(w.shape)
        if arch == "llama" and heads:
            back = _unpermute(back, heads)
        if gemma and name.endswith("norm.weight"):
            back = back - 1
        new_state[hf_name] = torch.from_numpy(np.ascontiguousarray(back))
    with torch.no_grad():
        for hf_name, t in new_state.items():
            state[hf_name].copy_(t)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out, model


def smol_gguf_factory(tmp_path_factory, prefix: str, write):
    """For a module-scoped fixture: ``key -> write(folder, key, vocab)``, called once per key, with
    a fresh temporary folder ``{prefix}-{key}`` and SmolLM2's vocabulary (from the default GGUF)."""
    from stencil.engine.models.default_model import fetch_gguf

    vocab = smol_vocab(fetch_gguf())
    return functools.cache(lambda key: write(tmp_path_factory.mktemp(f"{prefix}-{key}"), key, vocab))
