"""A new user's first ten minutes (issue 48, item 9): what `stencil serve` says until it is ready,
plain logs at a terminal, a warned schema typo, "did you mean" for other servers' fields, and a
405 that says how to call a POST route."""

from __future__ import annotations

import io
import json
import logging
import os
import re
import selectors
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from litestar.testing import TestClient

from stencil.engine.config import EngineConfig
from stencil.grammar.json_schema.keywords import MAX_UNKNOWN_NOTES, unknown_keywords
from stencil.service import cli
from stencil.service.app import create_app
from stencil.service.errors import unknown_field_hint
from stencil.service.logs import JsonFormatter, TextFormatter, log_format
from stencil.service.server import base_url
from stencil.service.state import ServiceConfig
from stencil.schemas.generate import GenerateRequest
from stencil.schemas.openai import ChatCompletionRequest
from stencil.schemas.responses import ResponsesRequest

TYPO = {"type": "object", "proprties": {"name": {"type": "string"}}}


@pytest.fixture(scope="module")
def client(tiny_model_dir):
    app = create_app(EngineConfig(model=tiny_model_dir, num_kv_blocks=128, max_num_seqs=4),
                     ServiceConfig(max_tokens_cap=64, default_max_tokens=16, request_timeout_s=60))
    with TestClient(app, timeout=60) as c:
        yield c


# -- stencil serve: its steps and the ready line ---------------------------------------------------

def _read_until(proc: subprocess.Popen, needle: str, timeout_s: float) -> str:
    """stdout of ``proc`` up to the line holding ``needle`` and the lines printed with it."""
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    out, deadline = "", time.monotonic() + timeout_s
    while needle not in out:
        assert time.monotonic() < deadline, f"no {needle!r} in {timeout_s} s; stdout so far:\n{out}"
        assert proc.poll() is None, f"stencil serve exited {proc.returncode}:\n{out}\n{proc.stderr.read()}"
        if sel.select(timeout=1.0):
            out += os.read(proc.stdout.fileno(), 65536).decode()
    time.sleep(0.2)  # the lines printed with it
    if sel.select(timeout=0):
        out += os.read(proc.stdout.fileno(), 65536).decode()
    return out


def test_serve_says_its_steps_and_ends_with_a_ready_line_whose_curl_works(tiny_model_dir, tmp_path):
    # the console script a user runs (``python -m`` from the clone would put its root folders on sys.path)
    stencil = Path(sys.executable).with_name("stencil")
    proc = subprocess.Popen([str(stencil), "serve", "--model", str(tiny_model_dir),
                             "--port", "0", "--num-kv-blocks", "64", "--max-num-seqs", "4", "--log-format", "text"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=tmp_path,
                            env={**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"})
    try:
        out = _read_until(proc, "Stencil is ready on", 180)
        assert re.search(r"^loading \S+ \(\d+ MB\) on cpu \.\.\.$", out, re.M), out
        url = re.search(r"^Stencil is ready on (http://127\.0\.0\.1:\d+)$", out, re.M).group(1)
        curl = re.search(r"^  curl -s (\S+) -H 'content-type: application/json' -d '(.*)'$", out, re.M)
        assert curl.group(1) == f"{url}/generate", out
        assert "demo model" not in out  # a model of the user's own
        r = httpx.post(curl.group(1), json=json.loads(curl.group(2)), timeout=60)
        assert r.status_code == 200 and r.json()["valid"] is True, r.text
        assert set(r.json()["output"]) == {"name", "age", "city"}
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    lines = [x for x in err.decode().splitlines() if x.strip()]
    assert lines and not any(x.lstrip().startswith("{") for x in lines), lines  # text, not JSON
    assert "\x1b[" not in err.decode()  # no colour codes


def test_ready_text_for_the_default_model_says_it_is_a_demo_and_how_to_serve_another():
    text = cli.ready_text("http://127.0.0.1:8000", demo=True)
    assert text.splitlines()[0] == "Stencil is ready on http://127.0.0.1:8000"
    assert "small demo model" in text and "--model path/to/file.gguf" in text
    body = json.loads(re.search(r"-d '(.*)'$", text, re.M).group(1))
    assert body == cli.TRY_BODY and body["response_schema"]["required"] == ["name", "age", "city"]
    keyed = cli.ready_text("http://127.0.0.1:8000", demo=False, api_key=True)
    assert '-H "Authorization: Bearer $STENCIL_API_KEY"' in keyed and "demo" not in keyed
    assert "with the server's key in $STENCIL_API_KEY" in keyed


def test_ready_text_for_a_base_model_sends_a_prompt(client):
    """A model without a chat template (Gemma 3 270M base) gets a curl it answers: a prompt, not messages."""
    text = cli.ready_text("http://127.0.0.1:8000", demo=False, chat=False)
    body = json.loads(re.search(r"-d '(.*)'$", text, re.M).group(1))
    assert "messages" not in body and body["prompt"] and body["response_schema"] == cli.TRY_BODY["response_schema"]
    r = client.post("/generate", json=body)
    assert r.status_code == 200 and r.json()["valid"] is True, r.text


def test_serve_says_a_port_in_use_before_loading_the_model(capsys):
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        assert cli.port_in_use("127.0.0.1", port)
        assert cli.main(["serve", "--model", "/nonexistent/never-loaded.gguf", "--port", str(port)]) == 2
    err = capsys.readouterr()
    assert f"cannot listen on 127.0.0.1:{port}" in err.err and "--port" in err.err
    assert "loading" not in err.out  # refused before the model
    assert cli.port_in_use("127.0.0.1", port) is None  # free again once closed


def test_serve_help_says_the_default_is_a_demo_model(capsys):
    with pytest.raises(SystemExit):
        cli.main(["serve", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "small demo model" in help_text and "--model path/to/file.gguf" in help_text
    assert "auto (default): text when stderr is a terminal, else json" in help_text


@pytest.mark.parametrize("sockname, url", [
    (("127.0.0.1", 8000), "http://127.0.0.1:8000"),
    (("0.0.0.0", 9000), "http://127.0.0.1:9000"),
    (("::", 8000, 0, 0), "http://[::1]:8000"),
    (("10.1.2.3", 80), "http://10.1.2.3:80"),
])
def test_base_url_turns_a_wildcard_into_loopback(sockname, url):
    assert base_url(sockname) == url


# -- logs ----------------------------------------------------------------------------------------

class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_log_format_auto_is_text_on_a_terminal_and_json_elsewhere():
    assert log_format("auto", _Tty()) == "text"
    assert log_format("auto", io.StringIO()) == "json"
    assert log_format("json", _Tty()) == "json" and log_format("text", io.StringIO()) == "text"
    with pytest.raises(ValueError, match="auto, text, json"):
        log_format("yaml")


def _uvicorn_record() -> logging.LogRecord:
    # as uvicorn logs "Uvicorn running on ...": the same message again, coloured, in an extra field
    record = logging.LogRecord("uvicorn.error", logging.INFO, __file__, 1, "Uvicorn running on %s", ("http://x",),
                               None)
    record.color_message = "Uvicorn running on \x1b[1m%s\x1b[0m"
    record.request_id = "r-1"
    return record


def test_neither_format_writes_color_message():
    obj = json.loads(JsonFormatter().format(_uvicorn_record()))
    assert obj["msg"] == "Uvicorn running on http://x" and obj["request_id"] == "r-1"
    assert "color_message" not in obj
    text = TextFormatter().format(_uvicorn_record())
    assert text.endswith("info    uvicorn.error: Uvicorn running on http://x request_id=r-1"), text
    assert "\x1b" not in text and "color_message" not in text


# -- a schema keyword typo -----------------------------------------------------------------------

def test_unknown_keywords_are_named_with_the_nearest_known_one():
    assert unknown_keywords(TYPO) == ["unknown keyword 'proprties' at #: ignored; did you mean 'properties'?"]
    schema = {"type": "object", "x-order": 1, "nullable": True,
              "properties": {"a/b": {"type": "string", "maxLenght": 3, "enum": [{"tpye": 1}]},
                             "c": {"items": [{"tpye": "integer"}]}},
              "$defs": {"d": {"requried": ["x"]}}}
    assert unknown_keywords(schema) == [
        "unknown keyword 'nullable' at #: ignored",
        "unknown keyword 'maxLenght' at #/properties/a~1b: ignored; did you mean 'maxLength'?",
        "unknown keyword 'tpye' at #/properties/c/items/0: ignored; did you mean 'type'?",
        "unknown keyword 'requried' at #/$defs/d: ignored; did you mean 'required'?",
    ]  # (x- extensions, and enum values, are not keywords)
    assert unknown_keywords({"type": "string", "format": "date", "$comment": "ok"}) == []
    assert unknown_keywords({"properties": {"m": {"type": "string", "format": "emial"},
                                            "n": {"format": "zip-code"}}}) == [
        "unknown format 'emial' at #/properties/m: ignored (an annotation); did you mean 'email'?",
        "unknown format 'zip-code' at #/properties/n: ignored (an annotation)"]
    assert unknown_keywords({"$schema": "http://json-schema.org/draft-07/schema#", "type": "string"}) == []
    assert unknown_keywords({"$schema": "https://example.com/mine", "type": "string"}) == [
        "unknown $schema 'https://example.com/mine': read as JSON Schema 2020-12"]
    many = unknown_keywords({f"k{i}": 1 for i in range(MAX_UNKNOWN_NOTES + 3)})
    assert len(many) == MAX_UNKNOWN_NOTES + 1 and many[-1] == "3 more unknown keywords (ignored)"


def test_a_schema_typo_is_served_but_warned_about(client):
    r = client.post("/generate", json={"prompt": "x", "response_schema": TYPO, "max_tokens": 8})
    assert r.status_code == 200, r.text
    warning = "unknown keyword 'proprties' at #: ignored; did you mean 'properties'?"
    assert warning in r.json()["warnings"]
    r = client.post("/v1/chat/completions", json={
        "model": _model(client), "messages": [{"role": "user", "content": "x"}], "max_tokens": 8,
        "response_format": {"type": "json_schema", "json_schema": {"name": "t", "schema": TYPO}}})
    assert r.status_code == 200, r.text
    assert warning in r.json()["warnings"] and warning in r.headers["x-stencil-warnings"]


@pytest.mark.parametrize("schema, hint", [
    ({"type": "objekt"}, "did you mean 'object' for 'objekt'?"),
    ({"properties": {"a": {"type": ["string", "nul"]}}}, "did you mean 'null' for 'nul'?"),
    ({"type": "String"}, "did you mean 'string' for 'String'?"),
    ({"type": "zzz"}, None),
])
def test_a_type_typo_is_a_400_with_the_nearest_type(client, schema, hint):
    r = client.post("/generate", json={"prompt": "x", "response_schema": schema, "max_tokens": 8})
    assert r.status_code == 400, r.text
    detail = r.json()["detail"]
    assert "invalid JSON Schema at" in detail and (hint in detail if hint else "did you mean" not in detail), detail


def test_a_typo_in_tool_parameters_is_warned_about(client):
    tool = {"type": "function", "function": {"name": "lookup", "parameters": TYPO}}
    r = client.post("/v1/chat/completions", json={
        "model": _model(client), "messages": [{"role": "user", "content": "x"}], "max_tokens": 40,
        "tools": [tool], "tool_choice": "required"})
    assert r.status_code == 200, r.text
    warning = "tool lookup: unknown keyword 'proprties' at #: ignored; did you mean 'properties'?"
    assert warning in r.json()["warnings"] and warning in r.headers["x-stencil-warnings"]


def _model(client) -> str:
    return client.get("/v1/models").json()["data"][0]["id"]


# -- fields other servers take -------------------------------------------------------------------

@pytest.mark.parametrize("field, hint", [
    ("response_format", "did you mean `response_schema`? (it takes the JSON Schema itself)"),
    ("schema", "did you mean `response_schema`?"),
    ("guided_json", "did you mean `response_schema`?"),
    ("guided_regex", "did you mean `regex`?"),
    ("max_new_tokens", "did you mean `max_tokens`?"),
    ("max_tokns", "did you mean `max_tokens`?"),
])
def test_generate_names_the_field_it_takes_instead(client, field, hint):
    r = client.post("/generate", json={"prompt": "x", field: {}})
    p = r.json()
    assert r.status_code == 422 and p["field"] == field, p
    assert f"unknown field `{field}`; {hint}" in p["detail"], p


@pytest.mark.parametrize("field, hint", [
    ("guided_json", "did you mean `structured_outputs.json`? (it takes the JSON Schema itself)"),
    ("guided_regex", "did you mean `structured_outputs.regex`?"),
    ("guided_choice", "did you mean `structured_outputs.choice`?"),
    ("guided_grammar", "did you mean `structured_outputs.grammar`? (it takes the Lark grammar text)"),
    ("response_schema", "did you mean `response_format`?"),
])
def test_chat_names_the_field_it_takes_instead(client, field, hint):
    r = client.post("/v1/chat/completions", json={"model": "m", "messages": [{"role": "user", "content": "x"}],
                                                  field: {}})
    e = r.json()["error"]
    assert r.status_code == 400 and e["param"] == field, e
    assert f"unknown field `{field}`; {hint}" in e["message"], e


def test_hints_follow_the_body_and_reach_nested_objects():
    msg = "Object contains unknown field `{}`"
    assert unknown_field_hint(msg.format("response_format"), "", ResponsesRequest).startswith(
        "; did you mean `text.format`?")
    assert unknown_field_hint(msg.format("contnet"), "messages[0]", ChatCompletionRequest) == \
        "; did you mean `content`?"
    assert unknown_field_hint(msg.format("zzzzzz"), "", GenerateRequest) == ""  # nothing close
    assert unknown_field_hint("Expected `int`, got `str`", "", GenerateRequest) == ""


# -- a wrong method --------------------------------------------------------------------------------

def test_get_on_a_post_route_says_how_to_call_it(client):
    r = client.get("/generate")
    p = r.json()
    assert r.status_code == 405 and r.headers["allow"].startswith("POST"), r.text
    assert p["title"] == "Method Not Allowed"
    assert p["detail"].startswith("/generate does not take GET: use POST /generate with a JSON body"), p
    assert "/schema" in p["detail"]
    r = client.get("/v1/chat/completions")
    e = r.json()["error"]
    assert r.status_code == 405 and "use POST /v1/chat/completions" in e["message"], e


def test_a_base_model_says_so_at_start_and_in_models(tmp_path, caplog):
    """A model without a chat template (Gemma 3 270M, the README's second model, is one): the start log
    says it serves prompts only, not a reasoning or tool-call format; /v1/models' chat_format is null."""
    from stencil.engine.models.default_model import fetch_gguf
    from gguf_testing import smol_vocab, write_tiny_gguf

    path = write_tiny_gguf(tmp_path / "base.gguf", "gemma3", smol_vocab(fetch_gguf()), seed=3,
                           chat_template=None)[0]
    caplog.set_level(logging.INFO, logger="stencil")
    app = create_app(EngineConfig(model=str(path), num_kv_blocks=64, max_num_seqs=2), ServiceConfig())
    with TestClient(app, timeout=60) as http:
        model = http.get("/v1/models").json()["data"][0]
        r = http.post("/v1/chat/completions", json={"model": model["id"], "max_tokens": 4,
                                                     "messages": [{"role": "user", "content": "hi"}]})
    assert model["chat_format"] is None, model
    assert r.status_code == 400 and "no chat template" in r.text, r.text
    said = [rec.getMessage() for rec in caplog.records if rec.getMessage().startswith("serving ")]
    assert len(said) == 1 and "a model without a chat template" in said[0] and "--chat-template" in said[0], said
    assert not any(rec.getMessage().startswith("tool calls in the") for rec in caplog.records)
