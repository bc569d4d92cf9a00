"""``--chat-template`` (``ServiceConfig.chat_template``): a template given at start replaces the model's
for every route; a file that does not parse, or does not render one user message with the model's
tokenizer, is refused before the model loads, naming its line."""

from __future__ import annotations

import traceback

import pytest
from litestar.testing import TestClient

from stencil.engine.config import ConfigError, EngineConfig
from stencil.service import cli
from stencil.service.app import create_app
from stencil.service.state import ServiceConfig

# Renders every message as "<<role>> content", then the assistant's cue: nothing like SmolLM2's own.
TEMPLATE = "{% for m in messages %}<<{{ m.role }}>> {{ m.content }}\n{% endfor %}<<assistant>> "


def test_the_given_template_renders_every_chat_route(tiny_model_dir, tokenizer):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
    expected = len(tokenizer("<<system>> Be brief.\n<<user>> Name a colour.\n<<assistant>> ",
                             add_special_tokens=False).input_ids)
    own = len(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True))
    assert expected != own  # the two templates are told apart by the prompt's length
    app = create_app(EngineConfig(model=tiny_model_dir, num_kv_blocks=64, max_num_seqs=2),
                     ServiceConfig(chat_template=TEMPLATE, max_tokens_cap=16, default_max_tokens=4))
    with TestClient(app, timeout=60) as client:
        r = client.post("/generate", json={"messages": messages, "regex": "[a-z]{3}"})
        assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == expected, r.text
        model = client.get("/v1/models").json()["data"][0]["id"]
        r = client.post("/v1/chat/completions", json={"model": model, "messages": messages, "max_tokens": 4})
        assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == expected, r.text


def test_a_template_that_does_not_parse_is_refused_naming_its_line(tmp_path, capsys):
    with pytest.raises(ConfigError, match=r"chat_template does not parse: line 2: "):
        ServiceConfig(chat_template="{% for m in messages %}\n{{ m.content }\n{% endfor %}").validate()
    bad = tmp_path / "bad.jinja"
    bad.write_text("{% for m in messages %}{{ m.content }}")  # the loop never ends
    assert cli.main(["serve", "--chat-template", str(bad), "--model", "/never/loaded.gguf"]) == 2
    err = capsys.readouterr().err
    assert "chat_template does not parse: line 1" in err and "loading" not in err
    assert cli.main(["serve", "--chat-template", str(tmp_path / "missing.jinja")]) == 2
    assert "--chat-template: cannot read" in capsys.readouterr().err


def test_a_template_that_does_not_render_is_refused_at_start_naming_its_line(tiny_model_dir, tmp_path, capsys):
    from stencil.service.prompts import check_template_renders
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    bad = "{% for m in messages %}\n{{ m.content }}\n{{ m.nope.deeper }}\n{% endfor %}"  # parses, never renders
    ServiceConfig(chat_template=bad).validate()
    tok.chat_template = bad
    with pytest.raises(ConfigError, match=r"chat_template does not render: line 3: .*'nope'"):
        check_template_renders(tok)
    tok.chat_template = TEMPLATE
    check_template_renders(tok)
    tok.chat_template = " \n"
    with pytest.raises(ConfigError, match="chat_template is empty"):
        check_template_renders(tok)
    tok.chat_template = '{{ "hello" }}'  # renders, but every conversation would become "hello"
    with pytest.raises(ConfigError, match="does not write the user's message"):
        check_template_renders(tok)
    # a raise_exception on the user's turn, as real templates write their refusals
    tok.chat_template = "{% for m in messages %}{% if m.role == 'user' %}\n{{ raise_exception('no users') }}{% endif %}{% endfor %}"
    with pytest.raises(ConfigError, match=r"line 2: no users"):
        check_template_renders(tok)
    # the server: refused before the model loads (one line, exit 2), and by the app's start too
    path = tmp_path / "bad.jinja"
    path.write_text(bad)
    assert cli.main(["serve", "--chat-template", str(path), "--model", str(tiny_model_dir)]) == 2
    err = capsys.readouterr().err
    assert "chat_template does not render: line 3" in err and "Traceback" not in err
    app = create_app(EngineConfig(model=tiny_model_dir, num_kv_blocks=16, max_num_seqs=1),
                     ServiceConfig(chat_template=bad))
    with pytest.raises(BaseException) as e:
        with TestClient(app, timeout=60):
            pass
    assert "ConfigError: chat_template does not render: line 3" in "".join(traceback.format_exception(e.value))
