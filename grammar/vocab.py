"""Token id → bytes, the alphabet every grammar is compiled against.

A grammar constrains *bytes*, so each token must be mapped to the exact bytes it adds to the
output. Three tokenizer families are handled:

* byte-level BPE (GPT-2, SmolLM, Llama 3, Qwen): token strings are written in the GPT-2
  byte-to-unicode alphabet (``Ġ`` = space); each character maps back to one byte
  (Radford et al. 2019, ``encoder.py::bytes_to_unicode`` of openai/gpt-2).
* SentencePiece (Llama 2, Mistral): ``▁`` stands for a space; byte-fallback tokens ``<0xNN>``
  stand for the single byte ``NN``.
* anything else: the token string encoded as UTF-8.

Left out of the grammar alphabet: special and added tokens (control tokens such as
``<|im_start|>``), EOS ids (handled apart by the matcher), empty tokens, and tokens containing the
end sentinel byte ``0x01`` (see :data:`END_SENTINEL`). String keys are not used: distinct tokens can
share a decoded string (309 collide on SmolLM2 through ``convert_tokens_to_string``) while their
bytes differ.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from typing import Any

#: The byte appended to every compiled regex, ``(?:REGEX)\x01``, standing for "the output may end
#: here". It works around outlines-core 0.2.14 dropping a token that passes through an accepting
#: state and ends inside a longer match (``tests/grammar/test_grammar_matcher.py`` pins it; see
#: docs/architecture.md, "Grammar backends"): with the sentinel the regex's accepting states are
#: no longer final, so no token is cut at them.
END_SENTINEL = b"\x01"

_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")
_SPACE_MARK = "\u2581"  # SentencePiece's "▁"


@dataclass(frozen=True, slots=True)
class TokenVocabulary:
    """The grammar alphabet of one tokenizer + model.

    Attributes:
        token_bytes: id → bytes for every token a grammar may emit (no EOS, no special tokens).
        eos_token_ids: ids that end the output; the first is the one forced by ``forced_tokens``.
        model_vocab_size: width of the model's logits; ids ≥ the tokenizer's size are padding and
            never allowed under a grammar.
        sentinel_id: an id that no real token uses, standing for :data:`END_SENTINEL` in the
            outlines-core index; never allowed in a mask (its bit is turned into the EOS bits).
        excluded_ids: tokenizer ids left out of the alphabet (special, added, undecodable, EOS,
            sentinel-containing, empty).
        fingerprint: sha256 hex of everything above; the cache key of compiled grammars.
    """

    token_bytes: dict[int, bytes]
    eos_token_ids: tuple[int, ...]
    model_vocab_size: int
    sentinel_id: int
    excluded_ids: frozenset[int]
    fingerprint: str

    @property
    def eos_token_id(self) -> int:
        return self.eos_token_ids[0]

    @property
    def bitmask_words(self) -> int:
        """Width of a bitmask row: ``ceil(model_vocab_size / 32)`` int32 words."""
        return (self.model_vocab_size + 31) // 32

    def outlines_map(self) -> dict[bytes, list[int]]:
        """``{bytes: [ids]}`` for ``outlines_core.Vocabulary``, the sentinel entry included."""
        out: dict[bytes, list[int]] = {}
        for tid, b in self.token_bytes.items():
            out.setdefault(b, []).append(tid)
        out[END_SENTINEL] = [self.sentinel_id]
        return out

    def to_outlines(self):
        """The ``outlines_core.Vocabulary`` (EOS apart, sentinel included)."""
        from outlines_core import Vocabulary

        return Vocabulary(self.eos_token_id, self.outlines_map())

    @classmethod
    def from_token_bytes(cls, token_bytes: dict[int, bytes], eos_token_ids: tuple[int, ...] | int,
                         model_vocab_size: int, excluded_ids: frozenset[int] | set[int] = frozenset()
                         ) -> "TokenVocabulary":
        """Build from an explicit id → bytes map (tests, hand-made vocabularies).

        Tokens that are empty or contain :data:`END_SENTINEL` are moved to ``excluded_ids``.

        Raises:
            ValueError: an id out of ``[0, model_vocab_size)``, an EOS id inside ``token_bytes``,
                or no free id for the sentinel (see :func:`_pick_sentinel`).
        """
        eos = (eos_token_ids,) if isinstance(eos_token_ids, int) else tuple(eos_token_ids)
        if not eos:
            raise ValueError("at least one EOS token id is required")
        excluded = set(excluded_ids) | set(eos)
        kept: dict[int, bytes] = {}
        for tid, b in token_bytes.items():
            if not 0 <= tid < model_vocab_size:
                raise ValueError(f"token id {tid} outside [0, {model_vocab_size})")
            if tid in eos:
                raise ValueError(f"EOS id {tid} must not be a grammar token")
            if not b or END_SENTINEL in b:
                excluded.add(tid)
            else:
                kept[tid] = b
        for e in eos:
            if not 0 <= e < model_vocab_size:
                raise ValueError(f"EOS id {e} outside [0, {model_vocab_size})")
        sentinel = _pick_sentinel(kept, excluded, eos, model_vocab_size)
        return cls(kept, eos, model_vocab_size, sentinel, frozenset(excluded),
                   _fingerprint(kept, eos, model_vocab_size, sentinel))


def build_vocabulary(tokenizer: Any, model_vocab_size: int | None = None,
                     eos_token_ids: tuple[int, ...] | None = None) -> TokenVocabulary:
    """Map every token of a Hugging Face tokenizer to its bytes, offline.

    Args:
        tokenizer: a ``transformers`` tokenizer, or any object with ``get_vocab() -> dict[str, int]``
            and ``eos_token_id`` (optionally ``all_special_ids``, ``added_tokens_decoder``,
            ``backend_tokenizer``).
        model_vocab_size: the model's logits width (default: the tokenizer's size). Must be ≥ it.
        eos_token_ids: ids ending the output (default: ``(tokenizer.eos_token_id,)``).

    Returns:
        The :class:`TokenVocabulary`. Not cached here: the compiler builds it once per tokenizer
        and keys its caches by ``fingerprint``.

    Raises:
        ValueError: no EOS id, a model smaller than the tokenizer, or no free id for the sentinel.
    """
    vocab: dict[str, int] = tokenizer.get_vocab()
    size = max(vocab.values(), default=-1) + 1
    model_vocab_size = size if model_vocab_size is None else model_vocab_size
    if model_vocab_size < size:
        raise ValueError(f"model vocab size {model_vocab_size} < tokenizer size {size}")
    if eos_token_ids is None:
        if getattr(tokenizer, "eos_token_id", None) is None:
            raise ValueError("tokenizer has no eos_token_id; pass eos_token_ids")
        eos_token_ids = (int(tokenizer.eos_token_id),)
    special = set(getattr(tokenizer, "all_special_ids", ()) or ())
    special |= set((getattr(tokenizer, "added_tokens_decoder", None) or {}).keys())
    kind = _tokenizer_kind(tokenizer, vocab)
    decode = _DECODERS[kind]
    token_bytes: dict[int, bytes] = {}
    excluded = set(special)
    for text, tid in vocab.items():
        if tid in special or tid in eos_token_ids:
            continue
        b = decode(text)
        if b is None:
            excluded.add(tid)
        else:
            token_bytes[tid] = b
    return TokenVocabulary.from_token_bytes(token_bytes, tuple(eos_token_ids), model_vocab_size,
                                            frozenset(excluded))


def _gpt2_unicode_to_byte() -> dict[str, int]:
    # GPT-2's printable stand-ins: bytes that are printable latin-1 keep their code point, the
    # other 68 are shifted to 256 + n in byte order.
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table = {chr(b): b for b in printable}
    n = 0
    for b in range(256):
        if b not in table.values():
            table[chr(256 + n)] = b
            n += 1
    return table


_UNICODE_TO_BYTE = _gpt2_unicode_to_byte()


def _decode_byte_level(text: str) -> bytes | None:
    try:
        return bytes(_UNICODE_TO_BYTE[c] for c in text)
    except KeyError:
        return None  # not written in the byte alphabet: an unmarked added token


def _decode_sentencepiece(text: str) -> bytes:
    m = _BYTE_FALLBACK.fullmatch(text)
    if m:
        return bytes([int(m.group(1), 16)])
    return text.replace(_SPACE_MARK, " ").encode("utf-8")


def _decode_plain(text: str) -> bytes:
    return text.encode("utf-8")


_DECODERS = {"byte_level": _decode_byte_level, "sentencepiece": _decode_sentencepiece,
             "plain": _decode_plain}


def _tokenizer_kind(tokenizer: Any, vocab: dict[str, int]) -> str:
    """"byte_level", "sentencepiece" or "plain", from the fast tokenizer's decoder when present."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    decoder = getattr(backend, "decoder", None)
    if decoder is not None:
        state = decoder.__getstate__()
        # Re-dump so "▁" reads the same whether the tokenizer file escaped it or not.
        spec = json.dumps(json.loads(state), ensure_ascii=False)
        if '"ByteLevel"' in spec:
            return "byte_level"
        if _SPACE_MARK in spec or '"Metaspace"' in spec or '"ByteFallback"' in spec:
            return "sentencepiece"
    if hasattr(tokenizer, "byte_decoder"):
        return "byte_level"
    if hasattr(tokenizer, "sp_model"):
        return "sentencepiece"
    # No decoder to ask: judge by the word-start marks the vocabulary uses.
    g = sum(1 for t in vocab if t.startswith("\u0120"))
    s = sum(1 for t in vocab if t.startswith(_SPACE_MARK))
    if g > s:
        return "byte_level"
    return "sentencepiece" if s else "plain"


def _pick_sentinel(kept: dict[int, bytes], excluded: set[int], eos: tuple[int, ...],
                   model_vocab_size: int) -> int:
    """An id for the end sentinel inside the bitmask row, used by no grammar token nor EOS.

    Preference: the smallest excluded non-EOS id below ``model_vocab_size`` (a special token, which
    a grammar never allows anyway; ``<|endoftext|>`` = 0 on SmolLM2), else the smallest padding
    bit of the last bitmask word (``≥ model_vocab_size``). Staying inside the row keeps the
    outlines-core index no wider than the bitmask that ``write_mask_into`` fills.

    Raises:
        ValueError: every bit of the row is a real token or EOS.
    """
    for tid in sorted(excluded):
        if tid not in eos and 0 <= tid < model_vocab_size:
            return tid
    for tid in range(model_vocab_size):
        if tid not in kept and tid not in eos:
            return tid
    words = (model_vocab_size + 31) // 32
    if model_vocab_size < words * 32:
        return model_vocab_size
    raise ValueError("no token id is free for the grammar end sentinel: every id below "
                     f"{model_vocab_size} is a grammar token or EOS")


def _fingerprint(kept: dict[int, bytes], eos: tuple[int, ...], model_vocab_size: int,
                 sentinel: int) -> str:
    h = hashlib.sha256()
    h.update(json.dumps([list(eos), model_vocab_size, sentinel]).encode())
    for tid in sorted(kept):
        b = kept[tid]
        h.update(tid.to_bytes(4, "little"))
        h.update(len(b).to_bytes(4, "little"))
        h.update(b)
    return h.hexdigest()
