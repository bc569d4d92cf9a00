"""``min_p``: keep the tokens at least ``min_p`` times as likely as the most likely one, over the
tokens the grammar allows, at the request's temperature; the same distribution for draft
positions, so a seeded request's tokens do not depend on speculation; a bad value is a 400
naming ``min_p``."""

from __future__ import annotations

import math

import pytest
import torch
from litestar.testing import TestClient

from stencil.engine.config import EngineConfig
from stencil.engine.llm_engine import EngineError, LLMEngine
from stencil.engine.request import Request, SamplingParams
from stencil.engine.sampler import Sampler, _probs
from stencil.grammar.base import GrammarSpec


def _req(**kw) -> Request:
    return Request("r", [1], SamplingParams(seed=0, **kw), eos_token_id=None)


def _reference_support(logits: torch.Tensor, temperature: float, min_p: float) -> tuple[set[int], set[int]]:
    """(tokens kept, tokens too near the threshold to call), from probabilities in float64."""
    p = torch.softmax(logits.double() / temperature, dim=-1)
    ratio = p / p.max()
    near = {i for i, r in enumerate(ratio.tolist()) if abs(r - min_p) < 1e-4}
    return {i for i, r in enumerate(ratio.tolist()) if r >= min_p} - near, near


@pytest.mark.parametrize("seed", range(6))
def test_min_p_keeps_the_tokens_a_probability_ratio_keeps(seed):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(50, generator=g) * 3
    for temperature, min_p in ((1.0, 0.1), (0.5, 0.05), (2.0, 0.3), (0.7, 0.9), (1.3, 1.0)):
        probs = _probs(logits.unsqueeze(0).clone(), _req(temperature=temperature, min_p=min_p))[0]
        kept, near = _reference_support(logits, temperature, min_p)
        ours = {i for i, v in enumerate(probs.tolist()) if v > 0}
        assert ours - near == kept, (temperature, min_p)
        # What stays keeps its relative weight: renormalised, not reshaped.
        ref = torch.softmax(logits.double() / temperature, dim=-1)[sorted(ours)]
        assert torch.allclose(probs[sorted(ours)].double(), ref / ref.sum(), atol=1e-5)
    full = _probs(logits.unsqueeze(0).clone(), _req(temperature=1.0, min_p=0.0))[0]
    assert (full > 0).all()  # 0 is off


def test_a_masked_token_with_the_top_logit_does_not_set_the_threshold():
    logits = torch.tensor([[9.0, 2.0, 1.9, 1.0, -3.0]])
    logits[0, 0] = float("-inf")  # the grammar's mask, applied before the sampler
    probs = _probs(logits.clone(), _req(temperature=1.0, min_p=0.5))[0]
    # The threshold is half the most likely *allowed* token's probability: exp(1.9 - 2) = 0.90
    # and exp(1 - 2) = 0.37; from the masked 9.0 nothing would be left.
    assert [i for i, v in enumerate(probs.tolist()) if v > 0] == [1, 2]
    assert math.isclose(float(probs[1] / probs[2]), math.exp(0.1), rel_tol=1e-5)
    out = Sampler()(logits.clone(), [_req(temperature=1.0, min_p=0.5)], [[]])
    assert out.tokens[0][0] in (1, 2)


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    return LLMEngine(EngineConfig(model=tiny_model_dir, num_kv_blocks=128, max_model_len=256))


def test_min_p_comes_after_the_grammar_mask_in_the_engine(engine):
    """The tiny model's favourite first token is no digit; under ``[0-9]{4}`` with ``min_p`` 1
    only the most likely digit stays, so every seed writes the greedy answer (with ``min_p``
    before the mask, the favourite would set the threshold and leave no digit)."""
    prompt = [1, 2, 3, 4, 5]
    free = engine.generate([prompt], SamplingParams(max_tokens=1, temperature=0))[0]["text"]
    assert not free[:1].isdigit(), free
    g = engine.grammar.compile(GrammarSpec("regex", "[0-9]{4}"))
    greedy = engine.generate([prompt], SamplingParams(max_tokens=8, temperature=0), [g])[0]["text"]
    for seed in range(4):
        out = engine.generate([prompt], SamplingParams(max_tokens=8, temperature=1.5, min_p=1.0, seed=seed), [g])[0]
        assert out["error"] is None and out["text"] == greedy, (seed, out)


def _decode(eng: LLMEngine, min_p: float, spec: dict) -> tuple[dict[str, list[int]], int]:
    for i in range(3):
        eng.add_request(f"r{i}", [7 + i, 8, 9, 10, 11] * 3,
                        SamplingParams(max_tokens=48, temperature=1.0, min_p=min_p, seed=100 + i, ignore_eos=True,
                                       speculative=spec))
    outs: dict[str, list[int]] = {}
    drafted = 0
    while eng.has_unfinished():
        for o in eng.step():
            outs.setdefault(o.request_id, []).extend(o.new_token_ids)
            drafted += o.num_draft_tokens if o.finished else 0
    return outs, drafted


def test_seeded_min_p_sampling_is_the_same_with_speculation_on_and_off(tiny_model_dir):
    # No prefix cache: every run computes its prompt the same way, so only speculation differs.
    eng = LLMEngine(EngineConfig(model=tiny_model_dir, num_kv_blocks=128, enable_prefix_caching=False),
                    cost_model=lambda shape: 10.0)
    spec = {"method": "ngram", "num_speculative_tokens": 4, "max_batch_size": 64, "min_acceptance": 0.0,
            "cost_aware": False}
    off, _ = _decode(eng, 0.2, {"method": "off"})
    plain, _ = _decode(eng, 0.0, {"method": "off"})
    assert off != plain  # min_p changed what was drawn: the comparison below has power
    # Drafts of the reference's next tokens (accepted while the draw agrees), then of the last
    # token again (mostly rejected): both paths of the sampled verification.
    eng.drafter.draft = lambda req, room: off[req.request_id][req.num_output_tokens:req.num_output_tokens + room]
    right, drafted = _decode(eng, 0.2, spec)
    assert right == off and drafted > 50
    eng.drafter.draft = lambda req, room: [req.all_token_ids[-1]] * room
    wrong, drafted = _decode(eng, 0.2, spec)
    assert wrong == off and drafted > 50


@pytest.mark.parametrize("value", [-0.1, 1.5, float("nan"), "0.1", True])
def test_a_bad_min_p_is_refused_naming_it(value):
    with pytest.raises(EngineError, match="min_p") as e:
        SamplingParams(min_p=value)
    assert e.value.field == "min_p"


@pytest.fixture(scope="module")
def client(tiny_model_dir):
    from stencil.service.app import create_app
    from stencil.service.state import ServiceConfig

    app = create_app(EngineConfig(model=tiny_model_dir, num_kv_blocks=64),
                     ServiceConfig(max_tokens_cap=16, default_max_tokens=4))
    with TestClient(app, timeout=60) as c:
        yield c


@pytest.mark.parametrize("value, status", [(-0.1, 400), (1.5, 400), ("0.1", 422)])
def test_bad_min_p_on_generate_names_it(client, value, status):
    """Out of range: the engine's 400; a string: the wire's 422 (``/generate``'s status for a
    value of the wrong type)."""
    r = client.post("/generate", json={"prompt": "x", "min_p": value})
    assert r.status_code == status, r.text
    assert r.json()["field"] == "min_p" and "min_p" in r.json()["detail"], r.text


@pytest.mark.parametrize("value", [-0.1, 1.5, "0.1"])
def test_bad_min_p_on_chat_completions_names_it(client, value):
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}], "min_p": value})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "min_p" and "min_p" in r.json()["error"]["message"], r.text


def test_min_p_is_served_on_every_route(client):
    """Taken by name on each route: ``min_p`` 1 under a temperature is the greedy answer."""
    greedy = client.post("/generate", json={"prompt": "x", "max_tokens": 6}).json()["text"]
    body = {"prompt": "x", "max_tokens": 6, "temperature": 1.5, "min_p": 1.0, "seed": 3}
    assert client.post("/generate", json=body).json()["text"] == greedy
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == greedy, r.text
    chat = {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 6, "seed": 3}
    want = client.post("/v1/chat/completions", json={**chat, "temperature": 0}).json()
    got = client.post("/v1/chat/completions", json={**chat, "temperature": 1.5, "min_p": 1.0}).json()
    assert got["choices"][0]["message"] == want["choices"][0]["message"], got
