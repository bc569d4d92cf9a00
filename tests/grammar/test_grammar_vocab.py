"""Token → bytes mapping: hand-made tokenizers of each family, and SmolLM2's real tokenizer."""

from __future__ import annotations

import pytest

from stencil.grammar.vocab import END_SENTINEL, TokenVocabulary, build_vocabulary


class FakeTokenizer:
    """The parts of a Hugging Face tokenizer that ``build_vocabulary`` reads."""

    def __init__(self, vocab: dict[str, int], eos: int, special: tuple[int, ...] = ()):
        self._vocab = vocab
        self.eos_token_id = eos
        self.all_special_ids = [eos, *special]

    def get_vocab(self) -> dict[str, int]:
        return dict(self._vocab)


def test_byte_level_tokens_map_through_the_gpt2_byte_alphabet():
    tok = FakeTokenizer({"<eos>": 0, "<pad>": 1, "Ġhi": 2, "Ċ": 3, "a": 4, "ĠĠ": 5, "Ã©": 6,
                         "ā": 7, "Āx": 8, "Ġthe": 9}, eos=0, special=(1,))
    v = build_vocabulary(tok)
    assert v.token_bytes == {2: b" hi", 3: b"\n", 4: b"a", 5: b"  ", 6: "é".encode(),
                             8: b"\x00x", 9: b" the"}
    assert 7 in v.excluded_ids  # "ā" stands for byte 0x01, the end sentinel
    assert v.eos_token_ids == (0,) and 0 not in v.token_bytes
    assert v.sentinel_id == 1  # the smallest non-EOS special id


def test_byte_level_keeps_nul_byte_tokens_but_drops_sentinel_bytes():
    tok = FakeTokenizer({"<eos>": 0, "Ā": 1, "ā": 2, "Ġā": 3, "Ġ": 4}, eos=0)
    v = build_vocabulary(tok)
    assert v.token_bytes == {1: b"\x00", 4: b" "}
    assert {2, 3} <= v.excluded_ids


def test_sentencepiece_space_mark_and_byte_fallback():
    tok = FakeTokenizer({"<s>": 0, "</s>": 1, "▁hi": 2, "<0x0A>": 3, "<0xE2>": 4, "é": 5,
                         "▁▁": 6, "hi▁": 7, "<0x01>": 8}, eos=1, special=(0,))
    v = build_vocabulary(tok)
    assert v.token_bytes == {2: b" hi", 3: b"\n", 4: b"\xe2", 5: "é".encode(), 6: b"  ",
                             7: b"hi "}
    assert 8 in v.excluded_ids  # <0x01> is the sentinel byte
    assert v.sentinel_id == 0


def test_padding_ids_beyond_the_tokenizer_are_not_tokens():
    tok = FakeTokenizer({"<eos>": 0, "a": 1, "b": 2}, eos=0)
    v = build_vocabulary(tok, model_vocab_size=64)
    assert v.model_vocab_size == 64 and v.bitmask_words == 2
    assert set(v.token_bytes) == {1, 2}
    assert v.sentinel_id == 3  # first id no token uses, still inside the bitmask row
    with pytest.raises(ValueError):
        build_vocabulary(tok, model_vocab_size=2)


def test_sentinel_uses_last_word_padding_when_every_id_is_a_token():
    v = TokenVocabulary.from_token_bytes({1: b"a", 2: b"b"}, 0, 3)
    assert v.sentinel_id == 3 and v.bitmask_words == 1
    full = {i: bytes([65 + i]) for i in range(1, 32)}
    with pytest.raises(ValueError, match="sentinel"):
        TokenVocabulary.from_token_bytes(full, 0, 32)


def test_from_token_bytes_rejects_eos_in_the_map_and_ids_out_of_range():
    with pytest.raises(ValueError):
        TokenVocabulary.from_token_bytes({0: b"a"}, 0, 4)
    with pytest.raises(ValueError):
        TokenVocabulary.from_token_bytes({5: b"a"}, 0, 4)


def test_outlines_map_keeps_duplicate_bytes_and_adds_the_sentinel():
    v = TokenVocabulary.from_token_bytes({1: b"a", 2: b"a", 3: b"b"}, 0, 8)
    m = v.outlines_map()
    assert m == {b"a": [1, 2], b"b": [3], END_SENTINEL: [v.sentinel_id]}


def test_fingerprint_tracks_content():
    a = TokenVocabulary.from_token_bytes({1: b"a", 2: b"b"}, 0, 8)
    b = TokenVocabulary.from_token_bytes({2: b"b", 1: b"a"}, 0, 8)
    c = TokenVocabulary.from_token_bytes({1: b"a", 2: b"c"}, 0, 8)
    d = TokenVocabulary.from_token_bytes({1: b"a", 2: b"b"}, 0, 16)
    assert a.fingerprint == b.fingerprint
    assert len({a.fingerprint, c.fingerprint, d.fingerprint}) == 3


# -- SmolLM2's real tokenizer -------------------------------------------------------------------

@pytest.fixture(scope="module")
def smol_vocab(tokenizer) -> TokenVocabulary:
    return build_vocabulary(tokenizer)


def test_real_tokens_round_trip_through_decode(tokenizer, smol_vocab):
    ids = sorted(smol_vocab.token_bytes)
    decoded = tokenizer.batch_decode([[i] for i in ids])
    complete = 0
    for tid, text in zip(ids, decoded):
        b = smol_vocab.token_bytes[tid]
        try:
            expected = b.decode("utf-8")
        except UnicodeDecodeError:
            continue  # a partial UTF-8 sequence decodes to U+FFFD; its bytes are still right
        assert text == expected, (tid, b, text)
        complete += 1
    assert complete > 0.9 * len(ids)


def test_real_partial_utf8_tokens_join_into_characters(tokenizer, smol_vocab):
    text = "naïve café — 日本語 🙂"
    pieces = tokenizer.encode(text, add_special_tokens=False)
    assert b"".join(smol_vocab.token_bytes[t] for t in pieces) == text.encode("utf-8")


def test_real_special_tokens_excluded(tokenizer, smol_vocab):
    special = set(tokenizer.added_tokens_decoder) | set(tokenizer.all_special_ids)
    assert special and special <= smol_vocab.excluded_ids
    assert not special & set(smol_vocab.token_bytes)
    assert smol_vocab.eos_token_ids == (tokenizer.eos_token_id,)
    assert smol_vocab.sentinel_id in special and smol_vocab.sentinel_id != tokenizer.eos_token_id


def test_real_vocabulary_loses_no_token_to_key_collisions(tokenizer, smol_vocab):
    # Every tokenizer id is either a grammar token or deliberately excluded, and the outlines
    # map carries each grammar token under its own bytes.
    size = len(tokenizer)
    assert set(smol_vocab.token_bytes) | smol_vocab.excluded_ids == set(range(size))
    ids_in_map = [i for ids in smol_vocab.outlines_map().values() for i in ids]
    assert sorted(ids_in_map) == sorted([*smol_vocab.token_bytes, smol_vocab.sentinel_id])
    # Sentinel-byte tokens are the only non-special exclusions.
    others = smol_vocab.excluded_ids - set(tokenizer.added_tokens_decoder)
    for tid in others:
        tok = tokenizer.convert_ids_to_tokens(tid)
        assert "ā" in tok, tok  # GPT-2 alphabet's stand-in for byte 0x01
