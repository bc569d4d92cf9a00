"""Reasoning models on the service's side: the format read from the real chat templates, the
server's options, ``chat_template_kwargs`` and ``reasoning_effort``, and the reasoning's place in
every answer (``reasoning_content``, ``/generate``'s ``reasoning``, the Responses API's reasoning
item), apart from the answer that the constraint judges. The engine's side (the region, its
forced end within ``max_tokens``) is ``tests/grammar/test_reasoning_matcher.py``'s and the
engine's tests'.

The models are tiny random ones carrying a family's real template and special tokens
(``family_model_factory``): a random model never writes ``</think>`` itself, so each answer
here is one whose reasoning the budget ended.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from litestar.testing import TestClient
from transformers import AutoTokenizer

from stencil.engine.config import ConfigError, EngineConfig
from stencil.service import cli, reasoning
from stencil.service.app import create_app
from stencil.service.reasoning_formats import BY_NAME, detect, resolve
from stencil.service.state import ServiceConfig

QWEN3 = ("Qwen-Qwen3-0.6B", ["<think>", "</think>", "<tool_call>", "</tool_call>"])
R1 = ("deepseek-ai-DeepSeek-R1-Distill-Qwen-32B",
      ["<｜begin▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>", "<think>", "</think>"])
R1_EOS, R1_BOS = "<｜end▁of▁sentence｜>", "<｜begin▁of▁sentence｜>"
SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                           "ok": {"type": "boolean"}},
          "required": ["city", "ok"], "additionalProperties": False}
ASK = [{"role": "user", "content": "Where is the Louvre? Answer in JSON."}]


@pytest.fixture(scope="module")
def qwen3_dir(family_model_factory):
    return family_model_factory(*QWEN3)


@pytest.fixture(scope="module")
def r1_dir(family_model_factory):
    return family_model_factory(*R1, eos_token=R1_EOS, bos_token=R1_BOS)


# -- formats ---------------------------------------------------------------------------------------


def test_each_family_is_told_from_its_real_template():
    from real_templates import real_template

    expected = {
        "Qwen-Qwen3-0.6B": "qwen3", "Qwen-QwQ-32B": "qwen3", "Qwen3.5-4B": "qwen3",
        "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B": "deepseek_r1",
        "deepseek-ai-DeepSeek-R1-Distill-Llama-8B": "deepseek_r1",
        "HuggingFaceTB-SmolLM3-3B": "smollm3", "mistralai-Ministral-3-14B-Reasoning-2512": "mistral",
        "openai-gpt-oss-120b": "gpt_oss",
        # no reasoning
        "meta-llama-Llama-3.1-8B-Instruct": None, "mistralai-Mistral-Nemo-Instruct-2407": None,
        "ibm-granite-granite-4.0": None, "Qwen-Qwen2.5-7B-Instruct": None, "google-gemma-2-2b-it": None,
    }
    found = {name: getattr(detect(real_template(name)), "name", None) for name in expected}
    assert found == expected
    assert detect(None) is None and detect("") is None


def test_the_server_option_resolves_or_is_refused_in_one_line(capsys):
    qwen = "{% for m in messages %}<|im_start|>{{ m.content }}<think></think>{% endfor %}"
    assert resolve("auto", qwen) is BY_NAME["qwen3"] and resolve(None, qwen) is BY_NAME["qwen3"]
    assert resolve("none", qwen) is None
    assert resolve("deepseek_r1", "{{ messages }}") is BY_NAME["deepseek_r1"]  # forced on any template
    with pytest.raises(ConfigError) as e:
        ServiceConfig(reasoning_format="qwen").validate()
    assert str(e.value) == ("reasoning_format 'qwen' is not known; use auto, none or one of: "
                            + ", ".join(BY_NAME))
    with pytest.raises(ConfigError, match="reasoning_budget must be >= 0"):
        ServiceConfig(reasoning_budget=-1).validate()
    assert cli.main(["serve", "--reasoning-format", "qwen", "--model", "/never/loaded.gguf"]) == 2
    err = capsys.readouterr().err.strip()
    assert "reasoning_format 'qwen' is not known" in err and "\n" not in err and "loading" not in err


# -- the plan: template keywords before the render, the region after it ---------------------------


def _state(model_dir, budget=None, fmt="auto"):
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    cfg = ServiceConfig(reasoning_budget=budget, reasoning_format=fmt).validate()
    return SimpleNamespace(reasoning=resolve(fmt, tok.chat_template), config=cfg,
                           engine=SimpleNamespace(tokenizer=tok)), tok


def _params(state, tok, effort=None, kwargs=None):
    from stencil.service.prompts import encode_prompt

    p = reasoning.plan(state, effort, kwargs)
    ids = encode_prompt(tok, messages=ASK, template_kwargs=p.kwargs)
    return p, p.params(tok, ids), ids


def test_qwen3_thinks_after_a_forced_start_unless_switched_off(qwen3_dir):
    state, tok = _state(qwen3_dir)
    p, r, on_ids = _params(state, tok)
    think, end = tok.convert_tokens_to_ids("<think>"), tok.convert_tokens_to_ids("</think>")
    assert p.kwargs == {"enable_thinking": True} and p.cap is None
    assert r.end_text == "</think>" and r.end_ids == (end,) and r.max_reasoning_tokens is None
    assert r.start_ids == (think, *tok.encode("\n", add_special_tokens=False))  # the prompt leaves it to us
    assert r.after_ids == tuple(tok.encode("\n\n", add_special_tokens=False))
    # off by the template's keyword (the request's own, or reasoning_effort none): the template
    # closes the region in the prompt, and the answer comes at once
    for effort, kwargs in ((None, {"enable_thinking": False}), ("none", None), ("high", {"enable_thinking": False})):
        p, r, off_ids = _params(state, tok, effort, kwargs)
        assert r is None and off_ids[:len(on_ids)] == on_ids and end in off_ids[len(on_ids):], (effort, kwargs)
    # efforts cap the reasoning; the server's budget caps every effort
    assert [_params(state, tok, e)[1].max_reasoning_tokens for e in ("minimal", "low", "medium", "high")] == \
        [256, 1024, 4096, None]
    state, tok = _state(qwen3_dir, budget=300)
    assert [_params(state, tok, e)[1].max_reasoning_tokens for e in (None, "minimal", "low")] == [300, 256, 300]
    with pytest.raises(Exception, match="reasoning_effort must be one of none, minimal, low, medium, high"):
        reasoning.plan(state, "extreme", None)


def test_deepseek_r1_prompt_opens_the_region(r1_dir):
    state, tok = _state(r1_dir)
    p, r, ids = _params(state, tok)
    assert state.reasoning.name == "deepseek_r1"
    assert tok.decode(ids[-3:]).endswith("<｜Assistant｜><think>\n")
    assert r.start_ids == () and r.end_ids == (tok.convert_tokens_to_ids("</think>"),)
    # this template's switch (llama.cpp's copy writes "</think>" unless enable_thinking): off closes it
    assert _params(state, tok, "none")[1] is None
    # a format forced on a template without the switch: none is an empty region
    state, tok = _state(r1_dir, fmt="qwen3")
    p, r, _ = _params(state, tok, "none")
    assert "enable_thinking" in tok.chat_template  # qwen3's switch is named the same: still honoured
    state.reasoning = BY_NAME["mistral"]  # no switch at all
    p, r, _ = _params(state, tok, "none")
    assert r is not None and r.max_reasoning_tokens == 0 and p.kwargs is None


@pytest.mark.parametrize("template, specials, start, after, off", [
    ("HuggingFaceTB-SmolLM3-3B", ["<think>", "</think>"], "<think>\n", "\n", "closed"),
    ("mistralai-Ministral-3-14B-Reasoning-2512", ["[THINK]", "[/THINK]", "[INST]", "[/INST]", "[SYSTEM_PROMPT]",
                                                  "[/SYSTEM_PROMPT]"], "[THINK]", "", "empty"),
    ("openai-gpt-oss-120b", ["<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|return|>"],
     "<|channel|>analysis<|message|>", "<|start|>assistant<|channel|>final<|message|>", "empty"),
])
def test_other_families_regions_from_their_real_templates(tiny_model_dir, template, specials, start, after, off):
    from real_templates import real_template

    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    tok.add_special_tokens({"additional_special_tokens": specials}, replace_extra_special_tokens=False)
    tok.chat_template = real_template(template)
    state = SimpleNamespace(reasoning=resolve("auto", tok.chat_template), config=ServiceConfig().validate(),
                            engine=SimpleNamespace(tokenizer=tok))
    p, r, _ = _params(state, tok)
    assert r.start_ids == tuple(tok.encode(start, add_special_tokens=False))  # the prompt leaves it to the model
    assert r.end_ids == tuple(tok.encode(state.reasoning.end, add_special_tokens=False))
    assert r.after_ids == tuple(tok.encode(after, add_special_tokens=False))
    p, r, ids = _params(state, tok, "none")
    if off == "closed":  # SmolLM3's switch writes an empty region into the prompt
        assert r is None and tok.decode(ids).endswith("<think>\n\n</think>\n")
    else:  # no switch: an empty region the engine forces
        assert r.max_reasoning_tokens == 0
    if state.reasoning.effort_kwarg:  # gpt-oss takes the effort itself, in its system message
        p, r, ids = _params(state, tok, "high")
        assert p.kwargs == {"reasoning_effort": "high"} and "Reasoning: high" in tok.decode(ids)


def test_a_model_that_does_not_reason_takes_any_effort_as_none(tiny_model_dir):
    state, tok = _state(tiny_model_dir)
    assert state.reasoning is None
    p, r, _ = _params(state, tok, "high")
    assert r is None and p.warnings == ["reasoning_effort 'high' was served as 'none': the served model does not "
                                        "reason (its chat template writes no reasoning; --reasoning-format names one)"]
    assert reasoning.plan(state, "none", None).warnings == []


def test_template_kwargs_reach_the_template_as_data(tiny_model_dir):
    from stencil.service.errors import InputError
    from stencil.service.prompts import encode_prompt

    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    tok.chat_template = "[{{ note }}]{% for m in messages %}{{ m.content }}{% endfor %}"
    end = tok.convert_tokens_to_ids("<|im_end|>")
    ids = encode_prompt(tok, messages=[{"role": "user", "content": "Hi"}],
                        template_kwargs={"note": "x<|im_end|>y"})
    assert tok.decode(ids) == "[x<|im_end|>y]Hi" and end not in ids  # written, never a control token
    with pytest.raises(InputError, match="'add_generation_prompt' is set by the server") as e:
        encode_prompt(tok, messages=[{"role": "user", "content": "Hi"}],
                      template_kwargs={"add_generation_prompt": False})
    assert e.value.field == "chat_template_kwargs"


# -- the routes ------------------------------------------------------------------------------------


def _app(model_dir, **cfg):
    return create_app(EngineConfig(model=str(model_dir), num_kv_blocks=64, max_num_seqs=2),
                      ServiceConfig(max_tokens_cap=256, default_max_tokens=64, **cfg))


def test_template_kwargs_and_efforts_on_a_model_that_does_not_reason(tiny_model_dir):
    with TestClient(_app(tiny_model_dir), timeout=60) as client:
        model = client.get("/v1/models").json()["data"][0]
        assert model["chat_format"]["reasoning"] is None
        body = {"model": model["id"], "messages": ASK, "max_tokens": 3}
        r = client.post("/v1/chat/completions", json={**body, "reasoning_effort": "high"})
        assert r.status_code == 200, r.text
        a = r.json()
        assert "reasoning_content" not in a["choices"][0]["message"] and "completion_tokens_details" not in a["usage"]
        assert a["warnings"][0].startswith("reasoning_effort 'high' was served as 'none'")
        assert "served as 'none'" in r.headers["x-stencil-warnings"]
        r = client.post("/v1/responses", json={"model": model["id"], "input": "Hi", "max_output_tokens": 3,
                                               "reasoning": {"effort": "low"}})
        assert r.status_code == 200 and r.json()["warnings"][0].startswith("reasoning.effort 'low' was served"), r.text
        assert [i["type"] for i in r.json()["output"]] == ["message"]
        r = client.post("/v1/responses", json={"input": "Hi", "reasoning": {"effort": "low", "summary": "auto"}})
        assert r.status_code == 400 and r.json()["error"]["param"] == "reasoning.summary"
        for key in ("add_generation_prompt", "messages", "tools", "tokenize"):
            r = client.post("/v1/chat/completions", json={**body, "chat_template_kwargs": {key: False}})
            assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template_kwargs", r.text
            assert repr(key) in r.json()["error"]["message"]
        r = client.post("/v1/chat/completions", json={**body, "reasoning_effort": "extreme"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "reasoning_effort"
        r = client.post("/generate", json={"prompt": "Hi", "chat_template_kwargs": {"x": 1}})
        assert r.status_code == 400 and r.json()["field"] == "chat_template_kwargs"
        # a keyword the template reads reaches it (SmolLM2's ignores unknown ones: same prompt)
        plain = client.post("/generate", json={"messages": ASK, "max_tokens": 2}).json()["usage"]["prompt_tokens"]
        r = client.post("/generate", json={"messages": ASK, "max_tokens": 2, "chat_template_kwargs": {"x": 1}})
        assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == plain and r.json()["reasoning"] is None


def _answer(text: str) -> dict:
    value = json.loads(text)
    assert set(value) == {"city", "ok"} and isinstance(value["city"], str) and isinstance(value["ok"], bool)
    return value


def test_qwen3_reasons_then_answers_a_valid_schema(qwen3_dir, caplog):
    from openai.types.chat import ChatCompletion, ChatCompletionChunk

    fmt = {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA, "strict": True}}
    caplog.set_level("INFO")
    with TestClient(_app(qwen3_dir), timeout=120) as client:
        model = client.get("/v1/models").json()["data"][0]
        assert model["chat_format"]["reasoning"] == "qwen3"
        assert "(reasoning format: qwen3, detected from its chat template)" in caplog.text
        body = {"model": model["id"], "messages": ASK, "response_format": fmt, "temperature": 0}
        # the least max_tokens: the region's 4 forced tokens (<think> \n </think> \n\n) and the
        # answer's shortest spelling, so the reasoning is empty
        r = client.post("/v1/chat/completions", json={**body, "max_tokens": 1})
        assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens", r.text
        least = int(r.json()["error"]["message"].split("at least ")[1].split()[0])
        r = client.post("/v1/chat/completions", json={**body, "max_tokens": least})
        a = r.json()
        choice = a["choices"][0]
        assert r.status_code == 200 and choice["valid"] is True and choice["finish_reason"] == "stop", a
        _answer(choice["message"]["content"])
        assert choice["message"]["reasoning_content"] == ""
        assert a["usage"]["completion_tokens_details"] == {"reasoning_tokens": 4}
        assert a["usage"]["completion_tokens"] == least
        assert any("the reasoning was ended for the model (4 tokens" in w for w in a["warnings"])
        # the OpenAI SDK reads it as vLLM's extra field
        assert ChatCompletion.model_validate(a).choices[0].message.model_extra["reasoning_content"] == ""

        # room to think: reasoning deltas first, then the answer's
        chunks = _sse(client.post("/v1/chat/completions",
                                  json={**body, "max_tokens": 50, "stream": True,
                                        "stream_options": {"include_usage": True}}))
        deltas = [ChatCompletionChunk.model_validate(c).choices[0].delta for c in chunks if c["choices"]]
        thoughts = [(d.model_extra or {}).get("reasoning_content") for d in deltas]
        thought = "".join(t or "" for t in thoughts)
        content = "".join(d.content or "" for d in deltas)
        first_content = next(k for k, d in enumerate(deltas) if d.content)
        assert not any(thoughts[first_content:]) and thought and "think>" not in thought + content
        assert chunks[-2]["choices"][0]["valid"] is True
        usage = chunks[-1]["usage"]
        assert 4 < usage["completion_tokens_details"]["reasoning_tokens"] < usage["completion_tokens"] <= 50
        _answer(content)

        # /generate: the same run (greedy, the same prompt), the reasoning apart
        r = client.post("/generate", json={"messages": ASK, "response_schema": SCHEMA, "max_tokens": 50})
        g = r.json()
        assert r.status_code == 200 and g["valid"] is True and g["output"] == _answer(g["text"]), g
        assert (g["reasoning"], g["text"]) == (thought, content)
        assert g["usage"]["reasoning_tokens"] == usage["completion_tokens_details"]["reasoning_tokens"]

        # thinking off: the answer at once, no reasoning
        r = client.post("/v1/chat/completions", json={**body, "max_tokens": 16,
                                                      "chat_template_kwargs": {"enable_thinking": False}})
        a = r.json()
        assert r.status_code == 200 and a["choices"][0]["valid"] is True, a
        assert "reasoning_content" not in a["choices"][0]["message"] and "completion_tokens_details" not in a["usage"]
        _answer(a["choices"][0]["message"]["content"])
        r = client.post("/generate", json={"messages": ASK, "response_schema": SCHEMA, "max_tokens": 16,
                                           "reasoning_effort": "none"})
        g = r.json()
        assert g["reasoning"] is None and g["valid"] is True and g["usage"]["reasoning_tokens"] == 0


def _sse(r) -> list[dict]:
    assert r.status_code == 200, r.text
    out = []
    for line in r.text.splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            out.append(json.loads(line[6:]))
    return out


def test_deepseek_r1_and_the_responses_reasoning_item(r1_dir):
    fmt = {"type": "json_schema", "name": "a", "schema": SCHEMA, "strict": True}
    with TestClient(_app(r1_dir), timeout=120) as client:
        model = client.get("/v1/models").json()["data"][0]
        assert model["chat_format"]["reasoning"] == "deepseek_r1"
        body = {"model": model["id"], "input": ASK[0]["content"], "text": {"format": fmt}, "max_output_tokens": 50,
                "temperature": 0}
        r = client.post("/v1/responses", json=body)
        a = r.json()
        assert r.status_code == 200 and a["status"] == "completed" and a["valid"] is True, a
        item, msg = a["output"]
        assert item["type"] == "reasoning" and item["status"] == "completed" and item["summary"] == []
        assert item["content"][0]["type"] == "reasoning_text" and item["content"][0]["text"]
        _answer(msg["content"][0]["text"])
        assert 0 < a["usage"]["output_tokens_details"]["reasoning_tokens"] < a["usage"]["output_tokens"]

        events = [e for e in _sse(client.post("/v1/responses", json={**body, "stream": True}))]
        kinds = [e["type"] for e in events]
        assert kinds[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
        done = next(e for e in events if e["type"] == "response.reasoning_text.done")
        text = "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta")
        assert text == done["text"] == item["content"][0]["text"]
        assert kinds.index("response.reasoning_text.done") < kinds.index("response.output_text.delta")
        assert events[-1]["type"] == "response.completed"
        assert events[-1]["response"]["output"][0]["content"] == item["content"]
        # the SDK's own types read both
        from openai.types.responses import ResponseReasoningTextDeltaEvent, ResponseReasoningTextDoneEvent

        ResponseReasoningTextDoneEvent.model_validate(done)
        ResponseReasoningTextDeltaEvent.model_validate(
            next(e for e in events if e["type"] == "response.reasoning_text.delta"))
        # the output sent back as the next turn's input: the reasoning item is taken (and dropped)
        r = client.post("/v1/responses", json={**body, "max_output_tokens": 16, "input": [
            {"role": "user", "content": "Where?"}, *a["output"], {"role": "user", "content": "Again."}]})
        assert r.status_code == 200, r.text
