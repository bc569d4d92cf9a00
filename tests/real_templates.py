"""Real chat templates as test data, and tiny random models that carry one.

The templates are llama.cpp's ``models/templates/`` (70 real ones: Qwen3, Llama 3.x, Mistral,
DeepSeek, Hermes, functionary, Granite, gpt-oss, ...), read from the llama-cpp-python sdist on PyPI,
the same file ``benchmarks/peers/build_llama_server.sh`` fetches into ``$STENCIL_CACHE_DIR/peers``.
Nothing of them enters the repository: the sdist is fetched once (76 MB, about 40 s) and only
its templates folder is unpacked; a test that needs one is skipped when PyPI cannot be reached.

:func:`family_model_dir` saves a tiny random Llama (``make_tiny_model_dir``'s) whose tokenizer is
SmolLM2's plus the family's own special tokens (``<think>``, ``[TOOL_CALLS]``, ``<|python_tag|>``,
...: each one token, as in the family's real vocabulary), with the real template as its chat
template, so the mechanics of a family's syntax are testable without its weights.
"""

from __future__ import annotations

import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

SDIST_VERSION = "0.3.36"  # the version build_llama_server.sh builds
_TEMPLATES = f"llama_cpp_python-{SDIST_VERSION}/vendor/llama.cpp/models/templates"
BASE_VOCAB = 49152  # SmolLM2's tokenizer
VOCAB_ROOM = 64  # ids past it for a family's added tokens


def peers_dir() -> Path:
    from stencil.engine.models.default_model import cache_dir

    return cache_dir() / "peers"


def templates_dir() -> Path:
    """The unpacked ``models/templates`` folder (fetched and unpacked once).

    Raises:
        pytest.skip.Exception: the sdist cannot be fetched (no registry).
    """
    root = peers_dir()
    out = root / _TEMPLATES
    if out.is_dir() and any(out.glob("*.jinja")):
        return out
    from stencil.engine.models.default_model import cache_lock

    with cache_lock("llama-cpp-python-templates"):  # test workers start together
        return _fetch_templates(root, out)


def _fetch_templates(root: Path, out: Path) -> Path:
    if out.is_dir() and any(out.glob("*.jinja")):
        return out
    sdist = root / f"llama_cpp_python-{SDIST_VERSION}.tar.gz"
    if not sdist.exists():
        root.mkdir(parents=True, exist_ok=True)
        r = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-binary", ":all:", "--no-deps",
                            f"llama-cpp-python=={SDIST_VERSION}", "-d", str(root)],
                           capture_output=True, text=True, timeout=600)
        if r.returncode != 0 or not sdist.exists():
            pytest.skip(f"the llama-cpp-python sdist could not be fetched: {r.stderr.strip()[-300:]}")
    with tarfile.open(sdist) as tar:
        members = [m for m in tar.getmembers() if m.name.startswith(_TEMPLATES + "/") and m.isfile()]
        tar.extractall(root, members=members, filter="data")
    return out


def real_template(name: str) -> str:
    """The text of ``models/templates/<name>.jinja`` (e.g. ``"Qwen-Qwen3-0.6B"``)."""
    path = templates_dir() / f"{name}.jinja"
    if not path.exists():
        raise FileNotFoundError(f"no template {name!r} in {templates_dir()}")
    return path.read_text()


def family_model_dir(out: Path, base_dir: Path, template: str, special_tokens: list[str] = (),
                     eos_token: str | None = None, bos_token: str | None = None) -> Path:
    """Save a tiny random Llama with SmolLM2's tokenizer, ``special_tokens`` added (each one id
    past SmolLM2's 49,152, in order), ``template`` as its chat template, into ``out``.

    Args:
        out: the directory to write.
        base_dir: the default model's directory (its tokenizer).
        template: the chat template's text (:func:`real_template`).
        special_tokens: the family's control tokens SmolLM2 lacks (``<think>``, ``</think>``,
            ``<tool_call>``, ``[TOOL_CALLS]``, ...); ones it has already are left as they are.
        eos_token: the token that ends a turn for this family (``<|eot_id|>``, ``</s>``, ...),
            added if missing; ``None`` keeps SmolLM2's ``<|im_end|>``.
        bos_token: likewise for the template's ``bos_token``.
    """
    from transformers import AutoTokenizer

    from conftest import make_tiny_model_dir

    tok = AutoTokenizer.from_pretrained(str(base_dir))
    wanted = [t for t in [*special_tokens, eos_token, bos_token] if t]
    new = [t for t in dict.fromkeys(wanted) if t not in tok.get_vocab()]
    if len(new) > VOCAB_ROOM:
        raise ValueError(f"{len(new)} added tokens; room for {VOCAB_ROOM}")
    if new:
        tok.add_special_tokens({"additional_special_tokens": new}, replace_extra_special_tokens=False)
    if eos_token:
        tok.eos_token = eos_token
    if bos_token:
        tok.bos_token = bos_token
    tok.chat_template = template
    eos_id = tok.convert_tokens_to_ids(tok.eos_token)
    bos_id = tok.convert_tokens_to_ids(tok.bos_token) if tok.bos_token else 1
    make_tiny_model_dir(out, base_dir, "llama", vocab_size=BASE_VOCAB + VOCAB_ROOM,
                        eos_token_id=eos_id, bos_token_id=bos_id, pad_token_id=eos_id)
    tok.save_pretrained(str(out))  # over the base tokenizer make_tiny_model_dir saved
    return out
