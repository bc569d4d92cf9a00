"""The tokenizer of a model path: an HF directory's own files, or one converted from a GGUF.

A GGUF's tokenizer is built by transformers' own GGUF tokenizer builders
(``transformers.integrations.gguf``: ``get_gguf_tokenizer`` reads ``tokenizer.ggml.*`` and
``tokenizer.chat_template``, ``convert_gguf_tokenizer`` makes the ``tokenizers`` object: GPT-2
byte-level BPE from ``.tokens`` and ``.merges`` with the split regex ``.pre`` names, or
SentencePiece-style BPE with byte fallback, merges rebuilt from the vocabulary; control tokens
special, user-defined ones added), wrapped in transformers' ``TokenizersBackend``. We take
transformers' converter rather than writing one because it is the conversion transformers
applies when it loads the file, so prompts tokenize as in the reference we test against
(``tests/engine/test_gguf_models.py`` compares the two), and the result is the fast tokenizer the
grammar, detokenizer and drafter already read. We call the builders directly rather than
``AutoTokenizer.from_pretrained(dir, gguf_file=...)``, which also reads the model config
through ``gguf.GGUFReader`` (45 s of its 70 s at Gemma 3's 262,144 tokens here) only to pick
the class: built this way the encodings, vocabulary and added tokens are the same (checked on
SmolLM2 and Gemma 3); only the class differs (``GemmaTokenizer`` also calls ``<mask>`` its
mask token, an added special token either way). Where those builders are missing (another
transformers version) ``AutoTokenizer`` is used.

The first start still pays the conversion (Gemma 3: about 17 s here, mostly rebuilding its
merges), so the converted tokenizer is saved under ``$STENCIL_CACHE_DIR/tokenizers/<digest>``
and later starts load that (about 6 s for Gemma 3, under 1 s for SmolLM2). The digest is the
SHA-256 of the file's header (metadata and tensor directory, ``GgufFile.header_digest``):
everything the tokenizer comes from, without reading the weights.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import time
from pathlib import Path

from stencil.engine.models.default_model import cache_dir
from stencil.engine.models.gguf_file import GgufFile
from stencil.engine.models.source import resolve_model_path

log = logging.getLogger(__name__)


def load_tokenizer(path: Path | str):
    """The transformers tokenizer of a model path (``source.resolve_model_path`` rules).

    Raises:
        ModelPathError: the path names no model.
        OSError, ValueError: from transformers, for a broken tokenizer.
    """
    source = resolve_model_path(path)
    if source.kind == "gguf":
        return gguf_tokenizer(source.path)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(source.path))


def tokenizer_cache_dir(gguf: GgufFile) -> Path:
    """Where the converted tokenizer of ``gguf`` is kept (may not exist yet)."""
    return cache_dir() / "tokenizers" / gguf.header_digest()[:24]


def gguf_tokenizer(path: Path | str, gguf: GgufFile | None = None):
    """The tokenizer of a GGUF file, converted once and cached (see the module docstring).

    Args:
        path: the ``.gguf`` file.
        gguf: the already opened file (saves reading its header twice).

    Returns:
        A ``PreTrainedTokenizerFast`` loaded from the cache directory (the first call converts,
        saves, then loads what it saved, so the first and every later start tokenize alike).
    """
    from transformers import AutoTokenizer

    path = Path(path)
    gguf = gguf or GgufFile(path)
    out = tokenizer_cache_dir(gguf)
    if not (out / "tokenizer_config.json").is_file():
        t0 = time.perf_counter()
        tok = convert_gguf_tokenizer(path)
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=out.name + ".", dir=out.parent))
        try:
            tok.save_pretrained(str(tmp))
            (tmp / "source.txt").write_text(f"converted from {path}\n")
            try:
                os.rename(tmp, out)
            except OSError:  # another process saved it first: keep theirs
                if not (out / "tokenizer_config.json").is_file():
                    raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        log.info("converted the tokenizer of %s in %.1f s into %s", path.name, time.perf_counter() - t0, out)
    return AutoTokenizer.from_pretrained(str(out))


def convert_gguf_tokenizer(path: Path | str):
    """Build the tokenizer of a GGUF with transformers' GGUF builders, uncached (see the module
    docstring); ``AutoTokenizer``'s own conversion where they are missing."""
    from transformers import AutoTokenizer

    path = Path(path)
    try:
        from transformers.integrations.gguf import convert_gguf_tokenizer as convert
        from transformers.integrations.gguf import get_gguf_tokenizer
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:
        return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    architecture, tokenizer_dict, tokenizer_config = get_gguf_tokenizer(str(path))
    backend, extra = convert(architecture, tokenizer_dict)
    return TokenizersBackend(tokenizer_object=backend, **tokenizer_config, **extra)


__all__ = ["convert_gguf_tokenizer", "gguf_tokenizer", "load_tokenizer", "tokenizer_cache_dir"]
