"""The examples run, as a user would run them, against a live server on the tiny model."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from stencil.engine.config import EngineConfig
from stencil.service.state import ServiceConfig

ROOT = Path(__file__).resolve().parents[2]


MODEL_NAME = "tiny"


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    from service_live import LiveServer

    live = LiveServer(EngineConfig(model=tiny_model_dir, num_kv_blocks=128, max_num_seqs=8),
                      ServiceConfig(model_name=MODEL_NAME, max_tokens_cap=1024)).start()
    yield live
    live.stop()


def _run(script: str, url: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, str(ROOT / "examples" / script), "--url", url], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)


def test_typed_client_example(server):
    p = _run("typed_client.py", server.url)
    assert p.returncode == 0, p.stdout + p.stderr
    lines = p.stdout.splitlines()
    assert lines[0].startswith("Person: Person(name=") and lines[1].startswith("Job: Job(person=")
    assert "valid=True" in lines[2]
    assert sum(line.startswith("Async: Person(") for line in lines) == 2


def test_tool_call_example(server):
    pytest.importorskip("openai")
    p = _run("tool_call.py", server.url)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "finish_reason: tool_calls" in p.stdout
    assert "model called get_weather({'city': " in p.stdout
    assert "answer:" in p.stdout


def test_responses_api_example(server):
    pytest.importorskip("openai")
    p = _run("responses_api.py", server.url)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "parsed: Invoice(number='INV-" in p.stdout
    assert "response.completed" in p.stdout or "response.incomplete" in p.stdout


def test_pydantic_tool_example(server):
    pytest.importorskip("openai")
    p = _run("pydantic_tool.py", server.url)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "called: CreateTicket" in p.stdout
    assert "ticket: CreateTicket(title=" in p.stdout and "priority=<Priority." in p.stdout


def test_readme_openai_snippets_are_the_examples_that_run():
    """Every line of the README's OpenAI code blocks is a line of the example it names."""
    import re

    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## OpenAI-compatible API"):]
    section = section[:section.index("\n## ", 1)]
    blocks = re.findall(r"```python\n(.*?)```", section, re.S)
    assert len(blocks) == 3
    sources = {name: (ROOT / "examples" / name).read_text() for name in ("responses_api.py", "pydantic_tool.py")}
    for block, name in zip(blocks, ("responses_api.py", "responses_api.py", "pydantic_tool.py")):
        lines = {ln.strip() for ln in sources[name].splitlines()}
        for line in block.splitlines():
            assert line.strip() in lines, (name, line)
