"""Draft proposers (token and text prompt lookup, span ends) and the per-step draft budget."""

from __future__ import annotations

import numpy as np
import pytest

from engine.spec_decode import SpecConfig, propose_ngram, propose_text, span_end


def test_propose_ngram_takes_the_longest_most_recent_suffix_match():
    tokens = np.array([5, 6, 7, 8, 9, 1, 6, 7, 2, 3, 5, 6, 7], dtype=np.int64)
    # Suffix [5, 6, 7] (length 3) occurred at 0, followed by 8, 9, 1...
    assert propose_ngram(tokens, 3, 2, 4) == [8, 9, 1]
    # Only length-2 suffixes searched: [6, 7] last occurred at 6, followed by 2, 3.
    assert propose_ngram(tokens, 2, 2, 2) == [2, 3]
    assert propose_ngram(np.array([1, 2, 3, 4]), 3, 2, 3) == []


def test_propose_text_continues_the_source_after_the_copied_suffix():
    source = "Invoice INV-2231 was issued to Northwind Traders on 2017-08-07."
    assert propose_text(source, '{"customer":"Northwind') == " Traders on 2017-08-07."
    assert propose_text(source, '{"x":"zz') == ""
    assert propose_text(source, "abc Northw", max_out_chars=6) == "ind Tr"


@pytest.mark.parametrize("text, end", [
    (" Wirth, who joined the team", 6),
    ("irth. She lives", 4),
    ("barbara.87@mail.test and more", 29),  # dots inside an address are not pauses
    ("3.5 kg (net)", 7),
    ("USD", 3),
    ('quoted" text', 6),
    ("Ave\nSpringfield", 3),
])
def test_span_end_finds_the_first_pause(text, end):
    assert span_end(text) == end


def test_spec_config_validates_fields():
    assert SpecConfig.from_dict({"method": "off"}) is None
    cfg = SpecConfig.from_dict({"method": "ngram", "max_draft_tokens_per_step": 3})
    assert cfg.max_draft_tokens_per_step == 3 and cfg.num_speculative_tokens == 4
    for bad in ({"method": "eagle"}, {"num_speculative_tokens": 0}, {"max_draft_tokens_per_step": -1},
                {"prompt_lookup_min": 3, "prompt_lookup_max": 2}, {"nope": 1}):
        with pytest.raises(ValueError):
            SpecConfig.from_dict({"method": "ngram", **bad} if "method" not in bad else bad)


def test_drafts_per_step_stay_within_the_shared_budget(tiny_model_dir):
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine
    from engine.request import SamplingParams

    eng = LLMEngine(EngineConfig(model=tiny_model_dir, num_kv_blocks=128))
    spec = {"method": "ngram", "num_speculative_tokens": 4, "max_batch_size": 64,
            "min_acceptance": 0.0, "max_draft_tokens_per_step": 5}
    for i in range(4):
        eng.add_request(f"r{i}", [7 + i, 8, 9, 10, 11] * 3,
                        SamplingParams(max_tokens=40 if i == 0 else 8, temperature=0, ignore_eos=True,
                                       speculative=spec))
    # A proposer that always fills the room it is given, so only the budget limits drafts.
    eng._drafts = lambda req, cfg, room: [req.all_token_ids[-1]] * room
    per_step, per_request = [], []
    propose = eng._propose_drafts

    def counted():
        propose()
        per_step.append(sum(len(r.draft_token_ids) for r in eng.scheduler.running))
        per_request.extend(len(r.draft_token_ids) for r in eng.scheduler.running)

    eng._propose_drafts = counted
    while eng.has_unfinished():
        eng.step()
    # Four requests decoding take 3 rows of the 5 beyond the first: 2 are left for drafts (they
    # could take 16). Alone, the long request gets num_speculative_tokens, never more.
    assert per_step[:3] == [2, 2, 2]
    assert max(per_step) == 4 and max(per_request) == 4
