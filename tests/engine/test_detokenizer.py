"""Incremental detokenization: no half characters, held-back stop strings, exact text."""

from __future__ import annotations

from stencil.engine.detokenizer import IncrementalDetokenizer


def _stream(tokenizer, ids, stop=None, chunk=1):
    d = IncrementalDetokenizer(tokenizer, stop)
    deltas = [d.push(ids[i:i + chunk]) for i in range(0, len(ids), chunk)]
    deltas.append(d.finish())
    return deltas, d


def test_multibyte_characters_never_split(tokenizer):
    text = "Zoë 東京 — naïve 🙂 café"
    ids = tokenizer.encode(text, add_special_tokens=False)
    deltas, d = _stream(tokenizer, ids)
    assert "".join(deltas) == text
    assert all("\ufffd" not in x for x in deltas)
    # Some token ends inside a character, so at least one step emitted nothing.
    assert "" in deltas[:-1]


def test_concatenated_deltas_equal_full_decode_for_any_chunking(tokenizer):
    text = 'The answer is {"name": "Ada Lovelace", "age": 36}\nDone.'
    ids = tokenizer.encode(text, add_special_tokens=False)
    for chunk in (1, 2, 3, 7):
        deltas, _ = _stream(tokenizer, ids, chunk=chunk)
        assert "".join(deltas) == tokenizer.decode(ids)


def test_stop_string_cut_and_held_back(tokenizer):
    text = "alpha beta STOP gamma"
    ids = tokenizer.encode(text, add_special_tokens=False)
    deltas, d = _stream(tokenizer, ids, stop=["STOP"])
    assert d.stopped
    assert "".join(deltas) == "alpha beta "
    # While "ST" could still become "STOP" it was not emitted.
    assert not any(x.endswith("S") or x.endswith("ST") for x in deltas if x)


def test_stop_string_prefix_released_when_it_diverges(tokenizer):
    text = "a STAR is born"
    ids = tokenizer.encode(text, add_special_tokens=False)
    deltas, d = _stream(tokenizer, ids, stop=["STOP"])
    assert not d.stopped
    assert "".join(deltas) == text


def test_special_tokens_skipped(tokenizer):
    ids = tokenizer.encode("hi", add_special_tokens=False) + [tokenizer.eos_token_id]
    deltas, _ = _stream(tokenizer, ids)
    assert "".join(deltas) == "hi"
