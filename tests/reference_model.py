"""The default model as a transformers directory: the reference the tests compare Stencil against.

``stencil serve`` serves the default model from its GGUF file (``stencil.engine.models.default_model``);
tests that check our model, tokenizer and kernels against transformers need the same weights as an
HF-format directory. ``converted_default_model`` makes it once: transformers loads the GGUF
(``gguf_file=``, dequantized to fp32; needs ``gguf`` and ``accelerate``) and saves fp32 safetensors
with the tokenizer and chat template, plus ``stencil.json`` naming the GGUF, so that Stencil serves
the directory's projections from the file's 4-bit blocks (``stencil.engine.models.loader.find_gguf``).

Cache: ``<cache>/models/SmolLM2-135M-Instruct/`` (517 MB; about 40 s to make on 2 cores).
"""

from __future__ import annotations

import json
from pathlib import Path

from stencil.engine.models.default_model import MODEL_NAME, cache_dir, cache_lock, fetch_gguf


def converted_default_model() -> Path:
    """The fp32 HF directory of the default model, converted from its GGUF if missing."""
    out = cache_dir() / "models" / MODEL_NAME
    gguf_file = fetch_gguf()
    if not (out / "config.json").exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        with cache_lock(MODEL_NAME):  # test workers start together
            if not (out / "config.json").exists():
                convert(gguf_file, out)
    elif not (out / "stencil.json").exists():
        record_gguf(out, gguf_file)  # directories converted before the record existed
    return out


def convert(gguf_file: Path, out_dir: Path) -> None:
    """Load a GGUF with transformers (dequantized to fp32) and save an HF safetensors directory.

    ``save_pretrained`` refuses a GGUF-loaded model ("quantized with gguf and is not
    serializable") until its ``hf_quantizer`` and ``config.quantization_config`` are dropped;
    the weights are already dequantized at that point, so dropping them loses nothing.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tmp = out_dir.with_name(out_dir.name + ".part")
    tok = AutoTokenizer.from_pretrained(str(gguf_file.parent), gguf_file=gguf_file.name)
    model = AutoModelForCausalLM.from_pretrained(str(gguf_file.parent), gguf_file=gguf_file.name,
                                                 dtype=torch.float32)
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(str(tmp), safe_serialization=True)
    tok.save_pretrained(str(tmp))
    record_gguf(tmp, gguf_file)
    tmp.rename(out_dir)


def record_gguf(model_dir: Path, gguf_file: Path) -> None:
    """Write ``stencil.json`` naming the GGUF ``model_dir`` was converted from."""
    (model_dir / "stencil.json").write_text(json.dumps({"gguf_file": str(gguf_file.resolve())}) + "\n")
